"""FastT's rule before training: the `fastt` planner's plan is kept only if it measures faster than data
parallelism and, on CPU worker devices, than one device with every core (what plain eager PyTorch uses: its
intra-op threads).

The plans run a few steps on the model itself, in turn, and the fastest median is kept (`raced`); `step.trial`
records them. The model, the optimizer and the random generators are put back as they were after (`restored`),
so training starts where it would have without the trial. Both runtimes race this way: `parallelize` on the
example batch, `parallelize_distributed` every rank on its shard, timed between barriers, rank 0's times
deciding.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from ..graph import replicable
from ..plan.named import plan
from ..simulate import simulate_plan
from ..strategy import Strategy
from .tune import settled

if TYPE_CHECKING:
    from .step import PlacedStep

S = TypeVar("S", bound="PlacedStep")
TRIAL_STEPS = 3  # steps each plan's median is of (after one warm-up step)
# A race whose two fastest medians are within CLOSE of each other runs again, up to ROUNDS rounds in all; each
# plan's time is then the mean of its rounds' medians. On this 2-core VM one round's medians of 3 varied by
# 10-30% between runs, and a single round kept dp at 158.5 ms against one device's 163.1 ms where one device
# then ran in 97-110 ms (fastt demo, transformer).
CLOSE, ROUNDS = 0.15, 3


class Trial(NamedTuple):
    """fastt's plan against its rivals before training: each one's seconds a step (the mean of its rounds'
    medians; None for a rival not raced), how many timed steps each ran, and the planner of the plan kept
    (`fastt`, `dp`, or `single`: one device with every core)."""

    fastt_plan_s: float
    dp_s: float | None
    steps: int
    kept: str
    one_device_s: float | None = None


def trial_steps(trial: bool | int) -> int:
    """The steps `trial=` asks for: TRIAL_STEPS for True, the number given, none for False or 0."""
    return TRIAL_STEPS if trial is True else int(trial)


def timed(fn: Callable, *args: object) -> float:
    """Wall seconds of fn(*args), with the GPU's queued work included when it runs on one."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def dp_rival(step: PlacedStep) -> Strategy | None:
    """Data parallelism to race the `fastt` planner's plan against: None where it cannot replicate the step on
    the plan's devices, does not fit, or places the step as the plan does (nothing to race)."""
    strategy = step.strategy
    if strategy.n_devices < 2 or not replicable(step.graph, strategy.n_devices):
        return None
    dp = plan(step.graph, step.cluster, "dp")
    if replace(dp, planner=strategy.planner) == strategy:
        return None
    return dp if simulate_plan(step.graph, dp, step.cluster, step.costs).fits else None


@contextlib.contextmanager
def restored(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Run the body, then put back the model's parameters and buffers, the optimizer's state (the step
    counters too) and its stepped flag, and the random generators, as they were: steps taken inside leave no
    trace."""
    params = [(p, p.detach().clone()) for p in model.parameters()]
    buffers = [(b, b.clone()) for b in model.buffers()]
    state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in optimizer.state.items()}
    called = getattr(optimizer, "_opt_called", None)
    gpus = sorted({x.device.index or 0 for x, _ in params + buffers if x.is_cuda})
    try:
        with torch.random.fork_rng(devices=gpus):
            yield
    finally:
        with torch.no_grad():
            for x, saved in params + buffers:
                x.copy_(saved)
        for p in list(optimizer.state):  # in place: a runtime may hold the state's tensors themselves
            if p not in state:
                del optimizer.state[p]
        for p, saved_state in state.items():
            now = optimizer.state[p]
            for k, v in saved_state.items():
                tensors = isinstance(v, torch.Tensor) and isinstance(now.get(k), torch.Tensor)
                if tensors and now[k].shape == v.shape:
                    with torch.no_grad():
                        now[k].copy_(v)
                else:
                    now[k] = v
            for k in set(now) - set(saved_state):
                del now[k]
        if called is None:
            optimizer.__dict__.pop("_opt_called", None)
        else:
            optimizer._opt_called = called


def trial_times(contenders: Sequence[PlacedStep], batch: Sequence[torch.Tensor], steps: int,
                clock: Callable[..., float] = timed) -> list[float]:
    """Each contender's median seconds a step on `batch` after a warm-up step (the tuner's rule, `settled`),
    their steps taken in turn so that a slow moment of the machine falls on all; `clock(step, *batch)` times
    one. They share one model and optimizer, put back after (`restored`)."""
    times: list[list[float]] = [[] for _ in contenders]
    with restored(contenders[0].model, contenders[0].optimizer):
        for _ in range(steps + 1):
            for s, t in zip(contenders, times):
                t.append(clock(s, *batch))
    return [settled(t) for t in times]


def raced(step: S, place_dp: Callable[[Strategy], S], batch: Sequence[torch.Tensor], steps: int,
          clock: Callable[..., float] = timed,
          agree: Callable[[list[float]], list[float]] = lambda times: times,
          alone: Callable[[], S] | None = None) -> S:
    """`step` (the `fastt` planner's plan), or the rival that measured faster over `steps` steps
    (`trial_times`): the step `place_dp(dp)` of data parallelism (`dp_rival`), and `alone()`, one device with
    every core, where given. A close race runs again (`CLOSE`, `ROUNDS`). The one kept has the `Trial`; `step`
    is returned as it is where there is no rival or no steps, and wins ties. `agree` makes the ranks of a
    process group decide alike (rank 0's times), so they run as many rounds."""
    if not steps:
        return step
    dp = dp_rival(step)
    rivals = ([place_dp(dp)] if dp is not None else []) + ([alone()] if alone is not None else [])
    if not rivals:
        return step
    contenders = [step, *rivals]
    rounds = [agree(trial_times(contenders, batch, steps, clock))]
    while len(rounds) < ROUNDS and close(rounds[-1]):
        rounds.append(agree(trial_times(contenders, batch, steps, clock)))
    times = [statistics.mean(t) for t in zip(*rounds)]
    kept = contenders[min(range(len(times)), key=lambda k: (times[k], k))]
    kept.trial = Trial(times[0], times[1] if dp is not None else None, steps * len(rounds),
                       kept.strategy.planner, times[-1] if alone is not None else None)
    return kept


def close(times: Sequence[float]) -> bool:
    """Whether the two fastest of `times` are within `CLOSE` of each other."""
    first, second = sorted(times)[:2]
    return second < first * (1 + CLOSE)
