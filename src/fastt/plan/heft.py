"""HEFT: Heterogeneous Earliest Finish Time (Topcuoglu, Hariri & Wu, IEEE TPDS 2002), made memory-aware.

Ops are taken in decreasing upward rank, rank(i) = w̄(i) + max over successors s of (c̄(i, s) + rank(s)), with
w̄ the op's mean time over devices and c̄ the edge's mean transfer time over ordered pairs of distinct
devices. Each op goes to the device where it would finish earliest, with insertion: it may fill an idle gap
between ops already scheduled there once its inputs have arrived (`schedule.ByRank`). Devices without room
under `schedule.StaticMemory` (residents homed with their updaters, as Baechi pins them) are skipped;
allreduces take no time (`schedule.FreeAllreduce`). Each device runs its ops in start order.
"""

from __future__ import annotations

from ..cluster import Cluster
from ..graph import OpGraph
from ..strategy import Strategy
from .common import PlanCosts, plan_costs
from .schedule import ByRank, FreeAllreduce, Schedule, StaticMemory, edge_bytes, list_schedule, upward_rank


def heft(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """HEFT with insertion and the static memory constraint (see the module docstring)."""
    return heft_schedule(graph, cluster, costs).strategy("heft")


def heft_schedule(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Schedule:
    """The schedule HEFT plans: each op's device and its planned start and finish times.

    Ties: ops of equal rank in topological order (so that zero-cost ops never precede their inputs); devices
    of equal finish time by index. O((ops + edges) · devices) plus the gap search.
    """
    costs = costs or plan_costs(graph, cluster)
    lat, per_byte = costs.mean_transfer()
    nbytes = edge_bytes(graph)
    rank = upward_rank(graph, costs.times.mean(axis=1), lambda i, s: lat + nbytes[i, s] * per_byte)
    memory = StaticMemory(graph, cluster, home_per_update=False)
    return list_schedule(Schedule(graph, costs, memory, FreeAllreduce()), ByRank(rank))
