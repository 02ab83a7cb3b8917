"""OS-DPOS, the `fastt` planner: DPOS plus splitting critical-path ops (mixed data and model parallelism).

1. Start graph: the data-parallel graph (the step at batch/N once per device, gradients allreduced) when data
   parallelism fits in memory, else the plain graph. The starting plan is the best, by simulation (plans that
   fit first, then the fastest), of: DPOS on the start graph and on the plain graph, data parallelism, one
   device, and the list schedulers HEFT, m-ETF, m-SCT and m-TOPO (milliseconds each) — a portfolio, so `fastt`
   is never slower than any of them; the `dpos` planner is DPOS alone.
2. Find the critical path of the starting plan's simulated schedule.
3. Take its ops that have a split rule in decreasing compute time. For each, try every dimension its rule
   allows and every part count from 2 to the number of devices, rerun DPOS on each split graph, keep the best.
4. Accept a split only if it lowers the iteration time; at the first op where no split helps, stop.
Candidates are compared by DPOS's own makespan (fast), and an accepted plan is confirmed by the simulator.
`budget_s` bounds the search: when it runs out the best plan so far is returned.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from ..cluster import Cluster
from ..cost import MeasuredCosts, op_times
from ..graph import OpGraph, data_parallel_graph, replicable, without_unplaced_updates
from ..simulate import simulate
from ..split import max_parts, split, splittable
from ..strategy import Split, Strategy
from .baechi import m_etf, m_sct, m_topo
from .basic import data_parallel, single_device
from .common import PlanCosts, plan_costs
from .dpos import dpos_strategy, schedule
from .heft import heft

# seconds of split search after the starting plans (docs/benchmarks.md gives planning times)
DEFAULT_BUDGET_S = 6.0


# the starting plans, in the order that breaks ties between equal simulated times
SEEDS = ("dpos", "single", "heft", "m-etf", "m-sct", "m-topo", "dp", "dpos on dp")


Seeds = dict[str, tuple[tuple[bool, float], OpGraph, Strategy]]  # name -> (judged, its graph, plan)


def _seeds(graph: OpGraph, cluster: Cluster, deadline: float, measured: MeasuredCosts | None,
           bounded: bool = False) -> list[tuple[tuple[bool, float], OpGraph, Strategy]]:
    """((does not fit, simulated time), graph, strategy) of each starting plan, best first: data parallelism
    and one device, then the scheduled ones (`_scheduled_seeds`, `bounded` by `deadline` or not)."""
    made = _first_seeds(graph, cluster, measured)
    _scheduled_seeds(graph, cluster, measured, made, deadline, bounded)
    return ranked(made)


def ranked(made: Seeds) -> list[tuple[tuple[bool, float], OpGraph, Strategy]]:
    """The starting plans made so far, best first."""
    return [made[k] for k in sorted(made, key=lambda k: (made[k][0], SEEDS.index(k)))]


def _first_seeds(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None,
                 judging: dict[str, float] | None = None) -> Seeds:
    """Data parallelism (where the batch splits) and one device, judged; the seconds each judgement took
    into `judging`."""
    n = len(cluster.devices)
    plans = {}
    if n > 1 and graph.batch % n == 0 and graph.recapture is not None and replicable(graph, n):
        plans["dp"] = data_parallel_graph(graph, n), data_parallel(graph, cluster)
    plans["single"] = graph, single_device(graph, cluster)
    made: Seeds = {}
    for name, (g, s) in plans.items():
        t0 = time.perf_counter()
        made[name] = _judged(g, s, cluster, measured)
        if judging is not None:
            judging[name] = time.perf_counter() - t0
    return made


def _scheduled_seeds(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None, made: Seeds,
                     deadline: float, bounded: bool = False) -> None:
    """DPOS and the list schedulers on the plain graph, cheapest first, then DPOS on DP's graph (N times
    larger) where DP fits and the budget lasts, each judged into `made`. `bounded` (the `fastt` portfolio,
    whose budget has other plans to make): each only while the time left before `deadline` covers the
    longest of them so far (gnmt on 8 devices: 0.4-2.2 s each, m-SCT the longest); OS-DPOS makes them all."""
    costs = plan_costs(graph, cluster, measured)
    listed = (("dpos", lambda: dpos_strategy(graph, cluster, costs, planner="fastt")),
              *((p.__name__.replace("_", "-"), lambda p=p: p(graph, cluster, costs))
                for p in (m_topo, heft, m_etf, m_sct)))
    longest = dpos_s = 0.0
    for name, make in listed:
        if bounded and time.perf_counter() + longest > deadline:
            return
        t0 = time.perf_counter()
        s = make()
        if name == "dpos":  # DPOS on DP's graph below takes about n times as long
            dpos_s = time.perf_counter() - t0
        made[name] = _judged(graph, s, cluster, measured)
        longest = max(longest, time.perf_counter() - t0)
    n = len(cluster.devices)
    if "dp" in made and not made["dp"][0][0] and time.perf_counter() + n * dpos_s < deadline:
        dp_graph = data_parallel_graph(graph, n)
        dp_costs = plan_costs(dp_graph, cluster, measured)
        made["dpos on dp"] = _judged(dp_graph, dpos_strategy(dp_graph, cluster, dp_costs, planner="fastt",
                                                             replicas=n), cluster, measured)


def _judged(g: OpGraph, s: Strategy, cluster: Cluster, measured: MeasuredCosts | None
            ) -> tuple[tuple[bool, float], OpGraph, Strategy]:
    return _judge(g, s, cluster, measured), g, replace(s, planner="fastt")


def _judge(g: OpGraph, s: Strategy, cluster: Cluster, measured: MeasuredCosts | None) -> tuple[bool, float]:
    """(does not fit, iteration seconds): sorting by it puts plans that fit first, then the fastest. `g` less
    the duplicate updates the plan leaves out (a device applies each update once, `strategy_from`)."""
    g = without_unplaced_updates(g, s.placement)
    tl = simulate(g, s, cluster, op_times(g, cluster, measured))
    return (not tl.fits, tl.iteration_s)


def os_dpos(graph: OpGraph, cluster: Cluster, budget_s: float = DEFAULT_BUDGET_S,
            measured: MeasuredCosts | None = None) -> Strategy:
    """The `fastt` planner (see the module docstring); op times from `measured` where it has them, else the
    roofline estimates."""
    deadline = time.perf_counter() + budget_s
    (_, best_t), g, best = _seeds(graph, cluster, deadline, measured)[0]
    if len(cluster.devices) == 1:
        return best
    return split_critical_path(g, best, best_t, cluster, deadline, measured)


def split_critical_path(g: OpGraph, best: Strategy, best_t: float, cluster: Cluster,
                        deadline: float = math.inf, measured: MeasuredCosts | None = None) -> Strategy:
    """Steps 2-4 of OS-DPOS from plan `best` of graph `g` (simulated at `best_t`): the plan with the splits
    that lowered the iteration time (recorded in `splits`, on top of any `best` already had)."""
    n = len(cluster.devices)
    if time.perf_counter() > deadline:
        return best
    times = op_times(g, cluster, measured)
    tl = simulate(g, best, cluster, times)
    cp = {g.index[name] for name in tl.critical_path if name in g.index}
    by_time = sorted((i for i in cp if splittable(g.ops[i], g)), key=lambda i: -times[i].max())
    names = [g.ops[i].name for i in by_time]
    splits = list(best.splits)
    makespan = max(schedule(g, PlanCosts(times, cluster)).finish)
    for name in names:
        found = None
        for dim in splittable(g.ops[g.index[name]], g):
            for parts in range(2, min(n, max_parts(g.ops[g.index[name]], g, dim)) + 1):
                if time.perf_counter() > deadline:
                    return replace(best, splits=tuple(splits))
                g2 = split(g, name, dim, parts)
                m2 = max(schedule(g2, plan_costs(g2, cluster, measured)).finish)
                if m2 < makespan and (found is None or m2 < found[0]):
                    found = (m2, g2, dim, parts)
        if found is None:
            break  # FastT stops at the first critical-path op that no split helps
        m2, g2, dim, parts = found
        s2 = dpos_strategy(g2, cluster, plan_costs(g2, cluster, measured), planner="fastt",
                           replicas=best.replicas)
        misfit, t2 = _judge(g2, s2, cluster, measured)
        if misfit or t2 >= best_t:
            break
        g, best, best_t, makespan = g2, s2, t2, m2
        splits.append(Split(op=name, dim=dim, parts=parts))
    return replace(best, splits=tuple(splits))


def fastt_planner(graph: OpGraph, cluster: Cluster) -> Strategy:
    """The `fastt` planner with the default search budget."""
    return os_dpos(graph, cluster)
