"""The list-scheduling core every list planner is a policy on (DPOS, HEFT, m-ETF, m-SCT, m-TOPO).

    list_schedule(sched, policy)
      +-- policy.ready(sched, i)   op i's inputs are all scheduled (an allreduce is not placed: its
      |                            `Allreduce` model times it at once and its readers are released)
      +-- policy.pick(sched)       -> Choice(op, device, start), the policy's priority and device rule
      +-- sched.place(choice)      device busy time (`Slots`), memory (`StaticMemory`), start and finish

A `Schedule` is the state: each op's device, start and finish, every device's busy blocks, free memory and
where each resident lives. Times come from one `PlanCosts`: op times, and transfer = latency + bytes · s per
byte.
"""

from __future__ import annotations

import bisect
import heapq
from typing import NamedTuple, Protocol

import numpy as np

from ..cluster import Cluster
from ..graph import ALLREDUCE, RESIDENT, OpGraph
from ..strategy import Strategy
from .common import PlanCosts, memory_of, strategy_from


class Choice(NamedTuple):
    """What a policy decides for one op: the device it runs on and when it starts there."""

    op: int
    device: int
    start: float


class Slots:
    """One device's busy time as sorted, disjoint blocks, for insertion-based scheduling.

    Ops that touch are merged into one block, so the gap search only visits real gaps (a loaded device is
    mostly back-to-back ops, and scanning them one by one made HEFT quadratic on large graphs).
    """

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def earliest(self, ready: float, dur: float) -> tuple[float, int]:
        """The first start >= ready where `dur` seconds fit, and the position to insert the interval at."""
        k = bisect.bisect_right(self.ends, ready)  # intervals before k end by `ready`
        t = ready
        while k < len(self.starts) and t + dur > self.starts[k]:
            t = max(ready, self.ends[k])
            k += 1
        return t, k

    def add(self, k: int, start: float, end: float) -> None:
        """Mark [start, end] busy; k is the position `earliest` returned for it."""
        starts, ends = self.starts, self.ends
        if k < len(starts) and starts[k] == end:
            starts[k] = start
        else:
            starts.insert(k, start)
            ends.insert(k, end)
        if k and ends[k - 1] == start:
            ends[k - 1] = ends.pop(k)
            starts.pop(k)


