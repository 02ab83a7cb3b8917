"""The captured step at another batch size, derived from its graph for planning, not traced again.

Data parallelism plans the step at batch/N. Tracing it again costs as long as the first capture (gnmt: 12 s
of make_fx on 20000 nodes); deriving it re-runs each aten op of the captured graph on fake tensors at the
new batch (a fifth of that). Every size an op reads from a tensor follows by itself; a size written into the
graph as a constant (a view's shape, an expand's, a factory's) is rewritten by the rules below, which know
which of its dims carry the batch. Where no rule decides (a view that splits the batch's dim two ways, a
slice inside it, an op with data-dependent sizes, a batch of one, where tracing drops ops), or where the
derived step's parameters, gradients and states come out other than the captured ones, there is no derived
step and the caller captures again.

The derived step is for reading only (shapes, FLOPs, bytes, the split rules' layouts): constants computed
from the batch (the divisor of `x.mean()`'s gradient) keep the captured batch's values, so it never runs.
The runtimes run the step traced at that batch (`coarsen.capture_graph`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .capture import Step
from .loss import reduction_of

aten = torch.ops.aten


class Undecided(Exception):
    """No rule decides how a constant of the graph changes with the batch."""


def derive(step: Step, batch: int) -> Step | None:
    """`step` at `batch`, derived from its graph (see the module docstring); None where no rule decides."""
    if batch == step.batch:
        return step
    if batch == 1:  # traced at a batch of one, a step can lose ops (an expand, a clone): only a trace tells
        return None
    nodes = list(step.gm.graph.nodes)
    vals = [n.meta.get("val") for n in nodes]
    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None or any("unbacked_bindings" in n.meta for n in nodes):
        return None
    # an op that refuses a shape is an answer here, not an error: FakeTensorMode logs each one with its
    # traceback at ERROR level, which the user would read as fastt failing
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    was, quiet.disabled = quiet.disabled, True
    try:
        graph = _derived_graph(step, nodes, batch, mode)
    except Exception:  # noqa: BLE001  Undecided, or a shape that an op refuses: the rules do not cover it
        return None
    finally:
        quiet.disabled = was
    gm = torch.fx._lazy_graph_module._LazyGraphModule(step.gm, graph)
    # how the loss reduces: its kind and the items it counts, which say whether replicas can compute it (its
    # constant factor, which the runtime's loss weights read, is the traced step's business)
    return dataclasses.replace(step, gm=gm, batch=batch, derived=True, reduction=reduction_of(gm, step.roles))


def _derived_graph(step: Step, nodes: list[fx.Node], batch: int, mode: FakeTensorMode) -> fx.Graph:
    """A copy of the step's graph, node for node and name for name, with the new batch's values and the rules'
    constants; Undecided where a rule cannot say."""
    ctx = _Batch(step.batch, batch, mode)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    roles = iter(step.roles)
    for n in nodes:
        old = n.meta.get("val")
        if n.op == "placeholder":
            role = next(roles)[0]
            new = (_alike(old, (batch, *old.shape[1:]))
                   if role == "input" and isinstance(old, torch.Tensor) and old.dim() else old)
            args, kwargs = n.args, n.kwargs
        elif n.op == "call_function":
            args, kwargs = n.args, n.kwargs
            rule = RULES.get(n.target)
            if rule is not None:
                args = rule(ctx, n, *args)
            changed = args is not n.args or any(ctx.vals.get(a) is not a.meta.get("val")
                                                for a in n.all_input_nodes)
            if changed:
                a, k = fx.node.map_arg((args, kwargs), lambda x: ctx.vals[x])
                new = ctx.run(n.target, a, k)
            else:
                new = old
        elif n.op == "get_attr":
            args, kwargs, new = n.args, n.kwargs, old
        elif n.op == "output":
            _check_outputs(step, n, ctx)
            graph.output(fx.node.map_arg(n.args[0], lambda x: env[x]))
            continue
        else:
            raise Undecided(f"{n.op} node {n.name}")  # call_module/call_method: make_fx makes none
        ctx.vals[n] = new
        copy = graph.create_node(n.op, n.target, fx.node.map_arg(args, lambda x: env[x]),
                                 fx.node.map_arg(kwargs, lambda x: env[x]), n.name, n.type)
        copy.meta = {**n.meta, "val": new}
        env[n] = copy
    return graph


def _check_outputs(step: Step, out: fx.Node, ctx: _Batch) -> None:
    """The step's gradients, parameters and states have the captured shapes: a wrong rule shows here."""
    for a, (role, _) in zip(out.args[0], step.outputs):
        if role != "loss" and isinstance(a, fx.Node) and _shape(ctx.vals[a]) != _shape(a.meta.get("val")):
            raise Undecided(f"output {a.name} changed shape")


