"""Discrete-event simulation of one training step under a Strategy on a Cluster, producing a Timeline.

The model, in full:
- each device runs its ops strictly in `strategy.order[d]`; an op starts when the device has finished its previous
  op and every input is on the device;
- residents (params, state, buffers) are on their holders at t=0; a non-holder reads one through a transfer from
  the holder with the fastest route, requested at t=0;
- when an op finishes, each other device with consumers of it gets one transfer (the largest bytes any of those
  consumers reads); a transfer occupies every link of its route, links carry one thing at a time and are granted
  in request order (ties by op index), so contention delays the later request;
- what an op sends off its device (transfers, its part of an allreduce) leaves when the op finishes, or, with
  `release`, when the op that ends its run of ops finishes (the runtimes hand values over per compiled segment);
- an allreduce runs on the devices of its inputs and of its readers once its inputs are all available and its
  links are free, as a ring or a gather (`Cluster.gather`); allreduces of one group that become ready at the
  same moment run as one (their bytes fused, one latency), as the distributed runtime's collectives do; the
  result is then on every device of the group;
- memory per device starts at its resident set; an op allocates its output when it starts (INPUT data at t=0), a
  transfer its bytes on the receiver when it starts, an allreduce its output on every ring device; a copy is freed
  when its last reader there (a local op, an outgoing transfer, an allreduce) has finished. At equal times
  allocations count before frees, so the peak is conservative.

The event loop (`_run`) is the whole scheduler; `_prepare` turns graph, strategy and cluster into flat lists of ints
so the loop only touches lists, and `_memory` replays allocations afterwards with numpy. `simulate_plan` simulates
a strategy on the graph it was planned for (replicated and split as it says), with `lower_bound` beside.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fastt.cluster import Cluster
from fastt.cost import MeasuredCosts, op_times
from fastt.errors import FasttError
from fastt.graph import ALLREDUCE, COMPUTE, INPUT, RESIDENT, UPDATE, Op, OpGraph, chain_lengths
from fastt.split import graph_for, splittable
from fastt.strategy import Strategy


class Transfer(NamedTuple):
    """Op `op`'s output moved from device `src` to `dst` over `links`, between `start` and `end` seconds."""

    op: int
    src: int
    dst: int
    nbytes: int
    start: float
    end: float
    links: tuple[int, ...]


class Collective(NamedTuple):
    """Allreduce ops `ops` (fused: their `nbytes` in one) over `group`, occupying `links` from `start` to `end`."""

    ops: tuple[int, ...]
    group: tuple[int, ...]
    nbytes: int
    start: float
    end: float
    links: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Timeline:
    """What a simulated step looks like: per-op times, per-device load and memory, transfers, critical path.

    `start`/`end`/`device` are indexed by op (residents: 0, 0, -1; allreduces: device -1). `memory_trace[d]` is
    (times, bytes): device d's memory after each allocation or free, in the order they are applied, starting with
    (0, resident_bytes[d]).
    """

    iteration_s: float
    start: np.ndarray
    end: np.ndarray
    device: np.ndarray
    busy_s: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...]
    memory_limit_bytes: tuple[int, ...]
    resident_bytes: tuple[int, ...]
    fits: bool
    oom: tuple[str, ...]
    critical_path: tuple[str, ...]
    transfers: tuple[Transfer, ...]
    collectives: tuple[Collective, ...]
    link_busy_s: tuple[float, ...]
    lower_bound_s: float
    device_names: tuple[str, ...]
    link_names: tuple[str, ...]
    memory_trace: tuple[tuple[np.ndarray, np.ndarray], ...]
    planner: str = ""


class Fanout(NamedTuple):
    """Where an op's output goes: to device `dst`, for its `consumers` there, `nbytes` of it, sent from `src`
    (a holder of it; `src == dst`: already there)."""

    dst: int
    consumers: list[int]
    nbytes: int
    src: int


