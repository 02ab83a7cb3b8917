"""Checkpoint and resume: the model's, the optimizer's and the LR scheduler's state_dicts saved mid-training (and
the plan: `step.strategy`), loaded into a fresh model, optimizer and step, give after the same further steps bit
for bit the state of the uninterrupted run, in this process, in a fresh one and under torchrun; a run killed
mid-training or mid-save loses nothing it checkpointed (`fastt.checkpoint.save` is atomic).

The plan travels with the checkpoint because the `fastt` planner plans from op times measured at the start, so a
fresh process may pick another plan, and another plan sums in another order: equal to rounding, not bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from resume_run import WORKLOADS, load, state, train

import fastt
from fastt.runtime import parallelize
from fastt.runtime.reference import eager_step

STEPS, SAVED_AT = 8, 3
SCRIPT = str(Path(__file__).parent / "resume_run.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def assert_identical(a: dict, b: dict) -> None:
    """Two state_dicts equal: every tensor bit for bit (dtype included), everything else =="""
    assert a.keys() == b.keys()
    for k, x in a.items():
        y = b[k]
        if isinstance(x, dict):
            assert isinstance(y, dict), k
            assert_identical(x, y)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), k
        else:
            assert x == y, k


CASES = [(w, p, "load, then parallelize", 1) for w in WORKLOADS for p in ("dp", "fastt")]
CASES += [("cnn-bn-sgd-steplr", "fastt", "parallelize, then load", 1)]
CASES += [("cnn-bn-sgd-steplr", "dp", "load, then parallelize", 2)]  # micro-batches


@pytest.mark.parametrize(("workload", "planner", "order", "accumulate"), CASES)
def test_a_fresh_model_optimizer_and_step_resume_bit_for_bit(workload: str, planner: str, order: str,
                                                             accumulate: int, tmp_path: Path) -> None:
    make = WORKLOADS[workload]
    model, loss_fn, opt, sched, inputs = make(STEPS)
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", planner, clip_grad_norm=1.0, accumulate=accumulate)
    train(step, sched, inputs, range(SAVED_AT))
    fastt.checkpoint.save({**state(model, opt, sched), "strategy": step.strategy.to_json()}, tmp_path / "ck.pt")
    train(step, sched, inputs, range(SAVED_AT, STEPS))

    ck = torch.load(tmp_path / "ck.pt")  # weights_only: tensors and plain data
    model2, loss_fn2, opt2, sched2, inputs2 = make(STEPS)
    # The plan goes back in, except with micro-batches: they are data parallelism's, planned the same anew.
    again = {"accumulate": accumulate} if accumulate > 1 else {"strategy": fastt.Strategy.from_json(ck["strategy"])}
    if order == "load, then parallelize":
        load(ck, model2, opt2, sched2)
    step2 = parallelize(model2, loss_fn2, opt2, inputs2, "cpu:2", planner, clip_grad_norm=1.0, **again)
    if order == "parallelize, then load":
        load(ck, model2, opt2, sched2)
    train(step2, sched2, inputs2, range(SAVED_AT, STEPS))
    assert_identical(state(model, opt, sched), state(model2, opt2, sched2))


def script(where: Path, out: str, *args: str, distributed: bool = False) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                if distributed else [sys.executable])
    return [*launcher, SCRIPT, str(where), out, *args, *(["--distributed"] if distributed else [])]


def run(cmd: list[str], timeout: float = 60) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_fresh_process_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The checkpoint of a run planned by `fastt`, resumed by another process that plans nothing."""
    assert "saved 3" in run(script(tmp_path, "whole.pt", "--planner", "fastt"))
    run(script(tmp_path, "resumed.pt", "--planner", "fastt", "--resume"))
    assert_identical(torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt"))


LONG = ("--steps", "40", "--save", "every")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The final state of 40 uninterrupted steps, from a process of its own."""
    where = tmp_path_factory.mktemp("uninterrupted")
    run(script(where, "whole.pt", "--steps", "40", "--save", "0"))
    return torch.load(where / "whole.pt")


def test_a_run_killed_mid_training_loses_nothing_it_checkpointed(tmp_path: Path, uninterrupted: dict) -> None:
    """SIGKILL once the third checkpoint is written (the run is in a later step or saving the next one): the run
    resumed from whatever checkpoint is there ends as the uninterrupted one."""
    p = subprocess.Popen(script(tmp_path, "never.pt", *LONG), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=ENV)
    try:
        for line in p.stdout:
            if line.strip() == "saved 3":
                p.send_signal(signal.SIGKILL)
                break
        assert p.wait(timeout=60) == -signal.SIGKILL, p.stderr.read()[-3000:]
    finally:
        p.kill()
        p.communicate()
    assert 3 <= torch.load(tmp_path / "ckpt.pt")["step"] < 40
    run(script(tmp_path, "resumed.pt", *LONG, "--resume"))
    assert_identical(uninterrupted, torch.load(tmp_path / "resumed.pt"))


def test_a_run_killed_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, uninterrupted: dict) -> None:
    """Killed halfway through writing checkpoint 4: checkpoint 3 is whole, and the run resumed from it ends as
    the uninterrupted one."""
    r = subprocess.run(script(tmp_path, "never.pt", *LONG, "--die-saving", "4"), capture_output=True, text=True,
                       env=ENV, timeout=60, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert (tmp_path / "ckpt.pt.tmp").stat().st_size > 0  # the half-written one
    assert torch.load(tmp_path / "ckpt.pt")["step"] == 3
    run(script(tmp_path, "resumed.pt", *LONG, "--resume"))
    assert_identical(uninterrupted, torch.load(tmp_path / "resumed.pt"))


@pytest.mark.parametrize("planner", ["dp", "fastt", "zero"])
def test_torchrun_resumes_bit_for_bit(planner: str, tmp_path: Path) -> None:
    """2 gloo ranks: rank 0 checkpoints its model (the truth); every rank of a new job loads the checkpoint.
    Under zero rank 0 holds the whole optimizer state, rank 1 its rows; both take the whole from the
    checkpoint."""
    # --trial-steps 0: fastt's race against DP comes before any checkpoint (the resumed job runs the checkpoint's
    # plan and races nothing), so it is not what this checks, and the job is shorter without it.
    run(script(tmp_path, "whole.pt", "--planner", planner, "--trial-steps", "0", distributed=True), timeout=90)
    run(script(tmp_path, "resumed.pt", "--planner", planner, "--resume", distributed=True), timeout=90)
    assert_identical(torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt"))


def test_checkpoints_move_between_eager_pytorch_and_fastt(tmp_path: Path) -> None:
    """A checkpoint of plain eager training resumes under fastt's one-device plan as eager would go on, and
    fastt's resumes in eager: the same state_dicts (Adam's step counters float32 tensors, as eager keeps them)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker device's threads: the same kernels as the eager loop's
    try:
        make = WORKLOADS["cnn-bn-adamw-cosine"]
        model, loss_fn, opt, sched, inputs = make(STEPS)
        eager = lambda *b: eager_step(model, loss_fn, opt, b, clip_grad_norm=1.0)
        train(eager, sched, inputs, range(SAVED_AT))
        fastt.checkpoint.save(state(model, opt, sched), tmp_path / "eager.pt")
        train(eager, sched, inputs, range(SAVED_AT, STEPS))

        model2, loss_fn2, opt2, sched2, inputs2 = make(STEPS)
        load(torch.load(tmp_path / "eager.pt"), model2, opt2, sched2)
        step = parallelize(model2, loss_fn2, opt2, inputs2, "cpu:2", "single", clip_grad_norm=1.0)
        train(step, sched2, inputs2, range(SAVED_AT, STEPS - 2))
        assert all(s["step"].dtype == torch.float32 for s in opt2.state.values())
        fastt.checkpoint.save(state(model2, opt2, sched2), tmp_path / "fastt.pt")

        model3, loss_fn3, opt3, sched3, inputs3 = make(STEPS)
        load(torch.load(tmp_path / "fastt.pt"), model3, opt3, sched3)
        train(lambda *b: eager_step(model3, loss_fn3, opt3, b, clip_grad_norm=1.0), sched3, inputs3,
              range(STEPS - 2, STEPS))
        assert_identical(state(model, opt, sched), state(model3, opt3, sched3))
    finally:
        torch.set_num_threads(old)
