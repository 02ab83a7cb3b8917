"""The Python interface users see: capture, cluster, plan, simulate."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .capture import capture_step
from .cluster import Cluster, cluster
from .coarsen import to_opgraph
from .cost import MeasuredCosts, op_times
from .cost import measure as _measure
from .graph import COMPUTE, UPDATE, OpGraph, chain_lengths
from .plan import get_planner, graph_for
from .plan.osdpos import DEFAULT_BUDGET_S, os_dpos
from .simulate import Timeline
from .simulate import simulate as _simulate
from .split import splittable
from .strategy import Strategy


def capture(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
            example_inputs: Sequence[torch.Tensor], name: str = "step",
            clip_grad_norm: float | None = None) -> OpGraph:
    """One whole training step (forward, backward, optimizer update) as an OpGraph.

    Convention: `loss = loss_fn(model(*example_inputs[:-1]), example_inputs[-1])`; dim 0 of every example input
    is the batch. The graph can recapture the step at a smaller batch (data parallelism needs batch/N).
    `clip_grad_norm`: clip the gradients to this global norm before the update (`clip_grad_norm_`).
    """
    example_inputs = tuple(example_inputs)

    @functools.lru_cache(maxsize=8)
    def recapture(batch: int) -> OpGraph:
        sliced = tuple(x[:batch] for x in example_inputs)
        g = to_opgraph(capture_step(model, loss_fn, optimizer, sliced, clip_grad_norm), name)
        return _with_recapture(g, recapture)

    g = to_opgraph(capture_step(model, loss_fn, optimizer, example_inputs, clip_grad_norm), name)
    return _with_recapture(g, recapture)


def measure(graph: OpGraph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            example_inputs: Sequence[torch.Tensor], threads: int = 1, runs: int = 5,
            progress: bool = True, concurrent: int = 1) -> MeasuredCosts:
    """Measured op times of `graph` (captured from this model) on this CPU with `threads` threads, or on the
    GPU the model is on.

    The step runs on copies of the real parameters, buffers and optimizer state: the model is not changed.
    Data parallelism places the step at batch/N: measure `rebatch(graph, b)` with the inputs sliced to b.
    `concurrent` copies run at once (see `cost.measure`): op times as when that many worker devices are busy.
    """
    step = graph.fx
    inputs = tuple(x[:graph.batch] for x in example_inputs)
    params, buffers, states, inputs, hypers = step.arguments(model, optimizer, inputs, create=False)
    kind = "cuda" if params and params[0].is_cuda else "cpu"
    return _measure(graph, [params, buffers, states, *inputs, hypers, 1.0], kind=kind, threads=threads, runs=runs,
                    progress=progress, concurrent=concurrent)


def _with_recapture(g: OpGraph, fn: Callable[[int], OpGraph]) -> OpGraph:
    return dataclasses.replace(g, recapture=fn)


def plan(graph: OpGraph, cluster_spec: str | Cluster, planner: str = "fastt",
         budget_s: float | None = None, measured: MeasuredCosts | None = None) -> Strategy:
    """A strategy for `graph` on the cluster from the named planner (see fastt.plan.PLANNERS).

    `budget_s` bounds the `fastt` planner's search (it returns the best plan found so far); `measured` gives it
    measured op times (the other planners plan with the cost model's estimates).
    """
    if planner == "fastt" and (budget_s is not None or measured is not None):
        return os_dpos(graph, cluster(cluster_spec), budget_s=budget_s or DEFAULT_BUDGET_S, measured=measured)
    return get_planner(planner)(graph, cluster(cluster_spec))


def lower_bound(graph: OpGraph, times: np.ndarray, n_devices: int) -> float:
    """A lower bound on the iteration time of any strategy fastt can produce for `graph`.

    LB = max(W / D, C): W = Σ_ops min_d t[op, d], D = number of devices, C = the longest chain of ops that no
    strategy divides (optimizer updates, parameter-only ops without a split rule), each at its fastest device.

    Proof sketch. Every op, or every part of it after data-parallel replication, runs on some device; under the
    roofline model the parts of an op never cost less in total than the whole (each part pays the launch overhead,
    FLOPs add up, and each part reads at least its share of the bytes), so the devices together are busy at least
    W, and one of the D devices at least W/D. Optimizer updates and ops that neither depend on the batch nor have
    a split rule are never divided (replication copies them whole), and a chain of dependent ops runs one after
    another, so the iteration lasts at least C.
    Transfers only add time. With measured costs the sub-additivity is not guaranteed, and the bound is an
    estimate.
    """
    fastest = times.min(axis=1) if times.size else np.zeros(len(graph.ops))
    work = float(fastest.sum()) / max(n_devices, 1)
    whole = [float(fastest[i]) if op.kind == UPDATE or (op.kind == COMPUTE and not op.batch
                                                        and not splittable(op, graph)) else 0.0
             for i, op in enumerate(graph.ops)]
    chain = max(chain_lengths(graph, whole), default=0.0)
    return max(work, chain)


def simulate(graph: OpGraph, strategy: Strategy, cluster_spec: str | Cluster,
             measured: MeasuredCosts | None = None, release: Mapping[str, str] | None = None) -> Timeline:
    """Simulate `strategy` on the cluster: iteration time, memory per device, critical path, lower bound.
    `release`: when ops send their results off their device (`fastt.simulate.simulate`; the runtime passes its
    segments')."""
    cl = cluster(cluster_spec)
    g = graph_for(graph, strategy)
    times = op_times(g, cl, measured)
    lb = lower_bound(graph, op_times(graph, cl, measured), len(cl.devices))
    return _simulate(g, strategy, cl, times, lower_bound_s=lb, release=release)
