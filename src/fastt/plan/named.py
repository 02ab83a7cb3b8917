"""Planning by name: a registered planner, and the `fastt` planner's options (search budget, measured op
times)."""

from __future__ import annotations

from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts, check_precision
from ..graph import OpGraph, gc_paused
from ..strategy import Strategy
from . import get_planner
from .osdpos import DEFAULT_BUDGET_S, os_dpos
from .portfolio import PLAN_S, best_plan


def plan(graph: OpGraph, cl: Cluster, planner: str = "fastt", budget_s: float | None = None,
         measured: MeasuredCosts | None = None) -> Strategy:
    """A strategy for `graph` on `cl` from the named planner (see fastt.plan.PLANNERS).

    `budget_s` bounds the `fastt` planner's whole plan, the capture at batch/n included (PLAN_S by default;
    `portfolio.best_plan` says what it makes in that time), and the `os-dpos` planner's split search
    (DEFAULT_BUDGET_S); both return the best plan found so far, and with 0 split nothing; `measured` gives
    them measured op times (the other planners plan with the cost model's estimates). A step in bf16 is
    refused on a GPU without BF16 tensor cores.
    """
    check_precision(graph, cl)
    with gc_paused():
        if planner in ("fastt", "os-dpos") and (budget_s is not None or measured is not None):
            if planner == "fastt":
                return best_plan(graph, cl, PLAN_S if budget_s is None else budget_s, measured)
            budget = DEFAULT_BUDGET_S if budget_s is None else budget_s
            return replace(os_dpos(graph, cl, budget_s=budget, measured=measured), planner="os-dpos")
        return get_planner(planner)(graph, cl)
