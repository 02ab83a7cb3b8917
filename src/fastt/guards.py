"""Branches a training step takes on its batch's values: taken from the example batch, checked on every batch.

Fake tracing knows shapes, not values, so code that branches on a value (`if mask.all():`, as transformers
does to skip a padding mask with no padding) stops it with a data-dependent guard. As torch.export's draft
mode does, `trace` then traces again with the example's real values beside the fake ones
(`fake_tensor_propagate_real_tensors`): each such condition takes the example batch's side, and the ShapeEnv
keeps what was assumed as a deferred runtime assertion over unbacked symbols (`Ne(u0, 1)`, u0 being
`mask.all()`). Those assertions are the step's `Guards`: a small graph that computes the symbols from the
batch alone (copied out of the step before its dead code goes), and the assertions over them. `check` runs
them on a batch before the step runs: a batch that would take another branch is refused, naming the source
line, rather than trained down the branch the graph holds. (torch.compile breaks its graph at such a branch
and decides it in Python every call; fastt plans one graph for the whole step.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.utils import _pytree as pytree

from .errors import FasttError

# a traced GraphModule's Guards, in gm.meta (none when the step takes no branch on values)
KEY = "fastt.guards"
_TORCH = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class Condition:
    """A branch the step took: `holds` (over the symbols) was true for the example batch, decided at
    `where`."""

    holds: sympy.Basic
    where: str


@dataclass(frozen=True)
class Guards:
    """What a step traced with real example values assumes about its batch. `values(*batch)` computes the
    nodes the symbols are read from; `symbols`: (symbol, which of those values, key path into it); `example`:
    the symbols' values for the example batch."""

    values: Callable[..., tuple]
    symbols: tuple[tuple[sympy.Symbol, int, tuple], ...]
    conditions: tuple[Condition, ...]
    example: dict

    def read(self, batch: Sequence[torch.Tensor]) -> dict:
        with torch.no_grad():
            out = self.values(*batch)
        return {s: sympy.sympify(functools.reduce(lambda v, key: key.get(v), path, out[i]))
                for s, i, path in self.symbols}

    def failed(self, batch: Sequence[torch.Tensor]) -> str:
        """'' when `batch` takes the branches the step was captured with, else which one it does not."""
        got = self.read(batch)
        for c in self.conditions:
            if not bool(c.holds.xreplace(got)):
                names = sorted(c.holds.free_symbols, key=str)
                was = ", ".join(f"{s} = {self.example[s]}" for s in names)
                now = ", ".join(f"{s} = {got[s]}" for s in names)
                return f"at {c.where} the step was captured where {c.holds} ({was}); this batch has {now}"
        return ""


def trace(fn: Callable, args: tuple, batch: Sequence[torch.Tensor]) -> fx.GraphModule:
    """`make_fx(fn, tracing_mode="fake")(*args)`, `args` holding the example `batch` (the same tensor
    objects). Where the step branches on the batch's values it takes the example's branch, and `gm.meta[KEY]`
    holds the guards that `check` tests later batches with (see the module docstring). A real tensor the step
    reads that is none of `args` (a loss module's class weights, a tensor the model keeps as a plain
    attribute) is a constant of the graph, as torch.compile takes it."""
    leaves, spec = pytree.tree_flatten(args)
    ids = {id(x) for x in batch}
    positions = [k for k, x in enumerate(leaves) if id(x) in ids]  # make_fx makes a placeholder per leaf
    args = pytree.tree_unflatten(_distinct(leaves), spec)
    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as e:  # the latter: no ShapeEnv
        if any(isinstance(x, FakeTensor) for x in leaves):
            where = _where(traceback.extract_tb(e.__traceback__))
            raise FasttError(f"the step branches on the batch's values at {where}: fastt takes the example "
                             "batch's branch, which needs real example inputs, not fake ones") from e
    with _real_values(leaves):
        gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    gm.meta[KEY] = _guards(gm, positions, batch)
    for n in gm.graph.nodes:  # the real values were for the trace: a graph keeps shapes only
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, FakeTensor):
                v.real_tensor = None
    return gm


