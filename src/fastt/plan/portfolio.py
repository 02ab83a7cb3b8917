"""The `fastt` planner: a portfolio of the expert plans, the spread search's and OS-DPOS's,
judged by simulation."""

from __future__ import annotations

import time
from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts
from ..errors import FasttError
from ..graph import UPDATE, OpGraph, base_name, data_parallel_graph, replicable
from ..shard import shardable
from ..split import chain_all, chain_links, graph_for
from ..strategy import Strategy
from .basic import zero
from .megatron import megatron
from .mixed import EXPERTS, MICRO_BATCHES, _stages_per_group, node_devices, pipeline
from .osdpos import DEFAULT_BUDGET_S, _judge, os_dpos
from .search import spread_plans

OPTIONAL = (*EXPERTS, "megatron", "search", "zero")  # planners that raise FasttError where they do not apply
FINER = (4, 8, 16)  # micro-batches a device of the pipelines tried where no plan fits
# at most this much of the budget for the spread search (as the `search` planner has); OS-DPOS's split
# search gets the rest
SEARCH_S = 4.0


def best_plan(graph: OpGraph, cluster: Cluster, budget_s: float = DEFAULT_BUDGET_S,
              measured: MeasuredCosts | None = None) -> Strategy:
    """The fastest simulated of the expert plans that apply, the spread search's and OS-DPOS's, plans that fit
    first (FastT's rule, keep a plan only if it is faster, over a portfolio), data parallelism with sharded
    updates (`zero`), the best plan with its replicated updates sharded and with its splits chained, and
    Megatron's tensor parallelism (`megatron`, which updates weights in parts, `split.chain_update`): on
    several nodes its replicas run the step at batch/nodes, another capture, so it is planned there only while
    the budget still covers a capture as long as the one at batch/devices (gpt2 on 2x4xA100@25Gbps: without
    it fastt's 332.2 ms against megatron's 315.0; with it 297.8). The experts plan
    first, the spread search takes up to SEARCH_S of `budget_s` (what the `search` planner takes), and
    OS-DPOS's split search what is left. Where none of them fits, pipelines with FINER micro-batches are
    tried until one does (memory-bound training)."""
    deadline = time.perf_counter() + budget_s
    capture_s = _capture_time(graph, len(cluster.devices))
    candidates = []
    nodes = len(node_devices(cluster))
    for name, expert in {**EXPERTS, "megatron": megatron}.items():
        try:
            if name == "megatron" and nodes > 1 and time.perf_counter() + capture_s >= deadline:
                continue  # a replica a node: another capture, at batch/nodes, while the budget covers one
            if name != "pipeline":
                candidates.append(expert(graph, cluster, measured))
                continue
            # The batch cut into one shard a device: op times were measured at the batch and at its share per
            # device (finer shards would be roofline guesses beside measured plans); the spread search's cuts
            # are pipelines too. The expert's own cut (GPipe's micro-batches) is a capture of its own
            # (13 s for bert-large): on roofline costs, tried while the budget covers a capture as long as
            # the last one. (Coarser where stages outnumber its micro-batches: 8 stages on one node.)
            candidates.append(pipeline(graph, cluster, measured, micro=_stages_per_group(cluster)))
            if (measured is None and _stages_per_group(cluster) != MICRO_BATCHES
                    and time.perf_counter() + capture_s < deadline):
                candidates.append(pipeline(graph, cluster, measured))
        except FasttError:
            continue  # not a plan for this model or cluster (no tables, a batch that does not split, ...)
    try:
        candidates.append(zero(graph, cluster))
    except FasttError:
        pass  # one device, or no update that shards
    try:
        candidates += spread_plans(graph, cluster, measured, min(SEARCH_S, budget_s))
    except FasttError:
        pass  # one device, or a batch that does not cut into one shard a device
    candidates.append(os_dpos(graph, cluster, max(0.0, deadline - time.perf_counter()), measured))
    judged = [(_judge(graph_for(graph, s), s, cluster, measured), k, s) for k, s in enumerate(candidates)]
    # the best plan's updates sharded where it replicates them, or every plan's where none fits
    fits = any(not misfit for (misfit, _), _, _ in judged)
    for s in [min(judged)[2]] if fits else [s for _, _, s in judged]:
        v = with_sharded_updates(graph, s)
        if v is not None:
            judged.append((_judge(graph_for(graph, v), v, cluster, measured), len(judged), v))
    best = min(judged)[2]
    v = with_chains(graph, best)
    if v is not None:  # the best plan's splits chained where their layouts agree: no join between them
        judged.append((_judge(graph_for(graph, v), v, cluster, measured), len(judged), v))
    for micro in FINER if not any(not misfit for (misfit, _), _, _ in judged) else ():
        # Nothing fits: a pipeline cut finer (1F1B keeps a stage's activations of a few micro-batches alive,
        # not all of them), each cut a capture of its own, until one fits.
        try:
            s = pipeline(graph, cluster, measured, micro=micro)
        except FasttError:
            break
        judged.append((_judge(graph_for(graph, s), s, cluster, measured), len(judged), s))
        if not judged[-1][0][0]:
            break
    return replace(min(judged)[2], planner="fastt")


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


def _capture_time(graph: OpGraph, n: int) -> float:
    """Seconds to capture the step at batch/n, which the data-parallel and mixed plans all read (captured
    here, first, so that it is timed: `rebatch` keeps it); 0 where there is no such step."""
    t0 = time.perf_counter()
    if n < 2 or graph.recapture is None or not replicable(graph, n):  # replicable captures it (or says no)
        return 0.0
    return time.perf_counter() - t0
