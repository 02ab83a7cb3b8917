"""The `fastt` planner: a portfolio of the expert plans, the spread search's and OS-DPOS's,
judged by simulation."""

from __future__ import annotations

import time
from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts
from ..errors import FasttError
from ..graph import OpGraph, replicable
from ..split import graph_for
from ..strategy import Strategy
from .mixed import EXPERTS, MICRO_BATCHES, _stages_per_group, pipeline
from .osdpos import DEFAULT_BUDGET_S, _judge, os_dpos
from .search import spread_plans

OPTIONAL = (*EXPERTS, "search")  # planners that raise FasttError where they do not apply
FINER = (4, 8, 16)  # micro-batches a device of the pipelines tried where no plan fits
# at most this much of the budget for the spread search (as the `search` planner has); OS-DPOS's split
# search gets the rest
SEARCH_S = 4.0


def best_plan(graph: OpGraph, cluster: Cluster, budget_s: float = DEFAULT_BUDGET_S,
              measured: MeasuredCosts | None = None) -> Strategy:
    """The fastest simulated of the expert plans that apply, the spread search's and OS-DPOS's, plans that fit
    first (FastT's rule, keep a plan only if it is faster, over a portfolio). The experts plan first, the
    spread search takes up to SEARCH_S of `budget_s` (what the `search` planner takes), and OS-DPOS's split
    search what is left. Where none of them fits, pipelines with FINER micro-batches are tried until one does
    (memory-bound training)."""
    deadline = time.perf_counter() + budget_s
    capture_s = _capture_time(graph, len(cluster.devices))
    candidates = []
    for name, expert in EXPERTS.items():
        try:
            if name != "pipeline":
                candidates.append(expert(graph, cluster, measured))
                continue
            # The batch cut into one shard a device: op times were measured at the batch and at its share per
            # device (finer shards would be roofline guesses beside measured plans); the spread search's cuts
            # are pipelines too. The expert's finer cut (GPipe's micro-batches) is a capture of its own
            # (13 s for bert-large): on roofline costs, tried while the budget covers a capture as long as
            # the last one.
            candidates.append(pipeline(graph, cluster, measured, micro=_stages_per_group(cluster)))
            if (measured is None and _stages_per_group(cluster) < MICRO_BATCHES
                    and time.perf_counter() + capture_s < deadline):
                candidates.append(pipeline(graph, cluster, measured))
        except FasttError:
            continue  # not a plan for this model or cluster (no tables, a batch that does not split, ...)
    try:
        candidates += spread_plans(graph, cluster, measured, min(SEARCH_S, budget_s))
    except FasttError:
        pass  # one device, or a batch that does not cut into one shard a device
    candidates.append(os_dpos(graph, cluster, max(0.0, deadline - time.perf_counter()), measured))
    judged = [(_judge(graph_for(graph, s), s, cluster, measured), k, s) for k, s in enumerate(candidates)]
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


def _capture_time(graph: OpGraph, n: int) -> float:
    """Seconds to capture the step at batch/n, which the data-parallel and mixed plans all read (captured
    here, first, so that it is timed: `rebatch` keeps it); 0 where there is no such step."""
    t0 = time.perf_counter()
    if n < 2 or graph.recapture is None or not replicable(graph, n):  # replicable captures it (or says no)
        return 0.0
    return time.perf_counter() - t0
