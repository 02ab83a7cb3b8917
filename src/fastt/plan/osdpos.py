"""OS-DPOS, the `fastt` planner: DPOS plus splitting critical-path ops (mixed data and model parallelism).

1. Start graph: the data-parallel graph (the step at batch/N once per device, gradients allreduced) when the
   model fits on one device, else the plain graph. The starting plan is the fastest, by simulation, of
   data parallelism itself, DPOS on the start graph, DPOS on the plain graph and one device — so `fastt` is never
   slower than those.
2. Find the critical path of the starting plan's simulated schedule.
3. Take its ops that have a split rule in decreasing compute time. For each, try every dimension its rule allows
   and every part count from 2 to the number of devices, rerun DPOS on each split graph, keep the best.
4. Accept a split only if it lowers the iteration time; at the first op where no split helps, stop.
Candidates are compared by DPOS's own makespan (fast), and an accepted plan is confirmed by the simulator.
`budget_s` bounds the search: when it runs out the best plan so far is returned.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..cluster import Cluster
from ..cost import op_times
from ..graph import OpGraph, data_parallel_graph
from ..simulate import simulate
from ..split import max_parts, split, splittable
from ..strategy import Split, Strategy
from .basic import data_parallel, single_device
from .common import PlanCosts
from .dpos import dpos_strategy, schedule

DEFAULT_BUDGET_S = 6.0  # with the starting plans, bert-large on 8 GPUs plans in under 10 s here


def _simulated(g: OpGraph, s: Strategy, cluster: Cluster) -> float:
    return simulate(g, s, cluster, op_times(g, cluster)).iteration_s


def _fits_one_device(graph: OpGraph, cluster: Cluster) -> bool:
    return bool(simulate(graph, single_device(graph, cluster), cluster, op_times(graph, cluster)).fits)


def _seeds(graph: OpGraph, cluster: Cluster, deadline: float) -> list[tuple[float, OpGraph, Strategy]]:
    """(simulated time, graph, strategy) of each starting plan, best first. The cheap ones always; DPOS on the
    data-parallel graph (N times larger) only while the budget lasts."""
    n = len(cluster.devices)
    t0 = time.perf_counter()
    seeds = [(graph, dpos_strategy(graph, cluster, planner="fastt"))]
    dpos_s = time.perf_counter() - t0
    seeds.append((graph, single_device(graph, cluster)))
    if n > 1 and graph.batch % n == 0 and graph.recapture is not None and _fits_one_device(graph, cluster):
        dp_graph = data_parallel_graph(graph, n)
        seeds.append((dp_graph, data_parallel(graph, cluster)))
        if time.perf_counter() + n * dpos_s < deadline:  # DPOS time grows with the graph, N times larger here
            seeds.append((dp_graph, dpos_strategy(dp_graph, cluster, planner="fastt", replicas=n)))
    out = [(_simulated(g, s, cluster), g, replace(s, planner="fastt")) for g, s in seeds]
    return sorted(out, key=lambda x: x[0])


def os_dpos(graph: OpGraph, cluster: Cluster, budget_s: float = DEFAULT_BUDGET_S) -> Strategy:
    """The `fastt` planner (see the module docstring)."""
    deadline = time.perf_counter() + budget_s
    best_t, g, best = _seeds(graph, cluster, deadline)[0]
    n = len(cluster.devices)
    if n == 1:
        return best
    tl = simulate(g, best, cluster, op_times(g, cluster))
    times = op_times(g, cluster)
    cp = [g.index[name] for name in tl.critical_path if name in g.index]
    cp = sorted({i for i in cp if splittable(g.ops[i], g)}, key=lambda i: -times[i].max())
    splits: list[Split] = []
    makespan = max(schedule(g, PlanCosts(times, cluster)).finish)
    for i in cp:
        name = g.ops[i].name
        if name not in g.index:
            continue
        found = None
        for dim in splittable(g.ops[g.index[name]], g):
            for parts in range(2, min(n, max_parts(g.ops[g.index[name]], g, dim)) + 1):
                if time.perf_counter() > deadline:
                    return _finish(best, splits)
                g2 = split(g, name, dim, parts)
                m2 = max(schedule(g2, PlanCosts(op_times(g2, cluster), cluster)).finish)
                if m2 < makespan and (found is None or m2 < found[0]):
                    found = (m2, g2, dim, parts)
        if found is None:
            break  # FastT stops at the first critical-path op that no split helps
        m2, g2, dim, parts = found
        s2 = dpos_strategy(g2, cluster, planner="fastt", replicas=best.replicas)
        t2 = _simulated(g2, s2, cluster)
        if t2 >= best_t:
            break
        g, best, best_t, makespan = g2, s2, t2, m2
        splits.append(Split(op=name, dim=dim, parts=parts))
    return _finish(best, splits)


def _finish(best: Strategy, splits: list[Split]) -> Strategy:
    return replace(best, splits=tuple(splits))


def fastt_planner(graph: OpGraph, cluster: Cluster) -> Strategy:
    """The `fastt` planner with the default search budget."""
    return os_dpos(graph, cluster)
