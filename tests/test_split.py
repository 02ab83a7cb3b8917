"""Operation splitting: every rule of the table against the whole aten op, and the split pass on captured graphs."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastt
from fastt import zoo
from fastt.cluster import cluster
from fastt.cost import op_times
from fastt.errors import FasttError
from fastt.graph import OpGraph, data_parallel_graph, without_unplaced_updates
from fastt.plan.common import strategy_from
from fastt.simulate import simulate
from fastt.split import RULES, max_parts, run_split, split, split_size, splittable

aten = torch.ops.aten
N, C, K = 5, 7, 9  # batch, channels/cols, reduction: 5 and 7 split unevenly into 2..4 parts
Case = Callable[[], tuple[list[Any], dict[str, Any]]]


def r(*shape: int) -> torch.Tensor:
    return torch.randn(shape)


def pos(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) + 0.1


def _conv_bwd(bias: bool, mask: list[bool]) -> Case:
    def make() -> tuple[list[Any], dict[str, Any]]:
        x, w = r(N, 3, 8, 8), r(C, 3, 3, 3)
        return [r(N, C, 4, 4), x, w, [C] if bias else None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, mask], {}
    return make


def _layer_norm(norm: list[int]) -> tuple[Case, Case]:
    x, w, b = r(N, C, 6), r(*norm), r(*norm)

    def fwd() -> tuple[list[Any], dict[str, Any]]:
        return [x, norm, w, b, 1e-5], {}

    def bwd() -> tuple[list[Any], dict[str, Any]]:
        _, mean, rstd = aten.native_layer_norm.default(x, norm, w, b, 1e-5)
        return [r(N, C, 6), x, norm, mean, rstd, w, b, [True, True, True]], {}
    return fwd, bwd


def _batch_norm(training: bool) -> tuple[Case, Case]:
    x = r(N, C, 4, 4)
    stats = [r(C), r(C), torch.zeros(C), torch.ones(C)]

    def fwd() -> tuple[list[Any], dict[str, Any]]:
        return [x, *[s.clone() for s in stats], training, 0.1, 1e-5], {}

    def bwd() -> tuple[list[Any], dict[str, Any]]:
        w, b, rm, rv = (s.clone() for s in stats)
        _, mean, invstd = aten.native_batch_norm.default(x, w, b, rm, rv, training, 0.1, 1e-5)
        return [r(N, C, 4, 4), x, w, rm, rv, mean, invstd, training, 1e-5, [True, True, True]], {}
    return fwd, bwd


def _pool() -> tuple[Case, Case, Case, Case]:
    x = r(N, C, 8, 8)
    out, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    avg = aten.avg_pool2d.default(x, [3, 3], [2, 2], [1, 1])
    return ((lambda: ([x, [2, 2], [2, 2]], {})),
            (lambda: ([r(*out.shape), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx], {})),
            (lambda: ([x, [3, 3], [2, 2], [1, 1]], {})),
            (lambda: ([r(*avg.shape), x, [3, 3], [2, 2], [1, 1], False, True, None], {})))


def _nll(reduction: int, weighted: bool) -> tuple[Case, Case]:
    logp = torch.log_softmax(r(N, C), 1)
    target = torch.tensor([0, 3, -100, 6, 3]) if not weighted else torch.randint(0, C, (N,))
    weight = pos(C) if weighted else None
    _, total = aten.nll_loss_forward.default(logp, target, weight, reduction, -100)
    return ((lambda: ([logp, target, weight, reduction, -100], {})),
            (lambda: ([r(), logp, target, weight, reduction, -100, total], {})))


_UNARY = (aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
          aten.exp.default, aten.neg.default, aten.sin.default, aten.cos.default, aten.clone.default)
_BINARY = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
           aten.gelu_backward.default, aten.silu_backward.default, aten.sigmoid_backward.default,
           aten.tanh_backward.default)
_LN_FWD, _LN_BWD = _layer_norm([6])
_LN2_FWD, _LN2_BWD = _layer_norm([C, 6])
_BN_TRAIN, _BN_TRAIN_BWD = _batch_norm(True)
_BN_EVAL, _BN_EVAL_BWD = _batch_norm(False)
_MAXPOOL, _MAXPOOL_BWD, _AVGPOOL, _AVGPOOL_BWD = _pool()
_NLL_SUM, _NLL_SUM_BWD = _nll(2, weighted=True)
_NLL_MEAN, _NLL_MEAN_BWD = _nll(1, weighted=False)

_SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _sdpa(causal: bool, mask: bool) -> tuple[Case, Case]:
    """SDPA on [batch, 5 heads, 6 positions, head dim 4] and its backward, with a mask the same for every
    head (size 1 along the heads) or none."""
    def qkv() -> tuple[list[Any], dict[str, Any]]:
        kw = {"attn_mask": r(N, 1, 6, 6), "scale": 0.3} if mask else {}
        return [r(N, 5, 6, 4), r(N, 5, 6, 4), r(N, 5, 6, 4), 0.0, causal], kw

    def bwd() -> tuple[list[Any], dict[str, Any]]:
        (q, k, v, p, c), kw = qkv()
        out, lse = _SDPA(q, k, v, p, c, **kw)
        return [r(N, 5, 6, 4), q, k, v, out, lse, p, c], kw
    return qkv, bwd


CASES: list[tuple[Any, Case]] = [
    (aten.convolution.default, lambda: ([r(N, 3, 8, 8), r(C, 3, 3, 3), r(C), [1, 1], [1, 1], [1, 1], False,
                                         [0, 0], 1], {})),
    (aten.convolution.default, lambda: ([r(N, 4, 8, 8), r(6, 2, 3, 3), None, [2, 2], [0, 0], [1, 1], False,
                                         [0, 0], 2], {})),  # grouped: batch only
    (aten.convolution_backward.default, _conv_bwd(True, [True, True, True])),
    (aten.convolution_backward.default, _conv_bwd(False, [False, True, False])),
    (aten.mm.default, lambda: ([r(N, K), r(K, C)], {})),
    (aten.addmm.default, lambda: ([r(C), r(N, K), r(K, C)], {})),
    (aten.addmm.default, lambda: ([r(N, C), r(N, K), r(K, C)], {"beta": 0.5, "alpha": 2.0})),
    (aten.addmm.default, lambda: ([r(1, C), r(N, K), r(K, C)], {})),
    (aten.bmm.default, lambda: ([r(N, 6, K), r(N, K, C)], {})),
    (aten.baddbmm.default, lambda: ([r(N, 6, C), r(N, 6, K), r(N, K, C)], {"beta": 0.5, "alpha": 2.0})),
    (aten.baddbmm.default, lambda: ([r(C), r(N, 6, K), r(N, K, C)], {})),
    *[(op, lambda: ([r(N, C, 3)], {})) for op in _UNARY],
    (aten._to_copy.default, lambda: ([r(N, C, 3)], {"dtype": torch.bfloat16})),  # autocast's cast
    (aten.gelu.default, lambda: ([r(N, C)], {"approximate": "tanh"})),
    (aten.sqrt.default, lambda: ([pos(N, C)], {})),
    (aten.rsqrt.default, lambda: ([pos(N, C)], {})),
    (aten.pow.Tensor_Scalar, lambda: ([r(N, C), 2], {})),
    *[(op, lambda: ([r(N, C, 3), r(N, C, 3)], {})) for op in _BINARY[4:]],
    (aten.threshold_backward.default, lambda: ([r(N, C), r(N, C), 0.0], {})),
    (aten.gelu_backward.default, lambda: ([r(N, C), r(N, C)], {"approximate": "tanh"})),
    *[(op, lambda: ([r(N, C, 3), r(C, 3)], {})) for op in _BINARY[:4]],  # a broadcast operand stays whole
    *[(op, lambda: ([r(N, 1, 3), pos(N, C, 3)], {})) for op in _BINARY[:4]],
    *[(op, lambda: ([r(N, C), 1.5], {})) for op in (aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar,
                                                    aten.div.Scalar)],
    (aten.where.self, lambda: ([r(N, C) > 0, r(N, C), r(C)], {})),
    # elementwise along dim2 too (a transformer's hidden dim): 3-d cases of the ops above tested in 2-d
    (aten.where.self, lambda: ([r(N, C, 3) > 0, r(N, C, 3), r(3)], {})),
    (aten.threshold_backward.default, lambda: ([r(N, C, 3), r(N, C, 3), 0.0], {})),
    (aten.sqrt.default, lambda: ([pos(N, C, 3)], {})),
    (aten.rsqrt.default, lambda: ([pos(N, C, 3)], {})),
    (aten.pow.Tensor_Scalar, lambda: ([r(N, C, 3), 3], {})),
    *[(op, lambda: ([r(N, C, 3), 1.5], {})) for op in (aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar,
                                                       aten.div.Scalar)],
    *[(op, lambda d=d: ([r(N, C, 4), d, False], {})) for op in (aten._softmax.default, aten._log_softmax.default)
      for d in (-1, 1, 0)],
    (aten._safe_softmax.default, lambda: ([r(N, C, 4), -1], {})),
    *[(bwd, lambda f=fwd, d=d: ([r(N, C, 4), f(r(N, C, 4), d, False), d, torch.float32], {}))
      for fwd, bwd in ((aten._softmax.default, aten._softmax_backward_data.default),
                       (aten._log_softmax.default, aten._log_softmax_backward_data.default)) for d in (-1, 0)],
    (aten.native_layer_norm.default, _LN_FWD),
    (aten.native_layer_norm.default, _LN2_FWD),
    (aten.native_layer_norm_backward.default, _LN_BWD),
    (aten.native_layer_norm_backward.default, _LN2_BWD),
    *[(op, case) for op in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default)
      for case in (_BN_TRAIN, _BN_EVAL)],
    (aten.native_batch_norm_backward.default, _BN_TRAIN_BWD),
    (aten.native_batch_norm_backward.default, _BN_EVAL_BWD),
    (aten.embedding.default, lambda: ([r(11, 4), torch.randint(0, 11, (N, C))], {})),
    (aten.embedding_dense_backward.default, lambda: ([r(N, C, 4), torch.randint(0, 11, (N, C)), 11, -1, False],
                                                     {})),
    (aten.embedding_dense_backward.default, lambda: ([r(N, C, 4), torch.randint(0, 11, (N, C)), 11, 2, False],
                                                     {})),
    (aten.max_pool2d_with_indices.default, _MAXPOOL),
    (aten.max_pool2d_with_indices_backward.default, _MAXPOOL_BWD),
    (aten.avg_pool2d.default, _AVGPOOL),
    (aten.avg_pool2d_backward.default, _AVGPOOL_BWD),
    (aten.mean.dim, lambda: ([r(N, C, 4, 4), [-1, -2], True], {})),
    (aten.mean.dim, lambda: ([r(N, C, 4), [2]], {})),
    (aten.sum.dim_IntList, lambda: ([r(N, C), [0]], {})),
    (aten.sum.dim_IntList, lambda: ([r(N, C), [0], True], {})),  # a bias gradient, split along dim1
    (aten.sum.dim_IntList, lambda: ([r(N, C, 3), [2], True], {})),
    (aten.nll_loss_forward.default, _NLL_SUM),
    (aten.nll_loss_backward.default, _NLL_SUM_BWD),
    (aten.nll_loss_backward.default, _NLL_MEAN_BWD),
    *[(op, case) for causal, mask in ((False, False), (True, False), (False, True))
      for op, case in zip((_SDPA, _SDPA_BWD), _sdpa(causal, mask))],
]


def _clone(x: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _close(got: Any, want: Any, tol: tuple[float, float] = (1e-5, 1e-6)) -> None:
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1])


def _tensors(args: list[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize(("target", "make"), CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(CASES)])
def test_rule_matches_whole_op(target: Any, make: Case) -> None:
    """Every dim the rule allows for these args, 2..4 parts: the joined parts equal the whole op, in-place
    updates (batch-norm running stats) included."""
    torch.manual_seed(0)
    args, kwargs = make()
    tried = 0
    for dim in RULES[target]:
        size = split_size(target, dim, args, kwargs)
        for parts in range(2, min(4, size) + 1):
            whole_args, part_args = _clone(args), _clone(args)
            want = target(*whole_args, **kwargs)
            _close(run_split(target, part_args, kwargs, dim, parts), want)
            _close(_tensors(part_args), _tensors(whole_args))
            tried += 1
    assert tried, f"no rule of {target} applies to this case"


def test_matmul_parts_read_a_transposed_weight_as_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear layer's weight reaches addmm transposed: its parts read their slices as views, never copies
    (a copy of a transposed slice costs four times the part's product), and still join to the whole op."""
    import fastt.split as sp

    torch.manual_seed(0)
    bias, x, weight = r(16), r(8, 12), r(16, 12)
    args = [bias, x, weight.t()]
    seen: list[torch.Tensor] = []
    run = sp._call
    monkeypatch.setattr(sp, "_call", lambda target, a, kw: (seen.extend(_tensors(a)), run(target, a, kw))[1])
    storages = {t.untyped_storage().data_ptr() for t in (bias, x, weight)}
    for dim in RULES[aten.addmm.default]:
        seen.clear()
        _close(run_split(aten.addmm.default, args, {}, dim, 2), aten.addmm.default(*args))
        assert {t.untyped_storage().data_ptr() for t in seen} <= storages, dim