@dataclass
class _Plan:
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
    routes: list[list[tuple[int, ...]]]
    lat: list[list[float]]
    bw: list[list[float]]
    readers: tuple[list[int], list[int]]  # (copy key op*D+dev, reader op): who reads which copy, for memory
    seeds: list[tuple]                # residents whose transfers are requested at t=0
    holders: dict[int, tuple[int, ...]]


def simulate(g: OpGraph, strategy: Strategy, cluster: Cluster, times: np.ndarray,
             lower_bound_s: float = 0.0, release: Mapping[str, str] | None = None) -> Timeline:
    """Run `strategy` for graph `g` on `cluster` with `times[i][d]` seconds per op and device → Timeline.
    `release` maps an op to a later op of its device whose end sends its results off the device (default: its
    own end)."""
    strategy.validate(g)
    n, nd = len(g.ops), len(cluster.devices)
    if strategy.n_devices != nd:
        raise FasttError(f"strategy is for {strategy.n_devices} devices but cluster {cluster.name} has {nd}; "
                         "plan for this cluster")
    t = np.asarray(times, dtype=float)
    if t.shape != (n, nd):
        raise FasttError(f"times has shape {t.shape}, expected (ops, devices) = ({n}, {nd})")
    with _gc_paused():
        return _simulate(g, strategy, cluster, t, lower_bound_s, release or {})



def simulate_plan(graph: OpGraph, strategy: Strategy, cluster: Cluster, measured: MeasuredCosts | None = None,
                  release: Mapping[str, str] | None = None) -> Timeline:
    """Simulate `strategy` for the step `graph` on `cluster`: op times measured where `measured` has them, else
    the roofline estimates; the Timeline's `lower_bound_s` is `lower_bound` of the plain step."""
    g = graph_for(graph, strategy)
    times = op_times(g, cluster, measured)
    lb = lower_bound(graph, op_times(graph, cluster, measured), len(cluster.devices))
    return simulate(g, strategy, cluster, times, lower_bound_s=lb, release=release)


def lower_bound(graph: OpGraph, times: np.ndarray, n_devices: int) -> float:
    """A lower bound on the iteration time of any strategy fastt can produce for `graph`.

    LB = max(W / D, C): W = Σ_ops min_d t[op, d], D = number of devices, C = the longest chain of ops that no
    strategy divides (optimizer updates, parameter-only ops without a split rule), each at its fastest device.

    Proof sketch. Every op, or every part of it after data-parallel replication, runs on some device; under the
    roofline model the parts of an op never cost less in total than the whole (each part pays the launch overhead,
    FLOPs add up, and each part reads at least its share of the bytes), so the devices together are busy at least
    W, and one of the D devices at least W/D. Optimizer updates and ops that neither depend on the batch nor have
    a split rule are never divided (replication copies them whole), and a chain of dependent ops runs one after
    another, so the iteration lasts at least C.
    Transfers only add time. With measured costs the sub-additivity is not guaranteed, and the bound is an
    estimate.
    """
    fastest = times.min(axis=1) if times.size else np.zeros(len(graph.ops))
    work = float(fastest.sum()) / max(n_devices, 1)
    whole = [float(fastest[i]) if op.kind == UPDATE or (op.kind == COMPUTE and not op.batch
                                                        and not splittable(op, graph)) else 0.0
             for i, op in enumerate(graph.ops)]
    chain = max(chain_lengths(graph, whole), default=0.0)
    return max(work, chain)

