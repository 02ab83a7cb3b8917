"""OS-DPOS (the `fastt` planner): splits that pay are kept, plans replay from JSON, never worse than its seeds."""

import dataclasses
import time

import pytest
from hypothesis import given, settings
from test_dpos import training_like

import fastt
from fastt import zoo
from fastt.errors import FasttError
from fastt.plan import PLANNERS, graph_for
from fastt.plan.osdpos import _seeds, os_dpos, split_critical_path
from fastt.plan.portfolio import OPTIONAL
from fastt.strategy import Strategy


@pytest.fixture(scope="module")
def alexnet() -> fastt.OpGraph:
    w = zoo.get("alexnet", "test", dropout=False)
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="alexnet")
    return dataclasses.replace(g, recapture=None)  # no data parallelism: model parallelism and splits only


def test_splits_that_shorten_the_step_are_kept(alexnet: fastt.OpGraph) -> None:
    cl = fastt.cluster("4xV100")
    start = fastt.plan(alexnet, cl, "dpos")
    start_t = fastt.simulate(alexnet, start, cl).iteration_s
    s = split_critical_path(alexnet, start, start_t, cl)
    assert s.splits, "a conv on the critical path of alexnet pays to split on 4 GPUs"
    split_graph = graph_for(alexnet, s)
    assert len(split_graph.ops) > len(alexnet.ops)
    s.validate(split_graph)
    got = fastt.simulate(alexnet, s, cl).iteration_s
    assert got < fastt.simulate(alexnet, fastt.plan(alexnet, cl, "dpos"), cl).iteration_s
    again = Strategy.from_json(s.to_json())  # the splits travel in the strategy file
    assert fastt.simulate(alexnet, again, cl).iteration_s == got


@pytest.mark.parametrize("spec", ["2xV100", "2x2xV100@1Gbps"])
def test_fastt_never_slower_than_its_seeds(spec: str) -> None:
    """fastt's plan is no slower than any planner's, one node's data parallelism included where the link
    between nodes is slow."""
    w = zoo.get("mlp", "test")
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="mlp")
    cl = fastt.cluster(spec)
    ours = fastt.simulate(g, fastt.plan(g, cl, "fastt"), cl).iteration_s
    for p in PLANNERS.keys() - {"fastt"}:
        try:
            theirs = PLANNERS[p](g, cl)
        except FasttError:
            assert p in OPTIONAL  # an expert plan that does not apply (mlp has no embedding tables)
            continue
        assert ours <= fastt.simulate(g, theirs, cl).iteration_s, p


def test_fastt_tries_the_expert_pipelines_cut_where_stages_outnumber_its_micro_batches() -> None:
    """On one node of 8 a stage a device outnumbers the expert pipeline's 4 micro-batches a device: fastt
    tries that cut beside its one shard a device (paper-size alexnet, where the pipeline is the fastest)."""
    w = zoo.get("alexnet", "paper")
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="alexnet")
    cl = fastt.cluster("8xA100-pcie")
    ours = fastt.simulate(g, fastt.plan(g, cl, "fastt"), cl).iteration_s
    assert ours <= fastt.simulate(g, fastt.plan(g, cl, "pipeline"), cl).iteration_s


def test_fastt_accumulates_gradients_where_memory_binds() -> None:
    """The transformer at batch 64 on two devices of 150 MB: DP needs 193 MB a device; the expert pipeline
    fits (144 MB, 12.9 ms), and DP over 2 micro-batches a device (130 MB, 10.6 ms) is faster. fastt keeps
    the fastest plan that fits, accumulation included (it kept the pipeline before)."""
    from fastt.plan.basic import data_parallel
    w = zoo.get("transformer", "test", batch=64)
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="transformer")
    base = fastt.cluster("2xV100")
    cl = dataclasses.replace(base, devices=tuple(dataclasses.replace(d, memory_bytes=int(150e6))
                                                 for d in base.devices))
    assert not fastt.simulate(g, fastt.plan(g, cl, "dp"), cl).fits
    ours = fastt.simulate(g, fastt.plan(g, cl, "fastt"), cl)
    assert ours.fits
    for rival in (data_parallel(g, cl, 2), fastt.plan(g, cl, "pipeline")):
        tl = fastt.simulate(g, rival, cl)
        assert tl.fits and ours.iteration_s <= tl.iteration_s


