"""The `fastt` planner: a portfolio of the expert plans, the spread search's and OS-DPOS's,
judged by simulation."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts, op_times
from ..errors import FasttError
from ..graph import UPDATE, OpGraph, base_name, data_parallel_graph, rebatch, replicable
from ..shard import shardable
from ..split import chain_all, chain_links, graph_for
from ..strategy import Strategy
from .basic import data_parallel, node_devices, one_node, one_node_devices, zero
from .megatron import held_in_parts, megatron
from .mixed import EXPERTS, MICRO_BATCHES, _stages_per_group, pipeline
from .osdpos import _first_seeds, _judge, _scheduled_seeds, ranked, split_critical_path
from .search import spread_plans

# planners that raise FasttError where they do not apply
OPTIONAL = (*EXPERTS, "megatron", "search", "zero", "one-node")
ACCUMULATE = (2, 4, 8)  # micro-batches a device of data parallelism tried where memory binds
FINER = (4, 8, 16)  # micro-batches a device of the pipelines tried where no plan fits after those
# the whole plan's default budget, the capture at batch/n included (issue 16: planning within 10 s)
PLAN_S = 8.5
# the experts in the order the portfolio tries them while its budget lasts, after the search: the cheapest to
# plan first (table-wise refuses at once a step without embedding tables)
TRIED_FIRST = ("table-wise", "pipeline", "owt")
# at most this much of the budget for the spread search's descents and ILP (as the `search` planner has), and
# at least this much (gnmt's descents on 2x4xA100@25Gbps take 0.6 s; bert-large's best plan there is found
# in 0.5 s)
SEARCH_S, SEARCH_MIN_S = 4.0, 0.75


class _Pool:
    """The candidates so far, each judged as it comes (plans that fit first, then the fastest), and the
    longest a plan and a judgement took, which say whether the budget left covers another."""

    def __init__(self, graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None,
                 deadline: float) -> None:
        self.graph, self.cluster, self.measured, self.deadline = graph, cluster, measured, deadline
        self.judged: list[tuple[tuple[bool, float], int, Strategy]] = []
        self.plan_s = self.judge_s = 0.0

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def covers(self, seconds: float = 0.0) -> bool:
        """Whether the budget left covers `seconds` more, one more plan made and judged, and the judgement the
        best plan's variant with sharded updates takes at the end (always made). A plan not made yet is
        taken to cost a judgement at least (a mixed plan list-schedules the replicated graph that DP's
        judgement simulates: gnmt's table-wise plan on 8 devices, 2.4 s, after DP's 1.7 s judgement)."""
        return self.left() > seconds + max(self.plan_s, self.judge_s) + 2 * self.judge_s

    def add(self, s: Strategy) -> None:
        t0 = time.perf_counter()
        judged = _judge(graph_for(self.graph, s), s, self.cluster, self.measured)
        self.judged.append((judged, len(self.judged), s))
        self.judge_s = max(self.judge_s, time.perf_counter() - t0)

    def make(self, planner: Callable[..., Strategy], *args: object, captures: bool = False,
             **kwargs: object) -> Strategy | None:
        """Plan with `planner(graph, cluster, *args, **kwargs)` and add its plan; nothing where it does not
        apply (FasttError: no tables, a batch that does not split, ...). A plan that `captures` the step
        again does not count as a plan's time."""
        t0 = time.perf_counter()
        try:
            s = planner(self.graph, self.cluster, *args, **kwargs)
        except FasttError:
            return None
        if not captures:
            self.plan_s = max(self.plan_s, time.perf_counter() - t0)
        self.add(s)
        return s

    def best(self) -> Strategy:
        return min(self.judged)[2]

    def fitting(self) -> int:
        """How many plans so far fit."""
        return sum(not misfit for (misfit, _), _, _ in self.judged)

    def fits(self) -> bool:
        return self.fitting() > 0

    def binds(self) -> bool:
        """Whether memory binds: the fastest plan so far does not fit."""
        return min(self.judged, key=lambda j: j[0][1])[0][0]


