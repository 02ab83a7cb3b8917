"""The `megatron` planner: Megatron-LM's tensor parallelism of a model's MLP blocks over a node's devices.

Megatron splits an MLP's first linear layer by its output features (column-parallel: each device holds its
rows of the weight and the bias) and the second by its input features (row-parallel: its columns), so that
the activation between them stays cut, no weight or weight gradient crosses a link, and each device updates
only its share of both weights and their optimizer state; the second layer's partial outputs are summed
(Megatron's allreduce).

Here that plan is found on the captured step by propagating a cut (GSPMD-style sharding propagation): the
seeds are the weights of column-parallel layers (a 2-d parameter read by a matmul as its right operand whose
output features outnumber its input features, an MLP's expansion), cut along their output features; in
graph order every op that reads a cut value takes the split rule that slices each cut argument along its cut
(`fastt.split.RULES`), and its result is cut where the rule concatenates (a summed result, the row-parallel
layer's, is whole again). A parameter that every reader slices along one of its dims (the row-parallel
weight) is then cut too, and the propagation reruns, which splits its backward readers. Split ops read their
producers' parts (`split.chain`), and each cut weight's update is split along its cut (`split.chain_update`).
Part k runs on device k; DPOS places the rest (attention, norms, embeddings) and list scheduling orders it.

On several nodes (as many devices on each) it is Megatron's data parallelism across them: the step is
replicated once a node (`replicate` at batch/nodes), replica k runs the one-node plan on node k's devices,
and each tensor-parallel weight's gradient allreduce is cut into one allreduce a part (`split.chain_all`):
part j of every replica's gradient, averaged among device j of each node (Megatron's data-parallel group of
tensor-parallel rank j), so each device holds and updates only its part of the weight, on every node.

Attention computed by SDPA is cut by its heads, as Megatron cuts it: the query, key and value projections'
weights are seeds too (`head_seeds`), SDPA and its backward split along the heads, and the reshapes between
features and heads keep a cut into even parts (`split.view_dim`). Not built: an eager attention's heads
(batch and heads are merged into one dim before its matmuls, which no contiguous cut of the heads
survives), grouped-query heads and a rotary embedding's `cat`. The planner refuses nodes of one device, or
of different sizes, and a model with no MLP or attention it can cut.
"""

from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

from ..cluster import Cluster
from ..coarsen import ALIAS
from ..cost import MeasuredCosts
from ..errors import FasttError
from ..graph import COMPUTE, INPUT, PARAM, UPDATE, OpGraph, data_parallel_graph, rebatch
from ..shard import fx_nodes
from ..split import (
    chain_links,
    fake_args,
    graph_for,
    out_cut,
    rule,
    slice_dims,
    split_size,
    splittable,
    update_link,
    view_dim,
)
from ..strategy import Split, Strategy
from .basic import node_devices
from .common import plan_costs, strategy_from
from .dpos import schedule
from .mixed import ordered

MATMULS = ("aten.addmm.default", "aten.mm.default")
LARGE_SHARE = 16  # `held_in_parts` cuts weights of at least 1/LARGE_SHARE of the model's parameters
CAST = "aten._to_copy.default"  # autocast's copy of a weight in bf16, which the matmul then reads
ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu.default",)  # SDPA as captured on a CPU


def _nodes(graph: OpGraph) -> dict[str, Node]:
    nodes = fx_nodes(graph)
    if not nodes:
        raise FasttError(f"graph '{graph.name}' was built by hand: megatron reads the captured step's shapes")
    return nodes


def _cut_views(nodes: dict[str, Node], op_nodes: tuple[str, ...], cut: dict[str, int],
               parts: int = 0) -> None:
    """Cut each view in `op_nodes` (an op's group) whose input is cut and which keeps the cut into `parts`."""
    for name in op_nodes:
        n = nodes[name]
        src = n.args[0] if n.args and isinstance(n.args[0], Node) else None
        if name not in cut and src is not None and src.name in cut and n.op == "call_function":
            d = view_dim(n, cut[src.name], parts) if hasattr(n.meta.get("val"), "shape") else None
            if d is not None:
                cut[name] = d


