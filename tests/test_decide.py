"""The decision sequence both runtimes share: which plan, which batch sizes are measured, where fastt plans."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import fastt
from fastt.cost import MeasuredCosts
from fastt.runtime.decide import decide
from fastt.runtime.tune import Tuner
from fastt.strategy import Strategy

BATCH = 8


@pytest.fixture(scope="module")
def graph() -> fastt.OpGraph:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return fastt.capture(model, torch.nn.functional.mse_loss, opt, (torch.randn(BATCH, 4), torch.randn(BATCH, 2)))


class Recorder:
    """A `measure` that records its calls and an `alone` that records whether it ran the planner."""

    def __init__(self, plans: bool = True) -> None:
        self.calls: list[tuple[list[int], Strategy | None]] = []
        self.alone_calls, self.plans = 0, plans
        self.costs = MeasuredCosts(kind="cpu", threads=1)

    def measure(self, batches: Sequence[int], strategy: Strategy | None) -> MeasuredCosts:
        self.calls.append((list(batches), strategy))
        return self.costs

    def alone(self, fn):
        self.alone_calls += 1
        return fn() if self.plans else None


def run(graph, rec: Recorder, planner: str = "fastt", strategy: Strategy | None = None,
        tuner: Tuner | None = None):
    return decide(graph, fastt.cluster("cpu:2"), n_devices=2, planner=planner, strategy=strategy, tuner=tuner,
                  measure=rec.measure, alone=rec.alone)


def test_fastt_measures_the_whole_and_the_replicas_step_then_plans_alone(graph) -> None:
    rec = Recorder()
    d = run(graph, rec)
    assert rec.calls == [([BATCH, BATCH // 2], None)] and rec.alone_calls == 1
    assert d.planned and d.costs is rec.costs and d.strategy.planner == "fastt"


def test_a_rank_that_waits_for_the_plan_gets_none(graph) -> None:
    rec = Recorder(plans=False)
    d = run(graph, rec)
    assert d.planned and d.strategy is None and rec.alone_calls == 1


def test_another_planner_plans_first_and_measures_its_batch(graph) -> None:
    rec = Recorder()
    d = run(graph, rec, planner="dp")
    assert d.strategy.planner == "dp" and not d.planned and rec.alone_calls == 0
    assert rec.calls == [([BATCH // 2], d.strategy)]


def test_a_strategy_given_is_kept(graph) -> None:
    rec = Recorder()
    given = fastt.plan(graph, "cpu:2", "single")
    d = run(graph, rec, strategy=given)
    assert d.strategy is given and not d.planned and rec.calls == [([BATCH], given)]


def test_a_tuner_starts_from_data_parallelism_and_measures_what_it_compares(graph) -> None:
    rec = Recorder()
    d = run(graph, rec, tuner=Tuner())
    assert d.strategy.planner == "dp" and not d.planned and rec.alone_calls == 0
    assert rec.calls == [([BATCH, BATCH // 2], d.strategy)]