class StaticMemory:
    """Planning memory: each device's free bytes, and where each resident (parameter, state, buffer) lives.

    An op charges `memory_of(g)[i]` on its device for the whole step (its output if that is live at the peak
    of a run in graph order, not every output as in Baechi's paper: see `memory_of`); a resident charges its
    bytes on each of its homes. With `home_per_update` (DPOS) a resident has one home per op that updates it
    (one in a plain graph, one per replica in a data-parallel one), made by the first ops that read or update
    it, and each update runs on a home of its own that no other update used. Without it (Baechi) a resident
    has one home, the device of the first op that updates it, or, if nothing updates it, of the first that
    reads it. A resident no op reads or updates lives on device 0, as `strategy_from` holds it, charged there
    only without `home_per_update` (as the two planners always did). A device without room for an op is not
    offered; when no device has room the one with the most free memory is, and the simulator reports the
    misfit.
    """

    def __init__(self, g: OpGraph, cluster: Cluster, home_per_update: bool) -> None:
        mem = memory_of(g)
        self.g, self.per_update = g, home_per_update
        self.size = [op.out_bytes if op.kind in RESIDENT else mem[i] for i, op in enumerate(g.ops)]
        self.free = np.array([dev.memory_bytes for dev in cluster.devices], dtype=np.int64)
        self.updaters: dict[int, list[int]] = {r: [] for r in g.residents}
        for i, op in enumerate(g.ops):
            for r in op.updates:
                self.updaters[r].append(i)
        self.copies = [max(len(self.updaters.get(r, ())), 1) if home_per_update else 1
                       for r in range(len(g.ops))]
        self.claims: list[tuple[int, ...]] = []  # the residents each op claims
        self.claimants: dict[int, list[int]] = {r: [] for r in g.residents}
        for i, op in enumerate(g.ops):
            claims: tuple[int, ...] = ()
            if op.kind not in RESIDENT and op.kind != ALLREDUCE:
                reads = [r for r in op.inputs
                         if g.ops[r].kind in RESIDENT and (home_per_update or not self.updaters[r])]
                claims = tuple(dict.fromkeys([*op.updates, *reads]))
            self.claims.append(claims)
            for r in claims:
                self.claimants[r].append(i)
        self.homes: list[list[int]] = [[] for _ in g.ops]
        self.updated_on: list[set[int]] = [set() for _ in g.ops]
        # need[i]: what op i charges on a device that is no home yet; `touchy`: ops whose charge or update
        # rule depends on the device (a resident partly homed, or updated elsewhere already)
        self.need = np.array([self.size[i] + sum(self.size[r] for r in c) for i, c in enumerate(self.claims)],
                             dtype=np.int64)
        self.touchy: set[int] = set()
        for r, ops in self.claimants.items():
            # strategy_from holds it on device 0; Baechi's planners charge it there, DPOS does not
            if not ops:
                self.homes[r].append(0)
                self.free[0] -= 0 if home_per_update else self.size[r]

    def where(self, r: int) -> list[int]:
        """Resident r's homes once it has them all; before that, none: it is free wherever its reader goes."""
        return self.homes[r] if len(self.homes[r]) >= self.copies[r] else []

    def _new_homes(self, i: int, d: int) -> list[int]:
        return [r for r in self.claims[i] if d not in self.homes[r] and len(self.homes[r]) < self.copies[r]]

    def charge(self, i: int, d: int) -> int:
        """Bytes placing op i on d takes there: its own and those of the residents it makes d a home of."""
        return self.size[i] + sum(self.size[r] for r in self._new_homes(i, d))

    def eligible(self, i: int, d: int) -> bool:
        """Op i may go to d: its updates are due there and d has room for it."""
        for r in self.g.ops[i].updates if self.per_update else ():
            if d in self.updated_on[r] or (d not in self.homes[r] and len(self.homes[r]) >= self.copies[r]):
                return False  # a second update of one copy would apply the step twice
            idle = [h for h in self.homes[r] if h not in self.updated_on[r]]
            if idle and d not in idle:
                return False  # a home waits for its update: holders must all be updated
        return self.charge(i, d) <= self.free[d]

    def room(self, i: int) -> np.ndarray:
        """Devices op i may go to: those with room for it, else only the one with the most free memory."""
        return self.room_many(np.array([i]))[0]

    def room_many(self, ops: np.ndarray) -> np.ndarray:
        """`room` for several ops at once: a (len(ops), devices) boolean array."""
        ok = self.need[ops][:, None] <= self.free[None, :]
        for row, i in enumerate(ops.tolist()):
            if i in self.touchy:
                ok[row] = [self.eligible(i, d) for d in range(len(self.free))]
        homeless = ~ok.any(axis=1)
        if homeless.any():
            ok[homeless, int(np.argmax(self.free))] = True
        return ok

    def place(self, i: int, d: int) -> None:
        """Op i goes to device d: take its bytes, and make d a home of the residents it claims there."""
        self.free[d] -= self.charge(i, d)
        for r in self._new_homes(i, d):
            self.homes[r].append(d)
            if len(self.homes[r]) == self.copies[r]:
                for k in self.claimants[r]:  # later claimants no longer pay for r
                    self.need[k] -= self.size[r]
            if self.per_update:
                self.touchy.update(self.updaters[r])
            if self.copies[r] > 1:
                self.touchy.update(self.claimants[r])
        for r in self.g.ops[i].updates:
            self.updated_on[r].add(d)


class Allreduce(Protocol):
    """How a list planner times an allreduce (data-parallel graphs): when it ends and where its result is."""

    def finish(self, sched: Schedule, a: int) -> tuple[float, list[int]]: ...