def best_plan(graph: OpGraph, cluster: Cluster, budget_s: float = PLAN_S,
              measured: MeasuredCosts | None = None) -> Strategy:
    """The fastest simulated of the expert plans that apply, the spread search's and OS-DPOS's, plans that fit
    first (FastT's rule, keep a plan only if it is faster, over a portfolio), data parallelism with sharded
    updates (`zero`), the best plan with its replicated updates sharded and with its splits chained, and
    Megatron's tensor parallelism (`megatron`, which updates weights in parts, `split.chain_update`).

    `budget_s` bounds the whole plan, the step at batch/n that every data-parallel and mixed plan reads
    included (derived from the capture, `fastt.rebatch`, or captured again). In that time, in this order: data
    parallelism and one device, always made (`zero` too where DP does not fit); data parallelism on one node
    where it may win (`_one_node_may_win`), made whatever the budget; the spread search's plans,
    each while the budget covers it (its descents and ILP with a quarter of the budget left, SEARCH_MIN_S to
    SEARCH_S); the experts (`TRIED_FIRST`) and Megatron on one node, each while the budget left covers another
    plan; OS-DPOS's other starting plans (DPOS and the list schedulers, cheapest first, while the budget
    covers the longest so far); owt's plan with its linear layers in parts over a node's devices
    (`megatron.held_in_parts`: 2 s for bert-large, where the search wins; 0.7 s for vgg19, where it wins);
    plans that need a step of their own (Megatron on several nodes, one replica a node, at batch/nodes; the
    expert pipeline's own cut on roofline costs) while the budget left covers one as long as the longest so
    far (gpt2 on 2x4xA100@25Gbps: fastt 332.2 ms without Megatron's, 297.8 with it); OS-DPOS's split search
    from the best starting plan, with what is left but two judgements; the best plan with its updates sharded
    (every step before keeps a judgement for it), `zero` where the budget covers it, and the best plan with
    its splits chained, while the budget covers it. Where memory binds (the fastest plan does not fit),
    every plan's sharded variant, then data parallelism and `zero` over ACCUMULATE micro-batches a device
    (gradient accumulation) until one fits, and where still nothing fits, pipelines with FINER micro-batches
    until one does (memory-bound training: a plan that fits is worth its time, whatever the budget)."""
    t0 = time.perf_counter()
    pool = _Pool(graph, cluster, measured, t0 + budget_s)
    capture_s = _capture_time(graph, len(cluster.devices))
    nodes = len(node_devices(cluster))
    judging: dict[str, float] = {}
    seeds = _first_seeds(graph, cluster, measured, judging)  # DP and one device first, always
    pool.judge_s = max(judging.values())  # DP's judgement where it is made: the longest
    judged, g, best = ranked(seeds)[0]
    pool.judged.append((judged, 0, best))
    zeroed = pool.binds()  # else DP's plan with its updates sharded comes last
    if zeroed:
        pool.make(zero)
    if _one_node_may_win(graph, cluster, measured, judged[1]):  # made whatever the budget, as DP is
        pool.make(one_node)
    # the spread search first: its plans have beaten the experts' wherever a slow link binds (bert-large,
    # gnmt on 2x4xA100@25Gbps), and a plan of it costs a list schedule and a judgement of the replicated step;
    # its descents and ILP get a quarter of what is left less a judgement, at least SEARCH_MIN_S: the
    # experts after it keep theirs (the pipeline's plan of bert-large on 2x4xV100, 196.5 ms against the
    # search's 226.1, needs 0.5 s)
    search_s = max(SEARCH_MIN_S, min(SEARCH_S, pool.left() / 4 - pool.judge_s))
    plans, ahead = spread_plans(graph, cluster, measured, search_s), search_s
    try:
        while pool.covers(ahead):  # the first plan after the search's descents and ILP
            t1 = time.perf_counter()
            if (s := next(plans, None)) is None:
                break
            pool.plan_s = max(pool.plan_s, time.perf_counter() - t1 - ahead)
            pool.add(s)
            ahead = 0.0
    except FasttError:
        pass  # one device, or a batch that does not cut into one shard a device
    made = {}
    for name in sorted(EXPERTS, key=TRIED_FIRST.index):
        if pool.covers():
            expert = EXPERTS[name]
            # the pipeline cuts the batch into one shard a device: op times were measured at the batch and at
            # its share per device; its own cut (GPipe's micro-batches) is another capture, below
            micro = {"micro": _stages_per_group(cluster)} if name == "pipeline" else {}
            made[name] = pool.make(expert, measured, **micro)
    if nodes == 1 and pool.covers():
        pool.make(megatron, measured)
    # DPOS and the list schedulers, while the budget covers them, a split tried and the variants
    _scheduled_seeds(graph, cluster, measured, seeds, pool.deadline - 2 * (pool.plan_s + pool.judge_s),
                     bounded=True)
    for k in seeds.keys() - {"dp", "single"}:
        pool.judged.append((seeds[k][0], len(pool.judged), seeds[k][2]))
    judged, g, best = ranked(seeds)[0]
    if made.get("owt") is not None and pool.covers():  # owt's linear layers in parts over a node's devices
        pool.make(held_in_parts, made["owt"], measured)
    if nodes > 1 and pool.covers(capture_s):
        pool.make(megatron, measured, captures=True)  # a replica a node: another capture, at batch/nodes
    if measured is None and _stages_per_group(cluster) != MICRO_BATCHES and pool.covers(capture_s):
        pool.make(pipeline, measured, captures=True)  # GPipe's cut: a capture of its own
    if len(cluster.devices) > 1 and pool.covers(2 * pool.plan_s):  # its schedule, then a split tried
        s = split_critical_path(g, best, judged[1], cluster, pool.deadline - 2 * pool.judge_s, measured)
        if s.splits != best.splits:
            pool.add(s)
    # the best plan's updates sharded where it replicates them, or every plan's where none fits
    for s in [pool.best()] if pool.fits() else [s for _, _, s in pool.judged]:
        v = with_sharded_updates(graph, s)
        if v is not None:
            pool.add(v)
    if not zeroed and pool.covers():
        # data parallelism with sharded updates where the best plan is another's (transformer on
        # 4x1xV100@10Gbps: OS-DPOS's order of DP's ops, 344.5 ms; sharded, 344.6; zero's, 344.2)
        pool.make(zero)
    v = with_chains(graph, pool.best()) if pool.covers() or not pool.fits() else None
    if v is not None:  # the best plan's splits chained where their layouts agree: no join between them
        pool.add(v)
    for k in ACCUMULATE if pool.binds() and measured is None else ():
        # Memory binds (the fastest plan does not fit): data parallelism over k micro-batches a device, one
        # after the other (gradient accumulation: a device holds one micro-batch's activations), its updates
        # sharded too, each k a capture of its own, until one fits (measured op times hold for the shards
        # they were measured at, not for micro-batches).
        before = pool.fitting()
        for planner in (data_parallel, zero):
            pool.make(planner, k, captures=True)
        if pool.fitting() > before:
            break
    for micro in FINER if not pool.fits() else ():
        # Nothing fits: a pipeline cut finer (1F1B keeps a stage's activations of a few micro-batches alive,
        # not all of them), each cut a capture of its own, until one fits.
        if pool.make(pipeline, measured, micro=micro, captures=True) is None or pool.fits():
            break
    return replace(pool.best(), planner="fastt")