def test_every_rule_is_tested() -> None:
    """Each (op, dim) of the table is exercised by some case, and each case with uneven parts."""
    torch.manual_seed(0)
    covered: set[tuple[Any, str]] = set()
    for target, make in CASES:
        args, kwargs = make()
        covered |= {(target, d) for d in RULES[target] if split_size(target, d, args, kwargs) >= 3}
    missing = {(t, d) for t, dims in RULES.items() for d in dims} - covered
    assert not missing, sorted(map(str, missing))


def test_inexact_splits_are_refused() -> None:
    x = r(N, C, 4, 4)
    train = [x, r(C), r(C), torch.zeros(C), torch.ones(C), True, 0.1, 1e-5]
    assert split_size(aten.native_batch_norm.default, "batch", train, {}) == 0  # batch statistics
    logp, target = torch.log_softmax(r(N, C), 1), torch.randint(0, C, (N,))
    with pytest.raises(FasttError, match="nll_loss_forward"):  # a mean needs reweighting
        run_split(aten.nll_loss_forward.default, [logp, target, None, 1, -100], {}, "batch", 2)
    with pytest.raises(FasttError, match="softmax"):  # the reduced dim
        run_split(aten._softmax.default, [r(N, C), 1, False], {}, "dim1", 2)
    with pytest.raises(FasttError, match="no split rule"):
        run_split(aten.bernoulli.p, [r(N, C), 0.5], {}, "batch", 2)
    with pytest.raises(FasttError, match="parts"):
        run_split(aten.mm.default, [r(N, K), r(K, C)], {}, "rows", N + 1)
    assert split_size(aten.embedding_dense_backward.default, "batch",
                      [r(N, 4), torch.randint(0, 11, (N,)), 11, -1, True], {}) == 0  # counts over the batch
    q = r(N, 4, 6, 4)
    assert split_size(_SDPA, "heads", [q, q, q], {}) == 4
    assert split_size(_SDPA, "heads", [q, q, q, 0.1], {}) == 0  # dropout draws per element
    assert split_size(_SDPA, "heads", [q, q, q], {"attn_mask": r(N, 4, 6, 6)}) == 0  # a mask per head
    assert split_size(_SDPA, "heads", [q, r(N, 2, 6, 4), r(N, 2, 6, 4)], {}) == 0  # grouped-query heads