class RingAllreduce:
    """A ring over its inputs' devices, each hop moving 2(n-1)/n of the bytes (as NCCL's); the result ends on
    every ring device, and another device reads it from the ring's first."""

    def finish(self, sched: Schedule, a: int) -> tuple[float, list[int]]:
        op = sched.g.ops[a]
        group = sorted({sched.dev[j] for j in op.inputs})
        n = len(group)
        nbytes = max(op.in_bytes, default=0)
        ring = 0.0
        if n > 1:
            hops = [(group[k], group[(k + 1) % n]) for k in range(n)]
            ring = max(sched.costs.transfer(s, t, 2 * (n - 1) / n * nbytes) for s, t in hops)
        return max(sched.finish[j] for j in op.inputs) + ring, group


class FreeAllreduce:
    """Baechi's: an allreduce takes no time, ending with its last input on the device of its first."""

    def finish(self, sched: Schedule, a: int) -> tuple[float, list[int]]:
        ins = [j for j, _ in sched.reads[a] if sched.dev[j] >= 0]
        return max((sched.finish[j] for j in ins), default=0.0), [sched.dev[ins[0]] if ins else 0]


def edge_bytes(g: OpGraph) -> dict[tuple[int, int], int]:
    """(producer, reader) -> the bytes the reader takes from it."""
    return {(j, i): b for i, reads in enumerate(g.reads) for j, b in reads}


class Schedule:
    """A partial schedule: each op's device, start and finish, each device's busy blocks and last op, and the
    memory and allreduce models it is built under."""

    def __init__(self, g: OpGraph, costs: PlanCosts, memory: StaticMemory, allreduce: Allreduce) -> None:
        n, nd = len(g.ops), len(costs.cluster.devices)
        self.g, self.costs, self.memory, self.allreduce = g, costs, memory, allreduce
        self.n_devices = nd
        self.times = np.asarray(costs.times, dtype=float)
        self.reads = g.reads
        self.dev = [-1] * n
        self.start = [0.0] * n
        self.finish = [0.0] * n
        self.slots = [Slots() for _ in range(nd)]
        self.free_at = np.zeros(nd)  # when each device's last op ends
        self.last = [-1] * nd  # the op placed last on each device
        self._group: dict[int, list[int]] = {}  # each timed allreduce's devices
        # `arrival_at`'s latency and seconds per byte, as lists
        self._lat, self._inv = costs.latency.tolist(), costs.inv_bandwidth.tolist()

    def arrival(self, i: int) -> np.ndarray:
        """When all of op i's inputs can be on each device (its producers must be scheduled)."""
        lat, inv = self.costs.latency, self.costs.inv_bandwidth
        t = np.zeros(self.n_devices)
        for j, nbytes in self.reads[i]:
            kind = self.g.ops[j].kind
            if kind in RESIDENT:
                homes = self.memory.where(j)
                if homes:
                    np.maximum(t, np.min(lat[homes] + nbytes * inv[homes], axis=0), out=t)
            elif kind == ALLREDUCE:
                group = self._group[j]
                hop = lat[group[0]] + nbytes * inv[group[0]]
                hop[group] = 0.0
                np.maximum(t, self.finish[j] + hop, out=t)
            else:
                src = self.dev[j]
                np.maximum(t, self.finish[j] + lat[src] + nbytes * inv[src], out=t)
        return t

    def arrival_at(self, i: int, d: int) -> float:
        """`arrival(i)[d]` alone, in plain floats: a policy that has fixed op i's device (`ByRank.fixed`)
        needs no other device's (numpy per op was most of `ordered`'s time on an 18k-op graph)."""
        lat, inv, ops = self._lat, self._inv, self.g.ops
        t = 0.0
        for j, nbytes in self.reads[i]:
            kind = ops[j].kind
            if kind in RESIDENT:
                homes = self.memory.where(j)
                if homes and d not in homes:
                    t = max(t, min(lat[h][d] + nbytes * inv[h][d] for h in homes))
            elif kind == ALLREDUCE:
                src = self._group[j][0]
                hop = 0.0 if d in self._group[j] else lat[src][d] + nbytes * inv[src][d]
                t = max(t, self.finish[j] + hop)
            else:
                src = self.dev[j]
                hop = self.finish[j] if src == d else self.finish[j] + lat[src][d] + nbytes * inv[src][d]
                t = max(t, hop)
        return t

    def earliest(self, d: int, ready: float, dur: float) -> float:
        """Earliest start ≥ ready of a `dur`-long slot on device d (insertion into idle gaps)."""
        return self.slots[d].earliest(ready, dur)[0]

    def place(self, c: Choice) -> None:
        """Run op c.op on c.device from the first idle slot at or after c.start."""
        i, d = c.op, c.device
        dur = float(self.times[i, d])
        self.memory.place(i, d)
        start, k = self.slots[d].earliest(c.start, dur)
        self.slots[d].add(k, start, start + dur)
        self.dev[i], self.start[i], self.finish[i] = d, start, start + dur
        self.free_at[d] = max(self.free_at[d], start + dur)
        self.last[d] = i

    def time_allreduce(self, a: int) -> None:
        """Allreduce a's inputs are all scheduled: record when it ends and on which devices."""
        self.finish[a], group = self.allreduce.finish(self, a)
        self.start[a], self.dev[a], self._group[a] = self.finish[a], group[0], group

    def strategy(self, planner: str, by_start: bool = True, replicas: int | None = None) -> Strategy:
        """The Strategy: each device's ops sorted by start time (or in topological order)."""
        device_of = [max(d, 0) for d in self.dev]
        return strategy_from(self.g, planner, self.n_devices, device_of,
                             start=self.start if by_start else None,
                             replicas=self.g.replicas if replicas is None else replicas)