def _simulate(g: OpGraph, strategy: Strategy, cluster: Cluster, t: np.ndarray, lower_bound_s: float,
              release: Mapping[str, str]) -> Timeline:
    """The simulation proper, on checked inputs: prepare, run the event loop, then account memory and load."""
    nd = len(cluster.devices)
    plan = _prepare(g, strategy, cluster, release)
    dur = t[np.arange(len(g.ops)), np.maximum(np.array(plan.dev, dtype=np.int64), 0)].tolist()
    start, end, crit, transfers, collectives = _run(g, plan, dur)
    start_a, end_a = np.array(start), np.array(end)
    dev = np.array(plan.dev, dtype=np.int64)
    base = [0] * nd
    for r, hs in plan.holders.items():
        for h in hs:
            base[h] += g.ops[r].out_bytes
    peak, trace = _memory(g, plan, start_a, end_a, transfers, collectives, base)
    limit = tuple(dv.memory_bytes for dv in cluster.devices)
    oom = tuple(f"device {d} ({cluster.devices[d].name}) needs {human_bytes(peak[d])}, has {human_bytes(limit[d])}"
                for d in range(nd) if peak[d] > limit[d])
    placed = dev >= 0
    busy = np.bincount(dev[placed], weights=(end_a - start_a)[placed], minlength=nd)
    link_busy = [0.0] * len(cluster.links)
    for rec in (*transfers, *collectives):
        for lk in rec.links:
            link_busy[lk] += rec.end - rec.start
    return Timeline(
        iteration_s=float(end_a.max(initial=0.0)), start=start_a, end=end_a, device=dev,
        busy_s=tuple(float(b) for b in busy), peak_memory_bytes=peak, memory_limit_bytes=limit,
        resident_bytes=tuple(base), fits=not oom, oom=oom, critical_path=_critical_path(g, end, crit),
        transfers=transfers, collectives=collectives, link_busy_s=tuple(link_busy), lower_bound_s=lower_bound_s,
        device_names=tuple(dv.name for dv in cluster.devices), link_names=tuple(lk.name for lk in cluster.links),
        memory_trace=trace, planner=strategy.planner)