def _propagate(graph: OpGraph, seeds: dict[str, int], parts: int) -> tuple[list[Split], dict[str, int]]:
    """The splits that carry the cut of the `seeds` (parameter op name -> its dim cut) through the step, and
    every cut value (fx node name -> its cut dim)."""
    nodes = _nodes(graph)
    cut: dict[str, int] = {}
    for name, d in seeds.items():
        op = graph.ops[graph.index[name]]
        cut[op.nodes[0]] = d
        _cut_views(nodes, op.nodes[1:], cut, parts)
    splits = []
    for op in graph.ops:
        if op.kind != COMPUTE or not op.head:
            continue
        head = nodes[op.head]
        cut_at = {pos: cut[a.name] for pos, a in enumerate(head.args)
                  if isinstance(a, Node) and a.name in cut}
        if not cut_at or any(isinstance(v, Node) and v.name in cut for v in head.kwargs.values()):
            continue
        vals, kwargs = fake_args(head)
        for dim in splittable(op, graph):
            spec = rule(op.target, dim)
            dims = slice_dims(spec, vals)
            if all(dims[pos] == d for pos, d in cut_at.items()) and split_size(op.target, dim, vals,
                                                                                 kwargs) >= parts:
                break
        else:
            continue  # it reads the parts joined
        splits.append(Split(op.name, dim, parts))
        d = out_cut(spec, head.meta.get("val"))
        if d is not None:
            cut[op.head] = d
            _cut_views(nodes, op.nodes[1:], cut, parts)
    return splits, cut


def _param_cuts(graph: OpGraph, splits: list[Split]) -> dict[str, set[int | None]]:
    """For each 1-d or 2-d parameter read by a split op: the dims of it that its readers slice (None for a
    reader that is not split, or reads it whole)."""
    nodes = _nodes(graph)
    split_of = {s.op: s.dim for s in splits}
    out: dict[str, set[int | None]] = {}
    for i, op in enumerate(graph.ops):
        if op.kind != PARAM or len(nodes[op.nodes[0]].meta["val"].shape) not in (1, 2):
            continue
        dims: set[int | None] = set()
        for r in graph.succs[i]:
            reader = graph.ops[r]
            if reader.kind == UPDATE:
                continue
            if reader.target == CAST and reader.name not in split_of:  # its readers read the weight
                readers = [graph.ops[c] for c in graph.succs[r]]
            else:
                readers = [reader]
            for reader in readers:
                if reader.name not in split_of:
                    dims.add(None)
                    continue
                head = nodes[reader.head]
                sliced = slice_dims(rule(reader.target, split_of[reader.name]), fake_args(head)[0])
                for pos, a in enumerate(head.args):
                    if isinstance(a, Node) and _behind_views(a).name == op.nodes[0]:
                        dims.add(_param_dim(nodes, op, a, sliced[pos]))
        if dims - {None}:
            out[op.name] = dims
    return out


def _param_dim(nodes: dict[str, Node], param: object, a: Node, d: int | None) -> int | None:
    """The parameter's dim that its view `a`'s dim d is (None where no view keeps it); `a` may be a view of
    autocast's cast of it."""
    if d is None:
        return None
    src = a
    while src.target in ALIAS and src.args and isinstance(src.args[0], Node):
        src = src.args[0]
    cast = src if str(src.target) == CAST else None
    cast_views = [v.name for v in _views_of(cast)] if cast is not None else []
    for pd in range(len(nodes[param.nodes[0]].meta["val"].shape)):
        probe = {param.nodes[0]: pd}
        _cut_views(nodes, param.nodes[1:], probe)
        if cast is not None and cast.args[0].name in probe:
            probe[cast.name] = probe[cast.args[0].name]
            _cut_views(nodes, cast_views, probe)
        if probe.get(a.name) == d:
            return pd
    return None


def _views_of(n: Node) -> list[Node]:
    """The views of `n`, and of them, each after the view it views (a view has one input)."""
    out, todo = [], [n]
    while todo:
        todo += (v := [u for u in todo.pop().users if u.target in ALIAS])
        out += v
    return out


def _reader(graph: OpGraph, i: int) -> object:
    """The first op that reads op `i`'s value, past autocast's cast of it."""
    reader = graph.ops[graph.succs[i][0]]
    j = graph.index[reader.name]
    return graph.ops[graph.succs[j][0]] if reader.target == CAST and graph.succs[j] else reader


def linear_weights(graph: OpGraph) -> dict[str, int]:
    """The linear layers' weights: a 2-d parameter whose first reader (the forward's) is a matmul reading it
    as its right operand (directly or through a transpose) -> its dim of output features."""
    nodes = _nodes(graph)
    out = {}
    for i, op in enumerate(graph.ops):
        if op.kind != PARAM or len(nodes[op.nodes[0]].meta["val"].shape) != 2 or not graph.succs[i]:
            continue
        reader = _reader(graph, i)
        right = nodes[reader.head].args[-1] if reader.target in MATMULS else None
        d = _param_dim(nodes, op, right, 1) if isinstance(right, Node) else None
        if d is not None:
            out[op.name] = d
    return out


