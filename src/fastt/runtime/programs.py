"""Compiled programs: a strategy lowered and cut into the segments each device runs, for either runtime.

`compile_programs` cuts each device's program into segments: runs of consecutive tasks that need nothing from
another device once started (a segment ends where another device waits for its last op, and starts where it
waits for another device or an allreduce). A segment of plain tasks becomes one generated Python function
(torch.fx codegen), so its values stay local and only the ones read elsewhere go through the replica's shared
table (a sharded update's task reads its rows of the values with its parameter's shape); split parts and
joins are interpreted. `place` lowers, compiles and simulates a strategy, with the
segments' release points (`release_points`), so that the simulator times the step the runtimes run. The local
runtime (`local.run_step`) runs the segments in threads, the distributed one a rank per device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import fx

from ..cluster import Cluster, torch_device
from ..cost import MeasuredCosts, direct
from ..errors import FasttError
from ..graph import UPDATE, OpGraph
from ..lower import JOIN, PART, RUN, SHARD, Lowered, Task, lower, part_reads
from ..shard import CUTS, REDUCE_SCATTER, chained_part, sharded_residents
from ..simulate import simulate_plan
from ..split import rule, slice_dims
from ..strategy import Strategy
from .oom import Budget, budgets

CODE = (RUN, SHARD)  # tasks whose nodes run as generated code (split parts and joins are interpreted)


@dataclass(frozen=True)
class Segment:
    """Consecutive tasks of one device and replica that run without waiting once `waits` (ops of other
    devices, allreduces) have finished. `fn([*inputs]) -> outputs` is their generated code (None for a split
    part or join); it takes its inputs as one list, which it empties."""

    replica: int
    tasks: tuple[Task, ...]
    waits: tuple[int, ...]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    fn: Callable | None = None
    reads: tuple[str, ...] = ()  # what it reads from its replica's table (`segment_reads`)


def segment_reads(low: Lowered, seg: Segment, nodes: dict[str, fx.Node]) -> tuple[str, ...]:
    """The values of its replica's table that segment `seg` reads (an interpreted part or join: every value
    its nodes read, those it wrote itself included)."""
    if seg.fn is not None:
        return seg.inputs
    t = seg.tasks[0]
    read = [x.name for name in t.nodes for x in nodes[name].all_input_nodes]
    if t.kind == PART:
        read += part_reads(t, nodes[t.head])
    elif t.kind == JOIN:
        read += [f"{t.head}#{k}" for k in range(low.graph.ops[t.waits[0]].split[2])]
    return tuple(dict.fromkeys(read))


def on_device(kwargs: dict, device: torch.device) -> dict:
    """An op's kwargs with a factory op's `device` (the device the step was captured on) set to `device`."""
    dev = kwargs.get("device")
    return {**kwargs, "device": device} if isinstance(dev, torch.device) and dev != device else kwargs


def _generate(low: Lowered, nodes: dict[str, fx.Node], tasks: Sequence[Task], device: torch.device,
              kept: frozenset[str]) -> tuple[tuple[str, ...], tuple[str, ...], Callable]:
    """The code of a run of plain tasks on `device`: (names it reads, names read after it, function). Of the
    step's results only those its end reads (`kept`) leave the code: the gradients die where eager's do."""
    names = [name for t in tasks for name in t.nodes]
    inside = set(names)
    inputs = tuple(dict.fromkeys(x.name for name in names for x in nodes[name].all_input_nodes
                                 if x.name not in inside))
    outputs = tuple(name for name in names if any(u.name not in inside and (u.op != "output" or name in kept)
                                                  for u in nodes[name].users))
    g = fx.Graph()
    values = {name: g.placeholder(name) for name in inputs}
    given = given_rows(low) if any(t.kind == SHARD for t in tasks) else set()
    for t in tasks:
        local = values
        if t.kind == SHARD:  # its rows of what it reads with the parameter's shape (`fastt.shard`); the
            # reduce-scatter hands it only its rows of the mean already, and its table holds only its rows of
            # the state (`held_rows`); a chained update's part reads its gradient's part (`t.renamed`)
            shape, (cut, k, parts) = nodes[t.head].meta["val"].shape, t.part
            own, local = set(t.nodes) | given | {x for x, _ in t.renamed}, {}
            for x in dict.fromkeys(x for name in t.nodes for x in nodes[name].all_input_nodes):
                val = x.meta.get("val")
                if x.name not in own and isinstance(val, torch.Tensor) and val.shape == shape:
                    local[x.name] = g.call_function(rows, (values[x.name], parts, k, CUTS[cut]))
        for name in t.nodes:
            values[name] = g.node_copy(nodes[name], lambda a, local=local: local.get(a.name, values[a.name]))
            values[name].kwargs = on_device(values[name].kwargs, device)
            if values[name].op == "call_function":
                values[name].target = direct(values[name].target)
    g.output(tuple(values[name] for name in outputs))
    # AOTAutograd's calling convention: the code takes its inputs as one list and empties it, so an input
    # the caller gave up is freed after its last use inside the code, not when the code returns.
    g.set_codegen(fx.graph._BoxedCodeGen())
    if tasks[0].tag:  # a chained update's part (alone in its segment): it reads and writes parts' names
        ren = dict(tasks[0].renamed)
        inputs = tuple(ren.get(x, x) for x in inputs)
        outputs = tuple(x + tasks[0].tag for x in outputs)
    return inputs, outputs, fx.GraphModule(low.step.gm, g).forward


def scattered(low: Lowered) -> set[str]:
    """The gradients a reduce-scatter carries, of which each replica's table holds only its rows of the mean:
    those no allreduce carries too (a gradient clip's norm reads the whole mean: then the mean is whole and
    each part reads its rows of it)."""
    whole = {name for a, names in low.allreduces.items() if low.graph.ops[a].target != REDUCE_SCATTER
             for name in names}
    return {name for a, names in low.allreduces.items() if low.graph.ops[a].target == REDUCE_SCATTER
            for name in names} - whole


def held_rows(low: Lowered) -> dict[str, int]:
    """The optimizer state of sharded updates (placeholder -> parts): each replica's table holds its rows of
    it, as a distributed rank keeps only its own across steps. Not a chained update's (tensor parallelism):
    its parts share one replica's table, which holds the state whole."""
    g = low.graph
    out = {}
    for j, parts in sharded_residents(g).items():
        writers = [g.ops[i] for i in g.succs[j] if g.ops[i].kind == UPDATE and g.ops[i].split]
        if not any(chained_part(g, w) for w in writers):
            out[g.ops[j].nodes[0]] = parts
    return out


