"""OpGraph: the DAG of one training step that planners, the cost model and the simulator see.

An `Op` is one schedulable unit: a compute op (an aten op with the cheap view-like ops grouped into it), a
resident tensor (parameter, optimizer state, buffer), an input of the batch, an optimizer `update` of one
parameter, or an `allreduce` that aggregates a gradient across replicas. Ops are stored in topological order
and refer to their producers by index.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property

from .errors import FasttError
from .loss import ONE, ReplicaWeights, replica_weights

# Op kinds. RESIDENT kinds live on their holder devices across iterations; the rest are produced in the step.
INPUT, PARAM, STATE, BUFFER, COMPUTE, UPDATE, ALLREDUCE = (
    "input", "param", "state", "buffer", "compute", "update", "allreduce")
RESIDENT = frozenset({PARAM, STATE, BUFFER})


@dataclass(frozen=True)
class Op:
    """One node of the OpGraph.

    `inputs[k]` is the index of a producer and `in_bytes[k]` the bytes this op reads from it (an edge's
    transfer size). `out_bytes` is what the op allocates for its results. An optimizer update (`updates` lists
    the residents it writes, by index) makes the new parameter and state as fresh tensors: they count in its
    `out_bytes` and live to the end of the step, beside the old ones.
    `batch` is True when the op's work depends on the input batch (data parallelism divides it). `dtype`: what
    its FLOPs are computed in (its matmul's or convolution's inputs: "bfloat16" under autocast), "" for none.
    """

    name: str
    kind: str
    target: str
    inputs: tuple[int, ...] = ()
    in_bytes: tuple[int, ...] = ()
    out_bytes: int = 0
    flops: float = 0.0
    io_bytes: int = 0
    nodes: tuple[str, ...] = ()
    updates: tuple[int, ...] = ()
    batch: bool = False
    signature: str = ""
    head: str = ""  # the fx node of the op's main aten call ("" for residents, inputs, hand-built ops)
    arg_inputs: tuple[int, ...] = ()  # per positional arg of `head`: its position in `inputs`, or -1
    split: tuple[str, int, int] | tuple[()] = ()  # (dim name, part index, parts) for a part of a split op
    temp_bytes: int = 0  # what it allocates beyond its results while it runs (an update's temporaries)
    dtype: str = ""
    out_parts: tuple[int, ...] = ()  # bytes of each storage of its results, when they are several
    in_parts: tuple[tuple[int, ...], ...] = ()  # per input: the parts of it this op keeps alive (() all)
    returned: tuple[int, ...] = ()  # the parts the step returns (its loss): they live to the step's end


@dataclass(frozen=True)
class OpGraph:
    """A DAG of Ops in topological order, for a step at a given batch size.

    `recapture(batch)` returns the same step captured at another batch size (data parallelism needs the step
    at batch/N); it is None for graphs built by hand. `fx` is the captured torch.fx GraphModule, if any.
    """

    ops: tuple[Op, ...]
    name: str = "graph"
    batch: int = 1
    fx: object | None = field(default=None, compare=False, repr=False)
    recapture: Callable[[int], OpGraph] | None = field(default=None, compare=False, repr=False)
    replicas: int = 1
    fx_nodes: int = 0  # aten nodes captured before grouping (0 for graphs built by hand)

    def __post_init__(self) -> None:
        for i, op in enumerate(self.ops):
            if len(op.inputs) != len(op.in_bytes) or op.in_parts and len(op.in_parts) != len(op.inputs):
                raise ValueError(f"op {op.name}: inputs, in_bytes and in_parts differ in length")
            if op.out_parts and sum(op.out_parts) != op.out_bytes:
                raise ValueError(f"op {op.name}: out_parts do not add up to out_bytes")
            for j in op.inputs:
                if not 0 <= j < i:
                    raise ValueError(f"op {op.name} reads op #{j}: ops must be in topological order")

    def __len__(self) -> int:
        return len(self.ops)

    @cached_property
    def index(self) -> dict[str, int]:
        """Op name -> position."""
        idx = {op.name: i for i, op in enumerate(self.ops)}
        if len(idx) != len(self.ops):
            raise ValueError("op names must be unique")
        return idx

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the indices of the ops that read it (each once)."""
        out: list[list[int]] = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            for j in dict.fromkeys(op.inputs):
                out[j].append(i)
        return tuple(tuple(s) for s in out)

    @cached_property
    def reads(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """For each op, (producer, bytes) once per distinct input: a tensor read twice moves once, the larger
        size."""
        out = []
        for op in self.ops:
            if len(set(op.inputs)) == len(op.inputs):
                out.append(tuple(zip(op.inputs, op.in_bytes)))
                continue
            seen: dict[int, int] = {}
            for j, b in zip(op.inputs, op.in_bytes):
                seen[j] = max(b, seen.get(j, 0))
            out.append(tuple(seen.items()))
        return tuple(out)

    @cached_property
    def _replicated(self) -> dict[tuple[int, bool], OpGraph]:
        """data_parallel_graph's graphs of this step, by replica count and whether traced."""
        return {}

    @cached_property
    def _without(self) -> dict[frozenset[int], OpGraph]:
        """without_unplaced_updates' last graph of this one, by the ops it leaves out."""
        return {}

    @cached_property
    def residents(self) -> tuple[int, ...]:
        """Indices of the resident ops (parameters, optimizer state, buffers)."""
        return tuple(i for i, op in enumerate(self.ops) if op.kind in RESIDENT)

    def of_kind(self, *kinds: str) -> list[int]:
        return [i for i, op in enumerate(self.ops) if op.kind in kinds]

    def resident_bytes(self) -> int:
        return sum(self.ops[i].out_bytes for i in self.residents)

    def summary(self) -> dict[str, int | float]:
        kinds: dict[str, int] = {}
        for op in self.ops:
            kinds[op.kind] = kinds.get(op.kind, 0) + 1
        return {"ops": len(self.ops), "edges": sum(len(op.inputs) for op in self.ops),
                "flops": sum(op.flops for op in self.ops), "resident_bytes": self.resident_bytes(), **kinds}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: planning and simulating allocate many small tuples, and each collection walks
    every object alive, the graphs and the captured fx modules included (bert-large on 2x4xV100: 20.1 s of
    planning with it, 16.2 s without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            # what the body keeps alive goes to the oldest generation unscanned: the first young collection
            # after it walked each of its objects (gnmt on 8 devices: ~1.8M, 0.4-1.2 s after planning)
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


def parts(op: Op) -> tuple[int, ...]:
    """Bytes of each storage of an op's results (`Op.out_parts`, or one storage of `out_bytes`)."""
    return op.out_parts or (op.out_bytes,)


def kept_parts(g: OpGraph, i: int, j: int) -> tuple[int, ...]:
    """The parts of op j's results that op i keeps alive by reading them (all, unless its `in_parts` say)."""
    n = len(g.ops[j].out_parts)
    if n < 2:
        return (0,)
    op = g.ops[i]
    if not op.in_parts:
        return tuple(range(n))
    kept = {p for k, src in enumerate(op.inputs) if src == j for p in op.in_parts[k] or range(n)}
    return tuple(sorted(kept))


def chain_lengths(graph: OpGraph, weight: Sequence[float]) -> list[float]:
    """Longest weighted path ending at each op (weights on ops, edges free)."""
    best = [0.0] * len(graph.ops)
    for i, op in enumerate(graph.ops):
        best[i] = weight[i] + max((best[j] for j in op.inputs), default=0.0)
    return best


def part_signature(whole: str, dim: str, share: float) -> str:
    """The signature of a part of a split op: the whole op's, the dim and the part's share of it ("" where
    the whole has none). `whole_share` reads them back."""
    return f"{whole}|{dim}:{share:.6g}" if whole else ""


def whole_share(signature: str) -> tuple[str, float] | None:
    """(the whole op's signature, the part's share of it) of a part's signature, else None."""
    whole, bar, rest = signature.rpartition("|")
    return (whole, float(rest.rpartition(":")[2])) if bar and whole else None


def rebatch(graph: OpGraph, batch: int, traced: bool = False) -> OpGraph:
    """The same step at another batch size: for planning, derived from `graph`'s capture where it can be
    (`fastt.rebatch`); `traced`, captured again at that batch (what a runtime runs, or measures)."""
    if batch == graph.batch:
        return graph
    if graph.recapture is None:
        raise FasttError(f"graph '{graph.name}' was built by hand: it cannot be captured at batch {batch}")
    return (getattr(graph.recapture, "traced", graph.recapture) if traced else graph.recapture)(batch)


def data_parallel_graph(graph: OpGraph, n: int, traced: bool = False) -> OpGraph:
    """The step at batch/n replicated n times (`graph` itself when n == 1), built once per graph, n and
    `traced` (see `rebatch`; planners build it many times: every mixed plan runs on it)."""
    built = graph._replicated
    if (n, traced) not in built:
        built[n, traced] = replicate(_replica_step(graph, n, traced), n)
    return built[n, traced]


def _replica_step(graph: OpGraph, n: int, traced: bool = False) -> OpGraph:
    """The step at batch/n that n replicas run; FasttError if they cannot compute `graph`'s step."""
    if graph.batch % n:
        raise FasttError(f"batch {graph.batch} of '{graph.name}' does not split into {n} equal replicas: "
                         f"use a batch divisible by {n}")
    shapes = graph.fx.structure.get("the batch's shapes and dtypes", ()) if graph.fx and n > 1 else ()
    for k, (shape, _) in enumerate(shapes):
        if not shape or shape[0] != graph.batch:
            raise FasttError(f"input {k} of '{graph.name}''s batch has shape {list(shape)}: replicas split "
                             f"every input along its first dimension, the batch ({graph.batch} rows, input "
                             "0's); give each input the batch's rows first (reshape a target inside loss_fn)")
    sub = rebatch(graph, graph.batch // n, traced)
    loss_weights(graph, sub, n)  # refuses a loss that replicas cannot compute
    return sub


def same_step(graph: OpGraph, sub: OpGraph) -> bool:
    """Whether `sub` (the step recaptured at another batch) has `graph`'s ops, name for name and target for
    target: then an op of one is known by its name in the other. At a batch of one, tracing may drop ops (an
    expand, a clone), and fx's numbering of the rest shifts (`clone_21` becomes another clone)."""
    return sub is graph or [(op.name, op.target) for op in sub.ops] == [(op.name, op.target)
                                                                        for op in graph.ops]


def replicable(graph: OpGraph, n: int) -> bool:
    """Whether n data-parallel replicas can compute `graph`'s step (its batch splits, its loss can be
    weighed), without building the replicated graph."""
    try:
        _replica_step(graph, n)
    except FasttError:
        return False
    return True


def loss_weights(graph: OpGraph, sub: OpGraph, n: int) -> ReplicaWeights:
    """How n replicas of `sub` (the step at batch/n) weigh their losses to compute `graph`'s (`fastt.loss`);
    FasttError if they cannot. Graphs built by hand have no loss to weigh."""
    whole, share = (getattr(x.fx, "reduction", None) for x in (graph, sub))
    if n == 1 or graph.fx is None:
        return ONE
    return replica_weights(whole, share, n)


def _replica_name(name: str) -> tuple[int, str]:
    """(replica, name in the captured step) of an op that `replicate` named `r{k}/name`; (0, name)
    otherwise."""
    head, sep, rest = name.partition("/")
    return (int(head[1:]), rest) if sep and head[:1] == "r" and head[1:].isdigit() else (0, name)


def replica_of(name: str) -> int:
    """The replica of an op of a data-parallel graph (`replicate` names them `r{k}/...`); 0 otherwise."""
    return _replica_name(name)[0]


def replicate(sub: OpGraph, n: int) -> OpGraph:
    """The data-parallel graph: `sub` (the step at batch/n) once per replica, gradients aggregated.

    Resident ops stay single (a strategy gives them several holders); every other op is copied per replica as
    `r{k}/name`. Each gradient an optimizer update reads becomes one ALLREDUCE over the replicas' copies, and
    each replica's update reads the aggregate, so every holder applies the same update to its own copy.
    """
    if n == 1:
        return sub
    ops: list[Op] = []
    where: dict[tuple[int, int], int] = {}  # (op in sub, replica) -> index in the new graph
    reduced: dict[tuple[int, int], int] = {}  # (gradient op, update op) in sub -> its allreduce

    def emit(op: Op) -> int:
        ops.append(op)
        return len(ops) - 1

    for i, op in enumerate(sub.ops):
        if op.kind in RESIDENT:
            idx = emit(op)
            for k in range(n):
                where[i, k] = idx
            continue
        if op.kind == UPDATE:
            # One allreduce per (gradient producer, update): a producer may feed several gradients. What an
            # update reads from another (a gradient clip's coefficient) is the same in every replica already.
            for j, nbytes, kept in zip(op.inputs, op.in_bytes, op.in_parts or [()] * len(op.inputs)):
                if sub.ops[j].kind not in RESIDENT and sub.ops[j].kind != UPDATE:
                    g = sub.ops[j]
                    reduced[j, i] = emit(Op(name=f"allreduce/{g.name}->{op.name}", kind=ALLREDUCE,
                                            target="allreduce",
                                         inputs=tuple(where[j, k] for k in range(n)),
                                         in_bytes=(nbytes,) * n, out_bytes=nbytes, io_bytes=2 * nbytes,
                                         in_parts=(kept,) * n if kept else ()))
        for k in range(n):
            inputs = tuple(reduced.get((j, i), where[j, k]) for j in op.inputs)
            updates = tuple(where[u, k] for u in op.updates)
            # an allreduce's result is one storage: the parts named of the gradient's producer are not its
            in_parts = tuple(() if (j, i) in reduced else p for j, p in zip(op.inputs, op.in_parts))
            where[i, k] = emit(_copied(op, name=f"r{k}/{op.name}", inputs=inputs, updates=updates,
                                       in_parts=in_parts))
    # fx stays: replicated ops keep their head node, whose shapes (at batch/n) split rules read.
    return OpGraph(ops=tuple(ops), name=sub.name, batch=sub.batch * n, replicas=n, fx=sub.fx)


def base_name(name: str) -> str:
    """The op of the captured step that a replica's copy `r{k}/name` copies (`name` itself otherwise)."""
    return _replica_name(name)[1]


def duplicate_updates(g: OpGraph, device_of: Sequence[int]) -> set[int]:
    """The updates a device need not run: copies of an update that a lower replica's copy already applies on
    the same device (the same mean gradient on the same parameter: identical results). Replica 0's copies, and
    updates another op reads (a gradient clip's norm), always run."""
    seen: set[tuple[str, int]] = set()
    out = set()
    for i, op in enumerate(g.ops):
        if op.kind == UPDATE:
            key = (base_name(op.name), device_of[i])
            if key in seen and replica_of(op.name) > 0 and not g.succs[i]:
                out.add(i)
            seen.add(key)
    return out


def without_unplaced_updates(g: OpGraph, placed: Mapping[str, int]) -> OpGraph:
    """`g` without the copies of updates that a strategy leaves unplaced because `duplicate_updates` found
    them (a copy is dropped only if it is not replica 0's, nothing reads it and another copy of it is
    placed)."""
    if g.replicas == 1:
        return g
    updates = g.of_kind(UPDATE)
    kept = {base_name(g.ops[i].name) for i in updates if g.ops[i].name in placed}
    gone = frozenset(i for i in updates if g.ops[i].name not in placed and not g.succs[i]
                     and replica_of(g.ops[i].name) > 0 and base_name(g.ops[i].name) in kept)
    if not gone:
        return g  # (not cached: a graph holding itself would live on until a full collection)
    # a plan is ordered on this graph and then judged on it: made once (gnmt's 113k-op step on 8 devices, the
    # search's plan judged in 1.2-1.4 s against 1.5 s before)
    made = g._without
    if gone not in made:
        made.clear()
        made[gone] = without(g, gone)
    return made[gone]


def without(g: OpGraph, gone: set[int]) -> OpGraph:
    """`g` without ops `gone` (nothing kept may read them), the rest renumbered."""
    if not gone:
        return g
    return replace(g, ops=tuple(renumbered(g.ops, lambda i, op, at, new: [] if i in gone else None)[0]))


def _copied(op: Op, **changes: object) -> Op:
    """`replace(op, **changes)` without dataclasses.replace's field walk and __init__, for changes that keep
    the op valid (names and indices: a fifth of planning bert-large went to `replace` renumbering, and most
    of replicating gnmt's step 8 times)."""
    new = object.__new__(Op)
    new.__dict__.update(op.__dict__, **changes)
    return new


def renumbered(ops: Sequence[Op], expand: Callable[[int, Op, int, list[int]], list[Op] | None]
               ) -> tuple[list[Op], list[int]]:
    """`ops` rebuilt in order, each reading its producers' new indices, and each op's new index (its last
    replacement's): `expand(i, op, at, new)` gives the ops that replace op i (`op` already renumbered, the
    first of them at index `at`; `new` so far), or None to keep it."""
    out: list[Op] = []
    new = list(range(len(ops)))
    at, moved = new.__getitem__, False  # moved: an op before this one has another index now
    for i, op in enumerate(ops):
        if moved:
            ins, ups = tuple(map(at, op.inputs)), tuple(map(at, op.updates))
            if ins != op.inputs or ups != op.updates:
                op = _copied(op, inputs=ins, updates=ups)
        more = expand(i, op, len(out), new)
        out += [op] if more is None else more
        new[i] = len(out) - 1
        moved = moved or new[i] != i
    return out, new
