"""Baechi's memory-constrained placers (Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs",
SoCC 2020): m-TOPO, m-ETF and m-SCT, plus the partial schedule and static memory model every list planner
shares (HEFT in `heft.py` builds on them too).

Memory (Baechi's static model): an op placed on device d pins `memory_of(g)[i]` bytes there (what planning
charges it, see plan/common.py) for the whole step, and a resident (parameter, optimizer state, buffer) pins
its bytes on the device of the first placed op that updates it, or, if nothing updates it, of the first placed
op that reads it. A device without room for an op is skipped; when no device has room the op goes to the device
with the most free memory anyway, and the simulator reports the plan as not fitting.

Time: an op's inputs arrive at device d when their producers finish plus the transfer from the producer's device
(`PlanCosts.transfer`, assumed linear in bytes); a resident input arrives at t=0 where it is pinned (or anywhere,
while unpinned) and after one transfer elsewhere. An allreduce (data-parallel graphs only) is not placed: it
finishes when its last input does, on the device of its first input.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from ..cluster import Cluster
from ..graph import ALLREDUCE, RESIDENT, OpGraph
from ..strategy import Strategy
from .common import PlanCosts, memory_of, plan_costs, strategy_from

_PROBE = float(2**30)  # bytes used to read the per-byte slope of a (linear) transfer time


class StaticMemory:
    """Free bytes per device under Baechi's static model, and how much placing each op would pin."""

    def __init__(self, g: OpGraph, cluster: Cluster) -> None:
        # Ops are charged what planning charges them (common.memory_of); residents their own bytes.
        mem = memory_of(g)
        size = [op.out_bytes if op.kind in RESIDENT else mem[i] for i, op in enumerate(g.ops)]
        self.size = size
        self.free = np.array([dev.memory_bytes for dev in cluster.devices], dtype=np.int64)
        updated = {r for op in g.ops for r in op.updates}
        self.pins: list[tuple[int, ...]] = []  # residents each op pins if it is placed first
        self.pinners: dict[int, list[int]] = {r: [] for r in g.residents}
        self.need = np.zeros(len(g.ops), dtype=np.int64)  # bytes placing each op would pin now
        for i, op in enumerate(g.ops):
            pins: tuple[int, ...] = ()
            if op.kind not in RESIDENT and op.kind != ALLREDUCE:
                readers = [r for r in op.inputs if g.ops[r].kind in RESIDENT and r not in updated]
                pins = tuple(dict.fromkeys([*op.updates, *readers]))
                self.need[i] = size[i] + sum(size[r] for r in pins)
            self.pins.append(pins)
            for r in pins:
                self.pinners[r].append(i)
        self.pinned: dict[int, int] = {}
        for r, ops in self.pinners.items():
            if not ops:  # neither updated nor read: strategy_from holds it on device 0
                self.pinned[r] = 0
                self.free[0] -= size[r]

    def room(self, i: int) -> np.ndarray:
        """Devices op i may go to: those with room for it, else only the one with the most free memory."""
        ok = self.free >= self.need[i]
        if not ok.any():
            ok[int(np.argmax(self.free))] = True
        return ok

    def room_many(self, ops: np.ndarray) -> np.ndarray:
        """`room` for several ops at once: a (len(ops), devices) boolean array."""
        ok = self.need[ops][:, None] <= self.free[None, :]
        homeless = ~ok.any(axis=1)
        if homeless.any():
            ok[homeless, int(np.argmax(self.free))] = True
        return ok

    def place(self, i: int, d: int) -> None:
        """Op i goes to device d: take its bytes and pin the residents it is first to claim."""
        self.free[d] -= self.need[i]
        for r in self.pins[i]:
            if r not in self.pinned:
                self.pinned[r] = d
                for k in self.pinners[r]:  # later claimants no longer pay for r
                    self.need[k] -= self.size[r]


