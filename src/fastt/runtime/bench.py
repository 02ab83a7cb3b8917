"""Real training runs of several planners side by side: measured and simulated iteration times (`fastt run`)."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from . import parallelize
from .reference import batch_like, eager_dp_step, eager_step, max_param_rel_diff

Workload = tuple  # (name, model, loss_fn, optimizer, example_inputs)


def _timed(fn: Callable, *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def run_planners(make: Callable[[], Workload], devices: str, planners: Sequence[str], steps: int,
                 check: bool) -> dict:
    """Train `steps` steps with each planner (and `eager`: plain PyTorch on all cores) from the same start.

    Measured iteration time: the median over the steps after the first. With `check`, the same steps are also
    trained in eager mode (data-parallel plans against eager data parallelism, DDP semantics) with the worker
    devices' thread count, and the largest relative difference of any parameter is reported.
    """
    results, worst = [], 0.0
    for planner in planners:
        name, model, loss_fn, opt, inputs = make()
        batches = [batch_like(inputs, i) for i in range(steps)]
        initial = copy.deepcopy(model.state_dict())
        if planner == "eager":
            times = [_timed(eager_step, model, loss_fn, opt, b) for b in batches]
            results.append({"planner": "eager", "measured_iteration_s": statistics.median(times[1:] or times),
                            "simulated_iteration_s": None, "error": None})
            continue
        step = parallelize(model, loss_fn, opt, inputs, devices, planner)
        times = [_timed(step, *b) for b in batches]
        measured = statistics.median(times[1:] or times)
        results.append({"planner": planner, "measured_iteration_s": measured,
                        "simulated_iteration_s": step.simulated_s,
                        "error": (step.simulated_s - measured) / measured, "replicas": step.strategy.replicas,
                        "splits": len(step.strategy.splits)})
        if check:
            worst = max(worst, _check(make, initial, batches, step, model))
    return {"model": name, "devices": devices, "steps": steps, "results": results,
            "max_param_rel_diff": worst if check else None}


def _check(make: Callable[[], Workload], initial: dict, batches: list, step, trained: torch.nn.Module) -> float:
    _, model, loss_fn, opt, _ = make()
    model.load_state_dict(initial)
    old = torch.get_num_threads()
    torch.set_num_threads(step.threads_per_device)
    try:
        for b in batches:
            if step.strategy.replicas > 1:
                eager_dp_step(model, loss_fn, opt, b, step.strategy.replicas)
            else:
                eager_step(model, loss_fn, opt, b)
    finally:
        torch.set_num_threads(old)
    return max_param_rel_diff(model, trained)
