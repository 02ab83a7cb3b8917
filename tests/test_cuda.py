"""The runtime on CUDA devices: plans train as eager PyTorch does on the same GPU (skipped without a GPU).

`cuda:0,0` is two devices on one GPU, each its own stream, so a one-GPU machine runs the multi-device path:
events between streams, hand-offs, allreduces, split ops. Copies between two GPUs need a machine with two.
TF32 is off and cuDNN deterministic here, so both sides compute in full FP32. Eager's batch norm on a GPU is
cuDNN's and the captured step's is ATen's (cuDNN's cannot be traced with fake tensors), which round differently:
one step of resnet50 then differs by up to 7e-2 relative in batch-norm biases that are still near zero. So the
batch-norm models run with cuDNN off on both sides (the same kernels: one step of resnet50 is then bit for bit
eager's), and step by step from the same state, as split plans are on the CPU (tests/test_runtime.py). Every test
prints the difference it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from test_runtime import (
    failing_allreduce_stops_every_device,
    out_of_memory_ends_the_step,
    random_plan,
    same_state,
)

import fastt
from fastt import zoo
from fastt.cluster import cluster
from fastt.plan.common import strategy_from
from fastt.runtime import parallelize
from fastt.runtime.bench import run_planners
from fastt.runtime.reference import batch_like, eager_reference_step, eager_step
from fastt.split import split
from fastt.strategy import Split

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = "cuda:0"
RTOL = 1e-4


@pytest.fixture(autouse=True)
def full_fp32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic = old


@pytest.fixture
def same_kernels():
    """cuDNN off: eager's batch norm then runs ATen's kernel, as the captured step does."""
    with torch.backends.cudnn.flags(enabled=False, deterministic=True, allow_tf32=False):
        yield


def pair(name: str, optimizer: str = "sgd") -> tuple[zoo.Workload, zoo.Workload]:
    """Two copies of a zoo workload with equal weights, on the GPU."""
    ws = [zoo.get(name, "test", optimizer=optimizer, dropout=False) for _ in range(2)]
    ws[1].model.load_state_dict(ws[0].model.state_dict())
    return tuple(dataclasses.replace(w, model=w.model.to(GPU), example_inputs=tuple(x.to(GPU) for x in
                                                                                    w.example_inputs)) for w in ws)


def batch(w: zoo.Workload, seed: int) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(GPU) for x in batch_like(w.example_inputs, seed))


def rel_diff(ref: zoo.Workload, ours: zoo.Workload) -> float:
    """The largest difference of any parameter or buffer, relative to its tensor's largest magnitude."""
    return max(((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item()
               for x, y in zip(ref.model.state_dict().values(), ours.model.state_dict().values())
               if x.is_floating_point() and x.numel())


def test_two_devices_on_one_gpu_are_two_streams() -> None:
    c = cluster("cuda:0,0")
    assert [d.name for d in c.devices] == ["cuda:0", "cuda:0/1"] and c.devices[0].kind == "cuda"
    assert c.devices[0].memory_bytes == torch.cuda.get_device_properties(0).total_memory // 2


@pytest.mark.parametrize(("devices", "planner"), [("cuda:0", "single"), ("cuda:0,0", "dpos"),
                                                  ("cuda:0,0", "heft")])
@pytest.mark.parametrize("name", ["mlp", "transformer", "bert-base", "rnnlm"])
def test_plans_train_as_eager_on_the_gpu(name: str, devices: str, planner: str) -> None:
    ref, ours = pair(name)
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, devices, planner)
    assert step.costs.kind == "cuda" and all(v >= 0 for v in step.costs.seconds.values())
    for i in range(10):
        b = batch(ref, i)
        with torch.backends.cudnn.flags(enabled=name != "rnnlm"):  # the captured LSTM is the native decomposition
            expected = eager_step(ref.model, ref.loss_fn, ref.optimizer, b)
        torch.testing.assert_close(step(*b), expected, rtol=RTOL, atol=1e-5)
    assert all(p.is_cuda for p in ours.model.parameters())
    diff = rel_diff(ref, ours)
    print(f"\n{name} {devices} {planner}: 10 steps, largest relative difference {diff:.2e}")
    assert diff < RTOL


@pytest.mark.parametrize(("devices", "planner"), [("cuda:0", "single"), ("cuda:0,0", "dpos"), ("cuda:0,0", "dp")])
@pytest.mark.parametrize("name", ["resnet50", "inception_v3"])
@pytest.mark.usefixtures("same_kernels")
def test_batch_norm_models_train_as_eager_step_by_step(name: str, devices: str, planner: str) -> None:
    ref, ours = pair(name)
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, devices, planner)
    diffs = []
    for i in range(5):
        same_state(ref, ours)
        b = batch(ref, i)
        eager_reference_step(ref.model, ref.loss_fn, ref.optimizer, b, step.strategy.replicas)
        step(*b)
        diffs.append(rel_diff(ref, ours))
    print(f"\n{name} {devices} {planner}: each step from the same state, largest relative differences "
          + " ".join(f"{x:.1e}" for x in diffs))
    assert max(diffs) < RTOL


