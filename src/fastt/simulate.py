"""Discrete-event simulation of one training step under a Strategy on a Cluster, producing a Timeline.

The model, in full:
- each device runs its ops strictly in `strategy.order[d]`; an op starts when the device has finished its
  previous op and every input is on the device;
- residents (params, state, buffers) are on their holders at t=0; a non-holder reads one through a transfer
  from the holder with the fastest route, requested at t=0;
- when an op finishes, each other device with consumers of it gets one transfer (the largest bytes any of
  those consumers reads); a transfer occupies every link of its route, links carry one thing at a time and are
  granted in request order (ties by op index), so contention delays the later request;
- what an op sends off its device (transfers, its part of an allreduce) leaves when the op finishes, or, with
  `release`, when the op that ends its run of ops finishes (the runtimes hand values over per compiled
  segment);
- an allreduce runs on the devices of its inputs and of its readers once its inputs are all available and its
  links are free, as a ring or a gather (`Cluster.gather`); allreduces of one group that become ready at the
  same moment run as one (their bytes fused, one latency), as the distributed runtime's collectives do; the
  result is then on every device of the group;
- an op whose device waited for another device's value while some other device was running pays its device's
  `wake_s` (CPU worker threads of one process); a device whose cores do the copying (`comm_s_per_byte`, a
  distributed CPU rank) is busy for that many seconds per byte it sends or receives, from the moment a
  transfer or collective is requested (an allreduce over n devices: each sends and receives 2(n-1)/n of its
  bytes), so its next op starts that much later;
- memory per device starts at its resident set; an op allocates its results when it starts (the batch at t=0),
  a transfer its bytes on the receiver when it starts, an allreduce its output on every ring device; each
  storage of an op's results (`Op.out_parts`: batch norm's output and saved statistics are two) is freed when
  the last reader there that keeps it (a local op, an outgoing transfer, an allreduce) has finished; what a
  device is given (a received copy, an allreduce's result) when the segment of its last reader there ends
  (`release`: the local runtime drops a device's claim then at the latest); the batch (its caller holds it),
  the loss (`Op.returned`) and an optimizer update's results (the new parameter and state, fresh tensors) live
  to the end of the step, an update's temporaries while it runs. At equal times a free counts before an
  allocation (what starts at t on a device starts after what ended there at t), unless it frees what was
  allocated at t.

Three modules share the work: `events` flattens graph, strategy and cluster into lists (`prepare`) and runs
the event loop over them (`run_events`); `links` times transfers and collectives on the links; this module
checks the inputs, replays the memory afterwards with numpy and assembles the Timeline. `simulate_plan`
simulates a strategy on the graph it was planned for (replicated and split as it says), with `lower_bound`
beside.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fastt.cluster import Cluster
from fastt.cost import MeasuredCosts, op_times
from fastt.errors import FasttError
from fastt.events import EventPlan, prepare, run_events
from fastt.graph import COMPUTE, INPUT, UPDATE, OpGraph, chain_lengths, gc_paused, parts
from fastt.links import Collective, Transfer
from fastt.shard import ALL_GATHER, held
from fastt.split import graph_for, splittable
from fastt.strategy import Strategy


@dataclass(frozen=True, eq=False)
class Timeline:
    """What a simulated step looks like: per-op times, per-device load and memory, transfers, critical path.

    `start`/`end`/`device` are indexed by op (residents: 0, 0, -1; allreduces: device -1). `memory_trace[d]`
    is (times, bytes): device d's memory after each allocation or free, in the order they are applied,
    starting with (0, resident_bytes[d]).
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

    @property
    def tight(self) -> tuple[int, ...]:
        """The devices a plan that fits fills past 90% of their memory: the simulator's peak is checked
        against what CPU worker devices hold (docs/design.md), not against a GPU's caching allocator, so such
        a plan may still run out."""
        return tuple(d for d, (p, cap) in enumerate(zip(self.peak_memory_bytes, self.memory_limit_bytes))
                     if self.fits and p > TIGHT * cap)


TIGHT = 0.9  # a fitting plan past this share of a device's memory is reported as tight (issue 17)


def simulate(g: OpGraph, strategy: Strategy, cluster: Cluster, times: np.ndarray,
             lower_bound_s: float = 0.0, release: Mapping[str, str] | None = None) -> Timeline:
    """Run `strategy` for graph `g` on `cluster` with `times[i][d]` seconds per op and device → Timeline.
    `release` maps an op to a later op of its device whose end sends its results off the device (default: its
    own end)."""
    strategy.validate(g, acyclic=False)  # a cycle stalls the event loop: `_simulate` names it then
    n, nd = len(g.ops), len(cluster.devices)
    if strategy.n_devices != nd:
        raise FasttError(f"strategy is for {strategy.n_devices} devices but cluster {cluster.name} has {nd}; "
                         "plan for this cluster")
    t = np.asarray(times, dtype=float)
    if t.shape != (n, nd):
        raise FasttError(f"times has shape {t.shape}, expected (ops, devices) = ({n}, {nd})")
    with gc_paused():
        return _simulate(g, strategy, cluster, t, lower_bound_s, release or {})


