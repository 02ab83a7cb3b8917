"""The simulator's event loop, and the flat plan it walks.

`prepare` turns graph, strategy and cluster into lists of ints (`EventPlan`), so that the loop only touches
lists; `run_events` is the whole scheduler: each device runs its order, an op starts once the op before it on
its device has ended and its inputs are there, and what it sends off its device goes over `links.Links`. The
model it implements is stated in full in `fastt.simulate`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from fastt.cluster import Cluster
from fastt.errors import FasttError
from fastt.graph import ALLREDUCE, RESIDENT, OpGraph, kept_parts
from fastt.links import Collective, Links, Routes, Transfer, allreduce_bytes, half, route_tables
from fastt.strategy import Strategy

# Kinds of event, in the order they are handled at equal times (the heap orders (time, kind, op, ...)).
_END, _ARRIVE, _COLLECTIVE = 0, 1, 2


class Fanout(NamedTuple):
    """Where an op's output goes: to device `dst`, for its `consumers` there, `nbytes` of it, sent from `src`
    (a holder of it; `src == dst`: already there)."""

    dst: int
    consumers: list[int]
    nbytes: int
    src: int


class Readers(NamedTuple):
    """Who reads which copy, for memory: `copies[k]` (op * devices + device) is read by op `ops[k]`, which
    keeps part `parts[k]` of it alive (`graph.kept_parts`: one record per part it keeps)."""

    copies: list[int]
    ops: list[int]
    parts: list[int]

    def add(self, g: OpGraph, key: int, i: int, j: int) -> None:
        """Op i reads op j's copy `key`."""
        for p in kept_parts(g, i, j):
            self.copies.append(key)
            self.ops.append(i)
            self.parts.append(p)


@dataclass
class EventPlan:
    """The static structure the event loop walks: everything that does not depend on time."""

    dev: list[int]                    # device of each placed op, -1 otherwise
    order: list[list[int]]            # per device, op indices in run order (sentinel -1 at the end)
    need: list[int]                   # inputs each placed op waits for (residents on its device excluded)
    fanout: list[list[Fanout]]        # op -> where its output goes, in device order
    ar_cons: list[list[int]]          # op -> allreduces reading it
    ar_need: dict[int, int]           # allreduce -> inputs it waits for
    group: dict[int, tuple[int, ...]]  # allreduce -> its devices
    ar_cost: dict[tuple[int, ...], tuple]  # group -> (links, s, s per byte, s per tensor)
    release: list[int]                # op -> the op whose end sends what it sends off its device
    routes: Routes
    readers: Readers
    seeds: list[tuple]                # residents whose transfers are requested at t=0
    holders: dict[int, tuple[int, ...]]
    wake: list[float]                 # per device: what an op pays that a value from another device wakes
    comm: list[float]                 # per device: seconds of its compute per byte it sends or receives


class Events(NamedTuple):
    """What the event loop found: per op its start, end and the op that decided its start (-1: none), and the
    transfers and collectives in the order they were granted."""

    start: list[float]
    end: list[float]
    crit: list[int]
    transfers: tuple[Transfer, ...]
    collectives: tuple[Collective, ...]


def prepare(g: OpGraph, strategy: Strategy, cluster: Cluster, release: Mapping[str, str]) -> EventPlan:
    """Flatten graph + strategy + cluster into the lists the event loop reads."""
    ops, index, nd = g.ops, g.index, len(cluster.devices)
    dev = [-1] * len(ops)
    for name, d in strategy.placement.items():
        dev[index[name]] = d
    holders = {index[name]: tuple(sorted(set(hs))) for name, hs in strategy.holders.items()}
    held: list[tuple[int, ...]] = [()] * len(ops)
    for r, hs in holders.items():
        held[r] = hs
    group = _groups(g, dev)
    for a, grp in group.items():
        held[a] = grp
    routes = route_tables(cluster)
    need, ar_cons, ar_need, edges, readers = _consumers(g, dev, held, nd)
    fanout = _fanout(len(ops), edges, held, dev, routes, nd)
    seeds = [(0.0, _END, r, -1, None) for r in sorted(holders) if fanout[r]]
    order = [[index[name] for name in names] + [-1] for names in strategy.order]
    ar_cost = {grp: cluster.allreduce_cost(grp) for grp in set(group.values())}
    rel = list(range(len(ops)))
    for name, r in release.items():
        i, k = index[name], index[r]
        if dev[i] < 0 or dev[k] != dev[i]:
            raise FasttError(f"release: '{name}' is sent after '{r}', which is not placed on its device")
        rel[i] = k
    return EventPlan(dev, order, need, fanout, ar_cons, ar_need, group, ar_cost, rel, routes, readers, seeds,
                     holders, [d.wake_s for d in cluster.devices],
                     [d.comm_s_per_byte for d in cluster.devices])