def test_budget_returns_a_plan_at_once(alexnet: fastt.OpGraph) -> None:
    """No budget: the starting plan, no split searched (here the search would keep one), in the time its seeds
    take (a fraction of a second; the bound is generous for a loaded machine)."""
    cl = fastt.cluster("2xV100-pcie")
    assert os_dpos(alexnet, cl).splits, "with the default budget a split of alexnet pays on 2 GPUs"
    t0 = time.perf_counter()
    s = os_dpos(alexnet, cl, budget_s=0.0)
    elapsed = time.perf_counter() - t0
    assert not s.splits and elapsed < 2.0, elapsed
    s.validate(graph_for(alexnet, s))


def test_plan_passes_a_zero_budget_on(alexnet: fastt.OpGraph) -> None:
    """A zero budget is a budget (it once read as none given, and searched for the default 6 s)."""
    assert os_dpos(alexnet, fastt.cluster("2xV100-pcie")).splits
    for planner in ("os-dpos", "fastt"):
        assert not fastt.plan(alexnet, "2xV100-pcie", planner, budget_s=0.0).splits, planner


def test_fastt_keeps_to_a_budget_that_counts_the_capture() -> None:
    """`fastt`'s budget bounds its whole plan, the capture of the step at batch/n included (issue 16: planning
    within 10 s): with a quarter of the time the unbounded plan took, it takes at most half of it, and its
    plan is still no slower than data parallelism (made first, always). Times as ratios in one run."""
    w = zoo.get("transformer", "test")
    cl = fastt.cluster("2x4xV100")

    def timed(budget_s: float) -> tuple[float, Strategy, fastt.OpGraph]:
        g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="transformer")
        t0 = time.perf_counter()
        s = fastt.plan(g, cl, "fastt", budget_s=budget_s)  # a fresh capture: nothing at batch/8 yet
        took = time.perf_counter() - t0
        assert g.recapture.seconds > 0  # the step at batch/8 is timed: the portfolio weighs another against it
        return took, s, g

    full_s, _, _ = timed(60.0)
    took, s, g = timed(full_s / 4)
    assert took < full_s / 2, (took, full_s)
    s.validate(graph_for(g, s))
    assert (fastt.simulate(g, s, cl).iteration_s
            <= fastt.simulate(g, fastt.plan(g, cl, "dp"), cl).iteration_s * (1 + 1e-9))


def test_fastt_seeds_keep_to_its_budget_data_parallelism_and_one_device_first() -> None:
    """Inside fastt's portfolio the starting plans keep to the budget: with none left, data parallelism and one
    device only (gnmt on 4x1xV100@10Gbps: one device is its best plan; on 8 devices DPOS and the list
    schedulers took 4.5 s); with time, the same seeds as OS-DPOS's."""
    w = zoo.get("mlp", "test")
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="mlp")
    cl = fastt.cluster("2xV100")
    none_left = _seeds(g, cl, time.perf_counter(), None, bounded=True)
    assert sorted((s.replicas, len(set(s.placement.values()))) for _, _, s in none_left) == [(1, 1), (2, 2)]
    far = time.perf_counter() + 600

    def seeds(bounded: bool) -> list:
        return sorted((j, len(gr.ops), s.to_json()) for j, gr, s in _seeds(g, cl, far, None, bounded=bounded))
    assert seeds(True) == seeds(False) and len(seeds(False)) == 8  # 6 on the plain graph, DP, DPOS on DP's


@settings(max_examples=60, deadline=None)
@given(training_like())
def test_fastt_plans_are_valid_on_random_steps(case) -> None:
    g, _, cl = case
    s = os_dpos(g, cl, budget_s=5)
    s.validate(graph_for(g, s))