def simulate_plan(graph: OpGraph, strategy: Strategy, cluster: Cluster, measured: MeasuredCosts | None = None,
                  release: Mapping[str, str] | None = None) -> Timeline:
    """Simulate `strategy` for the step `graph` on `cluster`: op times measured where `measured` has them,
    else the roofline estimates; the Timeline's `lower_bound_s` is `lower_bound` of the plain step."""
    g = graph_for(graph, strategy)
    times = op_times(g, cluster, measured)
    lb = lower_bound(graph, op_times(graph, cluster, measured), len(cluster.devices))
    return simulate(g, strategy, cluster, times, lower_bound_s=lb, release=release)


def lower_bound(graph: OpGraph, times: np.ndarray, n_devices: int) -> float:
    """A lower bound on the iteration time of any strategy fastt can produce for `graph`.

    LB = max(W / D, C): W = Σ_ops min_d t[op, d], D = number of devices, C = the longest chain of ops that no
    strategy divides (optimizer updates, parameter-only ops without a split rule), each at its fastest device.

    Proof sketch. Every op, or every part of it after data-parallel replication, runs on some device; under
    the roofline model the parts of an op never cost less in total than the whole (each part pays the launch
    overhead, FLOPs add up, and each part reads at least its share of the bytes), so the devices together are
    busy at least W, and one of the D devices at least W/D. Optimizer updates and ops that neither depend on
    the batch nor have a split rule are never divided (replication copies them whole), and a chain of
    dependent ops runs one after another, so the iteration lasts at least C.
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
    plan = prepare(g, strategy, cluster, release)
    dur = t[np.arange(len(g.ops)), np.maximum(np.array(plan.dev, dtype=np.int64), 0)].tolist()
    try:
        start, end, crit, transfers, collectives = run_events(g, plan, dur)
    except FasttError:
        strategy.validate(g)  # the orders make a cycle with the data edges: say which
        raise
    start_a, end_a = np.array(start), np.array(end)
    dev = np.array(plan.dev, dtype=np.int64)
    base = held(g, plan.holders, plan.dev, nd)
    peak, trace = _memory(g, plan, start_a, end_a, transfers, collectives, base)
    limit = tuple(dv.memory_bytes for dv in cluster.devices)
    oom = tuple(f"device {d} ({cluster.devices[d].name}) needs {human_bytes(peak[d])}, "
                f"has {human_bytes(limit[d])}" for d in range(nd) if peak[d] > limit[d])
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
        transfers=transfers, collectives=collectives, link_busy_s=tuple(link_busy),
        lower_bound_s=lower_bound_s, device_names=tuple(dv.name for dv in cluster.devices),
        link_names=tuple(lk.name for lk in cluster.links),
        memory_trace=trace, planner=strategy.planner)


def _memory(g: OpGraph, p: EventPlan, start: np.ndarray, end: np.ndarray, transfers: tuple[Transfer, ...],
            collectives: tuple[Collective, ...], base: list[int]) -> tuple[tuple[int, ...], tuple]:
    """Peak bytes per device and the memory curve, replaying every copy's allocation and free."""
    nd = len(base)
    cols = list(zip(*transfers)) or [()] * 6
    t_op, t_src, t_dst, t_bytes = (np.array(cols[k], dtype=np.int64) for k in range(4))
    t_start, t_end = (np.array(cols[k], dtype=float) for k in (4, 5))
    n_parts, part_bytes, w = _parts(g)
    last_read, given = _last_reads(p, end, n_parts, w, nd, t_op * nd + t_src, t_end)
    first = np.concatenate([[0], np.cumsum(n_parts)])
    dev = np.array(p.dev, dtype=np.int64)
    out = np.array([op.out_bytes for op in g.ops], dtype=np.int64)
    placed = np.flatnonzero((dev >= 0) & (out > 0))
    # A placed op's copy, one entry per part.
    of = np.repeat(placed, n_parts[placed])
    k_of = _each_part(n_parts[placed])
    kind = np.array([op.kind for op in g.ops])[of]
    ar = [(a, d) for c in collectives for a in c.ops for d in c.group if out[a] > 0]
    ar_op, ar_dev = (np.array([x[k] for x in ar], dtype=np.int64) for k in range(2))
    # Every part of a copy is freed after its last reader there, what a device is given when it is no longer
    # held there; an update's results (the step's new parameter and state), the loss and the batch (its
    # caller holds it) live to the step's end.
    d_all = np.concatenate([dev[of], ar_dev, t_dst])
    size = np.concatenate([part_bytes[first[of] + k_of], out[ar_op], t_bytes])
    t_free = np.maximum(np.concatenate([end[of], end[ar_op], t_end]), np.concatenate([
        last_read((of * nd + dev[of]) * w + k_of), given(ar_op * nd + ar_dev), given(t_op * nd + t_dst)]))
    returned = np.zeros(len(part_bytes), dtype=bool)
    for i in (i for i, op in enumerate(g.ops) if op.returned):
        returned[first[i] + np.array(g.ops[i].returned)] = True
    t_free[:len(of)][(kind == UPDATE) | (kind == INPUT) | returned[first[of] + k_of]] = end.max(initial=0.0)
    # so does a sharded update's gathered new parameter
    t_free[len(of) + np.flatnonzero([g.ops[a].target == ALL_GATHER for a in ar_op])] = end.max(initial=0.0)
    t_alloc = np.concatenate([np.where(kind == INPUT, 0.0, start[of]), start[ar_op], t_start])
    # At equal times a free comes first (what starts at t starts after what ended at t: a device runs its ops
    # one after another), unless it frees what was allocated at t (an op that takes no time).
    rank = np.concatenate([np.ones(len(t_alloc)), np.where(t_free > t_alloc, 0.0, 2.0)])
    d_all, size = np.concatenate([d_all, d_all]), np.concatenate([size, -size])
    times = np.concatenate([t_alloc, t_free])
    # An update's temporaries live while it runs.
    temp = np.array([g.ops[i].temp_bytes for i in range(len(g.ops))], dtype=np.int64)
    hot = np.flatnonzero((dev >= 0) & (temp > 0))
    d_all = np.concatenate([d_all, dev[hot], dev[hot]])
    size = np.concatenate([size, temp[hot], -temp[hot]])
    times = np.concatenate([times, start[hot], end[hot]])
    rank = np.concatenate([rank, np.ones(len(hot)), np.where(end[hot] > start[hot], 0.0, 2.0)])
    peak, trace = [], []
    for d in range(nd):
        m = d_all == d
        at, delta = times[m], size[m]
        o = np.lexsort((rank[m], at))
        level = base[d] + np.cumsum(delta[o])
        trace.append((np.concatenate([[0.0], at[o]]), np.concatenate([[base[d]], level])))
        peak.append(int(max(base[d], level.max(initial=0))))
    return tuple(peak), tuple(trace)


