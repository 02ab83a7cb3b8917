"""FastT's rule before training: `parallelize` races the `fastt` planner's plan against data parallelism and one
device with every core, keeps the fastest, and the trial leaves no trace in training (eager PyTorch is the
oracle)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from test_runtime import one_thread_per_device  # noqa: F401 - fixture
from torch import nn

from fastt.graph import UPDATE, data_parallel_graph, replica_of
from fastt.plan.common import strategy_from
from fastt.report import format_run
from fastt.runtime import parallelize
from fastt.runtime.reference import eager_reference_step, eager_step, take_state
from fastt.runtime.trial import ROUNDS, TRIAL_STEPS, restored
from fastt.strategy import Strategy

BATCH, DEPTH = 64, 16
decide = importlib.import_module("fastt.runtime.decide")  # the module (the package exports its function)


def make() -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    """A deep net of small layers (many ops: a plan pays for each op it runs) with batch-norm statistics and Adam
    (moments and step counters): state a trial step would move. No bias before the batch norm: its true gradient is
    zero, rounding noise whose sign Adam would follow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(),
                          *(m for _ in range(DEPTH) for m in (nn.Linear(32, 32), nn.Tanh())), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), batch(0)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def ping_pong(graph, cl) -> Strategy:
    """A real but bad plan: 16 micro-batches one after the other (gradient accumulation), their ops alternating
    between the two devices, so every op waits for the other device's last one: a long chain of hand-offs and 16
    times the ops of a data-parallel device, slower than data parallelism however the machine's cores are shared."""
    r = 16
    g = data_parallel_graph(graph, r)
    start = [replica_of(op.name) + r * (op.kind == UPDATE) for op in g.ops]
    return strategy_from(g, "fastt", len(cl.devices), [i % 2 for i in range(len(g.ops))], start=start, replicas=r)


@pytest.fixture
def bad_fastt(monkeypatch):
    """The `fastt` planner returns `ping_pong`; the other planners plan as ever."""
    real = decide.plan

    def plan(graph, cl, planner="fastt", *args, **kwargs):
        return ping_pong(graph, cl) if planner == "fastt" else real(graph, cl, planner, *args, **kwargs)
    monkeypatch.setattr(decide, "plan", plan)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "called": getattr(opt, "_opt_called", None)}


def assert_identical(a: dict, b: dict) -> None:
    """Bit for bit: every tensor of the model's and the optimizer's state, and the optimizer's stepped flag."""
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    states = [{p: s for p, s in x["opt"]["state"].items() if s} for x in (a, b)]  # capture reads state[p]: {}
    assert states[0].keys() == states[1].keys()
    for p, s in states[0].items():
        assert s.keys() == states[1][p].keys()
        for k, v in s.items():
            assert torch.equal(v, states[1][p][k]), (p, k)
    assert a["called"] == b["called"]


@pytest.mark.usefixtures("bad_fastt")
def test_a_plan_that_measures_slower_than_dp_is_rolled_back_and_says_so() -> None:
    model, opt, inputs = make()
    step = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2")
    t = step.trial
    assert t is not None and t.steps in range(TRIAL_STEPS, TRIAL_STEPS * ROUNDS + 1, TRIAL_STEPS)
    assert t.kept == step.strategy.planner and t.dp_s is not None and t.one_device_s is not None
    fastest = min(("fastt", t.fastt_plan_s), ("dp", t.dp_s), ("single", t.one_device_s), key=lambda x: x[1])
    assert t.kept == fastest[0] != "fastt"
    if t.kept == "dp":
        assert step.strategy.replicas == 2 and len(step.cluster.devices) == 2
    else:  # one worker device with both cores
        assert len(step.cluster.devices) == 1 and step.threads_per_device == torch.get_num_threads()
    raw = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", trial=False)
    assert raw.trial is None and raw.strategy == ping_pong(raw.graph, raw.cluster)


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "after-a-step"])
@pytest.mark.usefixtures("bad_fastt")
def test_training_after_the_trial_is_the_eager_training(warm: bool) -> None:
    """The trial's steps leave the model, Adam's state (step counters too) and the batch-norm statistics as they
    were, bit for bit; then every step equals the eager step from the same state (rtol 1e-5)."""
    model, opt, inputs = make()
    ref_model, ref_opt, _ = make()
    if warm:  # state that exists before parallelize: moments, counters, moved statistics
        eager_step(model, nn.functional.mse_loss, opt, batch(99))
    before = snapshot(model, opt)
    step = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2")
    assert step.trial is not None  # the trial ran
    assert_identical(before, snapshot(model, opt))
    for i in range(4):
        b = batch(i)
        take_state(model, opt, ref_model, ref_opt)
        expected = eager_reference_step(ref_model, nn.functional.mse_loss, ref_opt, b, step.strategy.replicas)
        torch.testing.assert_close(step(*b), expected, rtol=1e-5, atol=1e-6)
        for (n, x), y in zip(ref_model.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7, msg=lambda m, n=n, i=i: f"step {i}, {n}: {m}")


def test_steps_inside_restored_leave_no_trace() -> None:
    """Eager steps with dropout (random draws) inside `restored`: the model, the optimizer and the generator
    are as before, bit for bit (measuring before planning draws too: docs/design.md, Checkpoints)."""
    model, opt, _ = make()
    model.insert(4, nn.Dropout(0.5))
    eager_step(model, nn.functional.mse_loss, opt, batch(99))
    before, rng = snapshot(model, opt), torch.get_rng_state()
    with restored(model, opt):
        for i in range(2):
            eager_step(model, nn.functional.mse_loss, opt, batch(i))
    assert_identical(before, snapshot(model, opt))
    assert torch.equal(rng, torch.get_rng_state())


