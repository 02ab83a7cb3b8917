"""Planners: functions `(graph, cluster) -> Strategy`, registered by name."""

from __future__ import annotations

from collections.abc import Callable

from ..cluster import Cluster
from ..errors import FasttError
from ..graph import OpGraph, data_parallel_graph
from ..strategy import Strategy
from .basic import data_parallel, single_device
from .dpos import dpos

Planner = Callable[[OpGraph, Cluster], Strategy]

PLANNERS: dict[str, Planner] = {
    "single": single_device,
    "dp": data_parallel,
    "dpos": dpos,
}


def get_planner(name: str) -> Planner:
    try:
        return PLANNERS[name]
    except KeyError:
        raise FasttError(f"unknown planner '{name}': available planners are {', '.join(PLANNERS)}") from None


def graph_for(graph: OpGraph, strategy: Strategy) -> OpGraph:
    """The graph a strategy places: `graph` itself, or its data-parallel replication."""
    return data_parallel_graph(graph, strategy.replicas)
