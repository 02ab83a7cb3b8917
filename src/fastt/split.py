"""Operation splitting (OS-DPOS): how each aten op splits, running a split exactly, and the graph pass.

`RULES` is the table: for each aten op, the named dimensions it splits along, each a `SplitSpec` saying which
dim of each positional argument is sliced, and how each output is joined (concatenated, or summed when the
split dim is reduced, as a weight gradient split along the batch is). `run_split` executes a rule on real
tensors (what the runtime runs); `split` rewrites an OpGraph so that one op becomes `parts` sub-ops and a
join; `graph_for` replays a Strategy's replication and splits.

Batch norm in training mode is split along channels only: its statistics are taken over the batch, so parts of
the batch would normalise with different means. `nll_loss_forward` with reduction="mean" (what cross-entropy
captures) is left out: its parts' means would have to be reweighted by each part's total weight, which is
neither a concatenation nor a sum; its backward, which reads the whole step's total weight, splits exactly.
Random ops (dropout's `bernoulli`) are left out: parts would draw different numbers than the whole op.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch.fx import Node

from .coarsen import ALIAS
from .errors import FasttError
from .graph import (
    ALLREDUCE,
    COMPUTE,
    UPDATE,
    Op,
    OpGraph,
    data_parallel_graph,
    part_signature,
    renumbered,
    replica_of,
    without,
    without_unplaced_updates,
)
from .shard import CUTS, fx_nodes, param_of, rows_of, shape_of, shard_updates, shardable, shares, update_part
from .strategy import Strategy

aten = torch.ops.aten


class Bcast(NamedTuple):
    """Slice along output dim `dim`, the argument aligned right against the output's rank (broadcasting):
    an argument without that dim, or of size 1 there, goes whole to every part."""

    dim: int


ArgDim = int | Bcast | None
Valid = Callable[[Sequence[Any], dict[str, Any]], bool]


@dataclass(frozen=True)
class SplitSpec:
    """How one aten op splits along one named dimension.

    `args[k]`: the dim positional arg k is sliced along, a `Bcast`, or None (every part gets it whole; args
    past the end and non-tensor args are whole too). `outs[k]`: ("cat", dim) or ("sum",) for output k.
    `sizes`: (arg position, list index) entries set to the part's length (convolution_backward's bias_sizes).
    `later`: keyword args set on every part but the first (a bias added once: beta=0). `valid(args, kwargs)`:
    whether the split is exact for these arguments (real or fake tensors). `views`: the parts read their
    slices as strided views, not contiguous copies (BLAS takes a matrix at any strides: a linear layer's
    weight reaches addmm transposed, and a contiguous copy of its slice along the reduction took 4.3 ms where
    the part's product took 0.9).
    """

    args: tuple[ArgDim, ...]
    outs: tuple[tuple, ...]
    sizes: tuple[tuple[int, int], ...] = ()
    later: tuple[tuple[str, object], ...] = ()
    valid: Valid | None = None
    views: bool = False


def _arg(args: Sequence[Any], pos: int, default: Any = None) -> Any:
    return args[pos] if pos < len(args) else default


def _rank(args: Sequence[Any]) -> int:
    return max((a.dim() for a in args if isinstance(a, torch.Tensor)), default=0)


def _norm(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _not_reduced(d: int, arg: int) -> Valid:
    """Valid when the dim named by positional arg `arg` (softmax's dim) is not `d`."""
    return lambda a, kw: _norm(a[arg], a[0].dim()) != d


def _before_reduced(d: int) -> Valid:
    """Valid when mean/sum (arg 1: the dims reduced, None = all; arg 2: keepdim) does not reduce `d` and
    leaves it at index d: every reduced dim comes after it, or they are kept (a bias gradient,
    `sum(g, [0], True)`, split along dim1)."""
    def ok(a: Sequence[Any], kw: dict[str, Any]) -> bool:
        reduced = [_norm(r, a[0].dim()) for r in (_arg(a, 1) or range(a[0].dim()))]
        kept = bool(_arg(a, 2, kw.get("keepdim", False)))
        return d not in reduced and (kept or all(r > d for r in reduced))
    return ok


def _is(pos: int, value: object, default: object) -> Valid:
    return lambda a, kw: _arg(a, pos, default) == value


def _all(*checks: Valid) -> Valid:
    return lambda a, kw: all(c(a, kw) for c in checks)


_DIMS = (("batch", 0), ("dim1", 1))
_PLAIN_CONV = _all(_is(6, False, False), _is(8, 1, 1))  # not transposed, groups == 1
_PLAIN_CONV_BWD = _all(_is(7, False, False), _is(9, 1, 1))


def _elementwise() -> dict[str, SplitSpec]:
    """Any of the first three dims of the (broadcast) output (dim2: a transformer's hidden dim, [B, T, H]):
    every tensor arg sliced where it has that dim."""
    return {name: SplitSpec(args=(Bcast(d),) * 4, outs=(("cat", d),)) for name, d in (*_DIMS, ("dim2", 2))}


def _rowwise(tensors: Sequence[int], reduced_arg: int) -> dict[str, SplitSpec]:
    """Softmax-like ops: any dim but the one they reduce, named by positional arg `reduced_arg`."""
    return {name: SplitSpec(args=tuple(d if k in tensors else None for k in range(max(tensors) + 1)),
                            outs=(("cat", d),), valid=_not_reduced(d, reduced_arg)) for name, d in _DIMS}


def _pool(tensors: Sequence[int], n_outs: int) -> dict[str, SplitSpec]:
    """2-d pooling and its backward on NCHW: batch or channel (each plane pools alone; max pool's indices are
    within a plane)."""
    return {name: SplitSpec(args=tuple(d if k in tensors else None for k in range(max(tensors) + 1)),
                            outs=(("cat", d),) * n_outs, valid=lambda a, kw: a[0].dim() == 4)
            for name, d in (("batch", 0), ("channel", 1))}


def _layer_norm_ok(d: int, shape_arg: int, data_arg: int) -> Valid:
    """Layer norm normalises the trailing dims named by `normalized_shape`: split only the leading ones."""
    return lambda a, kw: d < a[data_arg].dim() - len(a[shape_arg])


def _matmul(bias: bool, batched: bool) -> dict[str, SplitSpec]:
    """mm / addmm / bmm / baddbmm: (b)atch, rows of the left matrix, cols of the right, or the reduction
    dim."""
    o = 1 if batched else 0  # offset of the matrix dims

    def spec(bias_dim: ArgDim, left: ArgDim, right: ArgDim, out: tuple, **kw: Any) -> SplitSpec:
        return SplitSpec(args=((bias_dim,) if bias else ()) + (left, right), outs=(out,), views=True, **kw)
    rules = {
        "rows": spec(Bcast(o), o, None, ("cat", o)),
        "cols": spec(Bcast(o + 1), None, o + 1, ("cat", o + 1)),
        # Parts' products sum to the whole; a bias joins only the first part (beta=0 drops it from the rest).
        "reduction": spec(None, o + 1, o, ("sum",), later=(("beta", 0),) if bias else ()),
    }
    if batched:
        rules["batch"] = spec(Bcast(0), 0, 0, ("cat", 0))
    return rules


def _heads_ok(dropout_arg: int) -> Valid:
    """SDPA along its heads: exact without dropout (parts would draw other numbers) and with a mask that is
    the same for every head (size 1 along the heads dim, or no heads dim): every part reads it whole."""
    def ok(a: Sequence[Any], kw: dict[str, Any]) -> bool:
        mask = kw.get("attn_mask")
        return _arg(a, dropout_arg, 0.0) == 0.0 and (mask is None or mask.dim() < 3 or mask.shape[-3] == 1)
    return ok


_BN = (0, 1, 2, 3, 4)  # native_batch_norm: input, weight, bias, running_mean, running_var
_BATCH_NORM = {
    # Channels normalise independently: slice the activations along dim 1 and per-channel tensors along dim 0.
    "channel": SplitSpec(args=(1, 0, 0, 0, 0), outs=(("cat", 1), ("cat", 0), ("cat", 0))),
    # Along the batch only in eval mode, where the running statistics are read, not computed.
    "batch": SplitSpec(args=(0,), outs=(("cat", 0), ("cat", 0), ("cat", 0)), valid=_is(5, False, None)),
}

RULES: dict[Any, dict[str, SplitSpec]] = {
    aten.convolution.default: {
        "batch": SplitSpec(args=(0,), outs=(("cat", 0),)),
        "channel": SplitSpec(args=(None, 0, 0), outs=(("cat", 1),), valid=_PLAIN_CONV),
    },
    aten.convolution_backward.default: {
        "batch": SplitSpec(args=(0, 0), outs=(("cat", 0), ("sum",), ("sum",))),
        "channel": SplitSpec(args=(1, None, 0), outs=(("sum",), ("cat", 0), ("cat", 0)), sizes=((3, 0),),
                             valid=_PLAIN_CONV_BWD),
    },
    aten.mm.default: _matmul(bias=False, batched=False),
    aten.addmm.default: _matmul(bias=True, batched=False),
    aten.bmm.default: _matmul(bias=False, batched=True),
    aten.baddbmm.default: _matmul(bias=True, batched=True),
    **{op: _elementwise() for op in (
        aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
        aten.exp.default, aten.neg.default, aten.sqrt.default, aten.rsqrt.default, aten.sin.default,
        aten.cos.default, aten.clone.default, aten._to_copy.default, aten.add.Tensor, aten.sub.Tensor,
        aten.mul.Tensor, aten.div.Tensor,
        aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Scalar,
        aten.where.self, aten.threshold_backward.default, aten.gelu_backward.default,
        aten.silu_backward.default,
        aten.sigmoid_backward.default, aten.tanh_backward.default)},
    # Attention head by head ([B, heads, T, head dim]): query, key, value (and the backward's output, its
    # gradient and the logsumexp) sliced along the heads; equal heads only (split_size: grouped-query
    # attention's fewer key/value heads do not slice alike).
    aten._scaled_dot_product_flash_attention_for_cpu.default: {
        "heads": SplitSpec(args=(1, 1, 1), outs=(("cat", 1), ("cat", 1)), valid=_heads_ok(3))},
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: {
        "heads": SplitSpec(args=(1, 1, 1, 1, 1, 1), outs=(("cat", 1),) * 3, valid=_heads_ok(6))},
    aten._softmax.default: _rowwise((0,), 1),
    aten._log_softmax.default: _rowwise((0,), 1),
    aten._safe_softmax.default: _rowwise((0,), 1),
    aten._softmax_backward_data.default: _rowwise((0, 1), 2),
    aten._log_softmax_backward_data.default: _rowwise((0, 1), 2),
    aten.native_layer_norm.default: {
        name: SplitSpec(args=(d,), outs=(("cat", d),) * 3, valid=_layer_norm_ok(d, 1, 0))
        for name, d in _DIMS},
    aten.native_layer_norm_backward.default: {
        name: SplitSpec(args=(d, d, None, d, d), outs=(("cat", d), ("sum",), ("sum",)),
                        valid=_layer_norm_ok(d, 2, 1)) for name, d in _DIMS},
    aten.native_batch_norm.default: _BATCH_NORM,
    aten._native_batch_norm_legit.default: _BATCH_NORM,
    aten.native_batch_norm_backward.default: {
        "channel": SplitSpec(args=(1, 1, 0, 0, 0, 0, 0), outs=(("cat", 1), ("cat", 0), ("cat", 0))),
        "batch": SplitSpec(args=(0, 0), outs=(("cat", 0), ("sum",), ("sum",)), valid=_is(7, False, None)),
    },
    aten.embedding.default: {
        name: SplitSpec(args=(None, d), outs=(("cat", d),)) for name, d in _DIMS},
    # Every index adds its row of grad_output into the weight gradient: parts of the indices sum.
    aten.embedding_dense_backward.default: {
        name: SplitSpec(args=(d, d), outs=(("sum",),), valid=_is(4, False, False)) for name, d in _DIMS},
    aten.max_pool2d_with_indices.default: _pool((0,), 2),
    aten.max_pool2d_with_indices_backward.default: _pool((0, 1, 7), 1),
    aten.avg_pool2d.default: _pool((0,), 1),
    aten.avg_pool2d_backward.default: _pool((0, 1), 1),
    aten.mean.dim: {name: SplitSpec(args=(d,), outs=(("cat", d),), valid=_before_reduced(d))
                    for name, d in _DIMS},
    aten.sum.dim_IntList: {
        **{name: SplitSpec(args=(d,), outs=(("cat", d),), valid=_before_reduced(d)) for name, d in _DIMS},
        # A bias gradient: the batch dim is summed away, so the parts' sums add up.
        "reduction": SplitSpec(args=(0,), outs=(("sum",),),
                               valid=lambda a, kw: 0 in [_norm(r, a[0].dim()) for r in (_arg(a, 1) or [0])]),
    },
    # The backward reads the step's total weight, so each row's gradient is exact in any part (mean or sum).
    aten.nll_loss_backward.default: {
        "batch": SplitSpec(args=(None, 0, 0), outs=(("cat", 0),), valid=lambda a, kw: a[4] != 0)},
    # reduction="sum" only: a mean would need each part reweighted by its share of the total weight.
    aten.nll_loss_forward.default: {
        "batch": SplitSpec(args=(0, 0), outs=(("sum",), ("sum",)), valid=_is(3, 2, None))},
}

_BY_NAME = {str(op): op for op in RULES}


def rule(target: Any, dim: str) -> SplitSpec:
    """The SplitSpec of aten op `target` (an OpOverload or its name) along `dim`; FasttError if there is
    none."""
    rules = RULES.get(_BY_NAME.get(target, target) if isinstance(target, str) else target)
    if rules is None:
        raise FasttError(f"{target} has no split rule: only ops in fastt.split.RULES can be split")
    if dim not in rules:
        raise FasttError(f"{target} cannot be split along '{dim}': it splits along {sorted(rules)}")
    return rules[dim]


def slice_dims(spec: SplitSpec, args: Sequence[Any]) -> list[int | None]:
    """For each positional arg, the dim it is sliced along (None: passed whole), broadcasting resolved."""
    rank = _rank(args)
    out: list[int | None] = []
    for pos, a in enumerate(args):
        d = _arg(spec.args, pos)
        if not isinstance(a, torch.Tensor) or d is None or a.numel() == 0:
            out.append(None)  # an empty tensor (eval batch norm's saved stats) has nothing to slice
        elif isinstance(d, Bcast):
            k = d.dim - (rank - a.dim())
            out.append(k if 0 <= k < a.dim() and a.shape[k] != 1 else None)
        else:
            out.append(d if d < a.dim() else -1)  # -1: the rule does not fit these args
    return out


def split_size(target: Any, dim: str, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> int:
    """Length of the split dim for these args; 0 when the rule does not apply to them (or is not exact)."""
    spec = rule(target, dim)
    dims = slice_dims(spec, args)
    sizes = {int(a.shape[d]) for a, d in zip(args, dims) if d is not None and d >= 0}
    if -1 in dims or len(sizes) != 1 or (spec.valid is not None and not spec.valid(args, kwargs or {})):
        return 0
    return sizes.pop()


def run_split(target: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, dim: str, parts: int) -> Any:
    """Run aten op `target` on real tensors as `parts` sub-ops along `dim`, joined: equals `target(*args)`."""
    return join(rule(target, dim), [run_part(target, args, kwargs, dim, k, parts) for k in range(parts)])


def run_part(target: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, dim: str, k: int,
             parts: int, given: Sequence[int] = (), whole: Sequence[Any] | None = None) -> Any:
    """Part k of `parts` of aten op `target` split along `dim`, on real tensors (what sub-op `op#k` runs).
    `given`: positions whose arg is already its part k (a chained producer's part, `chain`); then `whole`
    holds every arg as the whole op sees it (the capture's fake tensors), from which the slicing is read."""
    kwargs = dict(kwargs or {})
    spec = rule(target, dim)
    ref = args if whole is None else whole
    size = split_size(target, dim, ref, kwargs)
    if not 2 <= parts <= size:
        raise FasttError(f"{target} cannot be split into {parts} parts along '{dim}' for these arguments "
                         f"(length {size}; 0 means the rule does not apply)")
    dims = slice_dims(spec, ref)
    # Parts get contiguous slices, as a split node would hand them over (some CPU kernels, layer norm's
    # backward among them, misread strided statistics), unless the rule takes views (`SplitSpec.views`); a
    # slice along dim 0 stays a view, so in-place updates land.
    part_args = [_part(a, parts, d, k, spec.views) if d is not None and pos not in given else a
                 for pos, (a, d) in enumerate(zip(args, dims))]
    length = len(torch.tensor_split(torch.arange(size), parts)[k])
    for pos, idx in spec.sizes:
        if part_args[pos] is not None:
            part_args[pos] = [length if i == idx else s for i, s in enumerate(part_args[pos])]
    return _call(target, part_args, {**kwargs, **dict(spec.later)} if k else kwargs)


def _part(a: torch.Tensor, parts: int, dim: int, k: int, view: bool) -> torch.Tensor:
    """Slice k of `parts` of `a` along `dim`: a view, or contiguous."""
    x = torch.tensor_split(a, parts, dim)[k]
    return x if view else x.contiguous()


def _call(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return (_BY_NAME[target] if isinstance(target, str) else target)(*args, **kwargs)


def join(spec: SplitSpec, outs: Sequence[Any], like: Any = None) -> Any:
    """The whole op's result from its parts' results: each output concatenated or summed as `spec` says, and
    laid out as `like` (the captured result) where it gives strides: the views after the op read it as the
    op's kernel made it (SDPA's output is a transpose of its [B, T, heads, head dim] storage)."""
    single = not isinstance(outs[0], (tuple, list))
    columns = [[o] for o in outs] if single else [list(o) for o in outs]
    joined = []
    for i, how in enumerate(spec.outs[:len(columns[0])]):
        xs = [c[i] for c in columns]
        if any(x is None for x in xs):
            joined.append(None)
        elif how[0] == "cat":
            joined.append(torch.cat(xs, how[1]))
        else:
            total = xs[0]
            for x in xs[1:]:
                total = total + x
            joined.append(total)
    likes = [like] if single else list(like) if isinstance(like, (tuple, list)) else []
    for i, (x, v) in enumerate(zip(joined, likes)):
        if isinstance(x, torch.Tensor) and isinstance(v, torch.Tensor) and x.stride() != v.stride():
            joined[i] = torch.empty_strided(x.shape, v.stride(), dtype=x.dtype, device=x.device).copy_(x)
    return joined[0] if single else tuple(joined)


def out_cut(spec: SplitSpec, val: Any) -> int | None:
    """The dim every result of an op split by `spec` is concatenated along, given its captured result `val`
    (one tensor, or a tuple: SDPA's output and logsumexp); None where one is summed or they differ."""
    vals = val if isinstance(val, (tuple, list)) else (val,)
    if not vals or len(spec.outs) < len(vals) or not all(isinstance(v, torch.Tensor) and v.dim()
                                                         for v in vals):
        return None
    dims = {how[1] % v.dim() if how[0] == "cat" else None for how, v in zip(spec.outs, vals)}
    return dims.pop() if len(dims) == 1 and None not in dims else None


# ---- the graph pass
# ------------------------------------------------------------------------------------------

def _fx_node(graph: OpGraph, name: str) -> Node | None:
    """The captured fx node `name`, if the graph carries its capture (`shard.fx_nodes`)."""
    return fx_nodes(graph).get(name) if name else None


def fake_args(node: Node) -> tuple[list[Any], dict[str, Any]]:
    """Node `node`'s args and kwargs with every fx node replaced by its value in the capture (a fake
    tensor)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    return list(args), dict(kwargs)


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _only_aliases(graph: OpGraph, op: Op) -> bool:
    """Whether the op's group is its head plus alias ops (a rule rewrites the head alone)."""
    nodes = [_fx_node(graph, n) for n in op.nodes if n != op.head]
    return all(n is not None and n.target in ALIAS for n in nodes)


def splittable(op: Op, graph: OpGraph | None = None) -> list[str]:
    """Names of the dims `op` can be split along: those of its target's rule, and, when `graph` carries its
    capture, only those exact for the op's argument shapes with length ≥ 2 (without it, only those exact for
    any arguments). Parts and joins are not split again."""
    rules = RULES.get(_BY_NAME.get(op.target))
    if rules is None or op.split or op.kind != COMPUTE:
        return []
    node = _fx_node(graph, op.head) if graph is not None else None
    if node is None:  # shapes unknown: only the splits exact for any arguments
        return [d for d, spec in rules.items() if spec.valid is None]
    if not _only_aliases(graph, op):
        return []
    args, kwargs = fake_args(node)
    return [d for d in rules if split_size(node.target, d, args, kwargs) >= 2]


def max_parts(op: Op, graph: OpGraph, dim: str) -> int | None:
    """The most parts `op` splits into along `dim` (its length there); None when the graph has no capture."""
    node = _fx_node(graph, op.head)
    if node is None:
        return None
    args, kwargs = fake_args(node)
    return split_size(node.target, dim, args, kwargs)


@dataclass(frozen=True)
class _Layout:
    """What the pass needs from the op's shapes: per part its share of the work, per input and output its
    bytes."""

    shares: tuple[float, ...]
    in_bytes: tuple[tuple[int, ...], ...]  # [part][input]
    out_bytes: tuple[int, ...]  # per part
    io_bytes: tuple[int, ...]  # per part


def _layout(graph: OpGraph, op: Op, dim: str, parts: int) -> _Layout:
    spec = rule(op.target, dim)
    node = _fx_node(graph, op.head)
    if node is None:
        if spec.valid is not None:
            raise FasttError(f"op '{op.name}' can be split along '{dim}' only for some arguments, and graph "
                             f"'{graph.name}' does not carry its capture to check them: split along one of "
                             f"{splittable(op, graph)}")
        return _layout_by_bytes(op, spec, parts)
    args, kwargs = fake_args(node)
    size = split_size(node.target, dim, args, kwargs)
    if size < 2:
        raise FasttError(f"op '{op.name}' cannot be split along '{dim}' for its argument shapes: "
                         f"split it along one of {splittable(op, graph)}")
    if parts > size:
        raise FasttError(f"op '{op.name}' has length {size} along '{dim}': split it into 2..{size} parts, "
                         f"not {parts}")
    shares = tuple(len(r) / size for r in torch.tensor_split(torch.arange(size), parts))
    dims = slice_dims(spec, args)
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    ins, out_b, io_b = [], [], []
    for s in shares:
        saved_in = [0] * len(op.inputs)
        seen: set[Node] = set()
        saved_io = 0
        for pos, (a, d) in enumerate(zip(node.args, dims)):
            j = _arg(op.arg_inputs, pos, -1)
            if d is None or j < 0:
                continue
            saved = round(_nbytes(a.meta.get("val")) * (1 - s))
            saved_io += saved
            if a not in seen and all(dd is not None for aa, dd in zip(node.args, dims) if aa is a):
                seen.add(a)
                saved_in[j] += saved
        out = sum(_nbytes(v) if how[0] == "sum" else round(_nbytes(v) * s) for v, how in zip(outs, spec.outs))
        ins.append(tuple(b - x for b, x in zip(op.in_bytes, saved_in)))
        out_b.append(out)
        io_b.append(max(0, op.io_bytes - saved_io - (op.out_bytes - out)))
    return _Layout(shares, tuple(ins), tuple(out_b), tuple(io_b))


def _layout_by_bytes(op: Op, spec: SplitSpec, parts: int) -> _Layout:
    """Without the capture (replicated graphs): equal parts; an input fed to a sliced arg is sliced whole, and
    outputs count as concatenated unless every one is summed."""
    s = 1 / parts
    sliced = {j for pos, j in enumerate(op.arg_inputs) if j >= 0 and _arg(spec.args, pos) is not None}
    ins = tuple(round(b * s) if j in sliced else b for j, b in enumerate(op.in_bytes))
    out = op.out_bytes if all(h[0] == "sum" for h in spec.outs) else round(op.out_bytes * s)
    io = max(0, op.io_bytes - (sum(op.in_bytes) - sum(ins)) - (op.out_bytes - out))
    return _Layout((s,) * parts, (ins,) * parts, (out,) * parts, (io,) * parts)


def split(graph: OpGraph, op: str, dim: str, parts: int) -> OpGraph:
    """The graph with op `op` split into `parts` sub-ops `op#k` along `dim`, joined by `op#join` for its
    readers.

    Sub-ops keep the op's target and head and record `split = (dim, k, parts)`; their FLOPs and bytes are the
    op's scaled by their share (a summed output stays whole). Runs in O(ops).
    """
    return split_all(graph, [(op, dim, parts)])


def split_all(graph: OpGraph, splits: Sequence[tuple[str, str, int]]) -> OpGraph:
    """The graph with every (op, dim, parts) of `splits` split as `split` splits one, in one O(ops) pass."""
    want: dict[str, tuple[str, int]] = {}
    for op, dim, parts in splits:
        if op not in graph.index:
            raise FasttError(f"graph '{graph.name}' has no op '{op}'; split one of its ops by name")
        o = graph.ops[graph.index[op]]
        if o.kind != COMPUTE or o.split or op in want:
            what = "a part of a split" if o.split else "split twice" if op in want else f"a {o.kind} op"
            raise FasttError(f"op '{op}' is {what}: only unsplit compute ops split, once")
        rules = RULES.get(_BY_NAME.get(o.target), {})
        if dim not in rules:
            raise FasttError(f"op '{op}' ({o.target}) cannot be split along '{dim}': "
                             + (f"it splits along {sorted(rules)}" if rules
                                else "only ops in fastt.split.RULES split"))
        if not isinstance(parts, int) or parts < 2:
            raise FasttError(f"op '{op}' cannot be split into {parts} parts: use 2 or more")
        want[op] = (dim, parts)
    if not want:
        return graph
    # a split op's readers read its join, the last of its replacements
    ops, _ = renumbered(graph.ops, lambda i, o, at, new: _parts(graph, o, *want[o.name], at=at)
                        if o.name in want else None)
    return OpGraph(ops=tuple(ops), name=graph.name, batch=graph.batch, fx=graph.fx, replicas=graph.replicas,
                   fx_nodes=graph.fx_nodes)


def _parts(graph: OpGraph, o: Op, dim: str, parts: int, at: int) -> list[Op]:
    """Op `o`'s parts and their join, the first at index `at` of the new graph."""
    spec = RULES[_BY_NAME.get(o.target)][dim]
    lay = _layout(graph, o, dim, parts)
    subs = [replace(o, name=f"{o.name}#{k}", in_bytes=lay.in_bytes[k], out_bytes=lay.out_bytes[k],
                    flops=o.flops * lay.shares[k], io_bytes=lay.io_bytes[k], nodes=(o.head,),
                    signature=part_signature(o.signature, dim, lay.shares[k]),
                    split=(dim, k, parts), out_parts=(), returned=())
            for k in range(parts)]  # a part's results are one storage; the join makes the op's
    kinds = {h[0] for h in spec.outs}
    join_op = Op(name=f"{o.name}#join", kind=COMPUTE, target="join:" + ("+".join(sorted(kinds))),
                 inputs=tuple(range(at, at + parts)), in_bytes=lay.out_bytes, out_bytes=o.out_bytes,
                 io_bytes=sum(lay.out_bytes) + o.out_bytes, nodes=tuple(n for n in o.nodes if n != o.head),
                 batch=o.batch, out_parts=o.out_parts, returned=o.returned)
    return [*subs, join_op]


# ---- split chains
# ---------------------------------------------------------------------------------------------


def _parts_of(graph: OpGraph, op: str) -> list[int]:
    """Indices of split op `op`'s parts, in part order (empty when it is not split)."""
    first = graph.index.get(f"{op}#0")
    if first is None:
        return []
    return [graph.index[f"{op}#{k}"] for k in range(graph.ops[first].split[2])]


def _step_outputs(graph: OpGraph) -> set[str]:
    """The results of the step the runtimes keep: its loss, new parameters and state (not the gradients)."""
    gm = getattr(graph.fx, "gm", None)
    if gm is None:
        return set()
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    n = len(graph.fx.param_names)
    return {a.name for a in [out[0], *out[1 + n:]] if isinstance(a, Node)}


# getitem: a result of a tuple op whose results are all cut along one dim (`out_cut`)
_SAME = {aten.detach.default, aten.alias.default, operator.getitem}
_RESHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def view_dim(node: Node, d: int, parts: int = 0) -> int | None:
    """The dim of view node `node`'s result that is dim `d` of its input, element for element, or None where
    the view mixes it with others (so a slice of the input along d is a slice of the result along it). With
    `parts`, a reshape that splits dim d into several (the heads out of an attention's features) or merges
    it with the dims after it (the heads back into the features) keeps a cut into `parts` even parts too:
    part k of d is then the same elements as part k of the result's outermost dim of the group."""
    src, out = node.args[0].meta["val"], node.meta["val"]
    t = node.target
    if t in _SAME:
        return d
    if t is aten.t.default:
        return 1 - d if src.dim() == 2 else d
    if t is aten.transpose.int:
        a, b = (x % src.dim() for x in node.args[1:3])
        return b if d == a else a if d == b else d
    if t is aten.permute.default:
        return [x % src.dim() for x in node.args[1]].index(d)
    if t is aten.unsqueeze.default:
        return d + 1 if node.args[1] % out.dim() <= d else d
    if t in _RESHAPE:  # row-major: dim d keeps its length and everything after it keeps its size
        inner = math.prod(src.shape[d + 1:])
        same = next((e for e in range(out.dim()) if out.shape[e] == src.shape[d]
                     and math.prod(out.shape[e + 1:]) == inner), None)
        if same is not None or parts < 2 or src.shape[d] % parts:
            return same
        # dims d.. of the input and e.. of the result hold the same elements in the same order, and the
        # parts cut both outermost dims evenly: the same flat ranges
        block = src.shape[d] * inner
        return next((e for e in range(out.dim()) if math.prod(out.shape[e:]) == block
                     and out.shape[e] % parts == 0 and math.prod(out.shape[:e]) == math.prod(src.shape[:d])),
                    None)
    return None


def view_part(node: Node, x: torch.Tensor, d: int, parts: int = 0) -> torch.Tensor:
    """View node `node` applied to `x`, part k of `parts` of its input cut along dim d (`view_dim` says it
    may be)."""
    if node.target in _RESHAPE:
        shape = list(node.meta["val"].shape)
        e = view_dim(node, d, parts)
        shape[e] = shape[e] * x.shape[d] // node.args[0].meta["val"].shape[d]
        return node.target(x, shape)
    return node.target(x, *node.args[1:], **node.kwargs)


def alias_path(head: Node, node: Node, d: int, parts: int = 0) -> list[tuple[Node, int]] | None:
    """The view nodes from `head` (cut along dim d into `parts`) to `node`, each with the dim its input is
    cut along; None where `node` is not a view of `head` that keeps the cut (`view_dim`). The last dim:
    `cut_after`."""
    path = []
    n = node
    while n is not head:
        if n.target not in ALIAS or not n.args or not isinstance(n.args[0], Node):
            return None
        path.append(n)
        n = n.args[0]
    out = []
    for v in reversed(path):
        out.append((v, d))
        d = view_dim(v, d, parts)
        if d is None:
            return None
    return out


def cut_after(path: list[tuple[Node, int]], d: int, parts: int = 0) -> int:
    """The dim the last view of `path` leaves cut (d, the head's, where the path is empty)."""
    return view_dim(*path[-1], parts) if path else d


def _made_by(a: object, head: Node, join_op: Op) -> bool:
    """Whether arg `a` is the result of a split op (its head node, or a node of its join's group)."""
    return isinstance(a, Node) and (a is head or a.name in join_op.nodes)


def chain_links(graph: OpGraph, op: str) -> dict[int, list[int]]:
    """For split op `op` in the split graph: {input position j: the producer's parts, part order} for each
    input of its parts that part k can read from the producer's part k instead of slicing its join. That is
    exact when the producer P is split into as many parts, its one result concatenated along dim d, and `op`
    reads that result, or a view of it that keeps dim d whole (`view_dim`), only at args it slices along
    that dim: both cut the same dim of the same tensor into the same parts (`torch.tensor_split`). A
    column-split matmul feeding a relu split along dim1 chains, through a reshape from 2-d to 3-d too; a
    summed result (a reduction split) does not."""
    mine = _parts_of(graph, op)
    if not mine:
        return {}
    c = graph.ops[mine[0]]
    cnode = _fx_node(graph, c.head)
    if cnode is None:
        return {}
    cdims = slice_dims(rule(c.target, c.split[0]), fake_args(cnode)[0])
    out: dict[int, list[int]] = {}
    for j, src in enumerate(c.inputs):
        join_op = graph.ops[src]
        if not join_op.target.startswith("join:") or len(join_op.inputs) != len(mine):
            continue
        p = graph.ops[join_op.inputs[0]]
        pnode = _fx_node(graph, p.head)
        d = out_cut(rule(p.target, p.split[0]), pnode.meta.get("val")) if pnode is not None else None
        positions = [pos for pos, jj in enumerate(c.arg_inputs) if jj == j]
        if d is None or not positions or any(_made_by(x, pnode, join_op) for x in cnode.kwargs.values()):
            continue  # (a keyword arg read whole, SDPA's mask, is passed on whole)
        ok = True
        for pos in positions:
            a = cnode.args[pos] if pos < len(cnode.args) else None
            path = alias_path(pnode, a, d, len(mine)) if _made_by(a, pnode, join_op) else None
            ok = ok and path is not None and cdims[pos] is not None and cdims[pos] == cut_after(path, d,
                                                                                                len(mine))
        if ok:
            out[j] = list(join_op.inputs)
    return out


def update_link(graph: OpGraph, name: str) -> tuple[int, list[int], str, int] | None:
    """Whether update `name` can be split into the parts of the weight-gradient op it reads (tensor
    parallelism: part k of the gradient stays where it was made and updates its rows, or columns, of the
    parameter and its state there): (its input position j, the gradient op's parts, the gradient node it
    reads, the parameter dim they cut), or None. Exact when the gradient op's one result is concatenated
    along a dim that the gradient the update reads (that result or a view of it keeping the cut,
    `alias_path`) has as the parameter's dim 0 or 1, and the update is elementwise over the parameter
    (`shard.shardable`)."""
    i = graph.index.get(name)
    u = graph.ops[i] if i is not None else None
    param = param_of(graph, u) if u is not None and u.kind == UPDATE and not u.split else None
    shape = shape_of(graph, param) if param is not None else None
    if shape is None:
        return None
    for j, src in enumerate(u.inputs):
        join_op = _own_join(graph, src, replica_of(name))
        if join_op is None:
            continue
        p = graph.ops[join_op.inputs[0]]
        pnode = _fx_node(graph, p.head)
        d = out_cut(rule(p.target, p.split[0]), pnode.meta.get("val")) if pnode is not None else None
        if d is None:
            continue
        read = {a for n in u.nodes for a in _fx_node(graph, n).all_input_nodes if _made_by(a, pnode, join_op)}
        if len(read) != 1:
            continue
        a = read.pop()
        parts = len(join_op.inputs)
        path = alias_path(pnode, a, d, parts)
        cut = cut_after(path, d, parts) if path is not None else None
        if cut in CUTS.values() and a.meta["val"].shape == shape \
                and not shardable(graph, i, len(join_op.inputs), cut):
            return j, list(join_op.inputs), a.name, cut
    return None


def _own_join(graph: OpGraph, src: int, replica: int) -> Op | None:
    """The join of a split gradient op that an update reads at input `src`: the op itself, or, where the
    update reads the allreduce of every replica's join (data parallelism around tensor parallelism), its
    own replica's join, if every replica's is a join of as many parts (`_split_allreduce` can cut it)."""
    op = graph.ops[src]
    if op.kind == ALLREDUCE and op.target == "allreduce":  # not a reduce-scatter
        joins = [graph.ops[j] for j in op.inputs]
        if not all(x.target.startswith("join:") and len(x.inputs) == len(joins[0].inputs) for x in joins):
            return None
        op = joins[replica]
    return op if op.target.startswith("join:") else None


def _split_allreduce(graph: OpGraph, a: Op, new: list[int]) -> list[Op]:
    """Allreduce `a` of every replica's join of a split gradient op cut into one allreduce a part, `a.name#k`
    averaging part k of every replica's gradient (Megatron's data-parallel group of tensor-parallel rank k);
    producers read through `new` (old -> new index)."""
    parts = [graph.ops[j].inputs for j in graph.ops[graph.index[a.name]].inputs]
    out = []
    for k in range(len(parts[0])):
        nbytes = graph.ops[parts[0][k]].out_bytes
        out.append(replace(a, name=f"{a.name}#{k}", inputs=tuple(new[p[k]] for p in parts),
                           in_bytes=(nbytes,) * len(parts), out_bytes=nbytes, io_bytes=2 * nbytes,
                           in_parts=()))
    return out


def chain_update(graph: OpGraph, name: str) -> OpGraph:
    """The split graph with update `name` split into one part per part of its weight-gradient op
    (`update_link`): part k, `name#k`, reads gradient part k and updates those rows (or columns) of the
    parameter and its state, which only that part's device needs to hold (`shard.sharded_residents`); the
    gradient's join goes if nothing else reads it. FasttError if the update does not chain."""
    return chain_all(graph, [name])


def chain(graph: OpGraph, op: str) -> OpGraph:
    """The split graph with split op `op`'s part k reading part k of each producer `chain_links` finds, not
    its join; a join nothing reads any more goes (unless the step returns it). FasttError if none chains."""
    return chain_all(graph, [op])


def chain_all(graph: OpGraph, names: Sequence[str]) -> OpGraph:
    """`chain` of every split op and `chain_update` of every update in `names`, in one O(ops) pass."""
    if not names:
        return graph
    ops, joins, updates, reduced = list(graph.ops), set(), {}, set()
    for name in names:
        i = graph.index.get(name)
        if i is not None and graph.ops[i].kind == UPDATE:
            link = update_link(graph, name)
            if link is None:
                raise FasttError(f"update '{name}' cannot be chained to its gradient's parts: its gradient "
                                 "is not a split op's result cut along the parameter's dim 0 or 1, or the "
                                 "update is not elementwise over the parameter")
            updates[i] = link
            src = graph.ops[i].inputs[link[0]]
            if graph.ops[src].kind == ALLREDUCE:
                reduced.add(src)
                joins.update(graph.ops[src].inputs)
            else:
                joins.add(src)
            continue
        links = chain_links(graph, name)
        if not links:
            raise FasttError(f"op '{name}' cannot be chained: it is not split, or no input of it is a split "
                             "op cut the way it slices that input")
        mine = _parts_of(graph, name)
        joins |= {graph.ops[mine[0]].inputs[j] for j in links}
        for k, i in enumerate(mine):
            o = ops[i]
            ins, in_b, in_parts = list(o.inputs), list(o.in_bytes), list(o.in_parts)
            for j, producers in links.items():
                ins[j], in_b[j] = producers[k], graph.ops[producers[k]].out_bytes
                if in_parts:
                    in_parts[j] = ()
            ops[i] = replace(o, inputs=tuple(ins), in_bytes=tuple(in_b), in_parts=tuple(in_parts))
    for a in reduced:  # every replica's copy of the update must chain: they all read the parts' allreduces
        if missing := [graph.ops[s].name for s in graph.succs[a] if s not in updates]:
            raise FasttError(f"update '{missing[0]}' reads the allreduce '{graph.ops[a].name}' that other "
                             "replicas' updates chain: chain every replica's copy of the update")
    if updates:
        made: dict[int, list[int]] = {}  # a cut allreduce -> its parts' new indices

        def expand(i: int, o: Op, at: int, new: list[int]) -> list[Op] | None:
            if i in reduced:
                made[i] = list(range(at, at + len(graph.ops[graph.ops[i].inputs[0]].inputs)))
                return _split_allreduce(graph, o, new)
            return _update_parts(graph, o, updates[i], new, made.get(graph.ops[i].inputs[updates[i][0]]))\
                if i in updates else None
        ops, new = renumbered(ops, expand)
        joins = {new[j] for j in joins}
    return _without_unread(replace(graph, ops=tuple(ops)), joins)


def _update_parts(graph: OpGraph, u: Op, link: tuple[int, list[int], str, int], new: list[int],
                  reduced: list[int] | None = None) -> list[Op]:
    """Update `u`'s parts (`chain_update`), its producers' indices read through `new` (old -> new index); part
    k reads `reduced[k]` instead where its gradient's allreduce was cut into parts (`_split_allreduce`)."""
    j, producers, _, d = link
    share = shares(shape_of(graph, param_of(graph, graph.ops[graph.index[u.name]]))[d], len(producers))
    cut = {new[r] for r in rows_of(graph, graph.ops[graph.index[u.name]])}
    parts = []
    for k, src in enumerate(producers):
        ins, in_b = list(u.inputs), list(u.in_bytes)
        ins[j], in_b[j] = reduced[k] if reduced else new[src], graph.ops[src].out_bytes
        parts.append(update_part(replace(u, inputs=tuple(ins), in_bytes=tuple(in_b)),
                                 (next(c for c, x in CUTS.items() if x == d), k, len(producers)), share[k],
                                 cut, name=f"{u.name}#{k}"))
    return parts


def _without_unread(g: OpGraph, joins: set[int]) -> OpGraph:
    """`g` without the joins `joins` that nothing reads any more and the step does not return."""
    outputs = _step_outputs(g)
    gone = {i for i in joins if not g.succs[i] and not g.ops[i].returned
            and not outputs & {g.ops[g.ops[i].inputs[0]].head, *g.ops[i].nodes}}
    return without(g, gone)


def graph_for(graph: OpGraph, strategy: Strategy, traced: bool = False) -> OpGraph:
    """The graph a strategy places: `graph`, replicated for data parallelism, its sharded updates sharded
    (`fastt.shard`), with the strategy's splits and their chains (`chain`), less the duplicate updates it
    leaves out (`graph.duplicate_updates`). `traced`: its replicas run the step traced at their batch, not
    the one derived for planning (`graph.rebatch`): what a runtime runs."""
    g = shard_updates(data_parallel_graph(graph, strategy.replicas, traced), strategy.sharded)
    g = split_all(g, [(s.op, s.dim, s.parts) for s in strategy.splits])
    return without_unplaced_updates(chain_all(g, strategy.chained), strategy.placement)