def test_no_trial_for_another_planner_trial_false_or_a_plan_that_is_dp(monkeypatch) -> None:
    model, opt, inputs = make()
    assert parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", "single").trial is None
    tuned = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", tune=True, trial=False)
    assert tuned.trial is None and tuned.tuner is not None  # with a trial: test_tune's race before tuning
    real = decide.plan
    monkeypatch.setattr(decide, "plan", lambda graph, cl, planner="fastt", *a, **k: real(graph, cl, "dp"))
    t = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2").trial  # DP races one device alone
    assert t is not None and t.dp_s is None and t.one_device_s is not None
    assert parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", trial=False).trial is None


def test_one_device_on_every_core_trains_as_eager() -> None:
    """The trial's one-device rival: plain PyTorch on all the cores (the eager step, not the runtime), its op times
    measured so; its steps equal the eager steps (rtol 1e-5), and like every plan's they leave `.grad` as it was.
    Under the storage meter it runs through the runtime, whose threads the meter watches."""
    from fastt.runtime.memory import measured_peaks
    from fastt.runtime.step import EAGER, EagerStep, all_cores

    model, opt, inputs = make()
    ref_model, ref_opt, _ = make()
    first = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", "single")
    step = all_cores(model, nn.functional.mse_loss, opt, first.graph, inputs)
    assert isinstance(step, EagerStep) and step.host_seconds() == 0.0
    assert [d.kind for d in step.cluster.devices] == ["cpu"] and step.threads_per_device == torch.get_num_threads()
    assert step.costs.threads == torch.get_num_threads()
    marked = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), marked):
        p.grad = g
    for i in range(3):
        b = batch(i)
        expected = eager_step(ref_model, nn.functional.mse_loss, ref_opt, b)
        if i < 2:
            torch.testing.assert_close(step(*b), expected, rtol=1e-5, atol=1e-6)
        else:  # profiled: the one device busy for the whole step, which it names in a measured trace
            spans: list = []
            loss, busy, reducing = step.profiled(*b, spans=spans)
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
            assert [s[:2] for s in spans] == [(EAGER, 0)] and busy == [spans[0][3] - spans[0][2]] and reducing == [0]
    assert all(p.grad is g for p, g in zip(model.parameters(), marked))
    for (n, x), y in zip(ref_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    assert measured_peaks(step, inputs)[0] > 0  # counted by the runtime's meter (test_memory checks its bytes)
    # Its plan saved and given back (a resumed job) runs the same way on cpu:2: one device, every core, eager.
    again = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", strategy=step.strategy)
    assert len(again.cluster.devices) == 1 and again.threads_per_device == torch.get_num_threads()
    assert isinstance(again, EagerStep)


def test_fastt_run_says_which_plan_the_trial_kept() -> None:
    row = {"planner": "fastt", "measured_iteration_s": 0.13, "simulated_iteration_s": 0.12, "error": -0.08,
           "setup_s": 4.2, "trial": {"fastt_plan_s": 0.146, "dp_s": 0.13, "steps": 3, "kept": "dp"}}
    text = format_run({"model": "mlp", "devices": "cpu:2", "steps": 6, "results": [row], "max_param_rel_diff": None})
    assert "trial: fastt's plan 146.0 ms, dp 130.0 ms a step (3 steps each): kept dp" in text
    assert "setup 4.2 s" in text
    row["trial"] = {"fastt_plan_s": 0.146, "dp_s": None, "steps": 3, "kept": "single", "one_device_s": 0.1}
    text = format_run({"model": "mlp", "devices": "cpu:2", "steps": 6, "results": [row], "max_param_rel_diff": None})
    assert ("trial: fastt's plan 146.0 ms, one device on every core 100.0 ms a step (3 steps each): kept one device "
            "on every core") in text


@pytest.mark.parametrize(("rounds", "kept"), [
    ([[1.0, 2.0]], "first"),  # clear at once: one round
    ([[1.0, 1.1], [1.3, 1.0]], "second"),  # close, then clear: the means of both rounds decide (1.15, 1.05)
    ([[1.0, 1.05], [1.0, 1.1], [1.1, 1.0], [9.0, 0.0]], "first"),  # close every time: ROUNDS rounds, no more
])
def test_a_close_race_runs_again_and_the_means_of_its_rounds_decide(monkeypatch, rounds, kept) -> None:
    from fastt.runtime import trial

    assert ROUNDS == 3
    given = iter(rounds)
    monkeypatch.setattr(trial, "trial_times", lambda contenders, batch, steps, clock: next(given))
    model, opt, inputs = make()
    first = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", "dp", trial=False)
    second = parallelize(model, nn.functional.mse_loss, opt, inputs, "cpu:2", "single", trial=False)
    got = trial.raced(first, lambda dp: second, inputs, 3, alone=lambda: second)
    used = rounds[:min(len(rounds), ROUNDS)]
    assert got is (first if kept == "first" else second)
    assert got.trial.steps == 3 * len(used) and next(given, None) == (rounds[3] if len(rounds) > 3 else None)
    assert got.trial.fastt_plan_s == pytest.approx(sum(r[0] for r in used) / len(used))
    assert got.trial.one_device_s == pytest.approx(sum(r[1] for r in used) / len(used))
