"""The `fastt` planner: a portfolio of the expert plans, the spread search's and OS-DPOS's, judged by simulation."""

from __future__ import annotations

import time
from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts
from ..errors import FasttError
from ..graph import OpGraph
from ..split import graph_for
from ..strategy import Strategy
from .mixed import EXPERTS, _stages_per_group, pipeline
from .osdpos import DEFAULT_BUDGET_S, _judge, os_dpos
from .search import spread_plans

OPTIONAL = (*EXPERTS, "search")  # planners that raise FasttError where they do not apply
FINER = (4, 8, 16)  # micro-batches a device of the pipelines tried where no plan fits
SEARCH_S = 4.0  # at most this much of the budget for the spread search (as the `search` planner has); OS-DPOS's
# split search gets the rest


def best_plan(graph: OpGraph, cluster: Cluster, budget_s: float = DEFAULT_BUDGET_S,
              measured: MeasuredCosts | None = None) -> Strategy:
    """The fastest simulated of the expert plans that apply, the spread search's and OS-DPOS's, plans that fit
    first (FastT's rule, keep a plan only if it is faster, over a portfolio). The experts plan first, the spread
    search takes up to SEARCH_S of `budget_s` (what the `search` planner takes), and OS-DPOS's split search what
    is left. Where none of them fits, pipelines with FINER micro-batches are tried until one does (memory-bound
    training)."""
    deadline = time.perf_counter() + budget_s
    candidates = []
    for name, expert in EXPERTS.items():
        try:
            if name == "pipeline":
                # The batch cut no finer than one shard a device: op times were measured at the batch and at its
                # share per device (finer shards would be roofline guesses beside measured plans), and a finer cut
                # is a capture of its own (13 s for bert-large); the spread search's cuts are pipelines too.
                candidates.append(pipeline(graph, cluster, measured, micro=_stages_per_group(cluster)))
            else:
                candidates.append(expert(graph, cluster, measured))
        except FasttError:
            continue  # not a plan for this model or cluster (no tables, a batch that does not split, ...)
    try:
        candidates += spread_plans(graph, cluster, measured, min(SEARCH_S, budget_s))
    except FasttError:
        pass  # one device, or a batch that does not cut into one shard a device
    candidates.append(os_dpos(graph, cluster, max(0.0, deadline - time.perf_counter()), measured))
    judged = [(_judge(graph_for(graph, s), s, cluster, measured), k, s) for k, s in enumerate(candidates)]
    for micro in FINER if not any(not misfit for (misfit, _), _, _ in judged) else ():
        # Nothing fits: a pipeline cut finer (1F1B keeps a stage's activations of a few micro-batches alive, not
        # all of them), each cut a capture of its own, until one fits.
        try:
            s = pipeline(graph, cluster, measured, micro=micro)
        except FasttError:
            break
        judged.append((_judge(graph_for(graph, s), s, cluster, measured), len(judged), s))
        if not judged[-1][0][0]:
            break
    return replace(min(judged)[2], planner="fastt")