def _groups(g: OpGraph, dev: list[int]) -> dict[int, tuple[int, ...]]:
    """Each allreduce's devices: those of its inputs and of its readers, as in the distributed runtime's
    collective."""
    ops = g.ops
    group = {a: {dev[j] for j in ops[a].inputs} for a in g.of_kind(ALLREDUCE)}
    for a, op in enumerate(ops):
        for j in op.inputs:
            if j in group and dev[a] >= 0:
                group[j].add(dev[a])
    for a in group:
        if not ops[a].inputs:
            raise FasttError(f"allreduce '{ops[a].name}' has no inputs")
    return {a: tuple(sorted(grp)) for a, grp in group.items()}


def _fanout(n: int, edges: dict[int, list], held: list[tuple[int, ...]], dev: list[int], routes: Routes,
            nd: int) -> list[list[Fanout]]:
    """Per op, where its output goes, each copy sent from the holder with the fastest route there."""
    lat, bw = routes.latency, routes.bandwidth
    fanout: list[list[Fanout]] = [[] for _ in range(n)]
    for key, (cons, b) in edges.items():
        j, d = divmod(key, nd)
        have = held[j] or (dev[j],)
        if d in have:
            src = d
        elif len(have) == 1:
            src = have[0]
        else:
            src = min(have, key=lambda h: (lat[h][d] + b / bw[h][d], h))
        fanout[j].append(Fanout(d, cons, b, src))
    for f in fanout:
        if len(f) > 1:
            f.sort(key=lambda x: x.dst)  # transfers of one op are requested in device order
    return fanout


def _consumers(g: OpGraph, dev: list[int], held: list[tuple[int, ...]], nd: int) -> tuple:
    """Who waits for what: inputs per placed op, inputs per allreduce, and consumers per (op, device) copy.

    `held[j]` lists the devices that have op j without a transfer (a resident's holders, an allreduce's ring);
    a placed op reading a resident it holds does not wait. Returns need, ar_cons, ar_need, edges (copy key
    j*nd+d -> [consumers on d, largest bytes read]) and the memory readers.
    """
    need = [0] * len(g.ops)
    ar_cons: list[list[int]] = [[] for _ in g.ops]
    ar_need: dict[int, int] = {}
    edges: dict[int, list] = {}
    readers = Readers([], [], [])
    copies, by, kept = readers
    parted = [len(op.out_parts) > 1 for op in g.ops]  # one storage (the most): kept is part 0, added inline
    for i, op in enumerate(g.ops):
        pairs = g.reads[i]
        if op.kind == ALLREDUCE:
            ar_need[i] = len(pairs)
            for j, _ in pairs:
                ar_cons[j].append(i)
                readers.add(g, j * nd + dev[j], i, j)
            continue
        d = dev[i]
        for j, b in pairs:
            if d in held[j] and g.ops[j].kind in RESIDENT:
                continue  # a resident already on this device
            key = j * nd + d
            if parted[j]:
                readers.add(g, key, i, j)
            else:
                copies.append(key)
                by.append(i)
                kept.append(0)
            need[i] += 1
            e = edges.get(key)
            if e is None:
                edges[key] = [[i], b]
            else:
                e[0].append(i)
                e[1] = max(e[1], b)
    return need, ar_cons, ar_need, edges, readers


def run_events(g: OpGraph, p: EventPlan, dur: list[float]) -> Events:
    """The event loop over plan `p`, `dur[i]` being op i's seconds on its device."""
    loop = _Loop(g, p, dur)
    for d in range(len(p.order)):
        loop.run(d)
    heap, pop = loop.heap, heapq.heappop
    while heap:
        t, kind, j, _, cons = pop(heap)
        if kind == _ARRIVE:
            for i in cons:
                loop.arrive(i, j, t)
        elif kind == _COLLECTIVE:
            loop.allreduce(cons, t)
        else:
            loop.finish(j, t)
    _check_finished(g, p, loop.at, loop.ar_need)
    return Events(loop.start, loop.end, loop.crit, tuple(loop.links.transfers), tuple(loop.links.collectives))


