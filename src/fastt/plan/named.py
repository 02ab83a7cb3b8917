"""Planning by name: a registered planner, and the `fastt` planner's options (search budget, measured op
times)."""

from __future__ import annotations

from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts, check_precision
from ..graph import OpGraph
from ..strategy import Strategy
from . import get_planner
from .osdpos import DEFAULT_BUDGET_S, os_dpos
from .portfolio import best_plan


def plan(graph: OpGraph, cl: Cluster, planner: str = "fastt", budget_s: float | None = None,
         measured: MeasuredCosts | None = None) -> Strategy:
    """A strategy for `graph` on `cl` from the named planner (see fastt.plan.PLANNERS).

    `budget_s` bounds the `fastt` and `os-dpos` planners' split search (they return the best plan found so
    far; 0 searches no splits); `measured` gives them measured op times (the other planners plan with the cost
    model's estimates). A step in bf16 is refused on a GPU without BF16 tensor cores.
    """
    check_precision(graph, cl)
    if planner in ("fastt", "os-dpos") and (budget_s is not None or measured is not None):
        budget = DEFAULT_BUDGET_S if budget_s is None else budget_s
        if planner == "fastt":
            return best_plan(graph, cl, budget, measured)
        return replace(os_dpos(graph, cl, budget_s=budget, measured=measured), planner="os-dpos")
    return get_planner(planner)(graph, cl)
