"""Layers: the ops of a captured step grouped by the parameters they serve, in forward order.

Mixed plans (a layer held once, a stage of a pipeline, a table on its own device) are decisions per layer, and
a plan is explained by its layers ("classifier.0 on device 0"). The captured graph carries no module names or
forward/backward pairs (`make_fx` of `torch.func` records neither), so layers are found from its structure:

- the forward ops are the loss's ancestors (the step's first output); what an update reads that the step
  computes is its parameter's gradient;
- a parameter anchors its layer: the ops that read it (the forward op, the input-gradient op of the backward),
  the op that makes its gradient and its update; parameters read by one forward op (a weight and its bias, or
  a tied embedding and its decoder) are one layer;
- every other forward op joins the layer of its latest producer in forward order (an activation joins the
  matmul before it), or of its first consumer if it reads only the batch;
- every other backward op joins the layer of the latest forward op it reads (the saved activation whose
  gradient it computes: a ReLU's backward reads the ReLU's output), else of its latest producer;
- an op that writes a buffer in place (batch norm's statistics) brings the buffer, an update its state; a
  buffer nothing in a layer writes (batch norm's step count) joins the layer of its module, with the ops that
  count it.
Inputs, hyperparameters and ops that serve several layers' updates (a gradient clip's norm) are in no layer;
in a graph built by hand, an op none of these reach joins the layer of the op before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .graph import ALLREDUCE, COMPUTE, INPUT, PARAM, RESIDENT, UPDATE, OpGraph


@dataclass(frozen=True)
class Layer:
    """One layer: its parameters (resident ops, by index) and every op that serves them, in graph order.
    `name` is the module path its parameters share (`classifier.0` for classifier.0.weight and .bias)."""

    name: str
    params: tuple[int, ...]
    ops: tuple[int, ...]


@dataclass(frozen=True)
class Layers:
    """The layers of a step, in forward order, each op's layer (`of[i]`, -1 for ops in no layer) and whether
    it is a forward op (`forward[i]`: the loss or one of its ancestors)."""

    layers: tuple[Layer, ...]
    of: tuple[int, ...]
    forward: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.layers)


def layers(graph: OpGraph) -> Layers:
    """The layers of `graph`, a step as captured (not replicated or split): see the module docstring."""
    if graph.replicas != 1 or any(op.split for op in graph.ops):
        raise ValueError("layers() reads the captured step, not a replicated or split graph")
    ops = graph.ops
    forward = _forward(graph)
    root = list(range(len(ops)))  # union-find over parameters read by one forward op

    def find(p: int) -> int:
        while root[p] != p:
            root[p] = root[root[p]]
            p = root[p]
        return p

    for i in forward:
        params = [j for j in ops[i].inputs if ops[j].kind == PARAM]
        for p in params[1:]:
            root[find(p)] = find(params[0])
    anchor = [-1] * len(ops)  # op -> the parameter (a union-find root) that anchors it
    for p in graph.of_kind(PARAM):
        anchor[p] = find(p)
        for s in graph.succs[p]:
            if ops[s].kind != ALLREDUCE and anchor[s] < 0:
                anchor[s] = find(p)
    for i, op in enumerate(ops):
        params = [j for j in op.updates if ops[j].kind == PARAM]
        if op.kind == UPDATE and params:
            anchor[i] = find(params[0])
            for g in op.inputs:  # its gradient: what it reads that is computed in the step
                if (ops[g].kind not in RESIDENT and ops[g].kind not in (INPUT, UPDATE, ALLREDUCE)
                        and anchor[g] < 0):
                    anchor[g] = anchor[i]
    _spread(graph, anchor, forward)
    return _collect(graph, anchor, forward)


def _forward(graph: OpGraph) -> list[int]:
    """Indices of the forward ops (the loss and its ancestors) in graph order; every compute op for a graph
    built by hand (no loss known)."""
    loss = _loss_op(graph)
    if loss is None:
        return [i for i, op in enumerate(graph.ops) if op.kind not in RESIDENT
                and op.kind not in (INPUT, UPDATE)]
    seen = {loss}
    for i in range(loss, -1, -1):
        if i in seen:
            seen.update(graph.ops[i].inputs)
    return [i for i in sorted(seen) if graph.ops[i].kind not in RESIDENT and graph.ops[i].kind != INPUT]


def _node_ops(graph: OpGraph) -> dict[str, int]:
    return {n: i for i, op in enumerate(graph.ops) for n in op.nodes}


def _outputs(graph: OpGraph) -> list | None:
    step = graph.fx
    gm = getattr(step, "gm", None)
    if gm is None:
        return None
    return list(list(gm.graph.nodes)[-1].args[0])


def _loss_op(graph: OpGraph) -> int | None:
    outs = _outputs(graph)
    return None if outs is None else _node_ops(graph).get(outs[0].name)


def _spread(graph: OpGraph, anchor: list[int], forward: Sequence[int]) -> None:
    """Give every compute op that no parameter anchors the layer the module docstring says."""
    ops = graph.ops
    fwd = set(forward)
    rank = {i: k for k, i in enumerate(forward)}
    for i in forward:  # producers first
        if anchor[i] < 0:
            made = [j for j in ops[i].inputs if j in fwd and anchor[j] >= 0]
            if made:
                anchor[i] = anchor[max(made, key=rank.__getitem__)]
    for i in reversed(forward):  # what reads only the batch: its first consumer's layer
        if anchor[i] < 0:
            used = [s for s in graph.succs[i] if s in fwd and anchor[s] >= 0]
            if used:
                anchor[i] = anchor[min(used, key=rank.__getitem__)]
    for i, op in enumerate(ops):
        if anchor[i] >= 0 or i in fwd or op.kind in RESIDENT or op.kind in (INPUT, ALLREDUCE, UPDATE):
            continue
        saved = [j for j in op.inputs if j in fwd and anchor[j] >= 0]
        made = [j for j in op.inputs if j not in fwd and anchor[j] >= 0 and ops[j].kind not in RESIDENT]
        if saved:
            anchor[i] = anchor[max(saved, key=rank.__getitem__)]
        elif made:
            anchor[i] = anchor[max(made)]
    for i, op in enumerate(ops):
        if anchor[i] < 0:
            continue
        for u in op.updates:  # the buffers a forward op writes, the state an update writes
            if anchor[u] < 0:
                anchor[u] = anchor[i]
    module = {}  # a resident no op of a layer writes (batch norm's step count): the layer of its module
    for p in graph.of_kind(PARAM):
        module.setdefault(ops[p].name.removeprefix("param:").rpartition(".")[0], anchor[p])
    for j in graph.residents:
        if anchor[j] < 0:
            anchor[j] = module.get(ops[j].name.partition(":")[2].rpartition(".")[0], -1)
    for i, op in enumerate(ops):  # what reads only residents (that count + 1): their layer
        if anchor[i] < 0 and op.kind not in RESIDENT and op.kind not in (INPUT, ALLREDUCE):
            held = [anchor[j] for j in op.inputs if anchor[j] >= 0]
            if held and (op.kind != UPDATE or len(set(held)) == 1):
                anchor[i] = held[0]
    last = next((a for a in anchor if a >= 0), -1)
    # anything else (an op nothing reads, in a graph built by hand): the layer before
    for i, op in enumerate(ops):
        if anchor[i] < 0 and op.kind == COMPUTE:
            anchor[i] = last
        last = anchor[i] if anchor[i] >= 0 else last


def _collect(graph: OpGraph, anchor: list[int], forward: Sequence[int]) -> Layers:
    """Layers in the order their parameters are first read in the forward pass (ops that read only the batch,
    such as a dropout mask's, may come earlier); layers read by no forward op at the end."""
    first: dict[int, int] = {}
    for k, i in enumerate(forward):
        if anchor[i] >= 0 and any(graph.ops[j].kind == PARAM for j in graph.ops[i].inputs):
            first.setdefault(anchor[i], k)
    roots = sorted({a for a in anchor if a >= 0}, key=lambda a: (first.get(a, len(forward)), a))
    number = {a: k for k, a in enumerate(roots)}
    of = tuple(number[a] if a >= 0 else -1 for a in anchor)
    out = []
    for a in roots:
        members = tuple(i for i, k in enumerate(of) if k == number[a])
        params = tuple(i for i in members if graph.ops[i].kind == PARAM)
        out.append(Layer(_name(graph, params), params, members))
    fwd = set(forward)
    return Layers(tuple(out), of, tuple(i in fwd for i in range(len(graph.ops))))


def _name(graph: OpGraph, params: Sequence[int]) -> str:
    """The modules of the parameters: `classifier.0` for `param:classifier.0.weight` and `.bias`, joined by
    `+` when one op reads parameters of several (a tied embedding and its decoder's bias)."""
    modules = [graph.ops[p].name.removeprefix("param:").rpartition(".")[0] or graph.ops[p].name
               for p in params]
    return "+".join(dict.fromkeys(modules))


def where(graph: OpGraph, holders: Mapping[str, Sequence[int]], nodes: Sequence[int],
          sharded: Sequence[str] = (), chained: Sequence[str] = ()) -> list[tuple[str, str]]:
    """A plan in its own words: runs of consecutive layers held alike, as (`features.0 … features.28 (16
    layers)`, `every device`), from the plan's parameter holders and each device's node; `sharded` (the plan's
    sharded updates) adds "updates sharded" to a layer all of whose updates are, and `chained` (its chained
    ops) "tensor-parallel" to a layer whose weight each device holds a share of (`split.chain_update`)."""
    found = layers(graph)
    n = len(nodes)
    rows, cut = set(sharded), set(chained)

    def devices(layer: Layer) -> str:
        ups = {graph.ops[p].name.replace("param:", "update:", 1) for p in layer.params}
        return (placed(layer) + (", updates sharded" if ups and ups <= rows else "")
                + (", tensor-parallel" if ups & cut else ""))

    def placed(layer: Layer) -> str:
        held = sorted({d for p in layer.params for d in holders.get(graph.ops[p].name, ())})
        if len(held) == n:
            return "every device"
        if len(held) == 1:
            return f"device {held[0]}"
        node = {nodes[d] for d in held}
        if len(node) == 1 and held == [d for d in range(n) if nodes[d] in node]:
            return f"node {node.pop()} (devices {held[0]}-{held[-1]})"
        return "devices " + ",".join(map(str, held))

    runs: list[tuple[list[str], str]] = []
    for layer in found.layers:
        d = devices(layer)
        if runs and runs[-1][1] == d:
            runs[-1][0].append(layer.name)
        else:
            runs.append(([layer.name], d))
    return [(names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)} layers)", d)
            for names, d in runs]
