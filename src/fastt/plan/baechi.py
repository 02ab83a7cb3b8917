"""Baechi's memory-constrained placers (Jeon et al., "Baechi: Fast Device Placement of Machine Learning
Graphs", SoCC 2020): m-TOPO, m-ETF and m-SCT, as policies on the list-scheduling core (`schedule.py`).

Memory is `schedule.StaticMemory` with residents homed by their updaters (Baechi pins a parameter with the op
that updates it; one nobody updates with its first reader). Allreduces (data-parallel graphs) take no time
(`schedule.FreeAllreduce`). Time: an op's inputs arrive at a device when their producers finish plus the
transfer from the producer's device (`PlanCosts`, linear in bytes); a resident input is free wherever it is
not homed yet.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from ..cluster import Cluster
from ..graph import RESIDENT, OpGraph
from ..strategy import Strategy
from .common import PlanCosts, plan_costs, strategy_from
from .schedule import Choice, FreeAllreduce, Schedule, StaticMemory, list_schedule


def _baechi_schedule(graph: OpGraph, cluster: Cluster, costs: PlanCosts) -> Schedule:
    return Schedule(graph, costs, StaticMemory(graph, cluster, home_per_update=False), FreeAllreduce())


# ------------------------------------------------------------------------------------------------------------
# m-TOPO


class TopoFill:
    """m-TOPO's rule (see `m_topo`): ops in Kahn's breadth-first order fill device after device up to a cap,
    and an update goes where its parameter's first reader went."""

    def __init__(self, sched: Schedule, cluster: Cluster) -> None:
        mem = sched.memory
        share = sum(mem.size) / sched.n_devices + max(mem.size, default=0)
        self.cap = [min(dev.memory_bytes, share) for dev in cluster.devices]
        self.cap[-1] = cluster.devices[-1].memory_bytes
        self.used = [0.0] * sched.n_devices
        self.k = 0  # the device being filled
        self.queue: deque[int] = deque()
        self.home: dict[int, int] = {}  # parameter -> the device of its first reader
        self.order: list[int] = []  # the ops as they were placed: each device runs its own in this order
        # What one update writes (a parameter and its optimizer state) lives together, charged on the first
        # read.
        self.group: dict[int, tuple[int, ...]] = {}
        for op in sched.g.ops:
            for r in op.updates:
                self.group[r] = tuple(op.updates)

    def ready(self, sched: Schedule, i: int) -> None:
        self.queue.append(i)

    def pick(self, sched: Schedule) -> Choice | None:
        if not self.queue:
            return None
        i = self.queue.popleft()
        g, size = sched.g, sched.memory.size
        claimed = [r for r in (*g.ops[i].inputs, *g.ops[i].updates) if g.ops[r].kind in RESIDENT]
        new = [r for r in dict.fromkeys(m for r in claimed for m in self.group.get(r, (r,)))
               if r not in self.home]
        need = size[i] + sum(size[r] for r in new)
        homes = {self.home[r] for r in g.ops[i].updates if r in self.home}
        if homes:  # colocated with its parameter, which was charged with its state where it was first read
            d = min(homes)
        else:
            while self.k < sched.n_devices - 1 and self.used[self.k] + need > self.cap[self.k]:
                self.k += 1
            d = self.k
            if self.used[d] + need > self.cap[d]:
                d = int(np.argmax(sched.memory.free))
        for r in new:
            self.home[r] = d
        self.used[d] += need
        self.order.append(i)
        return Choice(i, d, 0.0)