class Schedule:
    """A partial schedule built by a list planner: each placed op's device, start and finish, memory left.

    Costs are flattened into arrays once (`times[i, d]`; transfer from s to d of b bytes = lat[s, d] + b ·
    per_byte[s, d]) so that `arrival` is a few numpy operations per input.
    """

    def __init__(self, g: OpGraph, cluster: Cluster, costs: PlanCosts) -> None:
        self.g = g
        self.n_devices = nd = len(cluster.devices)
        self.times = np.asarray(costs.times, dtype=float)
        self.lat = np.zeros((nd, nd))
        self.per_byte = np.zeros((nd, nd))
        for s in range(nd):
            for d in range(nd):
                if s != d:
                    self.lat[s, d] = costs.transfer(s, d, 0.0)
                    self.per_byte[s, d] = (costs.transfer(s, d, _PROBE) - self.lat[s, d]) / _PROBE
        self.reads: list[list[tuple[int, int]]] = [_deduped(g, i) for i in range(len(g.ops))]
        self.memory = StaticMemory(g, cluster)
        self.dev = [-1] * len(g.ops)
        self.start = [0.0] * len(g.ops)
        self.finish = [0.0] * len(g.ops)

    def comm_mean(self) -> tuple[float, float]:
        """(latency, seconds per byte) of a transfer averaged over ordered pairs of distinct devices."""
        nd = self.n_devices
        if nd < 2:
            return 0.0, 0.0
        pairs = nd * (nd - 1)
        return float(self.lat.sum()) / pairs, float(self.per_byte.sum()) / pairs

    def arrival(self, i: int) -> np.ndarray:
        """When all of op i's inputs can be on each device (its producers must be scheduled)."""
        t = np.zeros(self.n_devices)
        for j, nbytes in self.reads[i]:
            src = self.dev[j] if self.g.ops[j].kind not in RESIDENT else self.memory.pinned.get(j, -1)
            if src < 0:
                continue  # a resident nobody has claimed yet: it will be wherever i goes
            base = 0.0 if self.g.ops[j].kind in RESIDENT else self.finish[j]
            np.maximum(t, base + self.lat[src] + nbytes * self.per_byte[src], out=t)
        return t

    def place(self, i: int, d: int, start: float) -> float:
        """Run op i on device d from `start`; returns its finish time."""
        self.dev[i], self.start[i] = d, start
        self.finish[i] = start + float(self.times[i, d])
        self.memory.place(i, d)
        return self.finish[i]

    def resolve_allreduce(self, a: int) -> None:
        """An allreduce finishes with its last input, on its first input's device (it is not placed)."""
        ins = [j for j, _ in self.reads[a] if self.dev[j] >= 0]
        self.dev[a] = self.dev[ins[0]] if ins else 0
        self.start[a] = self.finish[a] = max((self.finish[j] for j in ins), default=0.0)

    def strategy(self, planner: str, by_start: bool = True) -> Strategy:
        """The Strategy: each device's ops sorted by start time (or in topological order)."""
        device_of = [max(d, 0) for d in self.dev]
        return strategy_from(self.g, planner, self.n_devices, device_of, start=self.start if by_start else None,
                             replicas=self.g.replicas)


def _deduped(g: OpGraph, i: int) -> list[tuple[int, int]]:
    """(producer, bytes) once per distinct input of op i: a tensor read twice moves once, the larger size."""
    seen: dict[int, int] = {}
    op = g.ops[i]
    for j, b in zip(op.inputs, op.in_bytes):
        seen[j] = max(b, seen.get(j, 0))
    return list(seen.items())


def placed_ops(g: OpGraph) -> list[int]:
    """Indices of the ops a planner schedules: everything but residents (allreduces included)."""
    return [i for i, op in enumerate(g.ops) if op.kind not in RESIDENT]


# ---------------------------------------------------------------------------------------------------------------
# m-TOPO