def column_seeds(graph: OpGraph) -> dict[str, int]:
    """The column-parallel layers' weights: linear weights with more output features than input features ->
    their dim of output features."""
    nodes = _nodes(graph)
    shape = {op.name: nodes[op.nodes[0]].meta["val"].shape for op in graph.ops if op.kind == PARAM}
    return {name: d for name, d in linear_weights(graph).items() if shape[name][d] > shape[name][1 - d]}


def _behind_views(n: Node) -> Node:
    """The node a chain of views of it ends at (`n` itself if it is no view), past autocast's casts."""
    while (n.target in ALIAS or str(n.target) == CAST) and n.args and isinstance(n.args[0], Node):
        n = n.args[0]
    return n


def head_seeds(graph: OpGraph) -> dict[str, int]:
    """The attention's query, key and value projections' weights: a 2-d parameter that a matmul reads as its
    right operand, whose result (through the views that cut it into heads) is an SDPA's query, key or value
    -> its dim of output features (Megatron's column-parallel attention: a device's heads)."""
    nodes = _nodes(graph)
    params = {graph.ops[i].nodes[0]: graph.ops[i] for i in graph.of_kind(PARAM)}
    out = {}
    for n in nodes.values():
        if str(n.target) not in ATTENTION:
            continue
        for a in n.args[:3]:
            mm = _behind_views(a) if isinstance(a, Node) else None
            if mm is None or str(mm.target) not in MATMULS or not isinstance(mm.args[-1], Node):
                continue
            param = params.get(_behind_views(mm.args[-1]).name)
            d = _param_dim(nodes, param, mm.args[-1], 1) if param is not None else None
            if d is not None:
                out[param.name] = d
    return out


def tensor_parallel(graph: OpGraph, parts: int, seeds: dict[str, int] | None = None
                    ) -> tuple[tuple[Split, ...], tuple[str, ...]]:
    """Megatron's MLP tensor parallelism of `graph` in `parts` (module docstring): its splits, and the split
    ops and updates that chain. A parameter that some split reader slices along one dim and none along
    another is cut too (the row-parallel weight), and one that some reader still reads whole after the
    propagation is not (a weight tied to an embedding), until nothing changes. `seeds` (weight -> its dim
    cut) replaces the column-parallel layers' and attention's weights."""
    seeds = {**column_seeds(graph), **head_seeds(graph)} if seeds is None else seeds
    if not seeds:
        raise FasttError(f"megatron: '{graph.name}' has no MLP to cut (no linear layer widens its input) and "
                         "no SDPA attention")
    for _ in range(6):
        splits, _ = _propagate(graph, seeds, parts)
        cuts = _param_cuts(graph, splits)
        new = {name: d for name, dims in cuts.items() if name not in seeds and len(dims - {None}) == 1
               for d in dims - {None}}
        kept = {name: d for name, d in seeds.items() if cuts.get(name) == {d}}
        if new or kept != seeds:
            seeds = {**kept, **new}
            continue
        break
    if not seeds:
        raise FasttError(f"megatron: no weight of '{graph.name}' can be cut along one dim by every reader")
    splits, _ = _propagate(graph, seeds, parts)
    plain = Strategy(planner="megatron", n_devices=parts, placement={}, order=((),) * parts, holders={},
                     splits=tuple(splits))
    g = graph_for(graph, plain)
    chained = [s.op for s in splits if chain_links(g, s.op)]
    chained += [op.name for op in graph.ops if op.kind == UPDATE and update_link(g, op.name) is not None
                and any(graph.ops[u].name in seeds for u in op.updates)]
    return tuple(splits), tuple(chained)