def given_rows(low: Lowered) -> set[str]:
    """The values of the parameter's shape that a sharded update's table holds as its rows already."""
    return scattered(low) | set(held_rows(low))


def rows(x: torch.Tensor, parts: int, k: int, dim: int = 0) -> torch.Tensor:
    """Part k of x's dim `dim` cut into `parts`, as torch.tensor_split cuts it (a sharded update's rows)."""
    return torch.tensor_split(x, parts, dim)[k]


def row_counts(n: int, parts: int) -> list[int]:
    """How many of n rows each of `parts` parts has, as torch.tensor_split cuts them."""
    return [n // parts + (k < n % parts) for k in range(parts)]


class Writeback(NamedTuple):
    """A placeholder (a batch-norm buffer) that replica 0 updates in place on `device`: the whole tensor
    (`region` None) or the slice (dim, k, parts) that part k of a split op updates."""

    name: str
    device: int
    region: tuple[int, int, int] | None


def written_placeholders(n: fx.Node) -> list[str]:
    """The placeholders node n writes in place: a buffer `copy_`'d into, batch norm's running statistics
    (which `native_batch_norm` updates in training although its schema does not say so)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    values = [*n.args, *(n.kwargs.get(a.name) for a in schema.arguments[len(n.args):])]
    written = [v for a, v in zip(schema.arguments, values)
               if a.alias_info is not None and a.alias_info.is_write]
    if n.target is torch.ops.aten.native_batch_norm.default and values[5]:
        written += values[3:5]
    return [v.name for v in written if isinstance(v, fx.Node) and v.op == "placeholder"]


def _writes(t: Task, d: int, nodes: dict[str, fx.Node]) -> list[Writeback]:
    """What task t on device d writes in place: the whole of a placeholder, or the slice that part k of a
    split op writes (batch norm split by channel)."""
    if t.kind != PART:
        return [Writeback(x, d, None) for name in t.nodes for x in written_placeholders(nodes[name])]
    n = nodes[t.head]
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]
    dims = slice_dims(rule(n.target, t.part[0]), vals)
    pos = {a.name: i for i, a in enumerate(n.args) if isinstance(a, fx.Node)}
    return [Writeback(x, d, None if dims[pos[x]] is None else (dims[pos[x]], t.part[1], t.part[2]))
            for x in written_placeholders(n)]


@dataclass(frozen=True)
class Programs:
    """The compiled programs: `devices[d]` is device d's segments; `signals` the ops some device waits for;
    the step's nodes by name, its placeholders and its outputs (names), looked up once. `targets[d]` is the
    torch device device d runs on, `streams[d]` its CUDA stream (CUDA only); `writeback` the placeholders
    (batch-norm buffers) that replica 0 updates in place."""

    devices: tuple[tuple[Segment, ...], ...]
    signals: frozenset[int]
    nodes: dict[str, fx.Node]
    placeholders: tuple[str, ...]
    outputs: tuple[str, ...]
    targets: tuple[torch.device, ...]
    streams: tuple = ()
    writeback: tuple[Writeback, ...] = ()
    copy_streams: dict = field(default_factory=dict)  # (device, source GPU) -> stream copying to the device
    # (replica, value) -> how many segments and allreduces read it; values the step's end reads are `kept`
    readers: dict[tuple[int, str], int] = field(default_factory=dict)
    kept: frozenset[str] = frozenset()
    # per device, the allreduces whose gradients and readers are all on it (a pipeline stage's microbatches,
    # one-node's shards): the local runtime sums each as soon as its last gradient is made
    accumulate: tuple[tuple[int, ...], ...] = ()

    @property
    def cuda(self) -> bool:
        return self.targets[0].type == "cuda"


def _streams(targets: Sequence[torch.device]) -> tuple:
    """A CUDA stream per device: its GPU's default stream for the first device on a GPU, a new one after."""
    seen: set[torch.device] = set()
    out = []
    for dev in targets:
        out.append(torch.cuda.Stream(dev) if dev in seen else torch.cuda.default_stream(dev))
        seen.add(dev)
    return tuple(out)


def compile_programs(low: Lowered, targets: Sequence[str | torch.device] | None = None) -> Programs:
    """Each device's program as segments (see the module docstring); `targets[d]` is the torch device device
    d runs on (default: all on the CPU)."""
    targets = tuple(torch.device(t) for t in (targets or ["cpu"] * len(low.programs)))
    if len({t.type for t in targets}) > 1 or len(targets) != len(low.programs):
        raise FasttError(f"devices {[str(t) for t in targets]}: the runtime needs one kind of device per "
                         f"plan device ({len(low.programs)})")
    device_of = {t.op: d for d, program in enumerate(low.programs) for t in program}
    # What each task waits for from elsewhere: ops of other devices and allreduces.
    foreign = {t.op: tuple(j for j in t.waits if j in low.allreduces or device_of[j] != d)
               for d, program in enumerate(low.programs) for t in program}

    def gated(t: Task) -> bool:  # waits for an allreduce, and for nothing else on another device
        return bool(foreign[t.op]) and all(j in low.allreduces for j in foreign[t.op])

    handoffs = {j for waits in foreign.values() for j in waits if j not in low.allreduces}
    nodes = {n.name: n for n in low.step.gm.graph.nodes}
    placeholders = tuple(name for name, n in nodes.items() if n.op == "placeholder")
    outputs = tuple(x.name for x in next(n for n in nodes.values() if n.op == "output").args[0])
    n = len(low.step.param_names)
    kept = frozenset([*placeholders, *low.prelude, outputs[0], *outputs[1 + n:],
                      *(f"{x}#{k}" for x, (_, parts) in low.joined.items() for k in range(parts))])
    programs = []
    for d, program in enumerate(low.programs):
        runs: list[list[Task]] = []
        for t in program:
            prev = runs[-1][-1] if runs else None
            # Gradients are not cut out of a segment for the allreduce: its readers, the updates, come at the
            # end of the backward. A run of updates waits for all its allreduces up front.
            joins = prev is not None and (not foreign[t.op] or gated(t) and gated(prev))
            if (not joins or t.kind not in CODE or prev.kind not in CODE or prev.op in handoffs
                    or prev.replica != t.replica or t.tag or prev.tag):
                runs.append([])
            runs[-1].append(t)
        segments = []
        for tasks in runs:
            waits = list(dict.fromkeys(j for t in tasks for j in foreign[t.op]))
            # Devices take a run's allreduces from different starting points, so they compute them side by
            # side.
            k = len(waits) * d // len(low.programs)
            waits = tuple(waits[k:] + waits[:k])
            code = _generate(low, nodes, tasks, targets[d], kept) if tasks[0].kind in CODE else ((), (), None)
            seg = Segment(tasks[0].replica, tuple(tasks), waits, *code)
            segments.append(replace(seg, reads=segment_reads(low, seg, nodes)))
        programs.append(tuple(segments))
    signals = handoffs | {j for a in low.allreduces for j in low.graph.ops[a].inputs} | set(low.allreduces)
    writeback = tuple(w for d, program in enumerate(low.programs) for t in program if t.replica == 0
                      for w in _writes(t, d, nodes))
    readers: Counter[tuple[int, str]] = Counter(
        (seg.replica, name) for segs in programs for seg in segs for name in seg.reads)
    readers.update((k, name) for names in low.allreduces.values() for name in names
                   for k in range(low.replicas))
    accumulate: list[list[int]] = [[] for _ in low.programs]
    for a in low.allreduces:
        devices = {device_of.get(j) for j in (*low.graph.ops[a].inputs, *low.graph.succs[a])}
        if len(devices) == 1 and None not in devices:
            accumulate[devices.pop()].append(a)
    return Programs(tuple(programs), frozenset(signals), nodes, placeholders, outputs, targets,
                    _streams(targets) if targets[0].type == "cuda" else (), writeback, readers=dict(readers),
                    kept=kept, accumulate=tuple(map(tuple, accumulate)))


@dataclass(frozen=True)
class Placed:
    """A strategy ready to run: its per-device programs, its simulated iteration time (measured op costs) and
    each device's simulated peak memory beside its memory (`budgets`, what a step that runs out names)."""

    strategy: Strategy
    lowered: Lowered
    programs: Programs
    simulated_s: float
    budgets: tuple[Budget, ...] = ()


def place(graph: OpGraph, strategy: Strategy, cl: Cluster, costs: MeasuredCosts,
          targets: Sequence[str | torch.device] | None = None) -> Placed:
    """Lower and compile `strategy` for `targets` (the torch device of each device; default: the cluster's); a
    strategy that does not fit in device memory is refused."""
    low = lower(graph, strategy)
    programs = compile_programs(low, targets or [torch_device(dev) for dev in cl.devices])
    tl = simulate_plan(graph, strategy, cl, costs, release=release_points(low, programs))
    if not tl.fits:
        raise FasttError("the plan does not fit in device memory: " + "; ".join(tl.oom))
    return Placed(strategy, low, programs, tl.iteration_s, budgets(tl))


def release_points(low: Lowered, programs: Programs) -> dict[str, str]:
    """Op -> the last op of its segment: what an op hands to other devices (values, gradients for an
    allreduce) leaves when its segment ends. The simulator's `release`, so it simulates the step the runtimes
    run."""
    ops = low.graph.ops
    return {ops[t.op].name: ops[seg.tasks[-1].op].name
            for segs in programs.devices for seg in segs for t in seg.tasks[:-1]}
