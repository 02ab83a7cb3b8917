"""HEFT: Heterogeneous Earliest Finish Time (Topcuoglu, Hariri & Wu, IEEE TPDS 2002), made memory-aware.

Ops are taken in decreasing upward rank, rank(i) = w̄(i) + max over successors s of (c̄(i, s) + rank(s)), with
w̄ the op's mean time over devices and c̄ the edge's mean transfer time over ordered pairs of distinct devices.
Each op goes to the device where it would finish earliest, with insertion: it may fill an idle gap between ops
already scheduled there once its inputs have arrived. Devices without room under Baechi's static memory model
(see `baechi.py`) are skipped. Each device runs its ops in start order.
"""

from __future__ import annotations

import numpy as np

from ..cluster import Cluster
from ..graph import ALLREDUCE, OpGraph
from ..strategy import Strategy
from .baechi import Schedule, placed_ops
from .common import PlanCosts, Slots, plan_costs
from .dpos import upward_rank


def heft(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """HEFT with insertion and Baechi's static memory constraint (see the module docstring)."""
    return heft_schedule(graph, cluster, costs).strategy("heft")


def heft_schedule(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Schedule:
    """The schedule HEFT plans: each op's device and its planned start and finish times.

    Ties: ops of equal rank in topological order (so that zero-cost ops never precede their inputs); devices of
    equal finish time by index. O((ops + edges) · devices) plus the gap search.
    """
    sched = Schedule(graph, cluster, costs or plan_costs(graph, cluster))
    lat, per_byte = sched.comm_mean()
    nbytes = {(j, i): b for i in placed_ops(graph) for j, b in sched.reads[i]}
    rank = upward_rank(graph, sched.times.mean(axis=1), lambda i, s: lat + nbytes[i, s] * per_byte)
    slots = [Slots() for _ in range(sched.n_devices)]
    for i in sorted(placed_ops(graph), key=lambda i: (-rank[i], i)):
        if graph.ops[i].kind == ALLREDUCE:
            sched.resolve_allreduce(i)
            continue
        ready = sched.arrival(i)
        best: tuple[float, float, int, int] | None = None
        for d in np.flatnonzero(sched.memory.room(i)):
            d = int(d)
            start, k = slots[d].earliest(float(ready[d]), float(sched.times[i, d]))
            end = start + float(sched.times[i, d])
            if best is None or end < best[0]:
                best = (end, start, d, k)
        assert best is not None  # room() always offers a device
        end, start, d, k = best
        sched.place(i, d, start)
        slots[d].add(k, start, end)
    return sched
