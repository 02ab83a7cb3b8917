"""Mixed plans: the batch cut into shards, and each layer's shards placed by a device map of its own.

A mixed plan runs the step as `replicate(step at batch/R, R)` (R shards, the replicated graph every runtime
runs) and gives every layer (`fastt.layers`) a `Spread`: the devices its shards run on, shard k on
`devices[k·m // R]`. What the spreads are decides the kind of parallelism (docs/design.md, "Mixed
parallelism"): every layer on every device is data parallelism; a layer on one device is held once (its
gradient a local sum, nothing crosses a link); on a node's devices it is replicated there only; layers on
different nodes with R shards are a pipeline whose micro-batches are the shards. A parameter is held by the
devices its layer's shards run on, each applies its update once (`graph.duplicate_updates`), and its gradient
is allreduced among them only.

The expert planners are spreads chosen as experts choose them (each raises FasttError where it does not
apply); `fastt` keeps the fastest of theirs, the spread search's (search.py) and OS-DPOS's (portfolio.py):
- `owt` (Krizhevsky's one weird trick): layers of convolutions and attention data-parallel, the other matrix
  multiplications and embeddings each held once, spread over the devices by their work;
- `table-wise` (TorchRec's table-wise sharding): each embedding table held once, spread by bytes, the rest DP;
- `pipeline` (GPipe's micro-batches in PipeDream-flush's 1F1B order, as Megatron runs them): a stage per node
  (or per device on one node), consecutive layers cut where the stages' work is even, each stage data-parallel
  inside its node, the shards its micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..cluster import Cluster
from ..cost import MeasuredCosts, op_times
from ..errors import FasttError
from ..graph import (
    ALLREDUCE,
    INPUT,
    RESIDENT,
    UPDATE,
    OpGraph,
    base_name,
    data_parallel_graph,
    rebatch,
    replica_of,
    same_step,
)
from ..layers import Layers, layers
from ..split import graph_for
from ..strategy import Strategy
from .basic import node_devices
from .common import plan_costs, strategy_from
from .schedule import ByRank, RingAllreduce, Schedule, edge_bytes, list_schedule, upward_rank

CONV = ("aten.convolution.default", "aten.convolution_backward.default")
MATMUL = ("aten.addmm.default", "aten.mm.default", "aten.bmm.default", "aten.linear.default")
EMBEDDING = ("aten.embedding.default", "aten._embedding_bag.default", "aten.embedding_bag.default")
MICRO_BATCHES = 4  # shards per device of a pipeline stage: the bubble is (stages-1)/(micro+stages-1)


@dataclass(frozen=True)
class Spread:
    """The devices a layer's shards run on: shard k of R on `devices[k·len(devices) // R]`."""

    devices: tuple[int, ...]

    def device(self, shard: int, shards: int) -> int:
        return self.devices[shard * len(self.devices) // shards]


def mixed_strategy(graph: OpGraph, cluster: Cluster, shards: int, spreads: Sequence[Spread], found: Layers,
                   planner: str, measured: MeasuredCosts | None = None,
                   stages: Sequence[Sequence[int]] | None = None) -> Strategy:
    """The strategy running layer k's shards by `spreads[k]`, ordered by list scheduling (`ordered`) or, for a
    pipeline whose `stages` are groups of devices, in 1F1B order (`one_f_one_b`), or GPipe's where that would
    deadlock. Ops in no layer (the batch, a clip's norm) go where their shard's first reader is, or by data
    parallelism."""
    n = len(cluster.devices)
    if not same_step(graph, rebatch(graph, graph.batch // shards)):
        raise FasttError(f"{planner}: the step at batch {graph.batch // shards} has other ops than at "
                         f"{graph.batch}, so its layers cannot be matched: use a larger batch")
    g = data_parallel_graph(graph, shards)
    everywhere = Spread(tuple(range(n)))
    device = [0] * len(g.ops)
    for i, op in enumerate(g.ops):
        base = graph.index.get(base_name(op.name))
        k = found.of[base] if base is not None else -1
        device[i] = (spreads[k] if k >= 0 else everywhere).device(replica_of(op.name), shards)
    for i, op in enumerate(g.ops):  # an input goes to the device of its first reader: nothing travels twice
        if op.kind == INPUT and g.succs[i]:
            device[i] = device[g.succs[i][0]]
    if stages is not None:
        stage = [next(s for s, grp in enumerate(stages) if d in grp) for d in device]
        s = strategy_from(g, planner, n, device, start=one_f_one_b(graph, g, found, shards, stage),
                          replicas=shards)
        try:
            s.validate(graph_for(graph, s))
            return s
        except FasttError:  # a stage that runs twice in the forward pass (a tied decoder): GPipe's order
            return strategy_from(g, planner, n, device, start=_gpipe_start(graph, g, found, shards),
                                 replicas=shards)
    return ordered(graph, strategy_from(g, planner, n, device, replicas=shards), cluster, measured)


def _gpipe_start(graph: OpGraph, g: OpGraph, found: Layers, shards: int) -> list[int]:
    """GPipe's order: every device runs its shards' forward ops shard after shard, then their backward ops,
    then the updates, so a stage hands each shard on as soon as it is done with it."""
    fwd = _forward_ops(graph, g, found)
    return [(2 if op.kind == UPDATE else 0 if fwd[i] else 1) * shards + replica_of(op.name)
            for i, op in enumerate(g.ops)]


def _forward_ops(graph: OpGraph, g: OpGraph, found: Layers) -> list[bool]:
    """For each op of the replicated graph `g`: is it an input or a forward op of `graph`'s step."""
    return [op.kind == INPUT or (b := graph.index.get(base_name(op.name))) is not None and found.forward[b]
            for op in g.ops]


def one_f_one_b(graph: OpGraph, g: OpGraph, found: Layers, shards: int, stage: Sequence[int]) -> list[int]:
    """PipeDream-flush's 1F1B order (Megatron's): virtual stage v of V runs V-v-1 shards' forward ops, then
    alternates the next shard's forward and the oldest shard's backward, so it keeps at most V-v shards'
    activations alive (GPipe's all-forwards-first keeps every shard's: the same bubble, more memory); the
    updates last. Shard m's forward is at 2m - (V-v-1), its backward at 2m + (V-v-1) + 1. A virtual stage is a
    stretch of the forward pass on one stage: a tied decoder that runs on the first stage after the last is a
    virtual stage of its own (as Megatron's interleaved schedule)."""
    virtual = [0] * len(g.ops)
    fwd = _forward_ops(graph, g, found)
    placed = [op.kind not in RESIDENT and op.kind != ALLREDUCE for op in g.ops]
    for i, op in enumerate(g.ops):  # forward: one more at each change of stage along the way
        if fwd[i] and placed[i]:
            virtual[i] = max((virtual[j] + (stage[j] != stage[i]) for j in op.inputs if fwd[j] and placed[j]),
                             default=0)
    top = max((virtual[i] for i in range(len(g.ops)) if fwd[i] and placed[i]), default=0)
    for i, op in enumerate(g.ops):  # backward: one less at each change of stage on the way back
        if not fwd[i] and placed[i] and op.kind != UPDATE:
            virtual[i] = min((virtual[j] - (stage[j] != stage[i]) for j in op.inputs if not fwd[j]
                              and placed[j]
                              and g.ops[j].kind != UPDATE), default=top)
    key = [0] * len(g.ops)
    for i, op in enumerate(g.ops):
        m, warm = replica_of(op.name), top - virtual[i]
        key[i] = 3 * shards + top if op.kind == UPDATE else 2 * m - warm if fwd[i] else 2 * m + warm + 1
    return key


class _Held:
    """Where each resident lives when the plan has said so already (its layer's devices): nothing to decide,
    and every device has room (the simulator checks memory)."""

    def __init__(self, homes: dict[int, list[int]], n_devices: int) -> None:
        self.homes = homes
        self._everywhere = np.ones(n_devices, dtype=bool)

    def where(self, r: int) -> list[int]:
        return self.homes[r]

    def room(self, i: int) -> np.ndarray:
        return self._everywhere

    def place(self, i: int, d: int) -> None:
        pass


def ordered(graph: OpGraph, strategy: Strategy, cluster: Cluster,
            measured: MeasuredCosts | None = None) -> Strategy:
    """`strategy` with each device's ops reordered by a list schedule of its placement (ops by decreasing
    upward rank, their time on their device plus the longest path after them with transfers, each in the first
    idle gap of its device), so that a device runs first what others wait for: the FC layer's shard a
    data-parallel device waits on. The placement and holders stay."""
    g = graph_for(graph, strategy)
    device = [strategy.placement.get(op.name, -1) for op in g.ops]
    costs = plan_costs(g, cluster, measured)
    nbytes = edge_bytes(g)
    here = [max(d, 0) for d in device]
    rank = upward_rank(g, costs.times[np.arange(len(g.ops)), here],
                       lambda i, s: 0.0 if here[i] == here[s]
                       else costs.transfer(here[i], here[s], nbytes[i, s]))
    homes = {g.index[name]: list(devs) for name, devs in strategy.holders.items()}
    policy = ByRank(rank, fixed=dict(enumerate(here)))  # every op fixed: ranks order, devices stay
    sched = list_schedule(Schedule(g, costs, _Held(homes, strategy.n_devices), RingAllreduce()), policy)
    order = [sorted((i for i, d in enumerate(device) if d == k), key=lambda i: (sched.start[i], i))
             for k in range(strategy.n_devices)]
    return replace(strategy, order=tuple(tuple(g.ops[i].name for i in o) for o in order))


def layer_work(graph: OpGraph, cluster: Cluster, found: Layers, measured: MeasuredCosts | None = None
               ) -> np.ndarray:
    """Seconds of each layer's ops on device 0, for balancing."""
    t = op_times(graph, cluster, measured)[:, 0]
    work = np.zeros(len(found))
    for i, k in enumerate(found.of):
        if k >= 0:
            work[k] += t[i]
    return work


def _targets(graph: OpGraph, found: Layers, k: int) -> set[str]:
    return {graph.ops[i].target for i in found.layers[k].ops}


def _balanced(weights: Sequence[float], n: int) -> list[int]:
    """A device per item, largest first onto the least loaded (LPT)."""
    load = [0.0] * n
    out = [0] * len(weights)
    for k in sorted(range(len(weights)), key=lambda k: -weights[k]):
        d = min(range(n), key=lambda d: (load[d], d))
        out[k] = d
        load[d] += weights[k]
    return out


def _held_once(graph: OpGraph, cluster: Cluster, found: Layers, chosen: list[int], weight: Sequence[float],
               planner: str, measured: MeasuredCosts | None) -> Strategy:
    """Layers `chosen` each on one device (balanced by `weight`), the others data-parallel over every
    device."""
    n = len(cluster.devices)
    if graph.batch % n:
        raise FasttError(f"{planner}: batch {graph.batch} does not split into {n} equal shares")
    everywhere = Spread(tuple(range(n)))
    spreads = [everywhere] * len(found)
    for k, d in zip(chosen, _balanced([weight[k] for k in chosen], n)):
        spreads[k] = Spread((d,))
    return mixed_strategy(graph, cluster, n, spreads, found, planner, measured)


def owt(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None) -> Strategy:
    """The one weird trick: convolutions and attention data-parallel, other matmuls and embeddings held
    once."""
    found = layers(graph)
    attention = {k for k, layer in enumerate(found.layers) if "attn" in layer.name
                 or "attention" in layer.name}
    chosen = [k for k in range(len(found)) if k not in attention and not _targets(graph, found, k) & set(CONV)
              and _targets(graph, found, k) & {*MATMUL, *EMBEDDING}]
    if not chosen:
        raise FasttError("owt: the model has no fully connected or embedding layer outside attention")
    return _held_once(graph, cluster, found, chosen, layer_work(graph, cluster, found), "owt", measured)


def table_wise(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None) -> Strategy:
    """Each embedding table on one device (balanced by bytes), the rest data-parallel."""
    found = layers(graph)
    tables = [k for k in range(len(found)) if _targets(graph, found, k) & set(EMBEDDING)]
    if not tables:
        raise FasttError("table-wise: the model has no embedding tables")
    size = [sum(graph.ops[p].out_bytes for p in layer.params) for layer in found.layers]
    return _held_once(graph, cluster, found, tables, size, "table-wise", measured)


def _stage_groups(cluster: Cluster) -> list[tuple[int, ...]]:
    """A pipeline's stages: the devices of each node, or each device on one node."""
    nodes = node_devices(cluster)
    return nodes if len(nodes) > 1 else [(i,) for i in range(len(cluster.devices))]


def _stages_per_group(cluster: Cluster) -> int:
    """Micro-batches a device for which a pipeline cuts the batch into one shard per device."""
    return len(_stage_groups(cluster))


def pipeline(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None,
             micro: int = MICRO_BATCHES) -> Strategy:
    """A stage per node (per device on one node), cut where the stages' work is even, each stage data-parallel
    over its devices with `micro` shards a device (fewer if the batch does not split so: 4, 2 or 1)."""
    groups = _stage_groups(cluster)
    if len(groups) < 2 or len({len(s) for s in groups}) > 1:
        raise FasttError("pipeline: needs two or more devices, or nodes with as many devices each")
    found = layers(graph)
    if len(found) < len(groups):
        raise FasttError(f"pipeline: {len(found)} layers cannot make {len(groups)} stages")
    fits = [m for m in (micro, 4, 2, 1) if m <= micro and graph.batch % (len(groups[0]) * m) == 0]
    if not fits:
        raise FasttError(f"pipeline: batch {graph.batch} does not split into {len(groups[0])} equal shares")
    work = np.cumsum(layer_work(graph, cluster, found))
    cut = [int(np.searchsorted(work, work[-1] * (s + 1) / len(groups))) for s in range(len(groups) - 1)]
    stage = np.searchsorted(np.array(cut), np.arange(len(found)), side="right")
    spreads = [Spread(groups[s]) for s in stage]
    return mixed_strategy(graph, cluster, len(groups[0]) * fits[0], spreads, found, "pipeline", measured,
                          stages=groups)


EXPERTS = {"owt": owt, "table-wise": table_wise, "pipeline": pipeline}