def m_topo(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """m-TOPO: ops in topological order fill the devices one after another, each up to a memory cap.

    The cap of device d is min(its memory, total static memory / number of devices), total static memory being
    what every op and resident pins (`StaticMemory.size`). When the next op would push the current device over
    its cap the walk moves on to the next device; the last device takes the rest up to its memory. An op no
    device has room for goes to the device with the most free memory. Each device runs its ops in topological
    order.
    `costs` only serves the interface shared with the other planners: m-TOPO ignores time.
    """
    sched = Schedule(graph, cluster, costs or _no_costs(graph, cluster))
    mem = sched.memory
    nd = sched.n_devices
    total = sum(mem.size)
    cap = [min(dev.memory_bytes, total / nd) for dev in cluster.devices]
    cap[-1] = cluster.devices[-1].memory_bytes
    used = [int(dev.memory_bytes - mem.free[d]) for d, dev in enumerate(cluster.devices)]
    k = 0
    for i in placed_ops(graph):
        if graph.ops[i].kind == ALLREDUCE:
            sched.resolve_allreduce(i)
            continue
        need = int(mem.need[i])
        while k < nd - 1 and used[k] + need > cap[k]:
            k += 1
        d = k if used[k] + need <= cap[k] else int(np.argmax(mem.free))
        used[d] += need
        sched.place(i, d, 0.0)
    return sched.strategy("m-topo", by_start=False)


def _no_costs(graph: OpGraph, cluster: Cluster) -> PlanCosts:
    """Zero op times: m-TOPO needs the Schedule's bookkeeping, not the cost model."""
    return PlanCosts(times=np.zeros((len(graph.ops), len(cluster.devices))), cluster=cluster)


# ---------------------------------------------------------------------------------------------------------------
# m-ETF and m-SCT: list scheduling by earliest start time


def m_etf(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """m-ETF: Earliest Task First list scheduling under Baechi's memory constraint.

    Repeatedly picks, among ready ops (all inputs scheduled) and devices with room for them, the pair with the
    earliest start time max(device free, inputs arrived); ties go to the op earlier in topological order, then to
    the lower device. Ops are appended to their device (no gap filling), so each device's order is its start
    order. O(ops · ready · devices) work, done with numpy per step.
    """
    sched = Schedule(graph, cluster, costs or plan_costs(graph, cluster))
    return _list_schedule(sched, None, "m-etf")


def m_sct(graph: OpGraph, cluster: Cluster, costs: PlanCosts | None = None) -> Strategy:
    """m-SCT: m-ETF with the favorite-child rule of Hanen & Munier's SCT algorithm, as Baechi uses it.

    Each op gets at most one favorite child (see `favorite_children`: the LP relaxation of the
    small-communication-time scheduling ILP). While scheduling, when the last op on a device has a favorite child
    that is ready and whose inputs are all on that device by the time the device is free, that child starts there
    right after its parent, ahead of the ETF choice (the earliest such device first). Otherwise the step is plain
    m-ETF. Simplification: a device is not held idle for a favorite child that is not ready yet.
    """
    sched = Schedule(graph, cluster, costs or plan_costs(graph, cluster))
    return _list_schedule(sched, favorite_children(sched), "m-sct")


def _list_schedule(sched: Schedule, favorite: Sequence[int] | None, planner: str) -> Strategy:
    """The ETF loop shared by m-ETF and m-SCT (`favorite[i]`: op i's favorite child, or -1)."""
    g, nd, mem = sched.g, sched.n_devices, sched.memory
    n = len(g.ops)
    live = [op.kind not in RESIDENT for op in g.ops]
    waiting = [sum(1 for j, _ in sched.reads[i] if live[j]) for i in range(n)]
    arrive = np.zeros((n, nd))  # for ready ops: when their inputs are all on each device
    free_t = np.zeros(nd)
    last = [-1] * nd
    ready: list[int] = []  # sorted, so that argmin's first hit is the earliest op
    is_ready = [False] * n

    def release(i: int) -> None:
        """Op i has all its inputs scheduled: it becomes ready (an allreduce resolves at once)."""
        if g.ops[i].kind == ALLREDUCE:
            sched.resolve_allreduce(i)
            done(i)
            return
        arrive[i] = sched.arrival(i)
        bisect.insort(ready, i)
        is_ready[i] = True

    def done(i: int) -> None:
        for s in g.succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                release(s)

    for i in range(n):
        if live[i] and not waiting[i]:
            release(i)
    while ready:
        pick = _favorite_pick(sched, favorite, last, free_t, arrive, is_ready) if favorite is not None else None
        if pick is None:
            r = np.array(ready)
            est = np.where(mem.room_many(r), np.maximum(arrive[r], free_t[None, :]), np.inf)
            row, d = divmod(int(np.argmin(est)), nd)
            pick = (int(r[row]), d, float(est[row, d]))
        i, d, s = pick
        ready.remove(i)
        is_ready[i] = False
        free_t[d] = sched.place(i, d, s)
        last[d] = i
        done(i)
    return sched.strategy(planner)


def _favorite_pick(sched: Schedule, favorite: Sequence[int], last: list[int], free_t: np.ndarray,
                   arrive: np.ndarray, is_ready: list[bool]) -> tuple[int, int, float] | None:
    """A (favorite child, its parent's device, start) that can start right after its parent, or None."""
    best: tuple[float, int, int] | None = None
    for d, p in enumerate(last):
        c = favorite[p] if p >= 0 else -1
        if c < 0 or not is_ready[c] or arrive[c, d] > free_t[d] or not sched.memory.room(c)[d]:
            continue
        cand = (float(free_t[d]), c, d)
        if best is None or cand < best:
            best = cand
    return None if best is None else (best[1], best[2], best[0])


# ---------------------------------------------------------------------------------------------------------------
# SCT favorite children


def favorite_children(sched: Schedule) -> list[int]:
    """Each op's favorite child (or -1), from the LP relaxation of the SCT scheduling ILP (Hanen & Munier 1995).

    Variables: a start time t_i per scheduled op, x_ij in [0, 1] per edge (0: j runs right after i on i's
    device, so the transfer vanishes) and the makespan w. Constraints, with p_i an op's mean time over devices and
    c_ij the edge's mean transfer time over device pairs:
        t_j >= t_i + p_i + c_ij · x_ij          for every edge i -> j
        sum_j x_ij >= out-degree(i) - 1         each op has at most one favorite child
        sum_i x_ij >= in-degree(j) - 1          each op has at most one favorite parent
        w >= t_i + p_i                          for every op without successors
    minimize w + ε · sum c_ij x_ij / sum c_ij, with ε = 1e-6 · sum p_i: the second term, too small to trade
    any real makespan, prefers dropping the heaviest transfers among equally short LP schedules. j is i's favorite child when x_ij < 1/2; the degree
    constraints keep that to one child per op and one parent per child. One device: no favorites. If HiGHS fails,
    fall back to the greedy rule: each op's heaviest-transfer child not yet claimed by another parent.
    """
    g = sched.g
    n = len(g.ops)
    if sched.n_devices < 2:
        return [-1] * n
    ops = placed_ops(g)
    col = {i: k for k, i in enumerate(ops)}
    edges = [(j, i, b) for i in ops for j, b in sched.reads[i] if j in col]
    if not edges:
        return [-1] * n
    lat, per_byte = sched.comm_mean()
    p = sched.times.mean(axis=1)
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
