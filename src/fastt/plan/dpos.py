"""DPOS: FastT's device placement and operation scheduling (critical path first, then earliest finish time).

1. Upward rank with each op's *maximum* time over devices and each edge's *maximum* transfer time over device
   pairs: rank(o) = W(o) + max over successors s of (C(o, s) + rank(s)). Ops are scheduled by decreasing rank.
2. The critical path: from the entry op of largest rank, repeatedly the successor of largest rank.
3. Critical-path device: for each device, as many of the remaining critical-path ops as fit in its memory,
   averaged over their times there; the device with the smallest average takes them; when it is full, choose
   again for the rest.
4. Every other op goes to the device where it finishes first (insertion-based: it may fill an idle gap); a
   device whose memory would overflow is skipped; devices may stay unused.
Memory is Baechi's static model (plan/common.py): every output stays pinned for the step — conservative.
Known bound: makespan ≤ 2·OPT + C_max.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ..cluster import Cluster
from ..graph import ALLREDUCE, RESIDENT, OpGraph
from ..strategy import Strategy
from .common import PlanCosts, Slots, memory_of, plan_costs, strategy_from


def upward_rank(g: OpGraph, w: np.ndarray, edge_cost) -> list[float]:
    """rank(o) = w[o] + max over successors s of (edge_cost(o, s) + rank(s))."""
    rank = [0.0] * len(g.ops)
    for i in range(len(g.ops) - 1, -1, -1):
        rank[i] = w[i] + max((edge_cost(i, s) + rank[s] for s in g.succs[i]), default=0.0)
    return rank


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


class _Schedule:
    """Per-device busy intervals, memory use, where residents live, and each op's device, start and finish.

    A resident gets as many homes as it has updating ops (one for a plain graph, one per replica for a
    data-parallel one): the first devices that read or update it become homes, a read on a home is free, others
    pay a transfer from a home. Each updating op runs on a home of its own, as the holders of a Strategy do.
    """

    def __init__(self, g: OpGraph, costs: PlanCosts) -> None:
        n_dev = len(costs.cluster.devices)
        self.g, self.costs = g, costs
        self.slots = [Slots() for _ in range(n_dev)]
        self.free = [float(d.memory_bytes) for d in costs.cluster.devices]
        self.dev = [-1] * len(g.ops)
        self.start = [0.0] * len(g.ops)
        self.finish = [0.0] * len(g.ops)
        self.mem = memory_of(g)
        self.cap = [0] * len(g.ops)
        for op in g.ops:
            for j in op.updates:
                self.cap[j] += 1
        self.homes: list[list[int]] = [[] for _ in g.ops]
        self.updated_on: list[set[int]] = [set() for _ in g.ops]
        self._allreduce: dict[int, tuple[float, list[int]]] = {}

    def _reaches(self, j: int, d: int) -> bool:
        """Resident j is (or can become) at home on d."""
        return d in self.homes[j] or len(self.homes[j]) < max(self.cap[j], 1)

    def ready_all(self, i: int) -> np.ndarray:
        """For every device, when all of op i's inputs can be there."""
        g, lat, inv = self.g, self.costs.latency, self.costs.inv_bandwidth
        t = np.zeros(len(self.free))
        for j, nbytes in zip(g.ops[i].inputs, g.ops[i].in_bytes):
            kind = g.ops[j].kind
            if kind in RESIDENT:
                if self.homes[j] and len(self.homes[j]) >= max(self.cap[j], 1):
                    t = np.maximum(t, np.min(lat[self.homes[j]] + nbytes * inv[self.homes[j]], axis=0))
            elif kind == ALLREDUCE:
                done, group = self.allreduce_done(j)
                hop = lat[group[0]] + nbytes * inv[group[0]]
                hop[group] = 0.0
                t = np.maximum(t, done + hop)
            else:
                src = self.dev[j]
                t = np.maximum(t, self.finish[j] + lat[src] + nbytes * inv[src])
        return t

    def allreduce_done(self, a: int) -> tuple[float, list[int]]:
        """Finish of an allreduce (a ring over its inputs' devices) and the ring's devices (cached: its inputs
        are all scheduled before any reader of it)."""
        if a not in self._allreduce:
            op = self.g.ops[a]
            group = sorted({self.dev[j] for j in op.inputs})
            ready = max(self.finish[j] for j in op.inputs)
            n = len(group)
            nbytes = max(op.in_bytes, default=0)
            ring = 0.0
            if n > 1:
                hops = [(group[k], group[(k + 1) % n]) for k in range(n)]
                ring = max(self.costs.transfer(s, t, 2 * (n - 1) / n * nbytes) for s, t in hops)
            self._allreduce[a] = (ready + ring, group)
        return self._allreduce[a]

    def _new_homes(self, i: int, d: int) -> list[int]:
        op = self.g.ops[i]
        return [j for j in dict.fromkeys((*op.inputs, *op.updates))
                if self.g.ops[j].kind in RESIDENT and d not in self.homes[j] and self._reaches(j, d)]

    def extra_memory(self, i: int, d: int) -> float:
        """Bytes placing op i on d pins there: its outputs and the residents that would make d a new home."""
        return self.mem[i] + sum(self.g.ops[j].out_bytes for j in self._new_homes(i, d))

    def earliest(self, d: int, ready: float, dur: float) -> float:
        """Earliest start ≥ ready of a `dur`-long slot on device d (insertion into idle gaps)."""
        return self.slots[d].earliest(ready, dur)[0]

    def eligible(self, i: int, d: int) -> bool:
        for j in self.g.ops[i].updates:
            if d in self.updated_on[j] or not self._reaches(j, d):
                return False  # a second update of one copy would apply the step twice
            idle = [h for h in self.homes[j] if h not in self.updated_on[j]]
            if idle and d not in idle:
                return False  # a home waits for its update: holders must all be updated
        return self.extra_memory(i, d) <= self.free[d]

    def place(self, i: int, d: int, start: float, dur: float) -> None:
        self.free[d] -= self.extra_memory(i, d)
        for j in self._new_homes(i, d):
            self.homes[j].append(d)
        for j in self.g.ops[i].updates:
            self.updated_on[j].add(d)
        start, k = self.slots[d].earliest(start, dur)
        self.slots[d].add(k, start, start + dur)
        self.dev[i], self.start[i], self.finish[i] = d, start, start + dur

    def best_device(self, i: int, devices) -> tuple[int, float]:
        """The device (among `devices`) where op i finishes first, and its start there."""
        best, best_d, best_s = math.inf, -1, 0.0
        times = self.costs.times[i]
        ready = self.ready_all(i)
        for d in devices:
            if not self.eligible(i, d):
                continue
            s = self.earliest(d, ready[d], times[d])
            if s + times[d] < best:
                best, best_d, best_s = s + times[d], d, s
        if best_d < 0:  # nowhere fits: the most free memory; the simulator will report it
            best_d = max(devices, key=lambda d: self.free[d])
            best_s = self.earliest(best_d, ready[best_d], times[best_d])
        return best_d, best_s