def megatron(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None) -> Strategy:
    """The `megatron` planner (module docstring): tensor parallelism over each node's devices, and on several
    nodes data parallelism across them, each node one replica running the one-node plan on its share of the
    batch, part k of a tensor-parallel gradient averaged with part k of the other nodes' (Megatron's data-
    parallel groups: tensor-parallel rank k of every node)."""
    nodes = node_devices(cluster)
    n = len(nodes[0])
    if n < 2 or len({len(devs) for devs in nodes}) > 1:
        raise FasttError("megatron needs two devices or more on every node, as many on each; the cluster's "
                         f"nodes have {[len(devs) for devs in nodes]}")
    if len(nodes) == 1:
        return _one_node(graph, cluster, measured)
    r = len(nodes)
    data_parallel_graph(graph, r)  # FasttError where r replicas cannot compute the step
    one = _one_node(rebatch(graph, graph.batch // r), _node(cluster, nodes[0]), measured)
    order: list[tuple[str, ...]] = [()] * len(cluster.devices)
    for k, devs in enumerate(nodes):  # replica k runs on node k as the one-node plan runs on node 0
        for d, x in enumerate(devs):
            order[x] = tuple(f"r{k}/{name}" for name in one.order[d])
    s = Strategy(planner="megatron", n_devices=len(cluster.devices), replicas=r, order=tuple(order),
                 placement={f"r{k}/{name}": devs[d] for name, d in one.placement.items()
                            for k, devs in enumerate(nodes)},
                 holders={name: tuple(sorted(devs[d] for d in held for devs in nodes))
                          for name, held in one.holders.items()},
                 splits=tuple(replace(sp, op=f"r{k}/{sp.op}") for k in range(r) for sp in one.splits),
                 chained=tuple(f"r{k}/{c}" for k in range(r) for c in one.chained))
    return ordered(graph, s, cluster, measured)


def held_in_parts(graph: OpGraph, cluster: Cluster, base: Strategy,
                  measured: MeasuredCosts | None = None) -> Strategy:
    """`base`, a mixed plan that holds linear layers once (`owt`'s), with those layers tensor-parallel over
    the devices of the node that holds the largest of them: each device holds its part of their weights and
    computes it for every shard, as Megatron cuts an MLP (the first layer by its output features, the next by
    its input features, the propagation decides), instead of one device computing every shard's whole layer.
    The rest stays where `base` runs it. vgg19 on 2x4xV100: owt's device holding classifier.0 runs its eight
    shards' 411 MB matmuls, 20 ms more than any other device (95.8 ms a step); in four parts, 81.6 ms.
    Only a weight of at least 1/LARGE_SHARE of the parameters is cut (vgg19's classifier.0 and .3, 74% and
    12%, not .6): owt holds every FFN of bert-large once, 1% each, and cutting them all took 3 s of planning
    for a plan slower than the search's. FasttError where `base` holds no such linear layer once, or its node
    has one device."""
    sub = rebatch(graph, graph.batch // base.replicas)
    held = {name: devs[0] for name, devs in base.holders.items() if len(devs) == 1}
    large = sum(sub.ops[i].out_bytes for i in sub.of_kind(PARAM)) / LARGE_SHARE
    # each cut by its output features; the propagation makes the next layer row-parallel
    seeds = {name: d for name, d in linear_weights(sub).items()
             if name in held and sub.ops[sub.index[name]].out_bytes >= large}
    if not seeds:
        raise FasttError(f"'{base.planner}' holds no large linear layer of '{graph.name}' once")
    biggest = max(seeds, key=lambda name: sub.ops[sub.index[name]].out_bytes)
    devices = next(devs for devs in node_devices(cluster) if held[biggest] in devs)
    if len(devices) < 2:
        raise FasttError(f"the node holding '{biggest}' has one device: nothing to cut it over")
    splits, chained = tensor_parallel(sub, len(devices), seeds)
    r = base.replicas
    cut = replace(base, splits=tuple(replace(sp, op=f"r{k}/{sp.op}") for k in range(r) for sp in splits),
                  chained=tuple(f"r{k}/{c}" for k in range(r) for c in chained))
    g = graph_for(graph, replace(cut, placement={}))
    device_of = [0] * len(g.ops)
    for i, op in enumerate(g.ops):  # a part on its node's device, the rest as `base` runs it, new joins at
        placed = [device_of[j] for j in op.inputs if g.ops[j].kind in (COMPUTE, INPUT)]  # their first input
        device_of[i] = (devices[op.split[1]] if op.split else base.placement.get(op.name, placed[0] if placed
                                                                                 else 0))
    s = strategy_from(g, base.planner, len(cluster.devices), device_of, replicas=r)
    return ordered(graph, replace(s, splits=cut.splits, chained=cut.chained), cluster, measured)


def _node(cluster: Cluster, devices: tuple[int, ...]) -> Cluster:
    """The cluster of `devices` (one node's), with the links and routes between them."""
    return replace(cluster, name=f"{cluster.name}[{devices[0]}..{devices[-1]}]",
                   devices=tuple(cluster.devices[d] for d in devices),
                   routes={(a, b): cluster.routes[devices[a], devices[b]] for a in range(len(devices))
                           for b in range(len(devices)) if a != b})


def _one_node(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None) -> Strategy:
    """Megatron's tensor parallelism of `graph` over every device of one node."""
    n = len(cluster.devices)
    splits, chained = tensor_parallel(graph, n)
    plain = Strategy(planner="megatron", n_devices=n, placement={}, order=((),) * n, holders={},
                     splits=splits, chained=chained)
    g = graph_for(graph, plain)
    placed = schedule(g, plan_costs(g, cluster, measured))
    device_of = [op.split[1] if op.split else max(d, 0) for op, d in zip(g.ops, placed.dev)]
    s = replace(strategy_from(g, "megatron", n, device_of, start=placed.start), splits=splits,
                chained=chained)
    return ordered(graph, s, cluster, measured)