# ---- the pass on captured graphs -------------------------------------------------------------------------------


def _captured(name: str, **kw: Any) -> OpGraph:
    w = zoo.get(name, "test", **kw)
    return fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)


@pytest.fixture(scope="module")
def mlp() -> OpGraph:
    return _captured("mlp")


@pytest.fixture(scope="module")
def resnet() -> OpGraph:
    return _captured("resnet50")


def _check_split(old: OpGraph, new: OpGraph, op: str, parts: int) -> None:
    """The invariants of one split: sizes, flops, readers of the join, untouched neighbours."""
    assert len(new) == len(old) + parts  # the op gives way to `parts` sub-ops and a join
    o, at = old.ops[old.index[op]], old.index[op]
    subs = [new.ops[new.index[f"{op}#{k}"]] for k in range(parts)]
    join = new.ops[new.index[f"{op}#join"]]
    assert [new.index[s.name] for s in subs] == list(range(at, at + parts)) and new.index[join.name] == at + parts
    assert sum(s.flops for s in subs) == pytest.approx(o.flops)
    assert sum(x.flops for x in new.ops) == pytest.approx(sum(x.flops for x in old.ops))
    assert all(s.target == o.target and s.head == o.head and s.split[1:] == (k, parts) and s.inputs == o.inputs
               for k, s in enumerate(subs))
    assert join.inputs == tuple(range(at, at + parts)) and join.in_bytes == tuple(s.out_bytes for s in subs)
    assert join.out_bytes == o.out_bytes and join.flops == 0 and join.target.startswith("join:")
    assert all(b <= w for s in subs for b, w in zip(s.in_bytes, o.in_bytes))
    for s in old.succs[at]:
        reader = new.ops[new.index[old.ops[s].name]]
        assert new.index[join.name] in reader.inputs and not set(reader.inputs) & set(range(at, at + parts))
    assert {x.name for x in old.ops} - {op} <= set(new.index)


