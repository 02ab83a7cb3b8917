"""Real training runs of several planners side by side: measured and simulated iteration times (`fastt
run`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..cluster import cluster, torch_device
from ..precision import name_of
from .reference import batch_like, eager_reference_step, eager_step, max_param_rel_diff, take_state
from .step import ParallelStep, parallelize
from .trial import timed
from .tune import Tuner

Workload = tuple  # (name, model, loss_fn, optimizer, example_inputs)


def _placed(make: Callable[[], Workload], home: str) -> Workload:
    """A fresh workload with its model and example inputs on `home` (the optimizer holds the same
    Parameters)."""
    name, model, loss_fn, opt, inputs = make()
    return name, model.to(home), loss_fn, opt, tuple(x.to(home) for x in inputs)


def run_planners(make: Callable[[], Workload], devices: str, planners: Sequence[str], steps: int,
                 check: bool, tune: bool = False, clip_grad_norm: float | None = None,
                 trial: bool = True, autocast: torch.dtype | None = None,
                 trace: Callable[[str, int, list, ParallelStep], None] | None = None) -> dict:
    """Train `steps` steps with each planner (and `eager`: plain PyTorch on all cores) from the same start.

    Measured iteration time: the median over the steps after the first (with `tune`, the `fastt` planner tunes
    its plan in the first steps: the median over the steps after tuning). `busy_s`: each device's busy seconds
    in the last step (`ParallelStep.profiled`), beside the simulator's (`simulated_busy_s`), and
    `allreduce_s` what each spent computing allreduce means. `setup_s`: what
    `parallelize` took, the `fastt` planner's trial against data parallelism included (`trial=False`: its
    plan unmeasured). With `check`, every step is also taken by the plain one-device eager step from the same
    state (`take_state`), with the worker devices' thread count, and the largest relative difference of any
    parameter after a step is reported. On GPUs the model lives on the first device, and `eager` is plain
    PyTorch there. `clip_grad_norm`: every step clips the gradients' global norm
    (`torch.nn.utils.clip_grad_norm_`), eager's too. `autocast`: every step's forward runs under
    `torch.autocast` in that dtype, eager's too. `trace(planner, index, spans, step)` is called with each
    planner's last step's spans (`ParallelStep.profiled`; `fastt run --trace`).
    """
    home = torch_device(cluster(devices).devices[0])
    results, worst = [], 0.0
    for planner in planners:
        name, model, loss_fn, opt, inputs = _placed(make, home)
        batches = [tuple(x.to(home) for x in batch_like(inputs, i)) for i in range(steps)]
        if planner == "eager":
            times = [timed(eager_step, model, loss_fn, opt, b, clip_grad_norm, autocast) for b in batches]
            results.append({"planner": "eager", "measured_iteration_s": statistics.median(times[1:] or times),
                            "simulated_iteration_s": None, "error": None})
            continue
        tuner = Tuner() if tune and planner == "fastt" else None
        t0 = time.perf_counter()
        step = parallelize(model, loss_fn, opt, inputs, devices, planner, tune=tuner or False,
                           clip_grad_norm=clip_grad_norm, trial=trial, autocast=autocast)
        setup_s = time.perf_counter() - t0
        ref = _placed(make, home) if check else None
        times, tuned, busy, reducing = [], 0, [], []
        for k, b in enumerate(batches):
            replicas = step.strategy.replicas
            if ref is not None:
                take_state(model, opt, ref[1], ref[3])
            last = k == len(batches) - 1 and not (tuner is not None and tuner.active)
            if last:
                spans: list = []
                seconds, busy, reducing = timed_busy(step, b, spans)
                times.append(seconds)
                if trace is not None and spans:
                    trace(planner, len(results), spans, step)
            else:
                times.append(timed(step, *b))
            tuned += tuner is not None and tuner.active
            if ref is not None:
                diff = eager_diff(ref, b, replicas, step.threads_per_device, model, clip_grad_norm,
                                  autocast)
                worst = max(worst, diff)
        after = times[tuned + 1:] or times[-max(1, len(times) // 2):]
        measured = statistics.median(after)
        results.append({"planner": planner, "measured_iteration_s": measured,
                        "simulated_iteration_s": step.simulated_s,
                        "error": (step.simulated_s - measured) / measured, "replicas": step.strategy.replicas,
                        "busy_s": busy, "allreduce_s": reducing,
                        **simulated_busy(step),
                        "splits": len(step.strategy.splits), "setup_s": setup_s,
                        "trial": step.trial._asdict() if step.trial else None,
                        "tuning": [vars(r) for r in tuner.rounds] if tuner is not None else None})
    return {"model": name, "devices": devices, "steps": steps, "results": results,
            "max_param_rel_diff": worst if check else None, "clip_grad_norm": clip_grad_norm,
            "precision": name_of(autocast)}


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


def eager_diff(ref: Workload, batch: Sequence[torch.Tensor], replicas: int, threads: int,
               trained: torch.nn.Module, clip_grad_norm: float | None = None,
               autocast: torch.dtype | None = None) -> float:
    """The plain one-device eager step of `ref` (which took the state `trained` started this step from) on
    `batch`, with `threads` threads (the worker devices' kernels); the largest relative difference from
    `trained` after its step. Batch statistics are per replica under data parallelism
    (`eager_reference_step`)."""
    _, model, loss_fn, opt, _ = ref
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eager_reference_step(model, loss_fn, opt, batch, replicas, clip_grad_norm, autocast)
    finally:
        torch.set_num_threads(old)
    return max_param_rel_diff(model, trained)
