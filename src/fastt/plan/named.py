"""Planning by name: a registered planner, and the `fastt` planner's options (search budget, measured op times)."""

from __future__ import annotations

from ..cluster import Cluster
from ..cost import MeasuredCosts
from ..graph import OpGraph
from ..strategy import Strategy
from . import get_planner
from .osdpos import DEFAULT_BUDGET_S, os_dpos


def plan(graph: OpGraph, cl: Cluster, planner: str = "fastt", budget_s: float | None = None,
         measured: MeasuredCosts | None = None) -> Strategy:
    """A strategy for `graph` on `cl` from the named planner (see fastt.plan.PLANNERS).

    `budget_s` bounds the `fastt` planner's search (it returns the best plan found so far); `measured` gives it
    measured op times (the other planners plan with the cost model's estimates).
    """
    if planner == "fastt" and (budget_s is not None or measured is not None):
        return os_dpos(graph, cl, budget_s=budget_s or DEFAULT_BUDGET_S, measured=measured)
    return get_planner(planner)(graph, cl)
