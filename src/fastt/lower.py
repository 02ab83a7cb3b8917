"""Lowering: a Strategy on a captured step -> one program per device, its tasks in the strategy's order.

A task runs the fx nodes of one placed op for one replica: all of the op's aten calls, or one part of a split
op (`split.run_part` on the head node), or the join of a split op's parts followed by the alias nodes that
read it, or one replica's rows of a sharded update (`fastt.shard`: its nodes on those rows). Allreduces are
not placed: the runtime runs each once, for the first task that needs it. Resident
tensors and inputs are placeholders of the captured step, bound before the step runs; its constants (get_attr
nodes) are read into every replica's table before the step, as every device has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from .capture import Step
from .errors import FasttError
from .graph import ALLREDUCE, COMPUTE, INPUT, PARAM, RESIDENT, UPDATE, OpGraph, loss_weights, replica_of
from .loss import ONE, ReplicaWeights
from .shard import ALL_GATHER, CUTS
from .split import alias_path, graph_for, out_cut, rule
from .strategy import Strategy

RUN, PART, JOIN, SHARD = "run", "part", "join", "shard"


@dataclass(frozen=True)
class Task:
    """One op of the plan for one replica. `waits`: ops (by index) whose results it reads, allreduces
    included."""

    op: int
    name: str
    kind: str
    replica: int
    nodes: tuple[str, ...]
    head: str = ""
    part: tuple = ()
    waits: tuple[int, ...] = ()
    given: tuple[tuple[int, str], ...] = ()  # a part's (arg position, value): its producer's part (a chain)
    views: tuple[tuple[str, int], ...] = ()  # a part's view nodes its chained readers read, each on its part
    # (`split.view_part`), with the dim its input is cut along
    renamed: tuple[tuple[str, str], ...] = ()  # a chained update part: value it reads -> the part it reads
    tag: str = ""  # appended to the names of the values it writes ("#k": a chained update's part k)


def part_names(t: Task) -> tuple[str, ...]:
    """The values part task `t` writes: its head's part k and the views of it its chained readers read."""
    k = t.part[1]
    return (f"{t.head}#{k}", *(f"{name}#{k}" for name, _ in t.views))


@dataclass(frozen=True)
class Lowered:
    """The programs of a strategy: `programs[d]` runs on device d; `allreduces[a]` lists the fx nodes (the
    gradients) that allreduce op `a` averages across replicas."""

    graph: OpGraph
    step: Step
    replicas: int
    programs: tuple[tuple[Task, ...], ...]
    allreduces: dict[int, tuple[str, ...]]
    # constants, alias nodes of residents and inputs (views of a parameter): run first
    prelude: tuple[str, ...] = ()
    weights: ReplicaWeights = ONE  # each replica's loss weight (`fastt.loss`)
    # results of chained updates (a new parameter or state): name -> (dim, parts) its parts `name#k` join on
    # (dim -1: each part computes it whole, Adam's step count)
    joined: dict[str, tuple[int, int]] = field(default_factory=dict)


def _task(g: OpGraph, i: int, call_nodes: set[str], nodes: dict[str, fx.Node],
          views: dict[int, dict[str, int]], renamed: dict[int, dict[str, str]]) -> Task:
    op = g.ops[i]
    waits = tuple(j for j in dict.fromkeys(op.inputs) if g.ops[j].kind not in RESIDENT
                  and g.ops[j].kind != INPUT)
    r = replica_of(op.name)
    if op.kind == UPDATE and op.split:  # replica r's rows of a sharded update; `head`: the parameter's node
        param = next(g.ops[u] for u in op.updates if g.ops[u].kind == PARAM)
        reads = renamed.get(i, {})  # a chained update's part reads its gradient's part
        return Task(i, op.name, SHARD, r, tuple(n for n in op.nodes if n in call_nodes), head=param.nodes[0],
                    part=op.split, waits=waits, renamed=tuple(reads.items()),
                    tag=f"#{op.split[1]}" if reads else "")
    if op.split:
        args = nodes[op.head].args
        given = tuple((pos, f"{args[pos].name}#{g.ops[op.inputs[j]].split[1]}")
                      for pos, j in enumerate(op.arg_inputs) if j >= 0 and g.ops[op.inputs[j]].split)
        return Task(i, op.name, PART, r, (op.head,), head=op.head, part=op.split, waits=waits, given=given,
                    views=tuple(views.get(i, {}).items()))
    if op.target.startswith("join:"):
        head = g.ops[op.inputs[0]].head
        return Task(i, op.name, JOIN, r, tuple(n for n in op.nodes if n in call_nodes), head=head,
                    waits=waits)
    return Task(i, op.name, RUN, r, tuple(n for n in op.nodes if n in call_nodes), waits=waits)


def part_args(t: Task, node: fx.Node) -> tuple[list[Any], dict[str, Any]]:
    """What part task `t` passes its head `node`: its args and kwargs with every fx node an input, as value
    names (str) where the task reads a chained producer's part instead (`t.given`)."""
    given = dict(t.given)
    args = [given.get(pos, a) for pos, a in enumerate(node.args)]
    return args, dict(node.kwargs)


