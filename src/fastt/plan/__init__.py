"""Planners: functions `(graph, cluster) -> Strategy`, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..cluster import Cluster
from ..errors import FasttError
from ..graph import OpGraph
from ..split import graph_for  # noqa: F401 - where it lived before split.py; tests import it from here
from ..strategy import Strategy
from .baechi import m_etf, m_sct, m_topo
from .basic import data_parallel, one_node, single_device, zero
from .dpos import dpos
from .heft import heft
from .megatron import megatron
from .mixed import owt, pipeline, table_wise
from .osdpos import fastt_planner
from .portfolio import best_plan
from .search import search

Planner = Callable[[OpGraph, Cluster], Strategy]

PLANNERS: dict[str, Planner] = {
    "fastt": best_plan,
    "os-dpos": lambda graph, cluster: replace(fastt_planner(graph, cluster), planner="os-dpos"),
    "single": single_device,
    "dp": data_parallel,
    "zero": zero,
    "one-node": one_node,
    "dpos": dpos,
    "m-topo": m_topo,
    "m-etf": m_etf,
    "m-sct": m_sct,
    "heft": heft,
    "owt": owt,
    "table-wise": table_wise,
    "pipeline": pipeline,
    "megatron": megatron,
    "search": search,
}


def get_planner(name: str) -> Planner:
    try:
        return PLANNERS[name]
    except KeyError:
        raise FasttError(f"unknown planner '{name}': available planners are {', '.join(PLANNERS)}") from None
