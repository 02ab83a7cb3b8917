"""FastT's tuning loop, run inside the first steps of real training.

Round by round: profile the running plan for a few steps (the wall time of every segment of every device, so
op times include what running beside the other devices costs them), refit the op costs, replan with the
`fastt` planner on the refitted costs, run the new plan for a few steps, and keep it only if its measured
iteration is faster — else roll back. Tuning stops when the refitted op times are stable, when the planner
returns the running plan, or after `max_rounds`. Every round logs the plan's simulated and measured iteration
times.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..cost import MeasuredCosts, op_times
from ..errors import FasttError
from ..plan.named import plan
from .programs import Placed, place

if TYPE_CHECKING:
    from .step import PlacedStep


def refit(placed: Placed, timings: Sequence[tuple], costs: MeasuredCosts, cluster) -> MeasuredCosts:
    """Costs refitted from segment timings: each op's time is scaled by its segment's measured / predicted
    ratio, and an op signature gets the median over everywhere it ran."""
    g = placed.lowered.graph
    times = op_times(g, cluster, costs)
    samples: dict[str, list[float]] = defaultdict(list)
    for seg, d, seconds in timings:
        if seg is None:  # an allreduce's mean, not an op's
            continue
        ops = [t.op for t in seg.tasks]
        predicted = float(sum(times[i, d] for i in ops))
        if predicted <= 0:
            continue
        for i in ops:
            if g.ops[i].signature:
                samples[g.ops[i].signature].append(float(times[i, d]) * seconds / predicted)
    fitted = {k: statistics.median(v) for k, v in samples.items()}
    return MeasuredCosts(costs.kind, costs.threads, {**costs.seconds, **fitted})


def settled(samples: Sequence[float]) -> float:
    """A plan's step time: the median of its steps after the first (which warms up caches and the allocator
    after a plan change). How the tuner and the trial before training (`fastt.runtime.trial`) measure a
    plan."""
    return statistics.median(samples[1:] or samples)


def change(old: MeasuredCosts, new: MeasuredCosts) -> float:
    """The median relative change of the op times both tables have."""
    rel = [abs(new.seconds[k] - v) / v for k, v in old.seconds.items() if v > 0 and k in new.seconds]
    return statistics.median(rel) if rel else 0.0


def _describe(p: Placed) -> str:
    s = p.strategy
    return f"{s.planner} ({s.replicas} replica{'s' * (s.replicas > 1)}, {len(s.splits)} splits)"


@dataclass
class Round:
    """One plan run while tuning: its simulated and measured iteration times and whether it was kept."""

    plan: str
    simulated_s: float
    measured_s: float
    kept: bool


@dataclass
class Tuner:
    """The tuning loop's settings and state. `window`: steps per measurement (the first after a plan change is
    not counted); `tolerance`: stop when refitted op times move less than this (median, relative)."""

    window: int = 4
    max_rounds: int = 3
    tolerance: float = 0.05
    budget_s: float = 3.0
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr))
    rounds: list[Round] = field(default_factory=list)
    active: bool = True
    _samples: list[float] = field(default_factory=list)
    _timings: list = field(default_factory=list)
    _kept: tuple | None = None  # (placed, measured seconds) of the plan a trial is compared with

    def observe(self, step: PlacedStep, seconds: float, timings: list) -> None:
        """Called after every step while tuning, with the step's wall time and segment timings."""
        self._samples.append(seconds)
        self._timings += timings
        if len(self._samples) < self.window:
            return
        measured = settled(self._samples)
        placed = step.placed
        costs = refit(placed, self._timings, step.costs, step.cluster)
        moved = change(step.costs, costs)
        step.costs = costs
        self._samples, self._timings = [], []
        if self._kept is not None:  # a trial ends: keep it or roll back
            old, old_s = self._kept
            kept = measured < old_s
            self._record(placed, measured, kept,
                         f"{'kept' if kept else 'rolled back'} (before: {old_s * 1e3:.1f} ms)")
            if not kept:
                step.placed, measured = old, old_s
            self._kept = None
        else:
            self._record(placed, measured, True, "running")
        if len(self.rounds) >= 2 * self.max_rounds or (len(self.rounds) > 1 and moved < self.tolerance):
            why = f"op times moved {moved:.1%}" if moved < self.tolerance else "rounds used up"
            return self._stop(step, why)
        candidate = plan(step.graph, step.cluster, "fastt", self.budget_s, measured=costs)
        if replace(candidate, planner=step.strategy.planner) == step.strategy:
            return self._stop(step, "the planner keeps the running plan")
        try:
            trial = place(step.graph, candidate, step.cluster, costs, step.targets)
        except FasttError as e:
            return self._stop(step, str(e))
        self._kept = (step.placed, measured)
        step.placed = trial

    def skip(self, why: str) -> None:
        """End tuning before it started (the step runs a plan the tuner does not replan)."""
        self.active = False
        self.log(f"tune: none ({why})")

    def _record(self, placed: Placed, measured: float, kept: bool, verdict: str) -> None:
        self.rounds.append(Round(_describe(placed), placed.simulated_s, measured, kept))
        self.log(f"tune: {_describe(placed)}: simulated {placed.simulated_s * 1e3:.1f} ms, measured "
                 f"{measured * 1e3:.1f} ms, {verdict}")

    def _stop(self, step: PlacedStep, why: str) -> None:
        """End tuning; the running plan's simulated time is recomputed with the refitted costs."""
        self.active = False
        simulated = step.timeline().iteration_s
        step.placed = replace(step.placed, simulated_s=simulated)
        self.log(f"tune: done ({why}); {_describe(step.placed)} simulated with the refitted costs: "
                 f"{simulated * 1e3:.1f} ms")