def check(gm: fx.GraphModule, batch: Sequence[torch.Tensor], replicas: int = 1) -> None:
    """Refuse a batch that the step traced into `gm` would run down another branch than its example took; with
    `replicas`, `gm` is the step at batch/replicas and each replica's share is checked."""
    guards = gm.meta.get(KEY)
    if guards is None or replicas > 1 and batch[0].shape[0] % replicas:  # the runtime refuses the latter
        return
    b = batch[0].shape[0] // replicas
    for k in range(replicas):
        why = guards.failed([x[k * b:(k + 1) * b] for x in batch] if replicas > 1 else batch)
        if why:
            share = f"replica {k}'s share of " if replicas > 1 else ""
            raise FasttError(f"{share}this batch takes another branch than the captured step: {why}; capture "
                             "the step again with a batch like this one")


def _distinct(leaves: list) -> list:
    """The leaves with every repeat of a tensor (labels = input_ids) replaced by a copy: make_fx maps a tensor
    to one proxy, so the graph would read the last placeholder of that tensor wherever any of them is used."""
    seen: set[int] = set()
    out = []
    for x in leaves:
        out.append(x.clone() if isinstance(x, torch.Tensor) and id(x) in seen else x)
        seen.add(id(x))
    return out


@contextlib.contextmanager
def _real_values(leaves: Sequence) -> Iterator[None]:
    """Fake tracing that also computes the real values, so a data-dependent condition takes the example's
    side. The kernels run for real: random ones must not advance the caller's generators. torch logs each
    assumption as a warning; `Guards` reports them when they matter."""
    cuda = sorted({x.device.index or 0 for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda})
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with (torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True),
              torch.random.fork_rng(devices=cuda)):
            yield
    finally:
        log.setLevel(level)


def _guards(gm: fx.GraphModule, positions: Sequence[int], batch: Sequence[torch.Tensor]) -> Guards | None:
    """The guards of a step traced with real values (see the module docstring); FasttError for what a guard
    cannot cover: a branch on the model's values, shapes that depend on values."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [placeholders[k] for k in positions]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for n in _ancestors([out]):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
            raise FasttError(f"the step's shapes depend on the batch's values ({n.target} makes a tensor of "
                             f"shape {tuple(val.shape)}): fastt needs every shape fixed by the batch's "
                             "shapes")
    shape_env = detect_fake_mode([n.meta.get("val") for n in placeholders]).shape_env
    asserts = {str(a.expr): a for ras in shape_env.deferred_runtime_asserts.values() for a in ras}
    if not asserts:
        return None
    conditions = tuple(Condition(a.expr, _where(a.stack.summary())) for a in asserts.values())
    binding = {s: (n, path) for n in gm.graph.nodes
               for s, path in n.meta.get("unbacked_bindings", {}).items()}
    symbols = sorted({s for c in conditions for s in c.holds.free_symbols}, key=str)
    nodes = list(dict.fromkeys(binding[s][0] for s in symbols))
    needed = _ancestors(nodes, stop=set(inputs))
    for c in conditions:
        reads = _ancestors([binding[s][0] for s in c.holds.free_symbols], stop=set(inputs))
        if any(n.op == "placeholder" and n not in inputs for n in reads):
            raise FasttError(f"the step branches at {c.where} on a value computed from the model, not from "
                             "the batch alone: fastt can take the example's branch only where the batch "
                             "decides it")
    g = fx.Graph()
    env = {n: g.placeholder(n.name) for n in inputs}
    for n in gm.graph.nodes:
        if n in needed and n not in env:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in nodes))
    guards = Guards(fx.GraphModule(gm, g),
                    tuple((s, nodes.index(binding[s][0]), binding[s][1]) for s in symbols),
                    conditions, {})
    return dataclasses.replace(guards, example=guards.read(batch))


def _ancestors(nodes: Sequence[fx.Node], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """The nodes `nodes` are computed from, themselves included; not looking past `stop`."""
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            if n not in stop:
                todo.extend(n.all_input_nodes)
    return seen


def _where(frames: Sequence[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch, as 'dir/file.py:line in function (`code`)'."""
    ours = [f for f in frames if not f.filename.startswith(_TORCH)]
    if not ours:
        return "an unknown line"
    f = ours[-1]
    path = "/".join(f.filename.split(os.sep)[-2:])
    return f"{path}:{f.lineno} in {f.name} (`{(f.line or '').strip()}`)"
