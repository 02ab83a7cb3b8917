"""The two reference strategies: everything on one device, and data parallelism."""

from __future__ import annotations

from ..cluster import Cluster
from ..graph import ALLREDUCE, RESIDENT, OpGraph, data_parallel_graph
from ..strategy import Strategy


def strategy_from(g: OpGraph, planner: str, n_devices: int, device_of: list[int], replicas: int = 1,
                  holders: dict[str, tuple[int, ...]] | None = None) -> Strategy:
    """A Strategy running each placed op of `g` on `device_of[i]`, every device in graph (topological) order.

    Residents are held where `holders` says, by default on every device that updates or reads them.
    """
    order: list[list[str]] = [[] for _ in range(n_devices)]
    placement: dict[str, int] = {}
    readers: dict[int, set[int]] = {}
    for i, op in enumerate(g.ops):
        if op.kind in RESIDENT or op.kind == ALLREDUCE:
            continue
        d = device_of[i]
        placement[op.name] = d
        order[d].append(op.name)
        for j in (*op.inputs, *op.updates):
            if g.ops[j].kind in RESIDENT:
                readers.setdefault(j, set()).add(d)
    if holders is None:
        holders = {g.ops[j].name: tuple(sorted(readers.get(j, {0}))) for j in g.residents}
    return Strategy(planner=planner, n_devices=n_devices, placement=placement,
                    order=tuple(tuple(o) for o in order), holders=holders, replicas=replicas)


def single_device(graph: OpGraph, cluster: Cluster) -> Strategy:
    """Every op on device 0, in the captured order."""
    return strategy_from(graph, "single", len(cluster.devices), [0] * len(graph.ops))


def data_parallel(graph: OpGraph, cluster: Cluster) -> Strategy:
    """The step replicated once per device on batch/N; gradients ring-allreduced; every device updates its copy."""
    n = len(cluster.devices)
    g = data_parallel_graph(graph, n)
    device_of = [int(op.name[1:op.name.index("/")]) if op.name.startswith("r") and "/" in op.name else 0
                 for op in g.ops]
    return strategy_from(g, "dp", n, device_of, replicas=n,
                         holders={g.ops[j].name: tuple(range(n)) for j in g.residents})
