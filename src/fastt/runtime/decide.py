"""Which plan a runtime runs: the one decision sequence that `parallelize` and `parallelize_distributed` call.

In order: a strategy given is run; with a tuner, data parallelism when it fits (the tuner starts from it);
another planner than `fastt` plans with the cost model's estimates; then op times are measured at the batch
sizes the plan runs (or, for the `fastt` planner and the tuner, those it compares: the whole step and the
data-parallel replicas' step), and the `fastt` planner plans with them. What differs between the runtimes
comes in: the cluster and its device count, how op times are measured, and where the `fastt` planner runs
(under torchrun: rank 0 alone, the others waiting for its plan).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from ..cluster import Cluster
from ..cost import MeasuredCosts
from ..graph import OpGraph, replicable
from ..plan.named import plan
from ..simulate import simulate_plan
from ..strategy import Strategy
from .tune import Tuner

T = TypeVar("T")
Measure = Callable[[Sequence[int], Strategy | None], MeasuredCosts]  # (batch sizes, plan so far) -> op times


class Decision(NamedTuple):
    """What `decide` chose: the plan (None where `alone` returned None: the ranks that wait for rank 0's), the
    measured op times it was planned and is simulated with, and whether the `fastt` planner made it from
    them."""

    strategy: Strategy | None
    costs: MeasuredCosts
    planned: bool


def here(fn: Callable[[], T]) -> T:
    """Run `fn` in this process (the local runtime's `alone`: there is no one else to wait)."""
    return fn()


def tuner_of(tune: bool | Tuner) -> Tuner | None:
    """The tuner `tune=` asks for: a default one for True, the one given, or None."""
    return Tuner() if tune is True else tune or None


def decide(graph: OpGraph, cl: Cluster, *, n_devices: int, planner: str, strategy: Strategy | None,
           tuner: Tuner | None, measure: Measure,
           alone: Callable[[Callable[[], Strategy]], Strategy | None] = here) -> Decision:
    """The strategy to run `graph` with on `cl` (`n_devices` devices) and its measured costs (module
    docstring).

    `measure(batches, strategy)` measures the step's op times at those batch sizes, knowing the plan decided
    so far (None when the `fastt` planner is still to plan); `alone(fn)` runs the `fastt` planner's `fn()` and
    returns its plan (`here`, or `distributed.alone_on_rank0`).
    """
    if strategy is None and tuner is not None and replicable(graph, n_devices):
        dp = plan(graph, cl, "dp")
        strategy = dp if simulate_plan(graph, dp, cl).fits else None
    planned = strategy is None and planner == "fastt"
    if strategy is None and not planned:  # the other planners plan with the cost model's estimates
        strategy = plan(graph, cl, planner)
    if strategy is not None and tuner is None:
        batches = [graph.batch // strategy.replicas]
    else:  # what the fastt planner compares: the whole step and the data-parallel replicas' step
        batches = [graph.batch] + ([graph.batch // n_devices] if replicable(graph, n_devices) else [])
    costs = measure(batches, strategy)
    if planned:
        strategy = alone(lambda: plan(graph, cl, "fastt", measured=costs))
    return Decision(strategy, costs, planned)