def part_reads(t: Task, node: fx.Node) -> list[str]:
    """The names of the values part task `t` reads to run its head `node`, in argument order."""
    names: list[str] = []
    args, kwargs = part_args(t, node)
    for a in (*args, kwargs):
        if isinstance(a, str):
            names.append(a)
        else:
            fx.node.map_arg(a, lambda n: names.append(n.name))
    return list(dict.fromkeys(names))


def _allreduce_nodes(g: OpGraph, a: int, nodes: dict, renamed: dict[int, dict[str, str]]) -> tuple[str, ...]:
    """The gradient nodes allreduce `a` carries: what its readers read from its inputs' producers (a split
    gradient's join makes its head node's value, which the join op does not list among its nodes); of the
    allreduce of every replica's part of a split gradient, the part's values its chained updates read."""
    made = g.ops[g.ops[a].inputs[0]]
    if made.split:
        return tuple(dict.fromkeys(name for s in g.succs[a] for name in renamed.get(s, {}).values()))
    produced = set(made.nodes) | ({g.ops[made.inputs[0]].head} if made.target.startswith("join:") else set())
    read = []
    for s in g.succs[a]:
        for n in g.ops[s].nodes:
            read += [x.name for x in nodes[n].all_input_nodes if x.name in produced]
    return tuple(dict.fromkeys(read))


def _chained_views(g: OpGraph, nodes: dict[str, fx.Node]) -> tuple[dict[int, dict[str, int]],
                                                                    dict[int, dict[str, str]]]:
    """For each producer part (by op index): the view nodes of its head that chained parts read, in graph
    order, each with the dim its input is cut along (`split.alias_path`); and for each chained update part:
    the value it reads -> the name of that value's part k."""
    views: dict[int, dict[str, int]] = {}
    renamed: dict[int, dict[str, str]] = {}
    for i, op in enumerate(g.ops):
        if not op.split:
            continue
        if op.kind == COMPUTE:
            args = nodes[op.head].args
            reads = [(args[pos], j) for pos, j in enumerate(op.arg_inputs) if j >= 0]
        else:  # an update's part: what its nodes read from outside it
            reads = [(x, j) for n in op.nodes for x in nodes[n].all_input_nodes if x.name not in op.nodes
                     for j in range(len(op.inputs))]
        for a, j in reads:
            srcs = [op.inputs[j]]
            if op.kind == UPDATE and g.ops[srcs[0]].kind == ALLREDUCE:
                # every replica's part makes the view: the allreduce averages each replica's, and replicas on
                # one device leave one update (`graph.duplicate_updates`: owt's layers in parts, 8 shards)
                srcs = list(dict.fromkeys(g.ops[srcs[0]].inputs))
            for src in srcs:
                p = g.ops[src]
                if not p.split or p.kind != COMPUTE:
                    continue
                d = out_cut(rule(p.target, p.split[0]), nodes[p.head].meta.get("val"))
                path = alias_path(nodes[p.head], a, d, p.split[2]) if d is not None else None
                if path is None:
                    continue
                for v, dv in path:
                    views.setdefault(src, {})[v.name] = dv
                if op.kind != COMPUTE:
                    renamed.setdefault(i, {})[a.name] = f"{a.name}#{p.split[1]}"
    return views, renamed


def lower(graph: OpGraph, strategy: Strategy) -> Lowered:
    """One program per device for `strategy` on the captured `graph` (see the module docstring)."""
    g = graph_for(graph, strategy, traced=True)
    strategy.validate(g)
    step = g.fx
    if not isinstance(step, Step):
        raise FasttError(f"graph '{graph.name}' was not captured from a model: there is nothing to run")
    nodes = {n.name: n for n in step.gm.graph.nodes}
    call_nodes = {name for name, n in nodes.items() if n.op == "call_function"}
    views, renamed = _chained_views(g, nodes)
    programs = tuple(tuple(_task(g, g.index[name], call_nodes, nodes, views, renamed) for name in order
                           if g.ops[g.index[name]].kind != INPUT) for order in strategy.order)
    # A sharded update's all-gather is read by no op of the step: the runtime joins the rows at its end.
    allreduces = {a: _allreduce_nodes(g, a, nodes, renamed) for a, op in enumerate(g.ops)
                  if op.kind == ALLREDUCE and op.target != ALL_GATHER}
    constants = [name for name, n in nodes.items() if n.op == "get_attr"]
    prelude = tuple(dict.fromkeys([*constants, *(n for op in g.ops if op.kind in RESIDENT or op.kind == INPUT
                                                 for n in op.nodes if n in call_nodes)]))
    order = {name: k for k, name in enumerate(nodes)}
    weights = loss_weights(graph, g, strategy.replicas)
    results = {x.name for x in next(n for n in nodes.values() if n.op == "output").args[0]}
    joined = {n: (CUTS[g.ops[i].split[0]] if nodes[n].meta["val"].shape == nodes[t.head].meta["val"].shape
                  else -1, g.ops[i].split[2])
              for prog in programs for t in prog if t.tag for i in [t.op] for n in t.nodes if n in results}
    return Lowered(graph=g, step=step, replicas=strategy.replicas, programs=programs, allreduces=allreduces,
                   prelude=tuple(sorted(prelude, key=order.__getitem__)), weights=weights, joined=joined)