def _simulates(g: OpGraph, op: str, parts: int, replicas: int = 1) -> None:
    """Parts of `op` on different devices, everything else on device 0: the simulator runs it."""
    c = cluster("4xV100")
    names = {f"{op}#{k}": k % 4 for k in range(parts)}
    dev = [names.get(x.name, 0) for x in g.ops]
    s = strategy_from(g, "test", 4, dev, replicas=replicas)
    g = without_unplaced_updates(g, s.placement)  # device 0 applies each update once for all its replicas
    tl = simulate(g, s, c, op_times(g, c))
    assert tl.iteration_s > 0 and len({tl.device[g.index[n]] for n in names}) == min(parts, 4)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_split_mlp_matmuls(mlp: OpGraph, parts: int) -> None:
    for op in ("addmm", "mm"):
        for dim in splittable(mlp.ops[mlp.index[op]], mlp):
            g = split(mlp, op, dim, parts)
            _check_split(mlp, g, op, parts)
            _simulates(g, op, parts)


def test_split_resnet_convs(resnet: OpGraph) -> None:
    ops = {o.target: o.name for o in reversed(resnet.ops) if o.target != "update"}
    for target in ("aten.convolution.default", "aten.convolution_backward.default",
                   "aten.native_batch_norm.default", "aten.native_batch_norm_backward.default",
                   "aten.max_pool2d_with_indices.default"):
        op = ops[target]
        dims = splittable(resnet.ops[resnet.index[op]], resnet)
        assert "channel" in dims and ("batch" in dims) == ("batch_norm" not in target)
        for dim in dims:
            g = split(resnet, op, dim, 3)
            _check_split(resnet, g, op, 3)
        _simulates(g, op, 3)