def m_topo(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """Baechi's m-TOPO: ops in Kahn's breadth-first topological order fill the devices one after another, each
    up to its capacity, the total static memory over the number of devices plus the largest op's (capped at
    the device's memory; the last device takes the rest up to its memory). Total static memory is what every
    op and resident charges once (`StaticMemory.size`); a parameter and its optimizer state are charged with
    the parameter's first reader, and its update runs there (Baechi colocates a variable with the ops that
    update it), so neither travels. An op over every capacity goes to the device with the most free memory.
    Each device runs its ops in that order. `costs` only serves the interface shared with the other planners:
    m-TOPO ignores time.
    """
    sched = _baechi_schedule(graph, cluster, costs or _no_costs(graph, cluster))
    placed = list_schedule(sched, (fill := TopoFill(sched, cluster)))
    order = {i: k for k, i in enumerate(fill.order)}
    return strategy_from(graph, "m-topo", placed.n_devices, [max(d, 0) for d in placed.dev],
                         start=[order.get(i, -1) for i in range(len(graph.ops))], replicas=graph.replicas)


def _no_costs(graph: OpGraph, cluster: Cluster) -> PlanCosts:
    """Zero op times: m-TOPO needs the Schedule's bookkeeping, not the cost model."""
    return PlanCosts(times=np.zeros((len(graph.ops), len(cluster.devices))), cluster=cluster)


# ------------------------------------------------------------------------------------------------------------
# m-ETF and m-SCT: list scheduling by earliest start time


class EarliestStart:
    """m-ETF's rule: among ready ops and devices with room, the pair that can start first (ties: the op
    earlier in graph order, then the lower device), appended to its device. With `favorite` (m-SCT), a
    device's last op's favorite child starts right after it there first, when it is ready and its inputs are
    there in time."""

    def __init__(self, sched: Schedule, favorite: Sequence[int] | None = None) -> None:
        self.favorite = favorite
        self.ops: list[int] = []  # ready ops, sorted, so that argmin's first hit is the earliest op
        self.is_ready = [False] * len(sched.g.ops)
        self.arrive = np.zeros((len(sched.g.ops), sched.n_devices))  # for ready ops: inputs there, per device

    def ready(self, sched: Schedule, i: int) -> None:
        self.arrive[i] = sched.arrival(i)
        bisect.insort(self.ops, i)
        self.is_ready[i] = True

    def pick(self, sched: Schedule) -> Choice | None:
        if not self.ops:
            return None
        c = self._favorite(sched) if self.favorite is not None else None
        if c is None:
            r = np.array(self.ops)
            est = np.where(sched.memory.room_many(r), np.maximum(self.arrive[r], sched.free_at[None, :]),
                           np.inf)
            row, d = divmod(int(np.argmin(est)), sched.n_devices)
            c = Choice(int(r[row]), d, float(est[row, d]))
        self.ops.remove(c.op)
        self.is_ready[c.op] = False
        return c

    def _favorite(self, sched: Schedule) -> Choice | None:
        """A favorite child that can start on its parent's device as soon as that is free (earliest first)."""
        assert self.favorite is not None
        best: tuple[float, int, int] | None = None
        for d, p in enumerate(sched.last):
            c = self.favorite[p] if p >= 0 else -1
            if (c < 0 or not self.is_ready[c] or self.arrive[c, d] > sched.free_at[d]
                    or not sched.memory.room(c)[d]):
                continue
            cand = (float(sched.free_at[d]), c, d)
            if best is None or cand < best:
                best = cand
        return None if best is None else Choice(best[1], best[2], best[0])


def m_etf(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """m-ETF: Earliest Task First list scheduling under the memory constraint (`EarliestStart`).

    Ops are appended to their device (no gap filling), so each device's order is its start order.
    O(ops · ready · devices) work, done with numpy per step.
    """
    sched = _baechi_schedule(graph, cluster, costs or plan_costs(graph, cluster))
    return list_schedule(sched, EarliestStart(sched)).strategy("m-etf")


def m_sct(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """m-SCT: m-ETF with the favorite-child rule of Hanen & Munier's SCT algorithm, as Baechi uses it.

    Each op gets at most one favorite child (see `favorite_children`: the LP relaxation of the
    small-communication-time scheduling ILP). While scheduling, when the last op on a device has a favorite
    child that is ready and whose inputs are all on that device by the time the device is free, that child
    starts there right after its parent, ahead of the ETF choice (the earliest such device first). Otherwise
    the step is plain m-ETF. Simplification: a device is not held idle for a favorite child that is not ready
    yet.
    """
    costs = costs or plan_costs(graph, cluster)
    sched = _baechi_schedule(graph, cluster, costs)
    return list_schedule(sched, EarliestStart(sched, favorite_children(graph, costs))).strategy("m-sct")


# ------------------------------------------------------------------------------------------------------------
# SCT favorite children


def favorite_children(g: OpGraph, costs: PlanCosts) -> list[int]:
    """Each op's favorite child (or -1), from the LP relaxation of the SCT scheduling ILP (Hanen & Munier
    1995).

    Variables: a start time t_i per scheduled op, x_ij in [0, 1] per edge (0: j runs right after i on i's
    device, so the transfer vanishes) and the makespan w. Constraints, with p_i an op's mean time over devices
    and c_ij the edge's mean transfer time over device pairs:
        t_j >= t_i + p_i + c_ij · x_ij          for every edge i -> j
        sum_j x_ij >= out-degree(i) - 1         each op has at most one favorite child
        sum_i x_ij >= in-degree(j) - 1          each op has at most one favorite parent
        w >= t_i + p_i                          for every op without successors
    minimize w + ε · sum c_ij x_ij / sum c_ij, with ε = 1e-6 · sum p_i: the second term, too small to trade
    any real makespan, prefers dropping the heaviest transfers among equally short LP schedules. j is i's
    favorite child when x_ij < 1/2; the degree constraints keep that to one child per op and one parent per
    child. One device: no favorites. If HiGHS fails, fall back to the greedy rule: each op's heaviest-transfer
    child not yet claimed by another parent.
    """
    n = len(g.ops)
    if len(costs.cluster.devices) < 2:
        return [-1] * n
    ops = [i for i, op in enumerate(g.ops) if op.kind not in RESIDENT]  # allreduces too
    col = {i: k for k, i in enumerate(ops)}
    reads = g.reads
    edges = [(j, i, b) for i in ops for j, b in reads[i] if j in col]
    if not edges:
        return [-1] * n
    lat, per_byte = costs.mean_transfer()
    p = np.asarray(costs.times, dtype=float).mean(axis=1)
    c = np.array([lat + b * per_byte for _, _, b in edges])
    x = _sct_lp(len(ops), [(col[a], col[b]) for a, b, _ in edges], p[ops], c)
    if x is None:  # the LP failed: greedy fallback, the heaviest transfers first
        rank = np.argsort(-c, kind="stable")
    else:  # x < 1/2 in the LP's order; the claims below also guard against solver tolerance
        rank = np.array([k for k in np.argsort(x, kind="stable") if x[k] < 0.5], dtype=np.int64)
    fav = [-1] * n
    claimed: set[int] = set()
    for k in rank:
        a, b, _ = edges[k]
        if fav[a] < 0 and b not in claimed:
            fav[a] = b
            claimed.add(b)
    return fav


def _sct_lp(n: int, edges: list[tuple[int, int]], p: np.ndarray, c: np.ndarray) -> np.ndarray | None:
    """Solve the SCT LP relaxation (see `favorite_children`) with HiGHS; x per edge, or None on failure.

    Columns: t_0..t_{n-1}, x_0..x_{m-1}, w. All constraints are written as A_ub @ v <= b_ub.
    """
    m = len(edges)
    scale = max(float(p.max(initial=0.0)), float(c.max(initial=0.0)), 1e-30)
    p, c = p / scale, c / scale  # HiGHS' tolerances are absolute: keep the numbers near 1
    src = np.array([a for a, _ in edges])
    dst = np.array([b for _, b in edges])
    er = np.arange(m)
    rows = [er, er, er]
    cols = [src, dst, n + er]
    vals = [np.ones(m), -np.ones(m), c]
    rhs = [-p[src]]
    nrow = m
    for key in (src, dst):  # at most one favorite child per op, one favorite parent per op
        deg = np.bincount(key, minlength=n)
        many = np.flatnonzero(deg >= 2)
        slot = np.full(n, -1)
        slot[many] = nrow + np.arange(len(many))
        sel = deg[key] >= 2
        rows.append(slot[key[sel]])
        cols.append(n + er[sel])
        vals.append(-np.ones(int(sel.sum())))
        rhs.append(-(deg[many] - 1).astype(float))
        nrow += len(many)
    sinks = np.flatnonzero(np.bincount(src, minlength=n) == 0)
    rows += [nrow + np.arange(len(sinks))] * 2
    cols += [sinks, np.full(len(sinks), n + m)]
    vals += [np.ones(len(sinks)), -np.ones(len(sinks))]
    rhs.append(-p[sinks])
    nrow += len(sinks)
    a_ub = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                             shape=(nrow, n + m + 1))
    obj = np.zeros(n + m + 1)
    obj[n + m] = 1.0
    total_c = float(c.sum())
    if total_c > 0:  # the tie-break among equally short schedules (see favorite_children)
        obj[n:n + m] = 1e-6 * max(float(p.sum()), total_c) * c / total_c
    bounds = [(0, None)] * n + [(0, 1)] * m + [(0, None)]
    try:
        res = linprog(obj, A_ub=a_ub, b_ub=np.concatenate(rhs), bounds=bounds, method="highs")
    except ValueError:
        return None
    return res.x[n:n + m] if res.status == 0 and res.x is not None else None