def _cp_devices(sched: _Schedule, cp: list[int]) -> dict[int, int]:
    """Critical-path ops -> device: the device with the smallest average time over the ops it can hold."""
    out: dict[int, int] = {}
    free = list(sched.free)
    rest = list(cp)
    n_dev = len(free)
    while rest:
        best = None
        for d in range(n_dev):
            used, k = 0.0, 0
            while k < len(rest) and used + sched.mem[rest[k]] <= free[d]:
                used += sched.mem[rest[k]]
                k += 1
            if k:
                avg = float(np.mean([sched.costs.times[i, d] for i in rest[:k]]))
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


def schedule(g: OpGraph, costs: PlanCosts) -> _Schedule:
    """Run DPOS on `g`: every placed op gets a device, a start and a finish."""
    w = costs.times.max(axis=1)
    max_c = {}

    def edge_cost(i: int, s: int) -> float:
        nbytes = max(b for j, b in zip(g.ops[s].inputs, g.ops[s].in_bytes) if j == i)
        if nbytes not in max_c:
            max_c[nbytes] = costs.max_transfer(nbytes)
        return max_c[nbytes]

    rank = upward_rank(g, w, edge_cost)
    placed = [op.kind not in RESIDENT and op.kind != ALLREDUCE for op in g.ops]
    sched = _Schedule(g, costs)
    cp_dev = _cp_devices(sched, [i for i in critical_path(g, rank, placed)])
    devices = range(len(costs.cluster.devices))
    # Decreasing rank respects dependencies; ties (zero-cost ops) fall back to graph order.
    heap = [(-rank[i], i) for i in range(len(g.ops)) if placed[i]]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        if i in cp_dev and sched.eligible(i, cp_dev[i]):
            d = cp_dev[i]
            s = sched.earliest(d, sched.ready_all(i)[d], costs.times[i, d])
        else:
            d, s = sched.best_device(i, devices)
        sched.place(i, d, s, float(costs.times[i, d]))
    return sched


def dpos_strategy(g: OpGraph, cluster: Cluster, costs: PlanCosts | None = None, planner: str = "dpos",
                  replicas: int = 1) -> Strategy:
    """DPOS's placement and per-device order (ops sorted by their scheduled start) for graph `g`."""
    sched = schedule(g, costs or plan_costs(g, cluster))
    return strategy_from(g, planner, len(cluster.devices), [max(d, 0) for d in sched.dev], start=sched.start,
                         replicas=replicas)


def dpos(graph: OpGraph, cluster: Cluster) -> Strategy:
    """The `dpos` planner: DPOS on the captured graph (no replication, no splits)."""
    return dpos_strategy(graph, cluster)