class _Loop:
    """The event loop's state, and what each kind of event does to it.

    Ops start eagerly: once an op's inputs are all there and the op before it on the device has a known end,
    its start is known, and only its end event goes on the heap. `ready[i]` is when op i's last input arrived
    and `why[i]` which input that was; `at[d]` is the position of device d's next op in its order, `busy[d]`
    when the device is next free and `last[d]` the op it ran last. `pending[group]` collects the allreduces of
    one group that became ready at one moment, launched as one. """

    def __init__(self, g: OpGraph, p: EventPlan, dur: list[float]) -> None:
        n, nd = len(g.ops), len(p.order)
        self.ops, self.p, self.dur = g.ops, p, dur
        self.start, self.end, self.ready = [0.0] * n, [0.0] * n, [0.0] * n
        self.why, self.crit = [-1] * n, [-1] * n
        self.need, self.ar_need = p.need[:], dict(p.ar_need)
        self.at, self.busy, self.last = [0] * nd, [0.0] * nd, [-1] * nd
        self.released, self.waiting = [False] * n, [[] for _ in range(n)]
        self.pending: dict[tuple[int, ...], list[int]] = {}
        self.links = Links(p.routes, p.ar_cost)
        self.heap = list(p.seeds)

    def run(self, d: int) -> None:
        """Start, in order, every op at the head of device d whose inputs are all there."""
        need, ready, why, crit = self.need, self.ready, self.why, self.crit
        start, end, dur, heap = self.start, self.end, self.dur, self.heap
        k, seq, b, prev = self.at[d], self.p.order[d], self.busy[d], self.last[d]
        dev, wake = self.p.dev, self.p.wake[d]
        i = seq[k]
        while i >= 0 and not need[i]:
            r = ready[i]
            if b > r:
                s, crit[i], woken = b, prev, 0.0
            else:
                s, crit[i] = r, why[i]
                # The device waited for another device's value, and another device is running: waking it
                # costs the running devices (`Device.wake_s`), charged here. In a chain, where the sender
                # waits in turn, the hand-off costs only its latency.
                woken = wake if wake and why[i] >= 0 and dev[why[i]] not in (-1, d) and any(
                    e != d and t > r for e, t in enumerate(self.busy)) else 0.0
            b = s + dur[i] + woken
            start[i], end[i], prev = s, b, i
            heapq.heappush(heap, (b, _END, i, -1, None))
            k += 1
            i = seq[k]
        self.at[d], self.busy[d], self.last[d] = k, b, prev

    def arrive(self, i: int, j: int, t: float) -> None:
        """Input j of op i is now on i's device."""
        need = self.need
        need[i] -= 1
        if t >= self.ready[i]:
            self.ready[i], self.why[i] = t, j
        d = self.p.dev[i]
        if not need[i] and self.p.order[d][self.at[d]] == i:
            self.run(d)

    def finish(self, j: int, t: float) -> None:
        """Op j's output exists: hand it to local consumers; send it off the device now or at its release."""
        for dst, cons, _, src in self.p.fanout[j]:
            if src == dst:
                for i in cons:
                    self.arrive(i, j, t)
        r = self.p.release[j]
        if r == j or self.released[r]:
            self.send(j, t)
        else:
            self.waiting[r].append(j)
        self.released[j] = True
        for k in self.waiting[j]:
            self.send(k, t)

    def send(self, j: int, t: float) -> None:
        """Request op j's transfers to other devices, feed the allreduces reading it."""
        comm = self.p.comm
        for dst, cons, nbytes, src in self.p.fanout[j]:
            if src != dst:
                e = self.links.transfer(j, src, dst, nbytes, t)
                heapq.heappush(self.heap, (e, _ARRIVE, j, dst, cons))
                if comm[src] or comm[dst]:  # the hot path: most clusters' devices copy for nothing
                    self.charge(src, t, nbytes)
                    self.charge(dst, t, nbytes)
        ar_need, why = self.ar_need, self.why
        for a in self.p.ar_cons[j]:
            ar_need[a] -= 1
            why[a] = j  # inputs arrive in time order, so the last one decides the start
            if not ar_need[a]:
                grp = self.p.group[a]
                if grp not in self.pending:  # launched once every event of this moment is in
                    self.pending[grp] = []
                    heapq.heappush(self.heap, (t, _COLLECTIVE, a, -1, grp))
                self.pending[grp].append(a)

    def charge(self, d: int, t: float, nbytes: float) -> None:
        """Device d sends or receives `nbytes` from t: on a device whose cores do the copying
        (`Device.comm_s_per_byte`, a distributed CPU rank), its next op starts that much later. Charged when
        the transfer or collective is requested, the moment the event loop is at, so no op already started
        moves."""
        c = self.p.comm[d]
        if c:
            self.busy[d] = max(self.busy[d], t) + nbytes * c

    def allreduce(self, grp: tuple[int, ...], t: float) -> None:
        """Run the allreduces of `grp` that became ready at t as one."""
        ops = self.pending.pop(grp)
        nbytes, halves = sum(allreduce_bytes(self.ops[a]) for a in ops), all(half(self.ops[a]) for a in ops)
        s, e = self.links.collective(ops, grp, nbytes, t, halves=halves)
        n = len(grp)
        for d in grp:  # each rank sends and receives 2(n-1)/n of the bytes, n-1 of them for a halved ring
            self.charge(d, t, (1 if halves else 2) * 2 * (n - 1) / n * nbytes)
        for a in ops:
            self.start[a], self.end[a], self.crit[a] = s, e, self.why[a]
            heapq.heappush(self.heap, (e, _END, a, -1, None))


def _check_finished(g: OpGraph, p: EventPlan, at: list[int], ar_need: dict[int, int]) -> None:
    """Every op ran; a validated strategy cannot stall, so this guards the simulator itself."""
    stuck = [f"device {d} waits to run '{g.ops[seq[at[d]]].name}'" for d, seq in enumerate(p.order)
             if seq[at[d]] >= 0]
    stuck += [f"allreduce '{g.ops[a].name}' waits for {k} input(s)" for a, k in ar_need.items() if k]
    if stuck:
        raise FasttError("simulation stalled: " + "; ".join(stuck)
                         + " (is the order consistent with the graph?)")
