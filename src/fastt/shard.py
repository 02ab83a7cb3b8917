"""Sharded updates (ZeRO's stage 2): each replica updates its rows of a parameter, then the rows are gathered.

Under data parallelism every replica's device averages the whole gradient and applies the whole update to its
own copy of the parameter and its optimizer state. A sharded update cuts the parameter's dim 0 into one part a
replica (`torch.tensor_split`'s parts): the gradient's allreduce becomes a reduce-scatter (replica k keeps
the mean of its rows), replica k's update runs on its rows of the parameter, the mean and the state, and an
all-gather brings the new parameter's rows to every replica. Each device then holds only its rows of the
optimizer state (`sharded_residents`) and makes only its rows of the new state, and the two collectives move
what one allreduce moves. The update computes exactly what the whole update computes on those rows: it is
elementwise over the parameter (`shardable` checks every node), so training is bit for bit data parallelism's.

`shard_updates(g, names)` rewrites the data-parallel graph in place of index: replica k's copy of update u
becomes part k (`split = ("rows", k, R)`), the allreduce feeding it a REDUCE_SCATTER, and an ALL_GATHER of
the parts' new rows is appended at the end of the graph (nothing in the step reads it: it is the step's new
parameter, which lives to the step's end).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.fx

from .coarsen import ALIAS
from .errors import FasttError
from .graph import ALLREDUCE, PARAM, STATE, UPDATE, Op, OpGraph, base_name, replica_of

REDUCE_SCATTER, ALL_GATHER = "reducescatter", "allgather"  # targets of ALLREDUCE-kind ops
ROWS = "rows"
CUTS = {ROWS: 0, "cols": 1}  # a sharded update's split names the parameter's dim its parts cut

_BY_NAME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# View ops that keep every element where it is; any other view (reshape, a transpose of a square parameter)
# would see the rows' shape, or another layout, not the parameter's.
_SAFE_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def param_of(g: OpGraph, op: Op) -> Op | None:
    """The parameter update `op` writes, if any."""
    return next((g.ops[u] for u in op.updates if g.ops[u].kind == PARAM), None)


def fx_nodes(g: OpGraph) -> dict[str, torch.fx.Node]:
    """The captured step's fx nodes by name (empty for a graph built by hand), looked up once per capture."""
    gm = getattr(g.fx, "gm", None)
    if gm is None:
        return {}
    if gm not in _BY_NAME:
        _BY_NAME[gm] = {n.name: n for n in gm.graph.nodes}
    return _BY_NAME[gm]


def shape_of(g: OpGraph, op: Op) -> torch.Size | None:
    """The shape of a resident op's value in the captured step, if the graph carries its capture."""
    node = fx_nodes(g).get(op.nodes[0]) if op.nodes else None
    val = node.meta.get("val") if node is not None else None
    return val.shape if isinstance(val, torch.Tensor) else None


def _rows_of(g: OpGraph, resident: Op, param: Op, shape: torch.Size | None) -> bool:
    """Whether a resident an update writes has the parameter's rows (its state of the same shape; not Adam's
    step counter)."""
    if shape is None:  # a graph built by hand: by size
        return resident.out_bytes == param.out_bytes
    return shape_of(g, resident) == shape


def shares(rows: int, parts: int) -> list[float]:
    """Each part's share of `rows` rows as torch.tensor_split cuts them."""
    return [len(r) / rows for r in torch.tensor_split(torch.arange(rows), parts)]


def shardable(g: OpGraph, i: int, parts: int, dim: int = 0) -> str:
    """Why update op i cannot be sharded into `parts` parts along its parameter's dim `dim` ("" when it can):
    it updates one parameter with at least `parts` rows (or columns), every node of it is elementwise over
    the parameter, and its gradient's allreduce feeds nothing but copies of it."""
    op = g.ops[i]
    param = param_of(g, op)
    if op.kind != UPDATE or param is None:
        return f"'{op.name}' updates no parameter"
    nodes = fx_nodes(g)
    if nodes:
        shape = shape_of(g, param)
        if shape is None or len(shape) <= dim or shape[dim] < parts:
            what = "rows" if dim == 0 else f"entries along dim {dim}"
            return f"'{param.name}' has fewer than {parts} {what}"
        for name in op.nodes:
            n = nodes[name]
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return f"'{op.name}' computes a non-tensor ({name})"
            reads_rows = any(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].shape == shape
                             for a in n.all_input_nodes)
            elementwise = val.shape == shape or (val.dim() == 0 and not reads_rows)
            if not elementwise or (n.target in ALIAS and n.target not in _SAFE_VIEWS):
                return f"'{op.name}' is not elementwise over '{param.name}' ({name}: {n.target})"
    for j in op.inputs:
        if g.ops[j].kind == ALLREDUCE and any(base_name(g.ops[s].name) != base_name(op.name)
                                              for s in g.succs[j]):
            return f"the gradient '{op.name}' reads is also read by another op (a gradient clip's norm)"
    return ""


