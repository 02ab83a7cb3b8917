"""The Python interface users see: capture, cluster, plan, simulate.

A facade over the stages of the data path (docs/design.md), which hold the code: `coarsen.capture_graph`,
`cost.measure_model`, `plan.named.plan`, `simulate.simulate_plan` and `simulate.lower_bound`. Here a cluster
may also be given by its spec ("4xV100", "cpu:2", a JSON path).
"""

from __future__ import annotations

from collections.abc import Mapping

from .cluster import Cluster, cluster
from .coarsen import capture_graph as capture
from .cost import MeasuredCosts
from .cost import measure_model as measure
from .graph import OpGraph
from .plan import named
from .simulate import Timeline, lower_bound, simulate_plan
from .strategy import Strategy

__all__ = ["capture", "lower_bound", "measure", "plan", "simulate"]


def plan(graph: OpGraph, cluster_spec: str | Cluster, planner: str = "fastt",
         budget_s: float | None = None, measured: MeasuredCosts | None = None) -> Strategy:
    """A strategy for `graph` on the cluster from the named planner (see fastt.plan.PLANNERS); `budget_s` and
    `measured` are the `fastt` planner's options (`fastt.plan.named.plan`)."""
    return named.plan(graph, cluster(cluster_spec), planner, budget_s, measured)


def simulate(graph: OpGraph, strategy: Strategy, cluster_spec: str | Cluster,
             measured: MeasuredCosts | None = None, release: Mapping[str, str] | None = None) -> Timeline:
    """Simulate `strategy` on the cluster: iteration time, memory per device, critical path, lower bound.
    `release`: when ops send their results off their device (`fastt.simulate.simulate`; the runtime passes its
    segments')."""
    return simulate_plan(graph, strategy, cluster(cluster_spec), measured, release)
