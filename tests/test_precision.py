"""Mixed precision: a step captured under torch.autocast trains as eager PyTorch under the same autocast, and
the cost model and the CLI know what bf16 changes."""

import pytest
import torch

import fastt
from fastt import zoo
from fastt.capture import capture_step, fused_kernels
from fastt.cli import main
from fastt.cost import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, efficiency, op_times
from fastt.errors import FasttError
from fastt.runtime import reference

RECURRENT = ("rnnlm", "gnmt")
# bf16 keeps 8 significant bits: one rounding moves a value by at most 2**-8 of itself. Where the captured
# step is not the same aten ops as eager's (see NOT_EXACT), a gradient may round once otherwise; from the same
# state (a check per step), no parameter may then move by more than that unit of its tensor's largest value.
BF16_UNIT = 2.0**-8
# Bit for bit unless listed: these compute some ops otherwise than eager does. The Llama's SiLU and DLRM's
# loss are differentiated through their decompositions (tests/test_capture.py: DECOMPOSED_ADAM); the LSTMs'
# cells and the transformer's attention differ in their last bits under autocast only (fp32: exact). DLRM's
# loss is computed in fp32 as eager's autocast computes it (`precision._at_the_op`), its decomposition
# summing in another order.
NOT_EXACT = {"transformer", "rnnlm", "gnmt", "llama", "dlrm"}


def _eager_autocast_step(w: zoo.Workload, batch: tuple, dtype: torch.dtype) -> torch.Tensor:
    return reference.eager_step(w.model, w.loss_fn, w.optimizer, batch, autocast=dtype)


@pytest.mark.parametrize("name", zoo.DISTINCT)
def test_bf16_step_matches_eager_autocast(name: str) -> None:
    """Every zoo model at test size, two steps, each from the same state: bit for bit, or within bf16's
    unit where the ops differ."""
    ref = zoo.get(name, "test", optimizer="sgd", dropout=False)
    ours = zoo.get(name, "test", optimizer="sgd", dropout=False)
    ours.model.load_state_dict(ref.model.state_dict())
    step = capture_step(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, autocast=torch.bfloat16)
    assert step.autocast is torch.bfloat16
    dtypes = {n.meta["val"].dtype for n in step.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert torch.bfloat16 in dtypes  # the graph holds autocast's casts and low-precision tensors
    with fused_kernels(name not in RECURRENT):
        for i in range(2):
            reference.take_state(ours.model, ours.optimizer, ref.model, ref.optimizer)
            batch = reference.batch_like(ref.example_inputs, i)
            expected = _eager_autocast_step(ref, batch, torch.bfloat16)
            got = step.run(ours.model, ours.optimizer, *batch)
            diff = reference.max_param_rel_diff(ref.model, ours.model)
            if name in NOT_EXACT:
                assert diff < BF16_UNIT, (name, i, diff)
                # DLRM's bf16 loss: its batch mean rounds at every partial sum, a few units at most
                torch.testing.assert_close(got.float(), expected.float(), rtol=4 * BF16_UNIT, atol=0)
            else:
                assert diff == 0.0, (name, i, diff)
                assert torch.equal(got, expected)
    # master weights and optimizer state stay fp32, as autocast leaves them
    assert {p.dtype for p in ours.model.parameters()} == {torch.float32}
    assert {v.dtype for st in ours.optimizer.state.values() for v in st.values()} == {torch.float32}


def test_attention_with_dropout_traces_under_autocast_as_eager_computes_it() -> None:
    """With dropout, scaled dot-product attention takes its math path, which eager runs in fp32 on bf16
    inputs; torch.func.grad would cast its inside again and fail ("expected scalar type BFloat16 but found
    Float"). DistilBERT (SDPA called directly) trains bit for bit as eager, dropout masks included (the same
    seed draws the same masks); nn.MultiheadAttention (SDPA inside F.multi_head_attention_forward) traces,
    its attention's products in fp32 as eager's."""
    ref = zoo.get("distilbert-padded", "test", optimizer="sgd", dropout=True)
    ours = zoo.get("distilbert-padded", "test", optimizer="sgd", dropout=True)
    ours.model.load_state_dict(ref.model.state_dict())
    step = capture_step(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, autocast=torch.bfloat16)
    for i in range(2):
        batch = reference.batch_like(ref.example_inputs, i)
        torch.manual_seed(i)
        expected = _eager_autocast_step(ref, batch, torch.bfloat16)
        torch.manual_seed(i)
        assert torch.equal(step.run(ours.model, ours.optimizer, *batch), expected)
        assert reference.max_param_rel_diff(ref.model, ours.model) == 0.0
    w = zoo.get("transformer", "test", optimizer="sgd", dropout=True)
    gm = capture_step(w.model, w.loss_fn, w.optimizer, w.example_inputs, autocast=torch.bfloat16).gm
    products = [n.meta["val"].dtype for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert products and set(products) == {torch.float32}
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


@pytest.mark.parametrize("name", ["mlp", "bert-base"])
def test_fp16_step_matches_eager_autocast(name: str) -> None:
    ref = zoo.get(name, "test", optimizer="adam", dropout=False)
    ours = zoo.get(name, "test", optimizer="adam", dropout=False)
    ours.model.load_state_dict(ref.model.state_dict())
    step = capture_step(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, autocast=torch.float16)
    for i in range(2):
        batch = reference.batch_like(ref.example_inputs, i)
        expected = _eager_autocast_step(ref, batch, torch.float16)
        assert torch.equal(step.run(ours.model, ours.optimizer, *batch), expected)
    assert reference.max_param_rel_diff(ref.model, ours.model) == 0.0


def test_bf16_graph_carries_smaller_activations_and_fp32_residents() -> None:
    """Activations that autocast makes bf16 take half the bytes; parameters and optimizer state do not."""
    w = zoo.get("bert-large", "paper")
    fp32 = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    bf16 = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, autocast=torch.bfloat16)
    assert bf16.resident_bytes() == fp32.resident_bytes()
    moved = [sum(sum(op.in_bytes) for op in g.ops if op.kind == "compute") for g in (fp32, bf16)]
    assert moved[1] < 0.8 * moved[0]
    mm = [op for op in bf16.ops if op.flops and "mm" in op.target]
    assert mm and {op.dtype for op in mm} == {"bfloat16"}


def test_matmuls_are_costed_at_the_tensor_core_peak_and_elementwise_at_bandwidth() -> None:
    w = zoo.get("bert-large", "paper")
    graphs = {dt: fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, autocast=dt)
              for dt in (None, torch.bfloat16)}
    a100 = fastt.cluster("1xA100")
    dev = a100.devices[0]
    for dt, g in graphs.items():
        t = op_times(g, a100)[:, 0]
        for i, op in enumerate(g.ops):
            if op.flops and op.target.startswith("aten.mm"):
                peak = 312e12 if dt is torch.bfloat16 else 19.5e12  # A100 data sheet: bf16 dense, fp32
                want = dev.op_overhead_s + (op.flops / peak / efficiency(op.flops, MATMUL_EFFICIENCY)
                                            + op.io_bytes / dev.mem_bandwidth / efficiency(op.io_bytes, MEMORY_EFFICIENCY))
                assert t[i] == pytest.approx(want)
            elif op.kind == "compute" and not op.flops:
                want = dev.op_overhead_s + op.io_bytes / dev.mem_bandwidth / efficiency(op.io_bytes, MEMORY_EFFICIENCY)
                assert t[i] == pytest.approx(want)