def shard_updates(g: OpGraph, names: Sequence[str]) -> OpGraph:
    """The data-parallel graph `g` with the updates `names` (names in the captured step, `update:fc.weight`)
    sharded over its replicas (module docstring); FasttError names an update that cannot be."""
    parts = g.replicas
    if not names:
        return g
    if parts < 2:
        raise FasttError("sharded updates need data-parallel replicas: the strategy has one")
    copies: dict[str, list[int]] = {name: [] for name in names}
    for i, op in enumerate(g.ops):
        if op.kind == UPDATE and base_name(op.name) in copies:
            copies[base_name(op.name)].append(i)
    ops = list(g.ops)
    gathers: list[Op] = []
    for name, idx in copies.items():
        if len(idx) != parts:
            raise FasttError(f"cannot shard '{name}': the graph has {len(idx)} copies of it, not one per "
                             f"replica ({parts})")
        why = shardable(g, idx[0], parts)
        if why:
            raise FasttError(f"cannot shard '{name}': {why}")
        param = param_of(g, g.ops[idx[0]])
        shape = shape_of(g, param)
        share = shares(shape[0], parts) if shape is not None else [1 / parts] * parts
        cut = {u for u in g.ops[idx[0]].updates if _rows_of(g, g.ops[u], param, shape)}
        for i in idx:
            op, k = g.ops[i], replica_of(g.ops[i].name)
            for j in op.inputs:
                if g.ops[j].kind == ALLREDUCE and g.ops[j].target != REDUCE_SCATTER:
                    a = g.ops[j]
                    ops[j] = replace(a, target=REDUCE_SCATTER, out_bytes=round(a.out_bytes * max(share)))
                    cut.add(j)
            ops[i] = update_part(op, (ROWS, k, parts), share[k], cut)
        by_replica = sorted(idx, key=lambda i: replica_of(g.ops[i].name))
        gathers.append(Op(name=f"{ALL_GATHER}/{name}", kind=ALLREDUCE, target=ALL_GATHER,
                          inputs=tuple(by_replica),
                          in_bytes=tuple(round(param.out_bytes * share[k]) for k in range(parts)),
                          out_bytes=param.out_bytes, io_bytes=2 * param.out_bytes))
    return replace(g, ops=tuple(ops) + tuple(gathers))


def update_part(op: Op, split: tuple[str, int, int], share: float, cut: set[int], name: str = "") -> Op:
    """Part `split` of update `op`: its work and results scaled by its `share` of the parameter, and so what
    it reads of the inputs `cut` (the parameter, its state, its gradient)."""
    out_parts = tuple(round(b * share) for b in op.out_parts)
    in_bytes = tuple(round(b * share) if j in cut else b for j, b in zip(op.inputs, op.in_bytes))
    return replace(op, name=name or op.name, split=split, flops=op.flops * share,
                   io_bytes=round(op.io_bytes * share), in_bytes=in_bytes,
                   out_bytes=sum(out_parts) if out_parts else round(op.out_bytes * share),
                   out_parts=out_parts, temp_bytes=round(op.temp_bytes * share))


def rows_of(g: OpGraph, update: Op) -> set[int]:
    """The residents update `update` writes that have its parameter's shape (its state; not Adam's step)."""
    param = param_of(g, update)
    shape = shape_of(g, param)
    return {u for u in update.updates if _rows_of(g, g.ops[u], param, shape)}


def held(g: OpGraph, holders: Mapping[int, Sequence[int]], device_of: Sequence[int], n: int) -> list[int]:
    """Bytes of the residents each of `n` devices holds across steps: every holder of a resident (`holders`,
    by op index) its copy, except the state of a sharded update, of which each part's device (`device_of`, by
    op index) holds its rows."""
    out = [0] * n
    for r, hs in holders.items():
        for h in hs:
            out[h] += g.ops[r].out_bytes
    for r, cut in sharded_residents(g).items():
        for h in holders[r]:
            out[h] -= g.ops[r].out_bytes
        for i in g.succs[r]:
            if g.ops[i].split and g.ops[i].kind == UPDATE:
                out[device_of[i]] += -(-g.ops[r].out_bytes // cut)
    return out


def chained_part(g: OpGraph, op: Op) -> bool:
    """Whether update part `op` reads its gradient's part (a tensor-parallel weight's, `split.chain_update`),
    or the allreduce of every replica's part, rather than a reduce-scatter's rows (ZeRO's)."""
    return any(x.split and x.kind != UPDATE or x.kind == ALLREDUCE and g.ops[x.inputs[0]].split
               for x in (g.ops[j] for j in op.inputs))


def sharded_residents(g: OpGraph) -> dict[int, int]:
    """Residents a sharded update writes of which each part's device holds only its rows (resident index ->
    parts): its optimizer state, and the parameter itself where every op reads only a part of it (a tensor-
    parallel layer's weight, `split.chain_update`; under ZeRO the forward reads it whole)."""
    out: dict[int, int] = {}
    for op in g.ops:
        if op.kind == UPDATE and op.split:
            chained = chained_part(g, op)
            for j, b in zip(op.inputs, op.in_bytes):
                if b < g.ops[j].out_bytes and (g.ops[j].kind == STATE or chained and g.ops[j].kind == PARAM):
                    out[j] = op.split[2]
    return out