def test_summed_outputs_stay_whole(resnet: OpGraph) -> None:
    """A weight gradient split along the batch: each part writes a whole gradient, the activations' part scales."""
    nodes = {n.name: n for n in resnet.fx.gm.graph.nodes}
    op = next(o for o in resnet.ops if o.target == "aten.convolution_backward.default"
              and nodes[o.head].meta["val"][0] is not None)
    grad_in, *grad_w = (v.numel() * v.element_size() for v in nodes[op.head].meta["val"] if v is not None)
    g = split(resnet, op.name, "batch", 2)  # batch 16: two equal halves
    assert g.ops[g.index[f"{op.name}#0"]].out_bytes == grad_in // 2 + sum(grad_w)
    assert g.ops[g.index[f"{op.name}#join"]].target == "join:cat+sum"


def test_split_data_parallel_graph(mlp: OpGraph, resnet: OpGraph) -> None:
    dp = data_parallel_graph(mlp, 2)
    g = split(dp, "r1/addmm", "rows", 2)
    _check_split(dp, g, "r1/addmm", 2)
    _simulates(g, "r1/addmm", 2, replicas=2)
    # A replicated graph carries no capture: splits whose exactness depends on the arguments are not offered.
    dp = data_parallel_graph(resnet, 2)
    bn = dp.ops[dp.index["r0/native_batch_norm"]]
    assert splittable(bn, dp) == ["channel"]
    with pytest.raises(FasttError, match="r0/native_batch_norm"):
        split(dp, bn.name, "batch", 2)