def test_bf16_on_a_v100_is_refused_naming_fp16(capsys) -> None:
    assert main(["plan", "--model", "mlp", "--size", "test", "--cluster", "4xV100", "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fp16" in err
    w = zoo.get("mlp", "test")
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, autocast=torch.bfloat16)
    with pytest.raises(FasttError, match="fp16"):
        fastt.plan(g, "4xV100", "dp")
    assert main(["plan", "--model", "mlp", "--size", "test", "--cluster", "4xV100", "--precision", "fp16"]) == 0


def test_an_autocast_dtype_fastt_does_not_capture_is_refused() -> None:
    w = zoo.get("mlp", "test")
    with pytest.raises(FasttError, match="bfloat16"):
        capture_step(w.model, w.loss_fn, w.optimizer, w.example_inputs, autocast=torch.float64)


def test_an_enabled_grad_scaler_is_refused_in_one_line_before_any_work() -> None:
    """fp16 with torch.amp.GradScaler (issue 19): the captured step has no loss scaling, inf/nan check or skipped
    update, so both runtimes' parallelize refuse an enabled scaler at once (before a capture or a process
    group), and anything else that is not a scaler; a disabled one (a no-op in an eager loop too) trains as no
    scaler does."""
    from fastt.runtime import parallelize
    from fastt.runtime.distributed import parallelize_distributed

    w = zoo.get("mlp", "test", dropout=False)
    for run in (parallelize, parallelize_distributed):
        with pytest.raises(FasttError, match=r"^fastt does not capture torch.amp.GradScaler's loss scaling yet: "
                                             r".*scaler.step\(optimizer\) have nothing to act on; train with "
                                             r"autocast=torch.bfloat16") as e:
            run(w.model, w.loss_fn, w.optimizer, w.example_inputs, autocast=torch.float16,
                grad_scaler=torch.amp.GradScaler("cpu"))
        assert "\n" not in str(e.value)
        with pytest.raises(FasttError, match="grad_scaler must be a torch.amp.GradScaler or None, got dict"):
            run(w.model, w.loss_fn, w.optimizer, w.example_inputs, grad_scaler={})
    before = [p.clone() for p in w.model.parameters()]
    step = parallelize(w.model, w.loss_fn, w.optimizer, w.example_inputs, "cpu:2", "dp", trial=False,
                       autocast=torch.float16, grad_scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert torch.isfinite(step(*w.example_inputs))
    assert not all(torch.equal(a, b) for a, b in zip(before, w.model.parameters()))


def test_bf16_plans_run_on_cpu_worker_devices_as_eager_autocast() -> None:
    """On cpu:2, data parallelism and DPOS's plan train in bf16 as eager under the same autocast, step by step
    from the same state (DP's mean sums in replica order, another order than one device's kernel)."""
    from fastt.runtime.bench import run_planners

    def make() -> tuple:
        torch.manual_seed(0)
        w = zoo.get("mlp", "test", dropout=False)
        return w.name, w.model, w.loss_fn, w.optimizer, w.example_inputs

    out = run_planners(make, "cpu:2", ["dp", "dpos"], 3, check=True, trial=False, autocast=torch.bfloat16)
    assert out["precision"] == "bf16"
    assert out["max_param_rel_diff"] < BF16_UNIT
    assert all(r["simulated_iteration_s"] > 0 for r in out["results"])
