"""Real training runs of several planners side by side: measured and simulated iteration times (`fastt
run`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..cluster import cluster, torch_device
from ..precision import name_of
from .reference import (
    batch_like,
    drawing_again,
    eager_reference_step,
    eager_step,
    max_param_rel_diff,
    not_compared,
    take_state,
)
from .step import ParallelStep, parallelize
from .trial import timed
from .tune import Tuner

Workload = tuple  # (name, model, loss_fn, optimizer, example_inputs)
BLOCK = 4  # steps a planner takes in a row in `run_planners` before the next planner's


def _placed(make: Callable[[], Workload], home: str) -> Workload:
    """A fresh workload with its model and example inputs on `home` (the optimizer holds the same
    Parameters)."""
    name, model, loss_fn, opt, inputs = make()
    return name, model.to(home), loss_fn, opt, tuple(x.to(home) for x in inputs)


def run_planners(make: Callable[[], Workload], devices: str, planners: Sequence[str], steps: int,
                 check: bool, tune: bool = False, clip_grad_norm: float | None = None,
                 trial: bool = True, autocast: torch.dtype | None = None,
                 trace: Callable[[str, int, list, ParallelStep], None] | None = None) -> dict:
    """Train `steps` steps with each planner (and `eager`: plain PyTorch on all cores) from the same start,
    each on its own copy of the workload (`make()`), the planners' steps taken in turn, BLOCK steps at a time:
    every copy is alive at once (twice as many with `check`).

    Measured iteration time: the median over the steps after the first, the first of each later block left
    out too (with `tune`, the `fastt` planner tunes its plan in the first steps: the median over the steps
    after tuning). `busy_s`: each device's busy seconds
    in the last step (`ParallelStep.profiled`), beside the simulator's (`simulated_busy_s`), and
    `allreduce_s` what each spent computing allreduce means. `setup_s`: what
    `parallelize` took, the `fastt` planner's trial against data parallelism included (`trial=False`: its
    plan unmeasured). With `check`, every step is also taken by the plain one-device eager step from the same
    state (`take_state`), with the worker devices' thread count, and the largest relative difference of any
    parameter after a step is reported. On GPUs the model lives on the first device, and `eager` is plain
    PyTorch there. `clip_grad_norm`: every step clips the gradients' global norm
    (`torch.nn.utils.clip_grad_norm_`), eager's too. `autocast`: every step's forward runs under
    `torch.autocast` in that dtype, eager's too. The reference draws the random numbers (dropout's) the
    step then draws, from the same generator state; a plan over several devices or replicas draws them
    otherwise (`reference.not_compared`): its difference is reported apart (`not_compared`: planner ->
    its reason and difference), not in `max_param_rel_diff`. `trace(planner, index, spans, step)` is called
    with each planner's last step's spans (`ParallelStep.profiled`; `fastt run --trace`).
    """
    home = torch_device(cluster(devices).devices[0])
    runs = [_Run(planner, _placed(make, home), steps, home) for planner in planners]
    for run in runs:
        if run.planner != "eager":
            run.place(devices, tune, clip_grad_norm, trial, autocast, _placed(make, home) if check else None)
    # the planners' steps taken in turn, BLOCK steps of each at a time: a slow moment of the machine falls on
    # all of them, not on one planner's run of steps (the demo's transformer, each planner's 16 steps in one
    # block: fastt's one device on every core 150.4 ms against eager's 121.9 in the block after; step by step
    # in turn, 90.6 against 91.2 and 92.7 against 92.9 in two runs), and the first step of a block, whose
    # caches another planner's steps left, is not counted: a training loop's steps follow each other warm
    # (step by step in turn, every step started cold, eager's too, and `runtime.py --sides` found fastt
    # slower than eager beyond the noise on no model; in blocks of 4, on dlrm and the ConvNeXt-style net)
    for start in range(0, steps, BLOCK):
        for index, run in enumerate(runs):
            for k in range(start, min(start + BLOCK, steps)):
                run.take(k, clip_grad_norm, autocast, trace, index)
    return {"model": runs[0].workload[0], "devices": devices, "steps": steps,
            "results": [run.result() for run in runs],
            "max_param_rel_diff": max(run.worst for run in runs) if check else None,
            **({"not_compared": {run.planner: {"why": run.why, "max_param_rel_diff": run.loose}
                                 for run in runs if run.why}} if check else {}),
            "clip_grad_norm": clip_grad_norm, "precision": name_of(autocast)}


class _Run:
    """One planner's training in `run_planners`: its own copy of the workload, its steps and what they
    measured."""

    def __init__(self, planner: str, workload: Workload, steps: int, home: str) -> None:
        self.planner, self.workload = planner, workload
        self.batches = [tuple(x.to(home) for x in batch_like(workload[4], i)) for i in range(steps)]
        self.times: list[float] = []
        self.tuned, self.worst = 0, 0.0
        self.why, self.loose = "", 0.0  # why the last step not compared with eager was not, the largest such
        self.busy: list = []
        self.reducing: list = []
        self.step: ParallelStep | None = None
        self.tuner: Tuner | None = None
        self.ref: Workload | None = None
        self.setup_s = 0.0

    def place(self, devices: str, tune: bool, clip_grad_norm: float | None, trial: bool,
              autocast: torch.dtype | None, ref: Workload | None) -> None:
        """Plan and place the step (`parallelize`, timed: `setup_s`); `ref`: the eager copy that checks it."""
        _, model, loss_fn, opt, inputs = self.workload
        self.tuner = Tuner() if tune and self.planner == "fastt" else None
        t0 = time.perf_counter()
        self.step = parallelize(model, loss_fn, opt, inputs, devices, self.planner, tune=self.tuner or False,
                                clip_grad_norm=clip_grad_norm, trial=trial, autocast=autocast)
        self.setup_s = time.perf_counter() - t0
        self.ref = ref

    def take(self, k: int, clip_grad_norm: float | None, autocast: torch.dtype | None,
             trace: Callable[[str, int, list, ParallelStep], None] | None, index: int) -> None:
        """Step k, timed (the last one profiled too), checked against the eager copy where there is one."""
        _, model, loss_fn, opt, _ = self.workload
        b, step = self.batches[k], self.step
        if step is None:
            self.times.append(timed(eager_step, model, loss_fn, opt, b, clip_grad_norm, autocast))
            return
        replicas = step.strategy.replicas
        if self.ref is not None:  # the reference takes this step from our state, drawing what the step will
            take_state(model, opt, self.ref[1], self.ref[3])
            with drawing_again():
                eager_reference(self.ref, b, replicas, step.threads_per_device, clip_grad_norm, autocast)
            why = not_compared(step.graph.fx.gm, len(set(step.strategy.placement.values())), replicas)
        if k == len(self.batches) - 1 and not (self.tuner is not None and self.tuner.active):
            spans: list = []
            seconds, self.busy, self.reducing = timed_busy(step, b, spans)
            self.times.append(seconds)
            if trace is not None and spans:
                trace(self.planner, index, spans, step)
        else:
            self.times.append(timed(step, *b))
        self.tuned += self.tuner is not None and self.tuner.active
        if self.ref is not None:
            diff = max_param_rel_diff(self.ref[1], model)
            if why:
                self.why, self.loose = why, max(self.loose, diff)
            else:
                self.worst = max(self.worst, diff)

    def result(self) -> dict:
        """The planner's row: its measured median after the first step (after tuning, with a tuner), beside
        the simulated time."""
        step, times = self.step, self.times
        counted = counted_steps(len(times), 1 if step is None else self.tuned + 1)
        measured = statistics.median(times[k] for k in counted)
        if step is None:
            return {"planner": "eager", "measured_iteration_s": measured, "counted_steps": counted,
                    "simulated_iteration_s": None, "error": None}
        tuner = self.tuner
        return {"planner": self.planner, "measured_iteration_s": measured, "counted_steps": counted,
                "simulated_iteration_s": step.simulated_s,
                "error": (step.simulated_s - measured) / measured, "replicas": step.strategy.replicas,
                "busy_s": self.busy, "allreduce_s": self.reducing,
                **simulated_busy(step),
                "splits": len(step.strategy.splits), "setup_s": self.setup_s,
                "trial": step.trial._asdict() if step.trial else None,
                "tuning": [vars(r) for r in tuner.rounds] if tuner is not None else None}


def counted_steps(steps: int, first: int) -> list[int]:
    """The steps of a planner's run in turn with others (BLOCK at a time) whose times count: from `first` on,
    less the first of each later block (its caches another planner's steps left), else the last half."""
    counted = [k for k in range(steps) if k >= first and k % BLOCK]
    return counted or list(range(steps))[-max(1, steps // 2):]


def simulated_busy(step: ParallelStep) -> dict:
    """The simulator's busy seconds of each device (`simulated_busy_s`) and of the allreduces, on links
    (`simulated_allreduce_s`), in the step's plan with its costs now."""
    tl = step.timeline()
    return {"simulated_busy_s": list(tl.busy_s),
            "simulated_allreduce_s": sum(c.end - c.start for c in tl.collectives)}


def timed_busy(step: ParallelStep, batch: Sequence[torch.Tensor],
               spans: list | None = None) -> tuple[float, list, list]:
    """`timed(step, *batch)` and each device's busy seconds in that step in segments and in allreduces
    (`ParallelStep.profiled`, which collects `spans`)."""
    out: list = []
    seconds = timed(lambda *b: out.extend(step.profiled(*b, spans=spans)[1:]), *batch)
    return seconds, *out


def eager_reference(ref: Workload, batch: Sequence[torch.Tensor], replicas: int, threads: int,
                    clip_grad_norm: float | None = None, autocast: torch.dtype | None = None) -> None:
    """The plain one-device eager step of `ref` (which took the state the checked step starts from) on
    `batch`, with `threads` threads (the worker devices' kernels). Batch statistics are per replica under
    data parallelism (`eager_reference_step`)."""
    _, model, loss_fn, opt, _ = ref
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eager_reference_step(model, loss_fn, opt, batch, replicas, clip_grad_norm, autocast)
    finally:
        torch.set_num_threads(old)
