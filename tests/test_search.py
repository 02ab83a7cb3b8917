"""The spread search: HiGHS finds the optimum of its own model (brute force over tiny instances), blocks cost what
their layers cost, its plans validate, simulate and train as eager, and fastt gains from it where DP waits."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mixed import graph_of, trains_as_eager
from test_runtime import one_thread_per_device  # noqa: F401 - fixture

from fastt.api import simulate
from fastt.cluster import cluster
from fastt.layers import layers
from fastt.plan import graph_for
from fastt.plan.mixed import Spread, mixed_strategy
from fastt.plan.search import (
    SpreadCosts,
    _milp_by,
    blocks,
    choices,
    descend,
    solve,
    spread_costs,
    spread_plans,
    two_stage,
)


@st.composite
def instances(draw) -> SpreadCosts:
    """A random instance of the search's model: K layers, C choices, D devices, L links, random pairs."""
    K, C, D, L = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    pairs = tuple(p for p in itertools.combinations(range(K), 2) if rng.random() < 0.6)
    memory = rng.integers(0, 10, (K, C, D)).astype(float)
    capacity = np.full(D, float(draw(st.integers(5, 40))))
    uses = tuple(tuple(sorted(set(rng.integers(0, L, 2).tolist()))) if L else () for _ in range(D))
    return SpreadCosts(tuple(Spread((c,)) for c in range(C)), rng.random((K, C, D)), rng.random((K, C, L)) * 0.5,
                       memory, capacity, pairs, rng.random((len(pairs), C, C, L)) * 0.5,
                       rng.random((len(pairs), C, C)) * 0.2, uses)


