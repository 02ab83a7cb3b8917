"""The reference strategies: everything on one device, data parallelism, data parallelism on one node, and
data parallelism with sharded updates (ZeRO)."""

from __future__ import annotations

from dataclasses import replace

from ..cluster import Cluster
from ..errors import FasttError
from ..graph import UPDATE, OpGraph, base_name, data_parallel_graph, replica_of
from ..shard import shard_updates, shardable
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


def one_node(graph: OpGraph, cluster: Cluster) -> Strategy:
    """Data parallelism on the devices of one node (the one with the most compute; the first of equals), each
    running n/m of the n shards one after the other (gradient accumulation over the step at batch/n that every
    plan with replicas reads): nothing crosses the links between nodes. Where they are slow, what a user of
    DDP does first (gnmt on 2x4xA100@25Gbps: data parallelism on 8 devices waits on its 25 Gbit/s link).
    FasttError on one node, on a node of one device (that is `single`), or where the node's devices do not
    divide the devices' count."""
    node, n = one_node_devices(cluster), len(cluster.devices)
    k = n // len(node)
    g = data_parallel_graph(graph, n)
    device_of = [node[replica_of(op.name) // k] for op in g.ops]
    start = [replica_of(op.name) + n * (op.kind == UPDATE) for op in g.ops]  # as data_parallel's
    return strategy_from(g, "one-node", n, device_of, start=start, replicas=n,
                         holders={g.ops[j].name: node for j in g.residents})


def one_node_devices(cluster: Cluster) -> tuple[int, ...]:
    """The devices `one_node` trains on: those of the node with the most compute, the first of equals;
    FasttError where it does not apply (one node, a node of one device, or devices it does not divide)."""
    nodes = node_devices(cluster)
    n = len(cluster.devices)
    if len(nodes) < 2:
        raise FasttError("one-node: the cluster is one node (that is `dp`)")
    node = max(nodes, key=lambda ds: sum(cluster.devices[d].flops for d in ds))
    m = len(node)
    if m < 2 or n % m:
        raise FasttError(f"one-node: node {cluster.devices[node[0]].node} has {m} of {n} devices: "
                         + ("that is `single`" if m < 2 else "they do not share the shards equally"))
    return node


def node_devices(cluster: Cluster) -> list[tuple[int, ...]]:
    """The devices of each node, nodes in order."""
    return [tuple(i for i, d in enumerate(cluster.devices) if d.node == j)
            for j in sorted({d.node for d in cluster.devices})]


def zero(graph: OpGraph, cluster: Cluster, accumulate: int = 1) -> Strategy:
    """Data parallelism with every update that can be sharded sharded over the replicas (ZeRO's stage 2,
    `fastt.shard`): each device keeps and updates its rows of the optimizer state, the gradients are
    reduce-scattered and the new parameters all-gathered. FasttError where no update can be sharded."""
    n = len(cluster.devices)
    r = n * accumulate
    if r < 2:
        raise FasttError("zero: sharded updates need at least two replicas")
    g = data_parallel_graph(graph, r)
    names = [base_name(op.name) for i, op in enumerate(g.ops)
             if op.kind == UPDATE and replica_of(op.name) == 0 and not shardable(g, i, r)]
    if not names:
        raise FasttError(f"zero: no update of '{graph.name}' can be sharded over {r} replicas")
    dp = data_parallel(graph, cluster, accumulate)
    s = shard_updates(g, names)
    device_of = [replica_of(op.name) // accumulate for op in s.ops]
    start = [replica_of(op.name) + r * (op.kind == UPDATE) for op in s.ops]
    plan = strategy_from(s, "zero", n, device_of, start=start, replicas=r, holders=dict(dp.holders))
    return replace(plan, sharded=tuple(names))
