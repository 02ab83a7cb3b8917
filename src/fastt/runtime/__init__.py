"""Running plans for real: `parallelize` returns a step callable backed by the local runtime."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..api import capture, measure, plan, simulate
from ..capture import bind
from ..cluster import cluster
from ..cost import calibrate_cpu
from ..errors import FasttError
from ..graph import rebatch
from ..lower import Lowered, lower
from ..strategy import Strategy
from .local import StepError, compile_programs, run_step

__all__ = ["ParallelStep", "StepError", "parallelize"]


class ParallelStep:
    """One training step of a model under a plan: `loss = step(*batch)`. The model's parameters and the
    optimizer's state are the truth: they are updated in place after every step (read them at any time)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, low: Lowered,
                 strategy: Strategy, simulated_s: float, threads_per_device: int) -> None:
        self.model, self.optimizer, self.lowered, self.strategy = model, optimizer, low, strategy
        self.programs = compile_programs(low)
        self.simulated_s = simulated_s
        self.threads_per_device = threads_per_device

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        step = self.lowered.step
        params, buffers, states = bind(self.model, self.optimizer, step.param_names, step.state_keys, create=True)
        loss, new_params, new_states = run_step(self.lowered, self.programs, params, buffers, states, batch,
                                                self.threads_per_device)
        # The step's results are fresh tensors: hand them over instead of copying (the Parameter objects, which
        # the optimizer and the user hold, stay the same).
        for p, new in zip(params, new_params):
            p.data = new
        fresh = iter(new_states)
        for p, keys in zip(params, step.state_keys):
            for k in keys:
                self.optimizer.state[p][k] = next(fresh)
        return loss


def parallelize(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                example_inputs: Sequence[torch.Tensor], devices: str = "cpu:2", planner: str = "fastt",
                strategy: Strategy | None = None) -> ParallelStep:
    """Capture the step, plan it for `devices` (or use `strategy`), refuse a plan that does not fit, and return
    the step callable. CPU worker devices (`cpu:N`) run here; the CUDA runtime is not built yet."""
    cl = cluster(devices)
    if any(d.kind != "cpu" for d in cl.devices):
        raise FasttError(f"running on {devices} is not supported yet: the local runtime runs cpu:N devices")
    cl = calibrate_cpu(cl)
    threads = max(1, torch.get_num_threads() // len(cl.devices))
    graph = capture(model, loss_fn, optimizer, example_inputs, name=type(model).__name__)
    strategy = strategy or plan(graph, cl, planner)
    tl = simulate(graph, strategy, cl)
    if not tl.fits:
        raise FasttError("the plan does not fit in device memory: " + "; ".join(tl.oom))
    # The simulated time of the plan with every op's time measured on a worker device (its share of the cores).
    part = rebatch(graph, graph.batch // strategy.replicas)
    costs = measure(part, model, optimizer, example_inputs, threads=threads, progress=False)
    simulated = simulate(graph, strategy, cl, costs).iteration_s
    return ParallelStep(model, optimizer, lower(graph, strategy), strategy, simulated, threads)
