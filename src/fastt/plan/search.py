"""The spread search: every layer gets a `Spread` (mixed.py), by local search and an ILP solved by
scipy's HiGHS.

The batch is cut into one shard a device (R = n). A layer may take one of a few spreads: every device (data
parallelism), the devices of one node (replicated there only) or one device (held once). What a choice costs
is read from the step at batch/R, layer by layer (`SpreadCosts`):

- compute: shards on a device x the layer's time a shard there, plus its update once on each device of the
  spread, plus, on a device outside the spread, one shard's time in the layer: its shards pass through it
  elsewhere before they come back (a pipeline's fill and drain);
- the layer's gradient allreduce over its spread (`Cluster.allreduce_cost`), charged to every link the
  ring uses;
- the activations and their gradients between two layers, moved for each shard whose devices differ under the
  two layers' spreads, charged to the links of that route (Alpa's resharding cost, per pair of choices);
- memory on a device: the residents of the layers held there (parameters, optimizer state, buffers) and the
  activations and gradients of the shards it runs, within its capacity.

The objective is the step's makespan bound: T at least every device's compute and every link's traffic (they
overlap), or, in the second model, a device's compute plus the busiest link it uses (they do not). Neither is
the truth; the simulator is, and `fastt` (portfolio.best_plan) keeps whichever plan simulates fastest, beside
the expert plans and OS-DPOS's. Layers are merged into blocks of consecutive layers (`blocks`) so that large
models solve in seconds. Per objective, a local search (`descend`) from data parallelism and from the best
two-stage pick (`two_stage`), and the ILP (`solve`), each give a pick, and the best one becomes a plan. In the
ILP a pair of choices per edge is linearised by
Alpa's trick: y[e, a, b] >= 0 with x[u, a] = sum_b y and x[v, b] = sum_a y, exact when the x are 0/1, so only
the x are integers.
"""

from __future__ import annotations

import multiprocessing
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import scipy.optimize
import scipy.sparse

from ..cluster import Cluster
from ..cost import MeasuredCosts, op_times
from ..errors import FasttError
from ..graph import ALLREDUCE, PARAM, RESIDENT, UPDATE, OpGraph, rebatch, replicable, same_step
from ..layers import Layers, layers
from ..split import graph_for
from ..strategy import Strategy
from .basic import node_devices
from .mixed import Spread, mixed_strategy
from .osdpos import _judge

TIE = 1e-3  # weight of the total work beside the makespan: of two plans as fast, the one that does less