def test_data_parallel_on_two_streams_trains_as_eager() -> None:
    """bert-base's loss is a masked mean, so data parallelism weighs each replica's mean by its labelled tokens
    (`fastt.loss`) and trains as the plain one-device step over the whole batch does. (An eager emulation that
    averages the replicas' means is another loss: against it this plan differed by 0.87, H100, 2026-12-05.)"""
    ref, ours = pair("bert-base")
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cuda:0,0", "dp")
    assert step.strategy.replicas == 2
    for i in range(10):
        b = batch(ref, i)
        expected = eager_step(ref.model, ref.loss_fn, ref.optimizer, b)
        torch.testing.assert_close(step(*b), expected, rtol=RTOL, atol=1e-5)
    print(f"\nbert-base cuda:0,0 dp: 10 steps, largest relative difference {rel_diff(ref, ours):.2e}")
    # Attention's key biases get no gradient in exact arithmetic: they hold rounding noise (1e-12 after 10
    # steps on the CPU), which the replicas' sums round otherwise. atol leaves that noise out.
    torch.testing.assert_close(ours.model.state_dict(), ref.model.state_dict(), rtol=RTOL, atol=1e-6)


@pytest.mark.usefixtures("same_kernels")
def test_split_convolutions_on_two_streams_train_as_eager() -> None:
    ref, ours = pair("resnet50")
    g = dataclasses.replace(fastt.capture(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs),
                            recapture=None)
    splits = tuple(Split(op.name, "batch", 2) for op in g.ops if op.target == "aten.convolution_backward.default")
    g2 = g
    for sp in splits:
        g2 = split(g2, sp.op, sp.dim, sp.parts)
    # Part k of every split op on device k, everything else on device 0: hand-offs and joins across streams.
    s = strategy_from(g2, "forced", 2, [op.split[1] if op.split else 0 for op in g2.ops])
    s = dataclasses.replace(s, splits=splits)
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cuda:0,0", strategy=s)
    diffs = []
    for i in range(3):
        same_state(ref, ours)
        b = batch(ref, i)
        eager_step(ref.model, ref.loss_fn, ref.optimizer, b)
        step(*b)
        diffs.append(rel_diff(ref, ours))
    print(f"\nresnet50 split convolutions on cuda:0,0: step by step {diffs}")
    assert max(diffs) < RTOL


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_random_plans_on_two_streams_train_as_eager(name: str, seed: int) -> None:
    """Random placements and orders (data-parallel for odd seeds): every stream waits for what it reads."""
    ref, ours = pair(name)
    replicas = 1 + seed % 2
    s = random_plan(ours, replicas, random.Random(seed))
    step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cuda:0,0", strategy=s)
    for i in range(3):
        b = batch(ref, i)
        eager_reference_step(ref.model, ref.loss_fn, ref.optimizer, b, replicas)
        step(*b)
    diff = rel_diff(ref, ours)
    print(f"\n{name} random plan {seed}: largest relative difference {diff:.2e}")
    assert diff < RTOL


def test_tuning_on_the_gpu_keeps_training_exact() -> None:
    def make() -> tuple:
        w = zoo.get("transformer", "test", dropout=False)
        return w.name, w.model, w.loss_fn, w.optimizer, w.example_inputs

    out = run_planners(make, "cuda:0,0", ["fastt"], steps=12, check=True, tune=True)
    r = out["results"][0]
    print(json.dumps(out))
    assert r["tuning"] and all(t["measured_s"] > 0 for t in r["tuning"])
    assert out["max_param_rel_diff"] < RTOL


def test_a_failing_allreduce_on_the_gpu_stops_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ours = pair("mlp")
    failing_allreduce_stops_every_device(ours, "cuda:0,0", monkeypatch)


def test_a_stream_that_runs_out_of_memory_ends_the_step_naming_it_and_its_peak() -> None:
    """The caching allocator's own torch.OutOfMemoryError (4 EiB asked for on the second stream's device)."""
    _, ours = pair("mlp")
    out_of_memory_ends_the_step(ours, "cuda:0,0", None)


def test_parallelize_needs_the_model_on_the_gpu() -> None:
    w = zoo.get("mlp", "test")
    with pytest.raises(fastt.FasttError, match="move them there first"):
        parallelize(w.model, w.loss_fn, w.optimizer, w.example_inputs, "cuda:0")


def test_fastt_run_on_the_gpu_reports_times_and_trains_as_eager() -> None:
    out = subprocess.run([sys.executable, "-m", "fastt.cli", "run", "--model", "bert-base", "--devices",
                          "cuda:0,0", "--planners", "fastt,dp,single,eager", "--steps", "10", "--check", "--json"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
    res = json.loads(out.stdout)
    print(json.dumps(res))
    assert [r["planner"] for r in res["results"]] == ["fastt", "dp", "single", "eager"]
    assert all(r["measured_iteration_s"] > 0 for r in res["results"])
    assert res["max_param_rel_diff"] < RTOL


@pytest.mark.parametrize("name", ["mlp", "bert-base"])
def test_bf16_plans_on_two_streams_train_as_eager_autocast(name: str) -> None:
    """--precision bf16 on the GPU: the step captured under CUDA's autocast (bf16 tensor cores where the GPU
    has them) trains under data parallelism and DPOS's plan as eager under the same autocast, step by step
    from the same state, within bf16's unit (as on the CPU, tests/test_precision.py)."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")

    def make() -> tuple:
        torch.manual_seed(0)
        w = zoo.get(name, "test", dropout=False)
        return w.name, w.model, w.loss_fn, w.optimizer, w.example_inputs

    out = run_planners(make, "cuda:0,0", ["dp", "dpos"], 3, check=True, trial=False, autocast=torch.bfloat16)
    print(json.dumps(out))
    assert out["precision"] == "bf16" and out["max_param_rel_diff"] < 2.0**-8