def _run(g: OpGraph, p: _Plan, dur: list[float]) -> tuple:
    """The event loop: returns per-op start, end, critical predecessor, and the transfer/collective records.

    `dur[i]` is op i's seconds on its device. Ops start eagerly: once an op's inputs are all there and the op
    before it on the device has a known end, its start is known, and only its end event goes on the heap.
    """
    n = len(g.ops)
    start, end, ready, why, crit = [0.0] * n, [0.0] * n, [0.0] * n, [-1] * n, [-1] * n
    need, ar_need, order, dev, fanout, ar_cons = p.need[:], dict(p.ar_need), p.order, p.dev, p.fanout, p.ar_cons
    routes, lat, bw = p.routes, p.lat, p.bw
    at, busy, last = [0] * len(order), [0.0] * len(order), [-1] * len(order)
    link_free = [0.0] * (1 + max((lk for r in routes for rt in r for lk in rt), default=0))
    transfers: list[Transfer] = []
    collectives: list[Collective] = []
    release, released, waiting = p.release, [False] * n, [[] for _ in range(n)]
    pending: dict[tuple[int, ...], list[int]] = {}  # group -> allreduces ready at this moment
    heap = list(p.seeds)
    push, pop = heapq.heappush, heapq.heappop

    def run(d: int) -> None:
        """Start, in order, every op at the head of device d whose inputs are all there."""
        k, seq, b, prev = at[d], order[d], busy[d], last[d]
        i = seq[k]
        while i >= 0 and not need[i]:
            r = ready[i]
            if b > r:
                s, crit[i] = b, prev
            else:
                s, crit[i] = r, why[i]
            b = s + dur[i]
            start[i], end[i], prev = s, b, i
            push(heap, (b, 0, i, -1, None))
            k += 1
            i = seq[k]
        at[d], busy[d], last[d] = k, b, prev

    def arrive(i: int, j: int, t: float) -> None:
        """Input j of op i is now on i's device."""
        need[i] -= 1
        if t >= ready[i]:
            ready[i], why[i] = t, j
        if not need[i] and order[dev[i]][at[dev[i]]] == i:
            run(dev[i])

    def finish(j: int, t: float) -> None:
        """Op j's output exists: hand it to local consumers; send it off the device now or at its release."""
        for dst, cons, _, src in fanout[j]:
            if src == dst:
                for i in cons:
                    arrive(i, j, t)
        r = release[j]
        if r == j or released[r]:
            send(j, t)
        else:
            waiting[r].append(j)
        released[j] = True
        for k in waiting[j]:
            send(k, t)

    def send(j: int, t: float) -> None:
        """Request op j's transfers to other devices, feed the allreduces reading it."""
        for dst, cons, nbytes, src in fanout[j]:
            if src == dst:
                continue
            route, s = routes[src][dst], t
            for lk in route:
                s = max(s, link_free[lk])
            e = s + lat[src][dst] + nbytes / bw[src][dst]
            for lk in route:
                link_free[lk] = e
            transfers.append(Transfer(j, src, dst, nbytes, s, e, route))
            push(heap, (e, 1, j, dst, cons))
        for a in ar_cons[j]:
            ar_need[a] -= 1
            why[a] = j  # inputs arrive in time order, so the last one decides the start
            if not ar_need[a]:
                grp = p.group[a]
                if grp not in pending:  # launched once every event of this moment is in
                    pending[grp] = []
                    push(heap, (t, 2, a, -1, grp))
                pending[grp].append(a)

    def allreduce(grp: tuple[int, ...], t: float) -> None:
        """Run the allreduces of `grp` that became ready at t as one."""
        ops = pending.pop(grp)
        links, latency, per_byte, per_tensor = p.ar_cost[grp]
        nbytes = sum(_allreduce_bytes(g.ops[a]) for a in ops)
        s = max([t, *(link_free[lk] for lk in links)])
        e = s + latency + nbytes * per_byte + len(ops) * per_tensor
        for lk in links:
            link_free[lk] = e
        for a in ops:
            start[a], end[a], crit[a] = s, e, why[a]
            push(heap, (e, 0, a, -1, None))
        collectives.append(Collective(tuple(ops), grp, nbytes, s, e, links))

    for d in range(len(order)):
        run(d)
    while heap:
        t, kind, j, _, cons = pop(heap)
        if kind == 1:
            for i in cons:
                arrive(i, j, t)
        elif kind == 2:
            allreduce(cons, t)
        else:
            finish(j, t)
    _check_finished(g, p, at, ar_need)
    return start, end, crit, tuple(transfers), tuple(collectives)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: the loop allocates many small tuples, and each collection walks the whole graph."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_finished(g: OpGraph, p: _Plan, at: list[int], ar_need: dict[int, int]) -> None:
    """Every op ran; a validated strategy cannot stall, so this guards the simulator itself."""
    stuck = [f"device {d} waits to run '{g.ops[seq[at[d]]].name}'" for d, seq in enumerate(p.order) if seq[at[d]] >= 0]
    stuck += [f"allreduce '{g.ops[a].name}' waits for {k} input(s)" for a, k in ar_need.items() if k]
    if stuck:
        raise FasttError("simulation stalled: " + "; ".join(stuck) + " (is the order consistent with the graph?)")


def _prepare(g: OpGraph, strategy: Strategy, cluster: Cluster, release: Mapping[str, str]) -> _Plan:
    """Flatten graph + strategy + cluster into the lists the event loop reads."""
    ops, index, nd = g.ops, g.index, len(cluster.devices)
    dev = [-1] * len(ops)
    for name, d in strategy.placement.items():
        dev[index[name]] = d
    holders = {index[name]: tuple(sorted(set(hs))) for name, hs in strategy.holders.items()}
    held: list[tuple[int, ...]] = [()] * len(ops)
    for r, hs in holders.items():
        held[r] = hs
    group = {a: {dev[j] for j in ops[a].inputs} for a in g.of_kind(ALLREDUCE)}
    for a, op in enumerate(ops):
        for j in op.inputs:
            if j in group and dev[a] >= 0:
                group[j].add(dev[a])  # a reader takes part, as in the distributed runtime's collective
    for a, grp in group.items():
        if not ops[a].inputs:
            raise FasttError(f"allreduce '{ops[a].name}' has no inputs")
        group[a] = held[a] = tuple(sorted(grp))
    routes, lat, bw = _route_tables(cluster)
    need, ar_cons, ar_need, edges, readers = _consumers(g, dev, held, nd)
    fanout: list[list[Fanout]] = [[] for _ in ops]
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
    seeds = [(0.0, 0, r, -1, None) for r in sorted(holders) if fanout[r]]
    order = [[index[name] for name in names] + [-1] for names in strategy.order]
    ar_cost = {grp: cluster.allreduce_cost(grp) for grp in set(group.values())}
    rel = list(range(len(ops)))
    for name, r in release.items():
        i, k = index[name], index[r]
        if dev[i] < 0 or dev[k] != dev[i]:
            raise FasttError(f"release: '{name}' is sent after '{r}', which is not placed on its device")
        rel[i] = k
    return _Plan(dev, order, need, fanout, ar_cons, ar_need, group, ar_cost, rel, routes, lat, bw, readers, seeds,
                 holders)