def _key(x: object) -> object:
    """What an op's output shapes can depend on in argument `x`: a tensor's shape, strides, dtype and
    device, else the value."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return (type(x), *map(_key, x))
    if isinstance(x, dict):
        return tuple((k, _key(v)) for k, v in x.items())
    return x


def _alike(x: object, shape: Sequence[int] | None = None) -> object:
    """A fresh fake tensor (or tuple of them) of `x`'s shapes (or `shape`), strides and dtypes, made without
    a dispatch through the fake mode (as long again as most ops')."""
    if isinstance(x, FakeTensor):
        size = x.shape if shape is None else shape
        meta = torch.empty_strided(size, x.stride(), dtype=x.dtype, device="meta")
        return FakeTensor(x.fake_mode, meta, x.device)
    if isinstance(x, (list, tuple)):
        return type(x)(map(_alike, x))
    return x


def _shape(v: object) -> tuple | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


@dataclasses.dataclass
class _Batch:
    """The captured batch, the new one, and each node's value at the new batch so far."""

    old: int
    new: int
    mode: FakeTensorMode
    vals: dict[fx.Node, object] = dataclasses.field(default_factory=dict)
    made: dict[tuple, object] = dataclasses.field(default_factory=dict)  # what ops made, by what they read

    def run(self, target: Callable, args: tuple, kwargs: dict) -> object:
        """`target(*args, **kwargs)` on fake tensors, or a result of the same shapes where an op made one from
        inputs of the same shapes (an LSTM's ops repeat every time step; fake tensors' own cache costs
        more)."""
        key = (target, _key(args), _key(kwargs))
        try:
            like = self.made.get(key)
        except TypeError:  # an argument that does not hash
            with self.mode:
                return target(*args, **kwargs)
        if like is not None:
            return _alike(like)
        with self.mode:
            out = target(*args, **kwargs)
        self.made[key] = out
        return out

    def shapes(self, x: fx.Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(captured shape, derived shape) of tensor node `x`."""
        return tuple(x.meta["val"].shape), tuple(self.vals[x].shape)

    def size(self, s: int) -> int:
        """A size no tensor decides: the batch's where it is the captured batch."""
        return self.new if s == self.old else s


def _view(ctx: _Batch, n: fx.Node, x: fx.Node, size: Sequence[int], *rest: object) -> tuple:
    old_in, new_in = ctx.shapes(x)
    if old_in == new_in:
        return n.args
    old_out = tuple(n.meta["val"].shape)
    new_out = list(old_out)
    for ins, outs in _groups(old_in, old_out):
        changed = [i for i in ins if new_in[i] != old_in[i]]
        if not changed:
            continue
        if len(changed) > 1:
            raise Undecided(f"{n.name}: several dims carry the batch")
        o = outs[0] if len(outs) == 1 else _batch_dim(ctx, n, changed[0], ins, outs, old_in, old_out)
        new_out[o] = old_out[o] * new_in[changed[0]] // old_in[changed[0]]
    return (x, new_out, *rest)


def _batch_dim(ctx: _Batch, n: fx.Node, c: int, ins: list[int], outs: list[int], old_in: Sequence[int],
               old_out: Sequence[int]) -> int:
    """Which of a view's result dims `outs` holds the batch that input dim `c` holds, the view mapping input
    dims `ins` onto `outs`: the one whose span of strides holds the batch's. Where dim c holds more than the
    batch (an earlier view merged it with others), the batch is its outermost or its innermost part: both
    must give one answer, else the one dim that is the batch or that the batch divides."""
    if old_in[c] % ctx.old:
        raise Undecided(f"{n.name}: dim {c} does not hold the batch")
    after = math.prod(old_in[i] for i in ins if i > c)
    spans = {}
    for k, o in enumerate(outs):
        spans[o] = math.prod(old_out[p] for p in outs[k + 1:])
    found = set()
    for inner in {1, old_in[c] // ctx.old}:
        stride = inner * after
        found |= {o for o, s in spans.items()
                  if stride % s == 0 and (s * old_out[o]) % (stride * ctx.old) == 0}
    if len(found) == 1:
        return found.pop()
    fits = ([o for o in outs if old_out[o] == ctx.old]
            or [o for o in outs if old_out[o] % ctx.old == 0 and old_out[o] * ctx.new % ctx.old == 0])
    if len(fits) != 1:
        raise Undecided(f"{n.name}: which of {[old_out[o] for o in outs]} holds the batch")
    return fits[0]


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The runs of dims of shape `a` and of shape `b` (as many elements) that a view maps onto each other:
    the shortest runs with equal products, left to right."""
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                ins.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                outs.append(j - 1)
            else:
                raise Undecided(f"view from {tuple(a)} to {tuple(b)}")
        out.append((ins, outs))
    rest = ([k for k in range(i, len(a))], [k for k in range(j, len(b))])
    if any(a[k] != 1 for k in rest[0]) or any(b[k] != 1 for k in rest[1]):
        raise Undecided(f"view from {tuple(a)} to {tuple(b)}")
    if out:  # trailing size-1 dims join the last run
        out[-1][0].extend(rest[0])
        out[-1][1].extend(rest[1])
    return out or [rest]


def _expand(ctx: _Batch, n: fx.Node, x: fx.Node, size: Sequence[int], *rest: object) -> tuple:
    old_in, new_in = ctx.shapes(x)
    lead = len(size) - len(old_in)
    new = [s if s == -1 else new_in[d - lead] if d >= lead and old_in[d - lead] == s else ctx.size(s)
           for d, s in enumerate(size)]
    return n.args if new == list(size) else (x, new, *rest)


def _factory(ctx: _Batch, n: fx.Node, size: Sequence[int], *rest: object) -> tuple:
    new = [ctx.size(s) for s in size]
    return n.args if new == list(size) else (new, *rest)


def _new_factory(ctx: _Batch, n: fx.Node, x: fx.Node, size: Sequence[int], *rest: object) -> tuple:
    new = [ctx.size(s) for s in size]
    return n.args if new == list(size) else (x, new, *rest)


def _arange(ctx: _Batch, n: fx.Node, *args: object) -> tuple:
    if len(args) == 1 and args[0] == ctx.old:
        return (ctx.new,)
    return n.args


def _kept_dim(ctx: _Batch, n: fx.Node, x: fx.Node, dim: int, *rest: object) -> tuple:
    """An op that picks along `dim` (a select, a split): its dim must not carry the batch."""
    old, new = ctx.shapes(x)
    if old[dim] != new[dim]:
        raise Undecided(f"{n.name} picks along the batch's dim")
    return n.args


def _slice(ctx: _Batch, n: fx.Node, x: fx.Node, dim: int = 0, start: int | None = None,
           end: int | None = None, step: int = 1) -> tuple:
    old, new = ctx.shapes(x)
    if old[dim] == new[dim]:
        return n.args
    if (start or 0) != 0 or step != 1 or end is not None and end < old[dim]:
        raise Undecided(f"{n.name} slices the batch's dim")
    return n.args  # the whole dim: end clamps to its new size


def _sized_backward(ctx: _Batch, n: fx.Node, grad: fx.Node, sizes: Sequence[int], dim: int,
                    *rest: object) -> tuple:
    """select_backward / slice_backward: the forward input's sizes, which are the gradient's but at `dim`."""
    old, new = ctx.shapes(grad)
    if old == new:
        return n.args
    inner = n.target is aten.slice_backward.default  # the gradient keeps dim `dim`, a select's drops it
    g_new = list(new) if inner else [*new[:dim], sizes[dim], *new[dim:]]
    g_old = list(old) if inner else [*old[:dim], sizes[dim], *old[dim:]]
    if g_old[dim] != g_new[dim]:
        raise Undecided(f"{n.name}: the batch's dim is the one cut")
    out = [g_new[d] if d != dim else sizes[d] for d in range(len(sizes))]
    return (grad, out, dim, *rest)


def _mean_divisor(ctx: _Batch, n: fx.Node, x: fx.Node, c: object) -> tuple:
    """A mean's gradient, divided by the count of the elements it spreads over (`x.mean()`'s backward): the
    count at the new batch, so that the op reads as the traced step's does (its signature)."""
    old, new = ctx.shapes(x)
    if old != new and isinstance(c, int) and c == math.prod(old):
        return (x, math.prod(new))
    return n.args


RULES: dict[object, Callable[..., tuple]] = {
    aten.div.Scalar: _mean_divisor,
    aten.view.default: _view, aten._unsafe_view.default: _view, aten.reshape.default: _view,
    aten.expand.default: _expand,
    aten.zeros.default: _factory, aten.ones.default: _factory, aten.empty.memory_format: _factory,
    aten.full.default: _factory, aten.rand.default: _factory, aten.randn.default: _factory,
    aten.new_zeros.default: _new_factory, aten.new_ones.default: _new_factory,
    aten.new_empty.default: _new_factory, aten.new_full.default: _new_factory,
    aten.arange.default: _arange,
    aten.select.int: _kept_dim, aten.unsafe_split.Tensor: lambda c, n, x, s, d=0: _kept_dim(c, n, x, d),
    aten.split.Tensor: lambda c, n, x, s, d=0: _kept_dim(c, n, x, d),
    aten.split_with_sizes.default: lambda c, n, x, s, d=0: _kept_dim(c, n, x, d),
    aten.narrow.default: _kept_dim,
    aten.slice.Tensor: _slice,
    aten.select_backward.default: _sized_backward, aten.slice_backward.default: _sized_backward,
}



def _refused(ctx: _Batch, n: fx.Node, *args: object) -> tuple:
    """Sizes and strides no rule reads (as_strided's): only where no input and no size changes."""
    if any(ctx.vals[a] is not a.meta.get("val") for a in n.all_input_nodes) or any(
            isinstance(a, (list, tuple)) and ctx.old in a for a in args):
        raise Undecided(f"{n.name}: {n.target} at another batch")
    return n.args


for _t in (aten.as_strided.default, aten.empty_strided.default, aten.new_empty_strided.default):
    RULES[_t] = _refused
