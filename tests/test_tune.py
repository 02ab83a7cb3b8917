"""FastT's tuning loop: refit op costs from profiled segments, replan, keep a plan only if it measured faster."""

from __future__ import annotations

import random

import pytest
from test_runtime import assert_same, one_thread_per_device, pair  # noqa: F401 - fixture used by every test

import fastt
from fastt.cost import op_times
from fastt.plan.common import strategy_from
from fastt.runtime import Tuner, parallelize
from fastt.runtime.reference import batch_like, eager_reference_step, max_param_rel_diff, take_state
from fastt.runtime.tune import _describe, change, refit


def kept_plan(rounds: list[dict]) -> dict:
    """The round whose plan the tuner ends on, FastT's rule replayed on the measured times: a trial is kept only
    if it measured faster than the plan it would replace (the first, or the last trial kept)."""
    best = rounds[0]
    for r in rounds[1:]:
        assert r["kept"] == (r["measured_s"] < best["measured_s"]), rounds
        best = r if r["kept"] else best
    return best


def ping_pong(name: str = "mlp"):
    """A workload and a poor plan: ops alternate between the two devices (every edge crosses)."""
    ref, ours = pair(name)
    g = fastt.capture(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs)
    return ref, ours, strategy_from(g, "ping-pong", 2, [i % 2 for i in range(len(g.ops))])


def test_refit_scales_each_segments_ops_by_its_measured_over_predicted_time() -> None:
    _, ours = pair("mlp")
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cpu:2", "single")
    times = op_times(step.lowered.graph, step.cluster, step.costs)
    seg = step.placed.programs.devices[0][0]
    predicted = sum(times[t.op, 0] for t in seg.tasks)
    new = refit(step.placed, [(seg, 0, 2 * predicted)], step.costs, step.cluster)
    for t in seg.tasks:
        sig = step.lowered.graph.ops[t.op].signature
        if sig and times[t.op, 0] > 0:
            assert new.seconds[sig] == pytest.approx(2 * step.costs.seconds[sig])
    assert change(step.costs, new) == pytest.approx(1.0)
    assert change(step.costs, step.costs) == 0.0


@pytest.mark.parametrize(("trial_s", "kept"), [(2.0, False), (0.5, True)])
def test_a_trial_plan_is_kept_only_if_it_measured_faster(trial_s: float, kept: bool) -> None:
    _, ours, start = ping_pong()
    lines: list[str] = []
    tuner = Tuner(window=2, max_rounds=1, log=lines.append)
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cpu:2", strategy=start,
                       tune=tuner)
    first = step.placed
    for _ in range(2):  # the profiling window of the running plan: 1 s a step
        tuner.observe(step, 1.0, [])
    assert step.strategy != first.strategy, "the planner should replace a ping-pong plan"
    for _ in range(2):  # the trial window
        tuner.observe(step, trial_s, [])
    assert (step.strategy != first.strategy) == kept
    assert [r.kept for r in tuner.rounds] == [True, kept]
    assert "rolled back" in lines[1] if not kept else "kept" in lines[1]
    assert not tuner.active and lines[-1].startswith("tune: done")


def test_tuning_while_training_keeps_training_exact() -> None:
    """Real steps with real timings: plans change while training, and every step trains as eager does from the
    same state. A step whose plan splits an op (the tuner's replan on the mlp can be megatron-like) sums its parts
    in another order, which flips a relu mask here and there: that step may differ by 1e-4 of a tensor's largest
    magnitude (2.3e-5 measured on the mlp); a step that splits nothing equals eager (rtol 1e-5)."""
    ref, ours, start = ping_pong()
    lines: list[str] = []
    tuner = Tuner(window=2, max_rounds=2, log=lines.append)
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cpu:2", strategy=start,
                       tune=tuner)
    first = step.strategy
    rng = random.Random(0)
    for i in range(12):
        batch = batch_like(ref.example_inputs, rng.randrange(1000))
        take_state(ours.model, ours.optimizer, ref.model, ref.optimizer)
        splits = bool(step.strategy.splits)
        eager_reference_step(ref.model, ref.loss_fn, ref.optimizer, batch, step.strategy.replicas)
        step(*batch)
        if splits or step.strategy.splits:
            assert max_param_rel_diff(ref.model, ours.model) <= 1e-4, (i, step.strategy.planner)
        else:
            assert_same(ref, ours)
    assert not tuner.active and tuner.rounds and lines[-1].startswith("tune: done")
    assert all("simulated" in line and "measured" in line for line in lines[:-1])
    assert all(r.measured_s > 0 and r.simulated_s > 0 for r in tuner.rounds)
    # The tuner's promise on these real timings: a trial is kept only if it measured faster than the plan it
    # would replace, and a rolled-back trial leaves that plan running, so training ends on the last plan kept.
    rounds = [vars(r) for r in tuner.rounds]
    ends_on = kept_plan(rounds)
    assert (step.strategy == first) == (ends_on is rounds[0]), rounds
    assert ends_on["plan"] == _describe(step.placed), rounds


def test_tune_starts_data_parallel() -> None:
    _, ours = pair("mlp")
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cpu:2",
                       tune=Tuner(log=lambda line: None), trial=False)
    assert step.strategy.planner == "dp" and step.strategy.replicas == 2


@pytest.mark.parametrize("one_device_wins", [True, False])
def test_tuning_starts_from_the_faster_of_dp_and_one_device_on_every_core(monkeypatch, one_device_wins) -> None:
    """The tuner replans over the worker devices, so it would never reach one device with every core (what
    eager uses): its start plan is raced against that rival first, with the tuner idle. Where the rival
    measures faster it is kept and nothing is tuned; else tuning starts from data parallelism."""
    from fastt.runtime import trial

    races = []

    def times(contenders, batch, steps, clock):
        races.append([(c.strategy.planner, c.tuner) for c in contenders])
        return [1.0, 0.5 if one_device_wins else 2.0]

    monkeypatch.setattr(trial, "trial_times", times)
    _, ours = pair("mlp")
    lines: list[str] = []
    tuner = Tuner(log=lines.append)
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cpu:2", tune=tuner)
    assert races == [[("dp", None), ("single", None)]], "the tuner must be idle during the race"
    assert step.trial.one_device_s == (0.5 if one_device_wins else 2.0) and step.trial.fastt_plan_s == 1.0
    if one_device_wins:
        assert step.strategy.n_devices == 1 and step.tuner is None and not tuner.active
        assert lines == ["tune: none (one device with every core measured 500.0 ms a step, dp's plan 1000.0 ms)"]
    else:
        assert step.strategy.planner == "dp" and step.tuner is tuner and tuner.active and not lines