def _consumers(g: OpGraph, dev: list[int], held: list[tuple[int, ...]], nd: int) -> tuple:
    """Who waits for what: inputs per placed op, inputs per allreduce, and consumers per (op, device) copy.

    `held[j]` lists the devices that have op j without a transfer (a resident's holders, an allreduce's ring);
    a placed op reading a resident it holds does not wait. Returns need, ar_cons, ar_need, edges (copy key
    j*nd+d -> [consumers on d, largest bytes read]) and the memory readers (copy keys, reader ops).
    """
    need = [0] * len(g.ops)
    ar_cons: list[list[int]] = [[] for _ in g.ops]
    ar_need: dict[int, int] = {}
    edges: dict[int, list] = {}
    rkeys: list[int] = []
    rops: list[int] = []
    for i, op in enumerate(g.ops):
        ins = op.inputs
        pairs = zip(ins, op.in_bytes) if len(set(ins)) == len(ins) else _dedup(ins, op.in_bytes)
        if op.kind == ALLREDUCE:
            ar_need[i] = len(set(ins))
            for j, _ in pairs:
                ar_cons[j].append(i)
                rkeys.append(j * nd + dev[j])
                rops.append(i)
            continue
        d = dev[i]
        for j, b in pairs:
            if d in held[j] and g.ops[j].kind in RESIDENT:
                continue  # a resident already on this device
            key = j * nd + d
            rkeys.append(key)
            rops.append(i)
            need[i] += 1
            e = edges.get(key)
            if e is None:
                edges[key] = [[i], b]
            else:
                e[0].append(i)
                e[1] = max(e[1], b)
    return need, ar_cons, ar_need, edges, (rkeys, rops)