def _parts(g: OpGraph) -> tuple[np.ndarray, np.ndarray, int]:
    """Each op's results as storages (`Op.out_parts`): how many per op, their bytes in op order, and the most
    any op has (part k of copy c is key c * that + k)."""
    sizes = [parts(op) for op in g.ops]
    n = np.array([len(x) for x in sizes], dtype=np.int64)
    return n, np.array([b for x in sizes for b in x], dtype=np.int64), int(n.max(initial=1))


def _last_reads(p: EventPlan, end: np.ndarray, n_parts: np.ndarray, w: int, nd: int, sent: np.ndarray,
                t_end: np.ndarray) -> tuple:
    """When each part of a copy (op, device) is last read there, by a local op or an allreduce keeping it or
    by an outgoing transfer (copy `sent`, every part), and when a copy a device is given is last held there:
    the runtimes drop a device's claim on a value it received or an allreduce's result when the segment that
    last reads it there ends (`release`), if no other device's claim keeps it longer (which comes first
    depends on how far apart the devices run)."""
    op_of = sent // nd
    r_copy, r_part, r_op = (np.array(x, dtype=np.int64) for x in (p.readers.copies, p.readers.parts,
                                                                   p.readers.ops))
    per_part = n_parts[op_of]
    keys = np.concatenate([r_copy * w + r_part, np.repeat(sent * w, per_part) + _each_part(per_part)])
    sends = np.repeat(t_end, per_part)
    held = np.concatenate([end[np.array(p.release, dtype=np.int64)[r_op]], sends])
    return _lookup(keys, np.concatenate([end[r_op], sends])), _lookup(keys // w, held)


def _each_part(n: np.ndarray) -> np.ndarray:
    """0, 1, ..., n[k] - 1 for each k, concatenated: the part numbers of copies with n[k] parts."""
    return np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)


def _lookup(keys: np.ndarray, ends: np.ndarray):
    """key -> the latest of `ends` recorded for it (0 for a key never read), as a vectorised function."""
    uniq, inv = np.unique(keys, return_inverse=True)
    last = np.zeros(len(uniq))
    np.maximum.at(last, inv, ends)

    def latest(k: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(uniq, k), max(len(uniq) - 1, 0))
        return np.where(uniq[at] == k, last[at], 0.0) if len(uniq) else np.zeros(len(k))
    return latest


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
            hops = sum(node[grp[i]] != node[grp[(i + 1) % n]] for i in range(n))
            total += hops * 2 * (n - 1) / n * c.nbytes
    return int(total)
