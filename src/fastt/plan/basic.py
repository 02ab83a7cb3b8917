"""The two reference strategies: everything on one device, and data parallelism."""

from __future__ import annotations

from ..cluster import Cluster
from ..graph import UPDATE, OpGraph, data_parallel_graph, replica_of
from ..strategy import Strategy
from .common import strategy_from


def single_device(graph: OpGraph, cluster: Cluster) -> Strategy:
    """Every op on device 0, in the captured order."""
    return strategy_from(graph, "single", len(cluster.devices), [0] * len(graph.ops))


def data_parallel(graph: OpGraph, cluster: Cluster, accumulate: int = 1) -> Strategy:
    """The step replicated once per device on batch/N; gradients ring-allreduced; every device updates its
    copy.

    With `accumulate` k, each device runs k replicas one after the other (micro-batches of batch/(N·k)), each
    replica's forward and backward before the next one's, so that a device holds one micro-batch's activations
    at a time; the allreduce sums the gradients of all N·k, which is gradient accumulation."""
    n = len(cluster.devices)
    r = n * accumulate
    g = data_parallel_graph(graph, r)
    device_of = [replica_of(op.name) // accumulate for op in g.ops]
    # As DistributedDataParallel does: the optimizer steps after the whole backward pass, so a device never
    # waits on an allreduce while backward work is left.
    start = [replica_of(op.name) + r * (op.kind == UPDATE) for op in g.ops]
    return strategy_from(g, "dp", n, device_of, start=start, replicas=r,
                         holders={g.ops[j].name: tuple(range(n)) for j in g.residents})