class Policy(Protocol):
    """A list planner's rules: which ready op goes next, to which device, from when."""

    def ready(self, sched: Schedule, i: int) -> None:
        """Op i's inputs are all scheduled."""

    def pick(self, sched: Schedule) -> Choice | None:
        """The next op to place, or None when no op is ready."""


def list_schedule(sched: Schedule, policy: Policy) -> Schedule:
    """Place every op of sched.g under `policy`: the ops whose inputs are all scheduled are offered to it."""
    g = sched.g
    waiting = [sum(1 for j, _ in reads if g.ops[j].kind not in RESIDENT) for reads in sched.reads]

    def release(i: int) -> None:
        if g.ops[i].kind == ALLREDUCE:
            sched.time_allreduce(i)
            done(i)
        else:
            policy.ready(sched, i)

    def done(i: int) -> None:
        for s in g.succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                release(s)

    for i, op in enumerate(g.ops):
        if op.kind not in RESIDENT and not waiting[i]:
            release(i)
    while (c := policy.pick(sched)) is not None:
        sched.place(c)
        done(c.op)
    return sched


def upward_rank(g: OpGraph, w: np.ndarray, edge_cost) -> list[float]:
    """rank(o) = w[o] + max over successors s of (edge_cost(o, s) + rank(s))."""
    rank = [0.0] * len(g.ops)
    for i in range(len(g.ops) - 1, -1, -1):
        rank[i] = w[i] + max((edge_cost(i, s) + rank[s] for s in g.succs[i]), default=0.0)
    return rank


class ByRank:
    """Ops by decreasing rank (ties in graph order), each to the device where it finishes first, filling idle
    gaps (HEFT's rule); an op in `fixed` goes to its device there while that has room (DPOS's critical
    path)."""

    def __init__(self, rank: list[float], fixed: dict[int, int] | None = None) -> None:
        self.rank, self.fixed = rank, fixed or {}
        self.heap: list[tuple[float, int]] = []

    def ready(self, sched: Schedule, i: int) -> None:
        heapq.heappush(self.heap, (-self.rank[i], i))

    def pick(self, sched: Schedule) -> Choice | None:
        if not self.heap:
            return None
        _, i = heapq.heappop(self.heap)
        room, times = sched.memory.room(i), sched.times[i]
        d = self.fixed.get(i, -1)
        if d >= 0 and room[d]:
            return Choice(i, d, sched.earliest(d, sched.arrival_at(i, d), float(times[d])))
        ready = sched.arrival(i)
        best: Choice | None = None
        best_end = np.inf
        for d in np.flatnonzero(room).tolist():
            s = sched.earliest(d, ready[d], times[d])
            if s + times[d] < best_end:
                best, best_end = Choice(i, d, s), s + times[d]
        return best
