"""`fastt run`'s training options: --clip-grad-norm clips on cpu:N as under torchrun (and in eager's check);
bad options are one error line, before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_distributed import MODELS, fastt_run


def test_clip_grad_norm_reaches_the_local_run_and_its_check(tmp_path: Path) -> None:
    """Clipped to 0.01 (the test MLP's gradients are far larger): fastt's step and eager's check both clip."""
    r = fastt_run("--model", "mlp", "--planners", "dp,fastt", "--steps", "3", "--check", "--clip-grad-norm", "0.01",
                  "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["clip_grad_norm"] == 0.01 and out["max_param_rel_diff"] <= 1e-5


@pytest.mark.parametrize(("args", "said"), [
    (["--clip-grad-norm", "-1"], "clip_grad_norm must be a positive number"),
    (["--data", f"{MODELS}:tokens"], "--data trains one shard of every batch per rank: use it with --launcher"),
    (["--data", "nowhere.py:tokens", "--launcher", "torchrun"], "--data nowhere.py:tokens: not path/to/file.py"),
    (["--data", f"{MODELS}:masked", "--launcher", "torchrun", "--planners", "dp", "--steps", "1"],
     "returned tuple, not a torch.utils.data.Dataset"),
])
def test_bad_training_options_are_one_error_line(args: list[str], said: str, tmp_path: Path) -> None:
    r = fastt_run("--model", "mlp", *args, cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