@settings(max_examples=60, deadline=None)
@given(instances(), st.booleans())
def test_the_ilp_finds_the_brute_force_optimum_of_its_model(costs: SpreadCosts, overlap: bool) -> None:
    K, C = len(costs.compute), len(costs.spreads)
    values = {pick: costs.objective(list(pick), overlap) for pick in itertools.product(range(C), repeat=K)}
    best = min(values.values())
    pick = solve(costs, overlap, time_limit_s=30)
    if best == float("inf"):
        assert pick is None  # nothing fits memory
    else:
        assert pick is not None and costs.objective(pick, overlap) == pytest.approx(best, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(("name", "spec"), [("gpt2", "2x2xV100-pcie"), ("transformer", "2xV100"),
                                            ("dlrm", "4xV100")])
def test_blocks_cost_what_their_layers_cost(name: str, spec: str) -> None:
    """A pick per block costs what the same choice for each of its layers costs, in either model."""
    g, cl = graph_of(name), cluster(spec)
    found = layers(g)
    per_layer = spread_costs(g, cl, found)
    groups = blocks(per_layer, [sum(g.ops[p].out_bytes for p in layer.params) for layer in found.layers], limit=4)
    assert [k for m in groups for k in m] == list(range(len(found))) and len(groups) < len(found)
    merged = per_layer.merged(groups)
    rng = np.random.default_rng(0)
    for _ in range(20):
        pick = rng.integers(0, len(merged.spreads), len(groups)).tolist()
        each = [pick[b] for b, m in enumerate(groups) for _ in m]
        for overlap in (True, False):
            assert merged.objective(pick, overlap) == pytest.approx(per_layer.objective(each, overlap), rel=1e-9)


def test_choices_are_every_device_each_node_and_each_device() -> None:
    assert [c.devices for c in choices(cluster("2x2xV100"))] == [(0, 1, 2, 3), (0, 1), (2, 3), (0,), (1,), (2,), (3,)]
    assert [c.devices for c in choices(cluster("2xV100"))] == [(0, 1), (0,), (1,)]


def test_descent_never_ends_worse_than_where_it_started() -> None:
    g, cl = graph_of("lenet"), cluster("2x2xV100-pcie")
    costs = spread_costs(g, cl, layers(g))
    rng = np.random.default_rng(1)
    for _ in range(5):
        start = rng.integers(0, len(costs.spreads), len(costs.compute)).tolist()
        for overlap in (True, False):
            end = descend(costs, overlap, start, time.perf_counter() + 10)
            assert costs.objective(end, overlap) <= costs.objective(start, overlap)


def test_two_stage_is_the_best_pick_with_one_cut_by_brute_force() -> None:
    """Over every pick of lenet's layers on two nodes of two, those that change choice exactly once: the
    two-stage start `descend` gets is the best of them, and descending from it ends no worse."""
    g, cl = graph_of("lenet"), cluster("2x2xV100-pcie")
    costs = spread_costs(g, cl, layers(g))
    K, C = len(costs.compute), len(costs.spreads)
    one_cut = [p for p in itertools.product(range(C), repeat=K)
               if sum(a != b for a, b in itertools.pairwise(p)) == 1]
    for overlap in (True, False):
        best = min((costs.excess(p), costs.objective(p, overlap)) for p in one_cut)
        start = two_stage(costs, overlap)
        assert (costs.excess(start), costs.objective(start, overlap)) == pytest.approx(best)
        end = descend(costs, overlap, start, time.perf_counter() + 10)
        assert costs.objective(end, overlap) <= costs.objective(start, overlap)


@pytest.mark.parametrize("name", ["lenet", "resnet50", "transformer", "gpt2", "dlrm", "rnnlm"])
@pytest.mark.parametrize("spec", ["2xV100", "2x2xV100-pcie"])
def test_search_plans_validate_and_simulate(name: str, spec: str) -> None:
    g, cl = graph_of(name), cluster(spec)
    for s in spread_plans(g, cl, budget_s=2.0):
        s.validate(graph_for(g, s))
        tl = simulate(g, s, cl)
        assert tl.iteration_s > 0 and (tl.fits or tl.oom)


def test_search_memory_keeps_plans_within_the_devices() -> None:
    """With devices just too small for data parallelism (brute force says a spread of the layers fits), the ILP
    returns a plan that fits, not DP."""
    g = graph_of("mlp")
    cl = cluster("2xV100")
    costs = spread_costs(g, cl, layers(g))
    K, C = len(costs.compute), len(costs.spreads)
    peak = {p: costs.loads(list(p))[2].max() for p in itertools.product(range(C), repeat=K)}
    dp, least = peak[(0,) * K], min(peak.values())
    assert least < dp
    room = (least + dp) / 2
    tight = SpreadCosts(costs.spreads, costs.compute, costs.links, costs.memory, np.full(2, room),
                        costs.pairs, costs.moves, costs.hops, costs.uses)
    pick = solve(tight, overlap=True)
    assert pick is not None and any(pick) and tight.loads(pick)[2].max() <= room


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_search_plans_train_as_eager(name: str) -> None:
    """A spread plan holding the first layer on one device and the rest everywhere trains as the eager step."""
    def first_held_once(g, cl):
        found = layers(g)
        return mixed_strategy(g, cl, 2, [Spread((0,))] + [Spread((0, 1))] * (len(found) - 1), found, "search")
    trains_as_eager(name, first_held_once)


def test_fastt_beats_dp_where_its_gradients_cross_the_nodes() -> None:
    """The issue's check, simulated: on 2x4xV100, fastt below DP and no slower than any expert's plan. (Issue
    16's target, 1.3x DP, is met by dlrm; vgg19 reaches 1.10x under the GPU cost model with kernel efficiency,
    1.38 times its lower bound: docs/benchmarks.md.)"""
    from fastt.api import plan
    from fastt.errors import FasttError
    from fastt.plan.portfolio import OPTIONAL

    cl = cluster("2x4xV100")
    for name in ("vgg19", "dlrm"):
        g = graph_of(name, "paper")
        ours = simulate(g, plan(g, cl, "fastt"), cl).iteration_s
        assert ours * 1.05 <= simulate(g, plan(g, cl, "dp"), cl).iteration_s, name
        for p in OPTIONAL:
            try:
                theirs = simulate(g, plan(g, cl, p), cl).iteration_s
            except FasttError:
                continue
            assert ours <= theirs * (1 + 1e-9), (name, p)


def test_fastt_is_no_slower_than_the_expert_pipeline_on_small_models() -> None:
    """The cases of docs/benchmarks.md where the expert pipeline's finer micro-batches beat fastt (mlp and
    alexnet on 2x4xA100@25Gbps): the step at the finer shards is quick to capture, so fastt tries that cut too."""
    from fastt.api import plan

    cl = cluster("2x4xA100@25Gbps")
    for name in ("mlp", "alexnet"):
        g = graph_of(name, "paper")
        ours = simulate(g, plan(g, cl, "fastt"), cl).iteration_s
        assert ours <= simulate(g, plan(g, cl, "pipeline"), cl).iteration_s * (1 + 1e-9), name


def test_the_ilp_runs_by_a_deadline_that_holds() -> None:
    """HiGHS keeps its time limit only between its own steps (3.9 s on a limit of 0.9 s, in bf16), so the
    search's ILP runs in a process killed at its deadline: there, the answer scipy gives; past it, None
    at once."""
    rng = np.random.default_rng(0)
    weights, values = rng.integers(1, 50, 30), rng.integers(1, 50, 30)
    knapsack = {"c": -values.astype(float), "integrality": np.ones(30),
                "bounds": scipy.optimize.Bounds(0, 1),
                "constraints": scipy.optimize.LinearConstraint(weights[None, :], 0, weights.sum() / 3)}
    direct = scipy.optimize.milp(**knapsack).x
    assert np.array_equal(_milp_by(time.perf_counter() + 60, **knapsack), direct)
    t0 = time.perf_counter()
    assert _milp_by(time.perf_counter(), **knapsack) is None
    assert time.perf_counter() - t0 < 1.0