def _dedup(inputs: tuple[int, ...], in_bytes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(input, bytes) once per distinct input; an op reading a tensor twice moves it once, the larger size."""
    seen: dict[int, int] = {}
    for j, b in zip(inputs, in_bytes):
        seen[j] = max(b, seen.get(j, 0))
    return list(seen.items())


def _route_tables(cluster: Cluster) -> tuple[list, list, list]:
    """Per ordered device pair: the route's links, total latency and bottleneck bandwidth (1.0 on the diagonal)."""
    nd = len(cluster.devices)
    routes: list[list[tuple[int, ...]]] = [[()] * nd for _ in range(nd)]
    lat = [[0.0] * nd for _ in range(nd)]
    bw = [[1.0] * nd for _ in range(nd)]
    for s in range(nd):
        for d in range(nd):
            if s == d:
                continue
            if (s, d) not in cluster.routes or not cluster.routes[s, d]:
                raise FasttError(f"cluster {cluster.name} has no route from device {s} to device {d}")
            links = [cluster.links[k] for k in cluster.routes[s, d]]
            routes[s][d] = tuple(cluster.routes[s, d])
            lat[s][d] = sum(lk.latency for lk in links)  # same sum as Cluster.transfer_time, bit for bit
            bw[s][d] = min(lk.bandwidth for lk in links)
    return routes, lat, bw


def _allreduce_bytes(op: Op) -> int:
    """Bytes an allreduce aggregates: its output, or the largest input if the output is written in place."""
    return max(op.out_bytes, *op.in_bytes, 0)


def _memory(g: OpGraph, p: _Plan, start: np.ndarray, end: np.ndarray, transfers: tuple[Transfer, ...],
            collectives: tuple[Collective, ...], base: list[int]) -> tuple[tuple[int, ...], tuple]:
    """Peak bytes per device and the memory curve, replaying every copy's allocation and free."""
    nd = len(base)
    cols = list(zip(*transfers)) or [()] * 6
    t_op, t_src, t_dst, t_bytes = (np.array(cols[k], dtype=np.int64) for k in range(4))
    t_start, t_end = (np.array(cols[k], dtype=float) for k in (4, 5))
    # When each copy (op, device) is last read: by a local op, an allreduce, or an outgoing transfer.
    keys = np.concatenate([np.array(p.readers[0], dtype=np.int64), t_op * nd + t_src])
    ends = np.concatenate([end[np.array(p.readers[1], dtype=np.int64)], t_end])
    uniq, inv = np.unique(keys, return_inverse=True)
    last = np.zeros(len(uniq))
    np.maximum.at(last, inv, ends)

    def last_read(k: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(uniq, k), max(len(uniq) - 1, 0))
        return np.where(uniq[at] == k, last[at], 0.0) if len(uniq) else np.zeros(len(k))

    dev = np.array(p.dev, dtype=np.int64)
    out = np.array([op.out_bytes for op in g.ops], dtype=np.int64)
    placed = np.flatnonzero((dev >= 0) & (out > 0))
    is_input = np.array([g.ops[i].kind == INPUT for i in placed], dtype=bool)
    ar = [(a, d) for c in collectives for a in c.ops for d in c.group if out[a] > 0]
    ar_op, ar_dev = (np.array([x[k] for x in ar], dtype=np.int64) for k in range(2))
    d_all = np.concatenate([dev[placed], ar_dev, t_dst])
    size = np.concatenate([out[placed], out[ar_op], t_bytes])
    t_alloc = np.concatenate([np.where(is_input, 0.0, start[placed]), start[ar_op], t_start])
    t_free = np.maximum(np.concatenate([end[placed], end[ar_op], t_end]),
                        last_read(np.concatenate([placed * nd + dev[placed], ar_op * nd + ar_dev, t_op * nd + t_dst])))
    peak, trace = [], []
    for d in range(nd):
        m = d_all == d
        times = np.concatenate([t_alloc[m], t_free[m]])
        delta = np.concatenate([size[m], -size[m]])
        o = np.lexsort((delta < 0, times))  # allocations before frees at equal times
        level = base[d] + np.cumsum(delta[o])
        trace.append((np.concatenate([[0.0], times[o]]), np.concatenate([[base[d]], level])))
        peak.append(int(max(base[d], level.max(initial=0))))
    return tuple(peak), tuple(trace)


def _critical_path(g: OpGraph, end: list[float], crit: list[int]) -> tuple[str, ...]:
    """Op names from the start of the step to the last-finishing op, following what delayed each start."""
    if not end:
        return ()
    i = max(range(len(end)), key=lambda k: (end[k], -k))
    path = []
    while i >= 0:
        path.append(g.ops[i].name)
        i = crit[i]
    return tuple(reversed(path))


def human_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps the number ≥ 1 (decimal units, as device specs use)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def inter_node_bytes(tl: Timeline, cluster: Cluster) -> int:
    """Bytes a simulated step moves between nodes: transfers between devices of different nodes, and each
    allreduce's hops that cross nodes (ring: 2(n-1)/n of its bytes per hop; fitted, the runtime's sharded sum:
    2/n of them from every device to every other, a shard each way)."""
    node = [d.node for d in cluster.devices]
    total = sum(t.nbytes for t in tl.transfers if node[t.src] != node[t.dst])
    for c in tl.collectives:
        grp, n = c.group, len(c.group)
        if cluster.gather is not None:
            total += sum(node[a] != node[b] for a in grp for b in grp) * 2 / n * c.nbytes
        elif n > 1:
            total += sum(node[grp[i]] != node[grp[(i + 1) % n]] for i in range(n)) * 2 * (n - 1) / n * c.nbytes
    return int(total)
