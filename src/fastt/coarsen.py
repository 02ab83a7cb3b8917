"""From a captured Step (fx graph of aten ops) to the OpGraph the planners see.

Three groupings make ops worth placing:
- alias ops (views, reshapes, transposes, getitem, detach) join the op that produced their input: they move no
  data, so a planner gains nothing by placing them apart;
- every op of the optimizer update of one parameter (those needed neither by the loss nor by any gradient)
  becomes one UPDATE op, as TensorFlow's ApplyAdam is one op;
- an op that writes a buffer in place (batch-norm running stats, `copy_` into a buffer) records the buffer in
  `updates`, so holders of the buffer are known to the strategy.

`capture_graph` is the whole stage: a model's training step captured (`capture.capture_step`) and coarsened,
able to derive itself at a smaller batch (`fastt.rebatch`) or capture itself again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from .capture import Step, capture_step
from .graph import BUFFER, COMPUTE, INPUT, PARAM, STATE, UPDATE, Op, OpGraph
from .rebatch import derive

aten = torch.ops.aten

# Ops that only alias their input: no data moves, no kernel worth timing.
ALIAS = {
    operator.getitem, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.unsqueeze.default, aten.alias.default, aten.detach.default, aten.slice.Tensor,
    aten.select.int, aten.as_strided.default, aten.view_as_real.default, aten.unfold.default,
    aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
}

# Ops that write some arguments in place (positions), beyond what their schema declares.
MUTATES = {
    aten.copy_.default: (0,),
    aten.native_batch_norm.default: (3, 4),
    aten._native_batch_norm_legit.default: (3, 4),
}


def grouped_mm_flop(a: torch.Tensor, b: torch.Tensor, *_: object, out_val: torch.Tensor, **__: object) -> int:
    """FLOPs of `aten._grouped_mm` (a mixture of experts' matmuls): every output element is a dot product over
    `a`'s last dim, except where both operands are 2D, when the groups split that dim and each group's output
    is a block of its own (a weight's gradient): 2 * rows * inner * cols."""
    if a.dim() == b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


# FLOP formulas torch's flop counter lacks: the CPU flash-attention kernels count as attention does.
EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
    aten._grouped_mm: grouped_mm_flop,
}

# Hyperparameters and the loss weight are read-only inputs of the step, as buffers that nothing writes are:
# held where they are read. The optimizer ops that several parameters' updates read (a gradient clip's global
# norm): one UPDATE op that writes nothing; under data parallelism it reads the averaged gradients, as the
# updates do.
SHARED = "update:*"
_ROLE_KIND = {"param": PARAM, "buffer": BUFFER, "state": STATE, "input": INPUT, "hyper": BUFFER,
              "weight": BUFFER}


def nbytes(val: object) -> int:
    """Bytes held by a node's value (a tensor, or a tuple/list of them)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


def _arg_nodes(node: Node) -> list[Node]:
    """The nodes whose values `node` reads from other ops. A get_attr constant (a tensor the model's code
    makes, such as transformers' empty key/value cache) is no op: the step holds it, so every device has
    it."""
    return [a for a in node.all_input_nodes if a.op != "get_attr"]


def _flops(node: Node) -> float:
    fn = flop_registry.get(getattr(node.target, "overloadpacket", None)) or EXTRA_FLOPS.get(
        getattr(node.target, "overloadpacket", None))
    if fn is None:
        return 0.0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    return float(fn(*args, **kwargs, out_val=node.meta.get("val")))


def _second_pass_bytes(node: Node) -> int:
    """Bytes a training-mode batch norm reads a second time. Its statistics reduce over the batch and every
    pixel, which no kernel holds on chip at training sizes, so the input is read once for them and again to
    normalize (PyTorch's CUDA and CPU kernels are two such passes: `batch_norm_collect_statistics_kernel`
    then `batch_norm_transform_input_kernel` in aten/src/ATen/native/cuda/Normalization.cuh); the backward
    reads the output's gradient and the input once for its two reductions and again for the input's
    gradient."""
    if node.target is aten.native_batch_norm.default and len(node.args) > 5 and node.args[5]:
        return nbytes(node.args[0].meta.get("val"))
    if node.target is aten.native_batch_norm_backward.default and len(node.args) > 7 and node.args[7]:
        return nbytes(node.args[0].meta.get("val")) + nbytes(node.args[1].meta.get("val"))
    return 0


def _compute_dtype(node: Node) -> str:
    """The dtype a node computes in: its first floating-point tensor argument's ("float32", "bfloat16")."""
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return str(v.dtype).removeprefix("torch.")
    return ""


def _shape_key(node: Node) -> str:
    def desc(v: object) -> str:
        if isinstance(v, torch.Tensor):
            return f"{tuple(v.shape)}{str(v.dtype)[6:]}"
        return repr(v) if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__
    args = torch.fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
    flat = args if isinstance(args, (tuple, list)) else (args,)
    return f"{node.target}({','.join(desc(a) if not isinstance(a, (list, tuple)) else str(a) for a in flat)})"


def _needed(roots: Iterable[Node]) -> set[Node]:
    """Nodes the roots depend on, roots included."""
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _assign_groups(step: Step) -> tuple[dict[Node, str], dict[str, str], dict[str, set[str]]]:
    """Map every fx node to the name of its OpGraph op; also each op's kind and the residents it updates."""
    nodes = list(step.gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    outs = list(out_node.args[0])
    group: dict[Node, str] = {}
    kind: dict[str, str] = {}
    updates: dict[str, set[str]] = {}
    for n, (role, name) in zip(placeholders, step.roles):
        group[n] = f"{role}:{name}"
        kind[group[n]] = _ROLE_KIND[role]
    loss, grads = outs[0], outs[1:1 + len(step.param_names)]
    fwd_bwd = _needed([loss, *grads, *(n for n in nodes if n.target in MUTATES)])
    # Optimizer nodes: assigned to the update of the parameter whose outputs they feed (reverse order).
    for n, (role, name) in zip(outs[1 + len(step.param_names):], step.outputs[1 + len(step.param_names):]):
        owner = f"update:{name.split(':')[0]}"
        group.setdefault(n, owner)
        kind[owner] = UPDATE
        updates.setdefault(owner, set()).add(f"{role}:{name}")
    for n in reversed(nodes):
        if n.op == "call_function" and n not in fwd_bwd and n not in group:
            owners = sorted({group[u] for u in n.users if u in group and kind.get(group[u]) == UPDATE})
            if len(owners) > 1:  # read by several updates: the global norm of a gradient clip
                group[n] = SHARED
                kind[SHARED] = UPDATE
            elif owners:
                group[n] = owners[0]
    for n in nodes:
        if n.op != "call_function" or n in group:
            continue
        ins = _arg_nodes(n)
        if n.target in ALIAS and len(ins) == 1:
            group[n] = group[ins[0]]
        elif n.target is aten.copy_.default and ins and ins[0].op == "placeholder":
            group[n] = group[n.args[1]] if isinstance(n.args[1], Node) else n.name
        else:
            group[n] = n.name
        kind.setdefault(group[n], COMPUTE)
        for pos in MUTATES.get(n.target, ()):
            a = n.args[pos] if pos < len(n.args) else None
            if isinstance(a, Node) and a.op == "placeholder":
                updates.setdefault(group[n], set()).add(group[a])
    return group, kind, updates


def _update_bytes(nodes: Sequence[Node], group: dict[Node, str], gname: str) -> tuple[int, int]:
    """(bytes of its results, the most its temporaries add while it runs) for an optimizer update's nodes,
    run in order: each aten result lives from its node to its last reader in the update (a view, to its
    view's), and its results (read outside it: the step's new parameter and state) to the end."""
    base: dict[Node, Node | None] = {}  # the aten result a node's value is (a view: its input's), or None
    for n in nodes:
        if n.target in ALIAS:
            a = next(iter(_arg_nodes(n)), None)
            base[n] = base.get(a) if a is not None else None
        else:
            base[n] = n
    last: dict[Node, int] = {}
    out: set[Node] = set()
    for i, n in enumerate(nodes):
        for a in _arg_nodes(n):
            if base.get(a) is not None:
                last[base[a]] = i
        if any(group.get(u) != gname for u in n.users) and base[n] is not None:
            out.add(base[n])
    live = peak = 0
    for i, n in enumerate(nodes):
        if base[n] is n and n.op == "call_function" and n.target is not aten.copy_.default:
            live += nbytes(n.meta.get("val"))
        peak = max(peak, live)
        live -= sum(nbytes(a.meta.get("val")) for a in set(map(base.get, _arg_nodes(n)))
                    if a is not None and a not in out and last.get(a) == i)
    kept = sum(nbytes(n.meta.get("val")) for n in out)
    return kept, max(0, peak - kept)


def _storages(nodes: Sequence[Node]) -> tuple[tuple[int, ...], dict[Node, tuple[int, ...]]]:
    """The storages a group's results are, when they are several (their bytes, as `Op.out_parts`; () for
    one), and for each node the parts its value lies on: each element of a tuple result is one part, a view
    lies on its base's."""
    sizes: list[int] = []
    part_of: dict[Node, tuple[int, ...]] = {}
    for n in nodes:
        ins = [part_of[a] for a in _arg_nodes(n) if a in part_of]
        if n.op == "placeholder" or n.target not in ALIAS and n.target is not aten.copy_.default:
            val = n.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else (val,)
            part_of[n] = tuple(range(len(sizes), len(sizes) + len(vals)))
            sizes.extend(nbytes(v) for v in vals)
        elif n.target is operator.getitem and ins and len(ins[0]) > 1:
            part_of[n] = (ins[0][n.args[1]],)
        else:  # a view, or a copy into a buffer: on its input's storage
            part_of[n] = ins[0] if ins else ()
    return (tuple(sizes) if len(sizes) > 1 else ()), part_of


def to_opgraph(step: Step, name: str = "step") -> OpGraph:
    """Coarsen a captured step into an OpGraph (alias ops and per-parameter updates grouped)."""
    group, kind, updates = _assign_groups(step)
    members: dict[str, list[Node]] = {}
    for n in step.gm.graph.nodes:
        if n in group:
            members.setdefault(group[n], []).append(n)
    index: dict[str, int] = {}
    ops: list[Op] = []
    parts_of: dict[str, dict[Node, tuple[int, ...]]] = {}  # group -> its nodes' parts (`_storages`)
    loss = next(iter(list(step.gm.graph.nodes)[-1].args[0]))
    for gname, nodes in _topo_groups(members, group):
        k = kind[gname]
        reads: dict[str, dict[Node, int]] = {}
        flops, io, shapes, heaviest = 0.0, 0, [], (0.0, "")
        out_bytes = 0
        for n in nodes:
            for a in _arg_nodes(n):
                if group[a] != gname:
                    reads.setdefault(group[a], {})[a] = nbytes(a.meta.get("val"))
            if n.op == "placeholder" or n.target not in ALIAS and n.target is not aten.copy_.default:
                out_bytes += nbytes(n.meta.get("val"))
            if n.op == "call_function" and n.target not in ALIAS:
                f = _flops(n)
                flops += f
                heaviest = max(heaviest, (f, _compute_dtype(n)))
                io += (nbytes(n.meta.get("val")) + sum(nbytes(a.meta.get("val")) for a in n.all_input_nodes)
                       + _second_pass_bytes(n))
                shapes.append(_shape_key(n))
        temp, out_parts = 0, ()
        if k == UPDATE:  # the new parameter and state are fresh tensors, the old ones kept to the step's end
            out_bytes, temp = _update_bytes(nodes, group, gname)
        else:
            out_parts, part_of = _storages(nodes)
            parts_of[gname] = part_of
        inputs = tuple(index[g] for g in reads)
        in_parts = tuple(tuple(sorted({p for a in r for p in parts_of[g].get(a, ())}))
                         if ops[index[g]].out_parts else () for g, r in reads.items())
        batch = k not in (UPDATE,) and (k == INPUT or any(ops[j].batch for j in inputs))
        updated = tuple(sorted(index[u] for u in updates.get(gname, ())))
        sig = hashlib.sha1("|".join(shapes).encode()).hexdigest()[:16] if shapes else ""
        head = next((n for n in nodes if n.op == "call_function" and n.target not in ALIAS), nodes[0])
        target = ("update" if k == UPDATE else str(head.target) if head.op == "call_function"
                  else "placeholder")
        order = list(reads)
        read = set(_arg_nodes(head))
        arg_inputs = tuple(order.index(group[a]) if isinstance(a, Node) and a in read and group[a] != gname
                           else -1
                           for a in head.args) if head.op == "call_function" else ()
        index[gname] = len(ops)
        ops.append(Op(name=gname, kind=k, target=target, inputs=inputs,
                      in_bytes=tuple(sum(r.values()) for r in reads.values()), out_bytes=out_bytes,
                      flops=flops, io_bytes=io, nodes=tuple(n.name for n in nodes), updates=updated,
                      batch=batch, signature=sig, head=head.name if head.op == "call_function" else "",
                      arg_inputs=arg_inputs, temp_bytes=temp, dtype=heaviest[1] if heaviest[0] else "",
                      out_parts=out_parts, in_parts=in_parts if any(in_parts) else (),
                      returned=(parts_of[gname][loss] or (0,)) if loss in nodes else ()))
    return OpGraph(ops=tuple(ops), name=name, batch=step.batch, fx=step,
                   fx_nodes=sum(1 for n in step.gm.graph.nodes if n.op != "output"))



def capture_graph(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                  example_inputs: Sequence[torch.Tensor], name: str = "step",
                  clip_grad_norm: float | None = None, autocast: torch.dtype | None = None) -> OpGraph:
    """One whole training step (forward, backward, optimizer update) as an OpGraph.

    Convention: `loss = loss_fn(model(*example_inputs[:-1]), example_inputs[-1])`; dim 0 of every example
    input is the batch. `clip_grad_norm`: clip the gradients to this global norm before the update
    (`clip_grad_norm_`). `autocast`: the forward runs under `torch.autocast` in this dtype
    (`capture.capture_step`).

    The graph's `recapture(batch)` is the step at a smaller batch (data parallelism needs batch/N) for
    planning: derived from this capture (`fastt.rebatch`), or traced again where no rule derives it;
    `recapture.traced(batch)` always traces it (what the runtimes run). `recapture.seconds` is the longest a
    planning `recapture` took so far: planners that weigh another against their budget read it.
    """
    example_inputs = tuple(example_inputs)

    def opgraph(step: Step) -> OpGraph:
        return dataclasses.replace(to_opgraph(step, name), recapture=recapture)

    def capture(inputs: tuple[torch.Tensor, ...]) -> Step:
        return capture_step(model, loss_fn, optimizer, inputs, clip_grad_norm, autocast)

    @functools.lru_cache(maxsize=8)
    def traced(batch: int) -> OpGraph:
        return opgraph(capture(tuple(x[:batch] for x in example_inputs)))

    @functools.lru_cache(maxsize=8)
    def recapture(batch: int) -> OpGraph:
        t0 = time.perf_counter()
        derived = derive(step, batch)
        g = opgraph(derived) if derived is not None else traced(batch)
        recapture.seconds = max(getattr(recapture, "seconds", 0.0), time.perf_counter() - t0)
        return g

    recapture.traced = traced
    step = capture(example_inputs)
    return opgraph(step)


def _topo_groups(members: dict[str, list[Node]], group: dict[Node, str]) -> list[tuple[str, list[Node]]]:
    """Groups in an order where every group comes after the groups it reads (Kahn's algorithm)."""
    deps = {g: {group[a] for n in ns for a in _arg_nodes(n)} - {g} for g, ns in members.items()}
    users: dict[str, list[str]] = {g: [] for g in members}
    for g, ds in deps.items():
        for d in ds:
            users[d].append(g)
    pending = {g: len(ds) for g, ds in deps.items()}
    ready = [g for g in members if pending[g] == 0]
    out = []
    while ready:
        g = ready.pop(0)
        out.append((g, members[g]))
        for u in users[g]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if len(out) != len(members):
        stuck = sorted(g for g, c in pending.items() if c > 0)[:5]
        raise RuntimeError(f"grouping made a cycle among {stuck}")
    return out