def with_sharded_updates(graph: OpGraph, s: Strategy) -> Strategy | None:
    """`s` with its updates sharded (`fastt.shard`) wherever it runs one copy a replica, each on its own
    device (a layer data-parallel over every replica), and the update can be; None where none is. The
    placement and order stay: a sharded update's parts are its copies, and the collectives are not placed."""
    if s.replicas < 2 or s.sharded:
        return None
    g = data_parallel_graph(graph, s.replicas)
    devices: dict[str, list[int]] = {}
    for i, op in enumerate(g.ops):
        if op.kind == UPDATE and op.name in s.placement:
            devices.setdefault(base_name(op.name), []).append(s.placement[op.name])
    names = tuple(u for u, ds in devices.items() if len(set(ds)) == s.replicas
                  and not shardable(g, g.index[f"r0/{u}"], s.replicas))
    return replace(s, sharded=names) if names else None


def with_chains(graph: OpGraph, s: Strategy) -> Strategy | None:
    """`s` with every split op chained to the split ops it reads where their layouts agree (`split.chain`),
    the joins that leaves unread out of its placement and order; None where no split chains."""
    g = graph_for(graph, s)
    names = [sp.op for sp in s.splits if sp.op not in s.chained and chain_links(g, sp.op)]
    if not names:
        return None
    g = chain_all(g, names)
    return replace(s, chained=(*s.chained, *names),
                   placement={k: d for k, d in s.placement.items() if k in g.index},
                   order=tuple(tuple(n for n in o if n in g.index) for o in s.order))


def _one_node_may_win(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None,
                      best_s: float) -> bool:
    """Whether data parallelism on one node (`one_node`) may beat the best plan so far (DP's among them): the
    cluster has several nodes of several devices, and the compute that one node's devices each run, n/m
    shards of the step at batch/n one after the other, is below `best_s`. Then the link between nodes costs DP
    more than the other nodes' compute gains it (gnmt on 2x4xA100@25Gbps: DP 413.3 ms, one node's compute
    about 300 and its plan 309.9; the search's plan, 307.4, takes 5-7 s more than the budget leaves there).
    Where DP is compute-bound, the bound is far above DP's time (gnmt on 2x4xV100: DP 220.2 ms, one node
    397.6), and the plan, a judgement of the replicated step, is not made."""
    try:
        node = one_node_devices(cluster)
    except FasttError:
        return False
    m, n = len(node), len(cluster.devices)
    if not replicable(graph, n):
        return False
    shard = rebatch(graph, graph.batch // n)
    t = op_times(shard, cluster, measured)[:, node[0]]
    compute = sum(t[i] for i, op in enumerate(shard.ops) if op.kind != UPDATE)
    return n // m * compute < best_s


def _capture_time(graph: OpGraph, n: int) -> float:
    """Seconds the step at another batch takes to make: the step at batch/n, which the data-parallel and mixed
    plans all read, is made here, first, replicated and timed (derived from the capture, or captured again
    where no rule derives it; `rebatch` keeps it); where an earlier plan made it already, the longest such
    so far (`coarsen.capture_graph` records it). 0 where there is no such step."""
    t0 = time.perf_counter()
    if n < 2 or graph.recapture is None or not replicable(graph, n):  # replicable makes it (or says no)
        return 0.0
    data_parallel_graph(graph, n)  # and its n replicas, which every plan with replicas reads
    return max(time.perf_counter() - t0, getattr(graph.recapture, "seconds", 0.0))