def test_split_errors_name_the_op(mlp: OpGraph) -> None:
    param = mlp.ops[mlp.residents[0]].name
    bernoulli = next(o.name for o in mlp.ops if o.target == "aten.bernoulli.p")
    bad = [("nope", "batch", 2), ("addmm", "channel", 2), ("addmm", "rows", 1), ("addmm", "rows", 10_000),
           (param, "batch", 2), (bernoulli, "batch", 2)]
    for op, dim, parts in bad:
        with pytest.raises(FasttError, match=re.escape(op)):
            split(mlp, op, dim, parts)
    loss_grad = mlp.ops[mlp.index["nll_loss_backward"]]
    assert max_parts(loss_grad, mlp, "batch") == mlp.batch
    assert max_parts(loss_grad, data_parallel_graph(mlp, 2), "batch") == mlp.batch // 2  # replicas: batch/2
    once = split(mlp, "relu", "batch", 2)
    assert splittable(once.ops[once.index["relu#0"]], once) == [] and not splittable(
        once.ops[once.index["relu#join"]], once)
    with pytest.raises(FasttError, match="relu#1"):
        split(once, "relu#1", "batch", 2)


def test_parts_run_the_step_exactly() -> None:
    """The captured mlp step with one op run as parts (`run_split`) gives the same loss and gradients."""
    w = zoo.get("mlp", "test", dropout=False)
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    step = g.fx
    params, buffers, states, batch, hypers = step.arguments(w.model, w.optimizer, w.example_inputs)
    inputs = _clone((params, buffers, states, *batch, hypers, 1.0))
    want = step.gm(*_clone(inputs))
    tried = 0
    for op in g.ops:
        for dim in splittable(op, g):
            interp = _PartsInterpreter(step.gm, op.head, dim, 3)
            got = interp.run(*_clone(inputs))
            tried += interp.split_runs
            # Gradients of a whole float32 step, with sums reassociated along the way: 1e-4.
            _close(got[:1 + len(params)], want[:1 + len(params)], (1e-4, 1e-4))
    assert tried >= 20


class _PartsInterpreter(torch.fx.Interpreter):
    """Runs the graph with node `head` executed by `run_split`."""

    def __init__(self, gm: torch.fx.GraphModule, head: str, dim: str, parts: int) -> None:
        super().__init__(gm)
        self.head, self.dim, self.parts = head, dim, parts
        self.split_runs = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name != self.head:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.split_runs += 1
        return run_split(n.target, args, kwargs, self.dim, self.parts)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_splits_keep_the_graph_sound(mlp: OpGraph, data: st.DataObject) -> None:
    g = mlp
    for _ in range(data.draw(st.integers(1, 3))):
        choices = [(o.name, d) for o in g.ops for d in splittable(o, g)]
        op, dim = data.draw(st.sampled_from(choices))
        parts = data.draw(st.integers(2, 4))
        new = split(g, op, dim, parts)
        _check_split(g, new, op, parts)
        g = new
    _simulates(g, op, parts)