def choices(cluster: Cluster) -> list[Spread]:
    """The spreads a layer may take: every device, each node's devices (on several nodes), each device."""
    n = len(cluster.devices)
    nodes = node_devices(cluster)
    out = [Spread(tuple(range(n)))] + ([Spread(devs) for devs in nodes] if len(nodes) > 1 else [])
    out += [Spread((d,)) for d in range(n)] if n > 1 else []
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class SpreadCosts:
    """The ILP's coefficients for K layers, C choices, D devices, L links and E layer pairs
    that exchange data.

    compute[k, c, d]: seconds on device d's path; links[k, c, l]: seconds on link l (the allreduce);
    memory[k, c, d]: bytes on d; pairs[e] = (u, v) and moves[e, a, b, l]: seconds on link l of the data
    between layers u and v when u takes choice a and v choice b, hops[e, a, b] the seconds a shard's path
    waits for them; uses[d]: the links device d's transfers and rings use."""

    spreads: tuple[Spread, ...]
    compute: np.ndarray
    links: np.ndarray
    memory: np.ndarray
    capacity: np.ndarray
    pairs: tuple[tuple[int, int], ...]
    moves: np.ndarray
    hops: np.ndarray
    uses: tuple[tuple[int, ...], ...]

    def loads(self, pick: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seconds per device: compute and its path's transfers, seconds per link, bytes per device) when
        layer k takes choice pick[k]."""
        pick = np.asarray(pick)
        k = np.arange(len(pick))
        e = np.arange(len(self.pairs))
        a, b = (pick[np.array(side, dtype=int)] for side in zip(*self.pairs)) if self.pairs else (e, e)
        link = self.links[k, pick].sum(axis=0) + self.moves[e, a, b].sum(axis=0)
        return (self.compute[k, pick].sum(axis=0) + self.hops[e, a, b].sum(), link,
                self.memory[k, pick].sum(axis=0))

    def excess(self, pick: Sequence[int]) -> float:
        """Bytes by which the devices' memory overflows (0 where the pick fits)."""
        return float(np.maximum(self.loads(pick)[2] - self.capacity, 0).sum())

    def objective(self, pick: Sequence[int], overlap: bool) -> float:
        """The makespan bound the ILP minimises (module docstring), inf where a device's memory overflows."""
        compute, link, memory = self.loads(pick)
        if (memory > self.capacity).any():
            return float("inf")
        if overlap:
            span = max(compute.max(), link.max(initial=0.0))
        else:
            span = max(compute[d] + max((link[lk] for lk in self.uses[d]), default=0.0)
                       for d in range(len(compute)))
        return float(span + TIE * (compute.sum() + link.sum()))


    def merged(self, groups: Sequence[Sequence[int]]) -> SpreadCosts:
        """The costs of blocks of layers that take one choice together
        (`groups[b]`: the layers of block b)."""
        block = np.empty(len(self.compute), dtype=int)
        for b, members in enumerate(groups):
            block[list(members)] = b
        pairs: dict[tuple[int, int], int] = {}
        for u, v in self.pairs:
            bu, bv = sorted((int(block[u]), int(block[v])))
            if bu != bv:
                pairs.setdefault((bu, bv), len(pairs))
        moves = np.zeros((len(pairs), *self.moves.shape[1:]))
        hops = np.zeros((len(pairs), *self.hops.shape[1:]))
        for e, (u, v) in enumerate(self.pairs):
            key = (int(block[u]), int(block[v]))
            if key[0] == key[1]:
                continue
            f = pairs[tuple(sorted(key))]
            flip = key[0] > key[1]  # the pair's choices are (its lower block's, its higher's)
            moves[f] += self.moves[e].swapaxes(0, 1) if flip else self.moves[e]
            hops[f] += self.hops[e].T if flip else self.hops[e]

        def total(a: np.ndarray) -> np.ndarray:
            return np.stack([a[list(m)].sum(axis=0) for m in groups])
        return SpreadCosts(self.spreads, total(self.compute), total(self.links), total(self.memory),
                           self.capacity, tuple(pairs), moves, hops, self.uses)


def blocks(costs: SpreadCosts, params: Sequence[float], limit: int = 32) -> list[list[int]]:
    """At most about `limit` blocks of consecutive layers for the search, so that a 24-block transformer (some
    200 layers) is solved in seconds: a layer with a large share of the parameters (an embedding, a large
    fully connected layer: the ones worth holding once) stays a block of its own, the others are merged in
    order until a block has 1/limit of the work."""
    work = costs.compute[:, 0].sum(axis=1)
    big = np.asarray(params) >= sum(params) / limit
    out: list[list[int]] = []
    for k in range(len(work)):
        if big[k] or not out or big[out[-1][-1]] or work[out[-1]].sum() + work[k] > work.sum() / limit:
            out.append([k])
        else:
            out[-1].append(k)
    return out


def descend(costs: SpreadCosts, overlap: bool, pick: Sequence[int], deadline: float) -> list[int]:
    """Local search on the objective from `pick`: the best of giving one block, every block before or after
    one (a pipeline's cut), or every block another choice, taken while it helps (or until the deadline). Where
    `pick` does not fit, the memory it overflows by is lowered first (a plan that fits where data parallelism
    does not)."""
    K, C = len(pick), len(costs.spreads)
    moves = ([range(k, k + 1) for k in range(K)] + [range(k) for k in range(2, K + 1)]
             + [range(k, K) for k in range(1, K - 1)])
    pick = list(pick)

    def value(p: list[int]) -> tuple[float, float]:
        return costs.excess(p), costs.objective(p, overlap)
    best = value(pick)
    while time.perf_counter() < deadline:
        found = None
        for span in moves:
            for c in range(C):
                trial = [c if k in span else x for k, x in enumerate(pick)]
                v = value(trial)
                if v[0] < best[0] or v[0] == best[0] and v[1] < best[1] - 1e-12:
                    found, best = trial, v
        if found is None:
            break
        pick = found
    return pick


TWO_STAGE_PICKS = 20_000  # about 0.5 s of objectives; 8 devices on 2 nodes take 33 x 11² = 4k


def two_stage(costs: SpreadCosts, overlap: bool) -> list[int]:
    """The best pick that gives every block before a cut one choice and every block after it another (a
    two-stage pipeline, e.g. one node each): a start for `descend`, which moves one block or one end at a time
    and so cannot reach it from data parallelism when each half alone is slower. K x C² picks, or, past
    TWO_STAGE_PICKS (many devices), only the spreads over several devices (every device, a node's)."""
    K, C = len(costs.compute), len(costs.spreads)
    pool = (range(C) if K * C * C <= TWO_STAGE_PICKS
            else [c for c in range(C) if len(costs.spreads[c].devices) > 1])
    trials = ([a] * k + [b] * (K - k) for k in range(1, K) for a in pool for b in pool if a != b)
    return min(trials, key=lambda p: (costs.excess(p), costs.objective(p, overlap)), default=[0] * K)


def spread_costs(graph: OpGraph, cluster: Cluster, found: Layers, measured: MeasuredCosts | None = None
                 ) -> SpreadCosts:
    """The coefficients of `graph`'s layers `found` on `cluster`, read from the step at batch/n
    (module docstring)."""
    n, nl = len(cluster.devices), len(cluster.links)
    spreads = tuple(choices(cluster))
    sub = rebatch(graph, graph.batch // n)
    if not same_step(graph, sub):
        raise FasttError(f"spread search: the step at batch {sub.batch} has other ops than at {graph.batch}")
    times = op_times(sub, cluster, measured)
    of = [found.of[graph.index[op.name]] if op.name in graph.index else -1 for op in sub.ops]
    shards = np.array([[sum(1 for s in range(n) if c.device(s, n) == d) for d in range(n)] for c in spreads])
    held = np.array([[d in c.devices for d in range(n)] for c in spreads], dtype=float)
    K, C = len(found), len(spreads)
    work = np.zeros((K, n))  # seconds a shard, per device
    update = np.zeros((K, n))  # seconds of the updates, once a device
    resident = np.zeros(K)
    per_shard = np.zeros(K)  # bytes a shard keeps: activations and its gradients
    grads = np.zeros(K)
    tensors = np.zeros(K)
    for i, op in enumerate(sub.ops):
        k = of[i]
        if k < 0 or op.kind == ALLREDUCE:
            continue
        if op.kind in RESIDENT:
            resident[k] += op.out_bytes
            if op.kind == PARAM:
                grads[k] += op.out_bytes
                tensors[k] += 1
        elif op.kind == UPDATE:
            update[k] += times[i]
        else:
            work[k] += times[i]
            per_shard[k] += op.out_bytes if found.forward[graph.index[op.name]] else 0
    # a device waits for what its shards pass through elsewhere: a shard's time in every layer not held on d
    # (a pipeline's fill and drain; nothing under data parallelism, where every layer is on every device)
    elsewhere = (work[:, None, :] * held[None, :, :]).sum(axis=2) / held.sum(axis=1)[None, :]
    compute = (shards[None, :, :] * work[:, None, :] + held[None, :, :] * update[:, None, :]
               + (1 - held[None, :, :]) * elsewhere[:, :, None])
    memory = (held[None, :, :] * resident[:, None, None]
              + shards[None, :, :] * (per_shard + grads)[:, None, None])
    links = np.zeros((K, C, nl))
    for c, spread in enumerate(spreads):
        used, fixed, per_byte, per_tensor = cluster.allreduce_cost(spread.devices)
        for lk in used:
            links[:, c, lk] = np.where(grads > 0, fixed + per_byte * grads + per_tensor * tensors, 0.0)
    pairs, moves, hops = _moves(sub, of, cluster, spreads)
    uses = tuple(tuple(sorted({lk for e in range(n) if e != d
                               for lk in (*cluster.route(d, e), *cluster.route(e, d))}))
                 for d in range(n))
    capacity = np.array([dev.memory_bytes for dev in cluster.devices], dtype=float)
    return SpreadCosts(spreads, compute, links, memory, capacity, pairs, moves, hops, uses)


def _moves(sub: OpGraph, of: Sequence[int], cluster: Cluster, spreads: Sequence[Spread]
           ) -> tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]:
    """The layer pairs that exchange tensors, the link seconds of moving them per pair of choices, and the
    seconds one shard's tensors spend on their way (the slowest shard's route): its path waits for them."""
    n, nl = len(cluster.devices), len(cluster.links)
    # (from, to) layer -> (tensors, bytes), once per reader layer
    sent: dict[tuple[int, int], np.ndarray] = {}
    for i, op in enumerate(sub.ops):
        if of[i] < 0 or op.kind == ALLREDUCE:
            continue
        for k in {of[s] for s in sub.succs[i]} - {of[i], -1}:
            sent[of[i], k] = sent.get((of[i], k), np.zeros(2)) + (1, op.out_bytes)
    per = np.zeros((n, n, nl, 2))  # link seconds per tensor and per byte from device x to y
    for x in range(n):
        for y in range(n):
            for lk in cluster.route(x, y):
                per[x, y, lk] = cluster.links[lk].latency, 1.0 / cluster.links[lk].bandwidth
    apart = np.zeros((len(spreads), len(spreads), n, n))  # shards on x under choice a and on y != x under b
    for a, sa in enumerate(spreads):
        for b, sb in enumerate(spreads):
            for s in range(n):
                x, y = sa.device(s, n), sb.device(s, n)
                apart[a, b, x, y] += x != y
    route = np.zeros((n, n, 2))  # a transfer's seconds per tensor and per byte over its route from x to y
    for x in range(n):
        for y in range(n):
            if x != y:
                links = [cluster.links[lk] for lk in cluster.route(x, y)]
                route[x, y] = sum(lk.latency for lk in links), 1.0 / min(lk.bandwidth for lk in links)
    pairs = tuple(sorted({(min(u, v), max(u, v)) for u, v in sent}))
    none = np.zeros(2)
    C = len(spreads)
    there_per = np.einsum("abxy,xylt->ablt", apart, per)  # link seconds per (tensor, byte) sent u -> v
    back_per = np.einsum("abxy,yxlt->ablt", apart, per)  # and v -> u
    moved = apart > 0
    moves, hops = np.zeros((len(pairs), C, C, nl)), np.zeros((len(pairs), C, C))
    for e, (u, v) in enumerate(pairs):
        there, back = sent.get((u, v), none), sent.get((v, u), none)
        moves[e] = there_per @ there + back_per @ back
        trip = route @ there + np.swapaxes(route, 0, 1) @ back  # [x, y]: a shard there and its gradient back
        hops[e] = np.where(moved, trip[None, None], 0.0).max(axis=(2, 3))
    return pairs, moves, hops


def solve(costs: SpreadCosts, overlap: bool, time_limit_s: float = 5.0) -> list[int] | None:
    """The choice per layer minimising `costs.objective(., overlap)`, by HiGHS;
    None if no choice fits memory."""
    K, C, _ = costs.compute.shape
    nx, ny = K * C, len(costs.pairs) * C * C
    nv = nx + ny + 1  # x[k, c], y[e, a, b], T
    objective = np.zeros(nv)
    objective[nv - 1] = 1.0
    objective[:nx] = TIE * (costs.compute.sum(axis=2) + costs.links.sum(axis=2)).ravel()
    objective[nx:nx + ny] = TIE * costs.moves.sum(axis=3).ravel()
    integral = np.zeros(nv)
    integral[:nx] = 1
    x = _milp_by(time.perf_counter() + time_limit_s * 1.2 + 0.1, objective,
                 constraints=_constraints(costs, overlap, nv), integrality=integral,
                 bounds=scipy.optimize.Bounds(0, np.r_[np.ones(nv - 1), np.inf]),
                 options={"time_limit": time_limit_s})
    if x is None:
        return None
    return [int(np.argmax(x[k * C:(k + 1) * C])) for k in range(K)]


def _milp_by(deadline: float, *args: object, **kwargs: object) -> np.ndarray | None:
    """`scipy.optimize.milp(*args, **kwargs).x`, computed in a forked process that is killed at `deadline`
    (perf_counter seconds): HiGHS keeps its time limit only between its own steps (the transformer in bf16 on
    2x4xA100@25Gbps: 3.9 s on a limit of 0.9 s, in its root LP). None where it found nothing by then."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_milp_to, args=(send, args, kwargs), daemon=True)
    with warnings.catch_warnings():  # Python 3.12+ warns of fork beside threads: the child runs HiGHS only
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
        child.start()
    send.close()
    try:
        return recv.recv() if recv.poll(max(0.0, deadline - time.perf_counter())) else None
    except EOFError:  # the child died without a result
        return None
    finally:
        child.kill()
        child.join()
        recv.close()


def _milp_to(send: Connection, args: tuple, kwargs: dict) -> None:
    send.send(scipy.optimize.milp(*args, **kwargs).x)


class _Rows:
    """A sparse constraint matrix built a row at a time: low <= sum of val * v[col] over the row <= high."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, entries: Sequence[tuple[int, float]], low: float, high: float) -> None:
        for col, val in entries:
            self.rows.append(len(self.lo))
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(low)
        self.hi.append(high)

    def constraint(self, nv: int) -> scipy.optimize.LinearConstraint:
        a = scipy.sparse.csr_array((self.vals, (self.rows, self.cols)), shape=(len(self.lo), nv))
        return scipy.optimize.LinearConstraint(a, self.lo, self.hi)


def _constraints(costs: SpreadCosts, overlap: bool, nv: int) -> scipy.optimize.LinearConstraint:
    """The ILP's rows over x[k, c] (layer k takes choice c), y[e, a, b] (the pair e's layers take a and b)
    and T: one choice a layer; each y summing to its layers' x (Alpa's linearisation); T at least every
    device's compute and the path's waits, and every link's traffic (`overlap`), or each device's compute
    plus a link it uses (not); each device's memory within its capacity."""
    K, C, D = costs.compute.shape
    nx = K * C

    def xi(k: int, c: int) -> int:
        return k * C + c

    def yi(e: int, a: int, b: int) -> int:
        return nx + (e * C + a) * C + b

    rows = _Rows()
    for k in range(K):
        rows.add([(xi(k, c), 1.0) for c in range(C)], 1.0, 1.0)
    for e, (u, v) in enumerate(costs.pairs):
        for a in range(C):
            rows.add([(yi(e, a, b), 1.0) for b in range(C)] + [(xi(u, a), -1.0)], 0.0, 0.0)
            rows.add([(yi(e, b, a), 1.0) for b in range(C)] + [(xi(v, a), -1.0)], 0.0, 0.0)
    path = [(yi(e, a, b), costs.hops[e, a, b]) for e, a, b in zip(*np.nonzero(costs.hops))]

    def device_terms(d: int) -> list[tuple[int, float]]:
        return [(xi(k, c), costs.compute[k, c, d]) for k in range(K) for c in range(C)
                if costs.compute[k, c, d]] + path

    def link_terms(lk: int) -> list[tuple[int, float]]:
        terms = [(xi(k, c), costs.links[k, c, lk]) for k in range(K) for c in range(C)
                 if costs.links[k, c, lk]]
        nz = np.nonzero(costs.moves[:, :, :, lk])
        return terms + [(yi(e, a, b), costs.moves[e, a, b, lk]) for e, a, b in zip(*nz)]

    links = [link_terms(lk) for lk in range(costs.links.shape[2])]
    for d in range(D):
        if overlap:
            rows.add([*device_terms(d), (nv - 1, -1.0)], -np.inf, 0.0)
        else:
            for lk in costs.uses[d] or (None,):
                uses = links[lk] if lk is not None else ()
                rows.add([*device_terms(d), *uses, (nv - 1, -1.0)], -np.inf, 0.0)
        rows.add([(xi(k, c), costs.memory[k, c, d]) for k in range(K) for c in range(C)], -np.inf,
                 costs.capacity[d])
    for terms in links if overlap else ():
        if terms:
            rows.add([*terms, (nv - 1, -1.0)], -np.inf, 0.0)
    return rows.constraint(nv)


# The most entries of the search's dense route table (`_moves`: devices x devices x links x 2 floats), 1 GiB:
# 64 V100s with a link per pair take a quarter of it, 128 would take 4 GiB, 256 of them 64 GiB.
MAX_ROUTE_TABLE = 2**27


def spread_plans(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None,
                 budget_s: float = 4.0) -> Iterator[Strategy]:
    """The plans of the search under both models (module docstring), one shard a device: for each, the best
    of the local search's from data parallelism and from the best two-stage pick, and the ILP's, where HiGHS
    finds one within its share of `budget_s` (which starts after the costs are read). Each plan is made when
    the next is asked for (ordering gnmt's 113k-op replicated step is 2 s of list scheduling), the pick with
    the lower bound of the model without overlap first: it has come out the faster plan (on 2x4xA100@25Gbps
    bert-large's 205 ms against 266, gnmt's 307 against 361). FasttError where the step cannot be cut into
    one shard a device."""
    n = len(cluster.devices)
    if n < 2 or not replicable(graph, n):
        raise FasttError(f"spread search: batch {graph.batch} does not split into {n} shards")
    if n * n * len(cluster.links) * 2 > MAX_ROUTE_TABLE:
        raise FasttError(f"spread search: {n} devices with {len(cluster.links)} links are more than its "
                         "route tables hold (devices² x links); plan with another planner")
    found = layers(graph)
    per_layer = spread_costs(graph, cluster, found, measured)
    groups = blocks(per_layer, [sum(graph.ops[p].out_bytes for p in layer.params) for layer in found.layers])
    costs = per_layer.merged(groups)
    # the budget is the search's own: the capture at batch/n before it (seconds for bert) is not taken from it
    deadline = time.perf_counter() + budget_s
    # per model, the descents' picks (both models' first: they are the cheaper), and then the ILP's
    found_here = {overlap: [descend(costs, overlap, start, deadline)
                            for start in ([0] * len(groups), two_stage(costs, overlap))]
                  for overlap in (True, False)}
    picks: list[list[int]] = []
    for overlap in (True, False):  # per model, the best of them
        left = (deadline - time.perf_counter()) / (2 if overlap else 1)
        optimum = solve(costs, overlap, left) if left > 0.05 else None
        picks.append(min([*found_here[overlap], *([optimum] if optimum else [])],
                         key=lambda p: (costs.excess(p), costs.objective(p, overlap))))
    picks.sort(key=lambda p: (costs.excess(p), costs.objective(p, False)))
    for pick in {tuple(p): p for p in picks if any(p)}.values():  # data parallelism is planned elsewhere
        # blocks in order
        spreads = [costs.spreads[pick[b]] for b, members in enumerate(groups) for _ in members]
        yield mixed_strategy(graph, cluster, n, spreads, found, "search", measured)


def search(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None) -> Strategy:
    """The `search` planner: the fastest simulated of `spread_plans`,
    data parallelism where none is better."""
    plans = list(spread_plans(graph, cluster, measured))
    if not plans:
        raise FasttError("spread search: no spread of the layers beats data parallelism on its cost model")
    return min(plans, key=lambda s: _judge(graph_for(graph, s), s, cluster, measured))
