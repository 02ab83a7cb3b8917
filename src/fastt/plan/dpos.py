"""DPOS: FastT's device placement and operation scheduling (critical path first, then earliest finish time).

1. Upward rank with each op's *maximum* time over devices and each edge's *maximum* transfer time over device
   pairs: rank(o) = W(o) + max over successors s of (C(o, s) + rank(s)). Ops are scheduled by decreasing rank.
2. The critical path: from the entry op of largest rank, repeatedly the successor of largest rank.
3. Critical-path device: for each device, as many of the remaining critical-path ops as fit in its memory,
   averaged over their times there; the device with the smallest average takes them; when it is full, choose
   again for the rest.
4. Every other op goes to the device where it finishes first (insertion-based: it may fill an idle gap); a
   device whose memory would overflow is skipped; devices may stay unused.
Memory: `schedule.StaticMemory`; a resident's first readers or updaters make its homes, one per update.
The allreduces of a data-parallel graph are rings (`schedule.RingAllreduce`).
Known bound: makespan ≤ 2·OPT + C_max.
"""

from __future__ import annotations

import functools

import numpy as np

from ..cluster import Cluster
from ..graph import ALLREDUCE, RESIDENT, OpGraph
from ..strategy import Strategy
from .common import PlanCosts, plan_costs
from .schedule import ByRank, RingAllreduce, Schedule, StaticMemory, edge_bytes, list_schedule, upward_rank


def critical_path(g: OpGraph, rank: list[float], placed: list[bool]) -> list[int]:
    """From the entry op of largest rank, follow the successor of largest rank (placed ops only)."""
    entries = [i for i, op in enumerate(g.ops) if placed[i] and not any(placed[j] for j in op.inputs)]
    if not entries:
        return []
    path = [max(entries, key=lambda i: (rank[i], -i))]
    while True:
        nxt = [s for s in g.succs[path[-1]] if placed[s]]
        if not nxt:
            return path
        path.append(max(nxt, key=lambda s: (rank[s], -s)))


def _cp_devices(memory: StaticMemory, times: np.ndarray, cp: list[int]) -> dict[int, int]:
    """Critical-path ops -> device: the device with the smallest average time over the ops it can hold."""
    out: dict[int, int] = {}
    free = memory.free.tolist()
    rest = list(cp)
    while rest:
        best = None
        for d in range(len(free)):
            used, k = 0, 0
            while k < len(rest) and used + memory.size[rest[k]] <= free[d]:
                used += memory.size[rest[k]]
                k += 1
            if k:
                avg = float(np.mean([times[i, d] for i in rest[:k]]))
                if best is None or avg < best[0]:
                    best = (avg, d, k, used)
        if best is None:
            break  # nothing fits anywhere: EFT decides
        _, d, k, used = best
        for i in rest[:k]:
            out[i] = d
        free[d] -= used
        rest = rest[k:]
    return out


def schedule(g: OpGraph, costs: PlanCosts) -> Schedule:
    """Run DPOS on `g`: every placed op gets a device, a start and a finish."""
    nbytes = edge_bytes(g)
    max_c = functools.cache(costs.max_transfer)  # edges of one size cost alike
    rank = upward_rank(g, costs.times.max(axis=1), lambda i, s: max_c(nbytes[i, s]))
    placed = [op.kind not in RESIDENT and op.kind != ALLREDUCE for op in g.ops]
    memory = StaticMemory(g, costs.cluster, home_per_update=True)
    cp_dev = _cp_devices(memory, costs.times, critical_path(g, rank, placed))
    return list_schedule(Schedule(g, costs, memory, RingAllreduce()), ByRank(rank, fixed=cp_dev))


def dpos_strategy(g: OpGraph, cluster: Cluster, costs: PlanCosts | None = None, planner: str = "dpos",
                  replicas: int = 1) -> Strategy:
    """DPOS's placement and per-device order (ops sorted by their scheduled start) for graph `g`."""
    return schedule(g, costs or plan_costs(g, cluster)).strategy(planner, replicas=replicas)


def dpos(graph: OpGraph, cluster: Cluster) -> Strategy:
    """The `dpos` planner: DPOS on the captured graph (no replication, no splits)."""
    return dpos_strategy(graph, cluster)
