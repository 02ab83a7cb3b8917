"""The distributed runtime: one process per device over torch.distributed (gloo on CPU, NCCL on GPU), launched
by torchrun.

Every rank builds the same model, captures the same step and compiles the same programs as the local runtime
(`local.compile_programs`); rank d runs device d's segments. What the local runtime hands over in memory goes by
point-to-point messages, all known before the first step (`wire`):

- a value one device reads from another: sent (`isend`, non-blocking) right after the segment that produced it,
  received right before the first segment that reads it. Sends never block and a rank only waits for values
  that come earlier in a valid plan, so no order of ranks can deadlock (the local runtime's argument).
- an allreduce: a collective of the ranks that hold one of its gradients or read its mean, after which all of
  them hold the same mean, bit for bit the local runtime's and eager data parallelism's (the sum in replica
  order): an `all_reduce` for two replicas (a + b is b + a), else each rank sums its shard of the mean in order
  (an `all_to_all` brings it the replicas' parts) and an `all_gather` of the shards follows (`Collective`).
  Ranks start the collectives they share in one order, which cannot deadlock (`_collectives`); allreduces that
  become ready together go in one.
- at the end of the step: the new parameters, optimizer state and batch-norm buffers go to the ranks that read
  them next step and to rank 0, whose model is the truth (read it for checkpoints); the replicas' losses to rank 0.

Messages carry no tags: each direction between two ranks has a process group of its own (`directions`), whose
messages are received in the order they are sent (`Wiring.inbox`), which is how NCCL matches them; gloo runs
the same way. On a GPU a rank only queues work (a receive makes its stream wait) and waits at the end of the step.

A rank that fails records the job's first failure in the process group's store and raises `RankError` (the
launcher exits non-zero); its peers then lose it in turn and report that first failure. Every wait has a timeout,
and ranks count heartbeats in the store, so a rank that loses a connection names the rank that stopped. A rank
waiting for a collective (which does not say which rank is gone) also stops once another rank has recorded a
failure.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist
from torch._guards import detect_fake_mode

from .. import guards
from ..capture import bind, stepped
from ..cluster import Cluster, Link, cpu_cluster, cuda_cluster
from ..cost import MeasuredCosts, calibrate_cpu, fit_transfers
from ..errors import FasttError
from ..graph import OpGraph, replicable
from ..lower import JOIN, PART, Lowered, Task
from ..split import run_part
from ..strategy import Strategy
from .local import (
    Placed,
    Programs,
    Segment,
    _Run,
    place,
    replica_envs,
    replica_mean,
    replica_tables,
    weighted_loss,
)
from .shards import Feed, Piece, plan_feed, shard_of
from .tune import Tuner

DEFAULT_TIMEOUT_S = 20.0
FAILED_KEY = "fastt/first_failure"


def _beat_key(rank: int) -> str:
    """The store key counting a rank's heartbeats (`start_heartbeat`)."""
    return f"fastt/heartbeat/{rank}"


def _failed_key(rank: int) -> str:
    """The store key a rank sets once it has recorded its failure (`record_failure`, `await_reports`)."""
    return f"fastt/failed/{rank}"


class RankError(RuntimeError):
    """This rank cannot go on: an op raised, or a peer is gone or silent. The message names the rank."""


class LostPeer(RankError):
    """A peer closed its connection or sent nothing in time."""


@dataclass(frozen=True)
class Message:
    """Values (replica, name) going from rank `src` to rank `dst` in one buffer."""

    src: int
    dst: int
    values: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Collective:
    """Allreduce ops whose gradients `ranks` average together: the ranks that hold one of the gradients or read
    the mean. `names`: the gradients, each with the rank that holds it per replica (`sources`) and its (shape,
    stride, dtype) (`leaves`). Two replicas: each rank adds up the ones it holds (or zeros) and an `all_reduce`
    sums them. More: the mean's vector is cut into one shard per rank (`shards`); an `all_to_all` brings every
    replica's part of a shard to the rank that owns it, which sums them in replica order, as eager data
    parallelism does, and an `all_gather` of the shards gives every rank the mean: the traffic of a ring
    `all_reduce`, whose own sum of more than two would go in an order of its own. Either way every rank gets
    eager's mean bit for bit."""

    ranks: tuple[int, ...]
    ops: tuple[int, ...]
    names: tuple[str, ...]
    sources: tuple[tuple[int, ...], ...]
    leaves: tuple[tuple, ...]

    def shards(self, rank: int) -> list[Shards]:
        """How `rank` takes part in the sharded form, one entry per dtype of the gradients."""
        return self._shards[rank]

    @cached_property
    def _shards(self) -> dict[int, list[Shards]]:  # read every step: made once
        out: dict[int, list[Shards]] = {r: [] for r in self.ranks}
        n, replicas = len(self.ranks), len(self.sources[0])
        for dtype in dict.fromkeys(leaf[2] for leaf in self.leaves):
            js = [j for j, leaf in enumerate(self.leaves) if leaf[2] == dtype]
            ends = list(itertools.accumulate(torch.Size(self.leaves[j][0]).numel() for j in js))
            size = max(1, -(-ends[-1] // n))
            # pieces[r][i]: what rank r sends the owner of shard i, in (replica, vector position) order:
            # (replica, name index, first and end element of the gradient, position in the vector)
            pieces: dict[int, list[list[tuple]]] = {r: [[] for _ in range(n)] for r in self.ranks}
            for k in range(replicas):
                for j, a, b in zip(js, [0, *ends], ends):
                    for i in range(a // size, -(-b // size)):
                        lo, hi = max(a, i * size), min(b, (i + 1) * size)
                        if hi > lo:
                            pieces[self.sources[j][k]][i].append((k, j, lo - a, hi - a, lo))
            for i, me in enumerate(self.ranks):
                rows: list[list[tuple[int, int, int]]] = [[] for _ in range(replicas)]
                at = 0
                for r in self.ranks:
                    for k, _, lo, hi, pos in pieces[r][i]:
                        rows[k].append((pos, at, at + hi - lo))
                        at += hi - lo
                out[me].append(Shards(
                    dtype, tuple(js), size,
                    tuple(p[:4] for ps in pieces[me] for p in ps),
                    tuple(sum(p[3] - p[2] for p in ps) for ps in pieces[me]),
                    tuple(sum(p[3] - p[2] for p in pieces[r][i]) for r in self.ranks),
                    tuple(_merged(sorted(row)) for row in rows)))
        return out


@dataclass(frozen=True)
class Shards:
    """One dtype of a collective of more than two replicas, as one of its ranks sees it. The mean's vector (the
    gradients `names`, flat, one after another) is cut into one shard of `size` elements per rank of the
    collective, in rank order (the last one padded). The rank sends slices of the gradients it holds (`send`:
    (replica, name index, first element, end), in the order sent: by owner, replica, position), `send_counts`
    elements to each rank; it receives `recv_counts` from each, which put side by side hold every replica's part
    of its own shard: `rows[k]`, ranges of that buffer that make replica k's part, in order."""

    dtype: torch.dtype
    names: tuple[int, ...]
    size: int
    send: tuple[tuple[int, int, int, int], ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    rows: tuple[tuple[tuple[int, int], ...], ...]

    def pack(self, envs: Sequence[dict], col: Collective, out: torch.Tensor) -> torch.Tensor:
        """What this rank sends (`envs`: its replicas' tables), into `out`."""
        flat = {}
        for k, j, _, _ in self.send:
            if (k, j) not in flat:
                flat[k, j] = _flat(envs[k][col.names[j]], col.leaves[j])
        if self.send:
            torch.cat([flat[k, j][lo:hi] for k, j, lo, hi in self.send], out=out)
        return out

    def mean(self, recv: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's shard of the mean into `out`, from what it received: the replicas' parts summed in replica
        order, then divided, as `replica_mean` does."""
        rows = [[recv[a:b] for a, b in rs] for rs in self.rows]
        if not rows[0]:
            return
        parts = [r[0] if len(r) == 1 else torch.cat(r) for r in rows]
        total = out[:parts[0].numel()]
        torch.add(parts[0], parts[1], out=total)
        for part in parts[2:]:
            total.add_(part)
        torch._foreach_div_([total], float(len(parts)))

    def means(self, gathered: torch.Tensor, col: Collective) -> dict[str, torch.Tensor]:
        """The mean gradients, views of the gathered shards."""
        out, at = {}, 0
        for j in self.names:
            out[col.names[j]] = _leaf_view(gathered, at, col.leaves[j])
            at += torch.Size(col.leaves[j][0]).numel()
        return out


def _merged(row: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, int], ...]:
    """Ranges (start, end) of a buffer, from pieces (position, start, end) sorted by position, joining those
    that follow each other in the buffer too."""
    out: list[list[int]] = []
    for _, a, b in row:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


@dataclass(frozen=True)
class Wiring:
    """Every message and collective of a step. Per rank and segment: the collectives it starts before it (one
    more entry: after the last segment), the messages it receives and the collectives it waits for before it,
    the messages it sends after it; then the end-of-step messages and, per rank, the values it keeps from its
    own replicas (placeholder name -> (replica, value name))."""

    messages: tuple[Message, ...]
    recv_before: tuple[tuple[tuple[int, ...], ...], ...]
    reduce_before: tuple[tuple[tuple[int, ...], ...], ...]
    send_after: tuple[tuple[tuple[int, ...], ...], ...]
    final: tuple[int, ...]
    keep: tuple[dict[str, tuple[int, str]], ...]
    shapes: dict[tuple[int, str], tuple]  # value -> (pytree spec, per leaf (shape, stride, dtype) or None)
    # Per rank: chunks of buffers its split ops wrote, to name before the end (buffer, name, dim, k, parts), and
    # chunks others wrote, to copy into its buffer after the end.
    chunks: tuple[tuple[tuple, ...], ...] = ()
    merge: tuple[tuple[tuple, ...], ...] = ()
    leaves: tuple[tuple, ...] = ()  # per message, the (shape, stride, dtype) of every tensor in its buffer
    inbox: tuple[tuple[int, ...], ...] = ()  # per rank, the messages it receives, in the order they are sent
    collectives: tuple[Collective, ...] = ()  # in the order every rank starts them
    start_before: tuple[tuple[tuple[int, ...], ...], ...] = ()


class _Post:
    """Builds the messages: a value goes to a rank once per step, and the values that leave one segment (or the
    step's end) for one receiving point travel together in one buffer."""

    def __init__(self, where: dict, segment_of: dict, programs: Programs) -> None:
        self.where, self.segment_of = where, segment_of
        self.messages: list[Message] = []
        self.sent: set[tuple[int, str, int]] = set()
        self.send_after: list[list[list[int]]] = [[[] for _ in segs] for segs in programs.devices]

    def need(self, k: int, name: str, d: int) -> tuple | None:
        """(source rank, its segment, value) when d needs replica k's `name` from another rank, else None."""
        src = self.where.get((k, name))
        if src is None or src == d or (k, name, d) in self.sent:
            return None
        self.sent.add((k, name, d))
        return src, self.segment_of.get((k, name), (src, -1))[1], (k, name)

    def post(self, d: int, needs: Sequence, at_end: bool = False) -> tuple[int, ...]:
        """Messages to d carrying `needs` (from `need`), one per source segment; sent after it or at the end."""
        groups: dict[tuple[int, int], list] = {}
        for src, seg, value in needs:
            if value is not None:
                groups.setdefault((src, -1 if at_end else seg), []).append(value)
        out = []
        for (src, seg), values in groups.items():
            out.append(len(self.messages))
            self.messages.append(Message(src, d, tuple(values)))
            if not at_end:
                self.send_after[src][seg].append(out[-1])
        return tuple(out)


def _produced(t: Task) -> tuple[str, ...]:
    """The values a task writes into its replica's table."""
    if t.kind == PART:
        return (f"{t.head}#{t.part[1]}",)
    if t.kind == JOIN:
        return (t.head, *t.nodes)
    return t.nodes


def _reads(low: Lowered, programs: Programs, seg: Segment) -> list[str]:
    """The values a segment reads from its replica's table."""
    if seg.fn is not None:
        return list(seg.inputs)
    names: list[str] = []
    for t in seg.tasks:
        if t.kind == PART:
            names += [x.name for x in programs.nodes[t.head].all_input_nodes]
        elif t.kind == JOIN:
            parts = low.graph.ops[t.waits[0]].split[2]
            names += [f"{t.head}#{k}" for k in range(parts)]
        names += [x.name for n in t.nodes for x in programs.nodes[n].all_input_nodes]
    return list(dict.fromkeys(names))


def _shapes(programs: Programs, names: Sequence[str], low: Lowered, chunks: dict) -> dict:
    """Each value's pytree spec and (shape, stride, dtype) of every tensor in it (None for a None), from the
    captured graph's fake tensors (split parts: the head op run on them)."""
    vals = {n.name: n.meta.get("val") for n in programs.nodes.values()}
    fake = detect_fake_mode([v for v in vals.values() if isinstance(v, torch.Tensor)])
    out = {}
    parts = {f"{t.head}#{t.part[1]}": t for prog in low.programs for t in prog if t.kind == PART}
    for name in names:
        if name in out:
            continue
        if name in chunks:
            x, dim, k, n_parts = chunks[name]
            v = torch.tensor_split(vals[x], n_parts, dim)[k]
        elif name in parts:
            t = parts[name]
            n = programs.nodes[t.head]
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: vals[a.name])
            with fake:
                v = run_part(n.target, args, kwargs, *t.part)
        else:
            v = vals.get(name)
        flat, spec = torch.utils._pytree.tree_flatten(v)
        if not flat or not all(isinstance(x, torch.Tensor) or x is None for x in flat):
            out[name] = None  # not sendable: only an error if some rank needs it
        else:
            out[name] = (spec, tuple(None if x is None else (x.shape, x.stride(), x.dtype) for x in flat))
    return out


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of this shape and stride fills a block of memory exactly (its dims in some order)."""
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def _wire_view(x: torch.Tensor) -> torch.Tensor:
    """The memory of a dense tensor (any order of dims) as one contiguous vector: what goes over the wire, so
    the receiver's tensor has the sender's strides (a later `view` in the captured step may rely on them)."""
    return x.as_strided((x.numel(),), (1,), x.storage_offset())


ALIGN = 16  # bytes: every tensor in a message buffer starts at a multiple, so it can be viewed as its dtype


def _nbytes(leaf: tuple | None) -> int:
    if leaf is None:
        return 0
    shape, _, dtype = leaf
    n = torch.Size(shape).numel() * dtype.itemsize
    return -(-n // ALIGN) * ALIGN


def _packed_size(leaves: Sequence) -> int:
    return sum(_nbytes(leaf) for leaf in leaves)


_PADS: dict[torch.device, torch.Tensor] = {}


def _pad(n: int, device: torch.device) -> torch.Tensor:
    pad = _PADS.get(device)
    if pad is None:
        pad = _PADS[device] = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    return pad[:n]


def _flat(x: torch.Tensor, leaf: tuple) -> torch.Tensor:
    """`x`'s elements as a vector laid out with the captured step's strides (`leaf`): a dense tensor's in its
    memory order (a view when `x` has those strides), another's contiguous."""
    shape, stride, _ = leaf
    if not _dense(shape, stride):
        return x.contiguous().view(-1)
    if tuple(x.stride()) != tuple(stride):
        x = torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device).copy_(x)
    return _wire_view(x)


def _leaf_view(typed: torch.Tensor, at: int, leaf: tuple) -> torch.Tensor:
    """The tensor `_flat` laid out from element `at` of `typed` (a vector of its dtype): a view when dense."""
    shape, stride, dtype = leaf
    if _dense(shape, stride):  # as_strided counts from the start of the storage, not of typed
        return typed.as_strided(shape, stride, typed.storage_offset() + at)
    numel = torch.Size(shape).numel()
    return torch.empty_strided(shape, stride, dtype=dtype, device=typed.device).copy_(typed[at:at + numel].view(shape))


def _pack(pairs: Sequence[tuple[torch.Tensor | None, tuple | None]], out: torch.Tensor | None = None) -> torch.Tensor:
    """One byte buffer holding the tensors of a message, each laid out with the captured step's strides (dense
    ones in their memory order, others contiguous), at offsets aligned to ALIGN: one `cat` of their bytes (into
    `out` when given)."""
    pieces = []
    for x, leaf in pairs:
        if leaf is None or not x.numel():
            continue  # a None has no bytes, an empty tensor ALIGN-rounded 0
        raw = _flat(x, leaf).view(torch.uint8)
        pieces.append(raw)
        if _nbytes(leaf) > raw.numel():
            pieces.append(_pad(_nbytes(leaf) - raw.numel(), raw.device))
    if not pieces:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(pieces) if out is None else torch.cat(pieces, out=out)


def _unpack(buf: torch.Tensor, leaves: Sequence) -> list[torch.Tensor | None]:
    """The tensors `_pack` put in `buf`, with the captured step's shapes and strides (views of buf when dense)."""
    out, off, typed = [], 0, {}
    for leaf in leaves:
        if leaf is None:
            out.append(None)
            continue
        dtype = leaf[2]
        view = typed.get(dtype)
        if view is None:
            view = typed[dtype] = buf.view(dtype)
        out.append(_leaf_view(view, off // dtype.itemsize, leaf))
        off += _nbytes(leaf)
    return out


def wire(low: Lowered, programs: Programs) -> Wiring:
    """All messages of a step of `programs`, one rank per device (see the module docstring)."""
    where: dict[tuple[int, str], int] = {}
    segment_of: dict[tuple[int, str], tuple[int, int]] = {}
    for d, segs in enumerate(programs.devices):
        for i, seg in enumerate(segs):
            for t in seg.tasks:
                for name in _produced(t):
                    where[t.replica, name] = d
                    segment_of[t.replica, name] = (d, i)
    carried = {name for names in low.allreduces.values() for name in names}
    post = _Post(where, segment_of, programs)
    recv_before, first_read = [], []
    for d, segs in enumerate(programs.devices):
        recvs, first = [], {}
        for i, seg in enumerate(segs):
            needs = [post.need(seg.replica, name, d) for name in _reads(low, programs, seg) if name not in carried]
            recvs.append(post.post(d, [x for x in needs if x]))
            for a in seg.waits:
                if a in low.allreduces:
                    first.setdefault(a, i)
        recv_before.append(tuple(recvs))
        first_read.append(first)
    final, keep, chunks, merge = _final(low, programs, where, post)
    values = list(dict.fromkeys(v for m in post.messages for v in m.values))
    info = {c[1]: (c[0], *c[2:]) for cs in chunks for c in cs}
    grads = list(dict.fromkeys(name for names in low.allreduces.values() for name in names))
    shapes = _shapes(programs, [name for _, name in values] + grads, low, info)
    bad = [name for name in [*(name for _, name in values), *grads] if shapes.get(name) is None]
    if bad:
        raise FasttError(f"values {bad[:3]} cross devices but are not tensors: this plan cannot run distributed")
    collectives, start_before, reduce_before = _collectives(low, programs, post, segment_of, first_read,
                                                            recv_before, {name: shapes[name][1][0] for name in grads})
    shapes = {(k, name): shapes[name] for k, name in values}
    leaves = tuple(tuple(leaf for v in m.values for leaf in shapes[v][1]) for m in post.messages)
    # A rank sends segment by segment, then its end-of-step messages: the order each direction carries them in.
    sent = [i for segs in post.send_after for ms in segs for i in ms] + final
    inbox = tuple(tuple(i for i in sent if post.messages[i].dst == d) for d in range(len(programs.devices)))
    return Wiring(tuple(post.messages), tuple(recv_before), reduce_before,
                  _frozen(post.send_after), tuple(final), keep,
                  shapes, chunks, merge, leaves, inbox, collectives, start_before)


def _collectives(low: Lowered, programs: Programs, post: _Post, segment_of: dict, first_read: list[dict],
                 recv_before: list, leaf: dict) -> tuple:
    """The allreduces as collectives, in one order every rank starts them in: (collectives, per rank the ones
    to start before each segment (one more entry: after the last), per rank the ones to wait for before each).

    A rank takes part in an allreduce if it holds one of its gradients or reads its mean. It could start it once
    its own gradients are made, but ranks must start the collectives they share in the same order. The order is
    that of a run of the programs in which every segment takes one unit of time: an allreduce is ready at T,
    when the last of its ranks has made its gradients; allreduces of the same ranks ready at the same T go in one
    collective. A rank starts each collective after its own gradients of it and after the collectives before
    it: all of those were ready by T, so in that run every collective still completes at T, before any rank
    reads it, even if it must wait for the ones its ranks started before it (`_Serial` runs a rank's sharded
    collectives one at a time). That run waits for the same things as a real one, whatever order the ranks
    happen to run in (a rank waits only for messages and collectives), so a real run cannot deadlock either."""
    segs = programs.devices
    ready: dict[tuple[int, int], int] = {}  # (rank, allreduce) -> its last segment making a gradient (-1: none)
    sources = {}
    for a, names in low.allreduces.items():
        for name in names:
            sources[name] = tuple(segment_of[k, name][0] for k in range(low.replicas))
            for k in range(low.replicas):
                d, i = segment_of[k, name]
                ready[d, a] = max(ready.get((d, a), -1), i)
        for d, first in enumerate(first_read):
            if a in first:
                ready.setdefault((d, a), -1)
    members: dict[int, set[int]] = {a: set() for a in low.allreduces}
    for d, a in ready:
        members[a].add(d)
    ranks = {a: tuple(sorted(ds)) for a, ds in members.items()}
    sent_at = {m: (d, i) for d, ms in enumerate(post.send_after) for i, xs in enumerate(ms) for m in xs}
    finish: list[list[int]] = [[] for _ in segs]  # per rank, the unit-time finish of each segment run so far
    ready_at: dict[int, int] = {}

    def done(d: int, i: int) -> int | None:
        return 0 if i < 0 else finish[d][i] if i < len(finish[d]) else None

    def ready_time(a: int) -> int | None:
        if a not in ready_at:
            ts = [done(d, ready[d, a]) for d in ranks[a]]
            if None in ts:
                return None
            ready_at[a] = max(ts)
        return ready_at[a]

    waits = [{i: [a for a, j in first.items() if j == i] for i in range(len(s))} for first, s in zip(first_read, segs)]
    moved = True
    while moved:
        moved = False
        for d in range(len(segs)):
            while len(finish[d]) < len(segs[d]):
                i = len(finish[d])
                ts = [done(d, i - 1), *(done(*sent_at[m]) for m in recv_before[d][i]),
                      *(ready_time(a) for a in waits[d][i])]
                if None in ts:
                    break
                finish[d].append(max(ts) + 1)
                moved = True
    if any(len(f) < len(s) for f, s in zip(finish, segs)):
        raise FasttError("the devices' programs wait for each other in a cycle: this plan cannot run")
    bundles: dict[tuple, list[int]] = {}
    for a in sorted(low.allreduces, key=lambda a: (ready_time(a), ranks[a], a)):
        bundles.setdefault((ready_time(a), ranks[a]), []).append(a)
    collectives = []
    start = [[[] for _ in range(len(s) + 1)] for s in segs]
    wait = [[[] for _ in s] for s in segs]
    at = [0] * len(segs)  # per rank, where it started its last collective
    for c, ((_, group), ops) in enumerate(bundles.items()):
        names = tuple(dict.fromkeys(name for a in ops for name in low.allreduces[a]))
        collectives.append(Collective(group, tuple(ops), names, tuple(sources[x] for x in names),
                                      tuple(leaf[x] for x in names)))
        for d in group:
            at[d] = max(at[d], *(ready[d, a] + 1 for a in ops))
            start[d][at[d]].append(c)
            reads = [first_read[d][a] for a in ops if a in first_read[d]]
            if reads:
                if min(reads) < at[d]:  # cannot happen (see above)
                    raise FasttError(f"rank {d} would read allreduce '{low.graph.ops[ops[0]].name}' before it starts")
                wait[d][min(reads)].append(c)
    return tuple(collectives), _frozen(start), _frozen(wait)


def _frozen(lists: Sequence[Sequence[Sequence[int]]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(tuple(x) for x in xs) for xs in lists)


def _final(low: Lowered, programs: Programs, where: dict, post: _Post):
    """End-of-step messages: the new state to the ranks that read it next step (and rank 0), the losses to rank 0.
    Returns (message indices, per rank {placeholder: (replica, value name)} it keeps from its own replicas)."""
    n_dev = len(programs.devices)
    step, out = low.step, programs.outputs
    n, n_buf = len(step.param_names), len(step.buffer_names)
    ph = programs.placeholders
    params, buffers = ph[:n], ph[n:n + n_buf]
    states = ph[n + n_buf:n + n_buf + len(out) - 1 - 2 * n]
    new = dict(zip(params, out[1 + n:1 + 2 * n])) | dict(zip(states, out[1 + 2 * n:]))
    nodes = programs.nodes
    # A buffer's new value is its placeholder, written in place by replica 0, whole or slice by slice.
    partial: dict[str, list[tuple[int, int, int, int]]] = {}
    for x, d, region in programs.writeback:
        if region is not None:
            partial.setdefault(x, []).append((d, *region))
    for x, d, region in programs.writeback:
        if x in buffers and x not in partial:
            new[x] = x
            where[0, x] = d
    # Tasks read a parameter itself or through a view of it made before the step (the prelude).
    root: dict[str, str] = {}
    for name in low.prelude:
        if nodes[name].op == "get_attr":  # a constant: every rank holds it, nobody updates it
            continue
        base = nodes[name].all_input_nodes[0].name
        root[name] = root.get(base, base)
    readers: dict[str, set[int]] = {x: {0} for x in [*new, *partial]}
    for d, segs in enumerate(programs.devices):
        for seg in segs:
            for name in _reads(low, programs, seg):
                if root.get(name, name) in readers:
                    readers[root.get(name, name)].add(d)
    needs: list[list] = [[] for _ in range(n_dev)]
    keep: list[dict[str, tuple[int, str]]] = [{} for _ in range(n_dev)]
    for x, value in new.items():
        for d in sorted(readers[x]):
            own = [k for k in range(low.replicas) if where.get((k, value)) == d]
            # Every replica applies the same update, so a rank's own replica's new parameter is the same.
            k = own[0] if own and x not in buffers else 0
            keep[d][x] = (k, value)
            needs[d].append(post.need(k, value, d))
    chunks: list[list[tuple]] = [[] for _ in range(n_dev)]
    merge: list[list[tuple]] = [[] for _ in range(n_dev)]
    for x, pieces in partial.items():  # each rank gets the slices the others wrote
        for d, dim, k, parts in pieces:
            piece = (x, f"{x}@{k}", dim, k, parts)
            chunks[d].append(piece)
            where[0, piece[1]] = d
            for r in sorted(readers[x]):
                if r != d:
                    needs[r].append(post.need(0, piece[1], r))
                    merge[r].append(piece)
    needs[0] += [post.need(k, out[0], 0) for k in range(low.replicas)]
    final = [m for d in range(n_dev) for m in post.post(d, [x for x in needs[d] if x], at_end=True)]
    return final, tuple(keep), tuple(map(tuple, chunks)), tuple(map(tuple, merge))


class _Buffers:
    """Buffers of messages and collectives kept from step to step: a fresh buffer of megabytes costs its page
    faults every step (16 MiB: about 6 ms here). Not for messages or collectives that carry a value this rank
    keeps after the step (a new parameter, or a mean, is a view of the buffer): those get a fresh one each time.
    A message's key is its index; a collective's, (its index, a dtype) for a sum, (its index, a dtype, a role)
    for the sharded form."""

    def __init__(self, wiring: Wiring, rank: int, device: torch.device) -> None:
        kept = set(wiring.keep[rank].values())
        names = {name for _, name in kept}
        self.fresh = frozenset([*(i for i, m in enumerate(wiring.messages) if m.dst == rank and kept & set(m.values)),
                                *(c for c, col in enumerate(wiring.collectives) if names & set(col.names))])
        self.kept: dict[int | tuple, torch.Tensor] = {}
        self.device = device

    def get(self, key: int | tuple, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The buffer of `key` (its sends have completed, its values of the last step are gone), viewed as
        `dtype` (`nbytes` a multiple of its size)."""
        if (key if isinstance(key, int) else key[0]) in self.fresh:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device).view(dtype)
        buf = self.kept.get(key)
        if buf is None:
            buf = self.kept[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf.view(dtype)


class _Serial:
    """A thread that runs functions one at a time, in the order they come (`submit`): a rank's collectives of
    more than two replicas, whose second half (an `all_gather`) can only start once the first has arrived and
    been summed, and which every rank must start on a process group in one order."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="fastt-collectives").start()

    def submit(self, fn: Callable[[], list]) -> Future:
        future: Future = Future()
        self.queue.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            fn, future = self.queue.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the rank that waits for it
                future.set_exception(e)


_SERIAL: list[_Serial] = []


class _Then:
    """The `all_gather`s of a sharded collective, issued by the `_Serial` thread (`future`) or already (a GPU),
    into `outs` (one per dtype): what `_wait` and `_poll` wait for. Raises what the thread raised."""

    def __init__(self, future: Future, outs: list[torch.Tensor]) -> None:
        self.future, self.outs = future, outs

    def is_completed(self) -> bool:
        return self.future.done() and all(w.is_completed() for w in self.future.result())

    def wait(self) -> None:
        for w in self.future.result():
            w.wait()


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


_DIRECTIONS: list = [None, {}]  # [the process group they belong to, {(src, dst): group}]


def directions(device: torch.device) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A process group of two ranks for every ordered pair (src, dst), carrying only messages from src to dst.
    NCCL matches the messages between two ranks by their order alone (it ignores tags) and runs a group's
    operations in order on one stream. With a group per direction, each direction is a queue whose sends and
    receives pair off one for one, in the order the sender sends (`Wiring.inbox`), and no receive waits behind a
    send going the other way: in one group for both directions, two ranks that both post their receives first
    deadlock. Gloo runs the same way. Every rank makes them together, once per process group, and connects each
    with one message, in one order on all ranks: NCCL connects a group on its first message, so a rank that
    posted its receives first would wait for a peer that waits for it."""
    if _DIRECTIONS[0] is dist.group.WORLD:
        return _DIRECTIONS[1]
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {pair: dist.new_group(list(pair)) for pair in itertools.permutations(range(world), 2)}
    one = torch.zeros(1, device=device)
    for (src, dst), g in groups.items():
        if rank == src:
            dist.isend(one, dst, group=g).wait()
        elif rank == dst:
            dist.irecv(one, src, group=g).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    _DIRECTIONS[:] = [dist.group.WORLD, groups]
    return groups


_REDUCERS: list = [None, {}]  # [the process group they belong to, {ranks: group}]


def reducers(sets: Iterable[tuple[int, ...]], device: torch.device) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group for each tuple of ranks in `sets` (a wiring's collectives'), made when first needed.
    Making a group is a collective of all ranks: every rank calls this with the same sets at the same point. New
    groups are made, then connected with one `all_reduce` each, in sorted order (NCCL connects a group on its
    first collective, which blocks until all its ranks are there; started in the step, that would wait on ranks
    that start their collectives in another group first)."""
    if _REDUCERS[0] is not dist.group.WORLD:
        _REDUCERS[:] = [dist.group.WORLD, {}]
    groups = _REDUCERS[1]
    new = sorted({r for r in sets if len(r) > 1 and r not in groups})
    for ranks in new:
        groups[ranks] = dist.new_group(list(ranks))
    one = torch.zeros(1, device=device)
    for ranks in new:
        if dist.get_rank() in ranks:
            dist.all_reduce(one, group=groups[ranks])
    if new and device.type == "cuda":
        torch.cuda.synchronize(device)
    return groups


class _RankRun(_Run):
    """One step on this rank: its device's segments, with the wiring's messages instead of shared memory.
    On a GPU the rank only queues work: a receive makes the rank's stream wait for it, and the step ends by
    waiting (at most the timeout) for every message and the GPU."""

    signalled = False

    def __init__(self, low: Lowered, programs: Programs, wiring: Wiring, envs: list[dict], rank: int,
                 timeout: timedelta, buffers: _Buffers, timings: list | None = None) -> None:
        super().__init__(low, programs, envs, torch.get_num_threads(), timings)
        self.wiring, self.rank, self.timeout, self.buffers = wiring, rank, timeout, buffers
        self.groups = directions(buffers.device)
        if self.cuda:  # the GPU's default stream: never a pooled stream, which a direction's NCCL ops may run on
            self.streams = (torch.cuda.default_stream(buffers.device),) * len(programs.devices)
        self.sends: list = []  # (message, buffer, its send)
        self.posted: dict[int, tuple] = {}  # message -> (buffer, its posted receive)
        self.reducers = reducers((c.ranks for c in wiring.collectives), buffers.device)
        # collective -> a sum's per dtype (leaves, buffer, its all_reduce), the sharded form's `_Then`, or None (a
        # rank on its own)
        self.started: dict[int, object] = {}
        # On a GPU, what to wait for at the end: (message, its receive) and (collective, its work).
        self.pending: list = []

    def post_receives(self) -> None:
        """Post every receive of the step up front, each into its buffer, in the order the senders send them:
        a message then finds its buffer waiting (here a 64 KiB exchange takes half the time of one whose
        receives are posted late)."""
        for i in self.wiring.inbox[self.rank]:
            m = self.wiring.messages[i]
            buf = self.buffers.get(i, _packed_size(self.wiring.leaves[i]))
            try:
                self.posted[i] = (buf, dist.irecv(buf, m.src, group=self.groups[m.src, m.dst])
                                  if buf.numel() else None)
            except RuntimeError as e:
                raise LostPeer(_lost(m.src, m.values[0][1], e, self.timeout)) from e

    def receive(self, ms: Sequence[int]) -> None:
        for i in ms:
            m, leaves = self.wiring.messages[i], self.wiring.leaves[i]
            buf, work = self.posted.pop(i)
            self._wait(i, work, m.src, m.values[0][1])
            tensors = iter(_unpack(buf, leaves))
            for v in m.values:
                spec, vleaves = self.wiring.shapes[v]
                self.envs[v[0]][v[1]] = torch.utils._pytree.tree_unflatten([next(tensors) for _ in vleaves], spec)

    def send(self, ms: Sequence[int]) -> None:
        for i in ms:
            m = self.wiring.messages[i]
            pairs = [(x, leaf) for v in m.values for x, leaf in
                     zip(torch.utils._pytree.tree_leaves(self.envs[v[0]][v[1]]), self.wiring.shapes[v][1])]
            buf = _pack(pairs, self.buffers.get(i, _packed_size(self.wiring.leaves[i])))
            if buf.numel():
                self.sends.append((i, buf, dist.isend(buf, m.dst, group=self.groups[m.src, m.dst])))

    def start(self, cs: Sequence[int]) -> None:
        """Start collectives `cs`, not waited for. Two replicas: this rank's part of their sum (both gradients
        added in replica order, one, or zeros) and an `all_reduce` per dtype: a + b is b + a, bit for bit.
        More: the sharded form (`Collective`, `_start_shards`)."""
        for c in cs:
            col = self.wiring.collectives[c]
            if len(col.ranks) == 1:
                self.started[c] = None
            elif self.low.replicas == 2:
                self.started[c] = self._start_sum(c, col)
            else:
                self.started[c] = self._start_shards(c, col)

    def _start_sum(self, c: int, col: Collective) -> list:
        pairs = []
        for name, src, leaf in zip(col.names, col.sources, col.leaves):
            mine = [self.envs[k][name] for k, r in enumerate(src) if r == self.rank]
            pairs.append((mine[0] + mine[1] if len(mine) == 2 else mine[0] if mine else
                          torch.zeros(leaf[0], dtype=leaf[2], device=self.buffers.device), leaf))
        started = []
        for dtype in dict.fromkeys(leaf[2] for leaf in col.leaves):
            these = [(x, leaf) for x, leaf in pairs if leaf[2] == dtype]
            buf = _pack(these, self.buffers.get((c, dtype), _packed_size([leaf for _, leaf in these])))
            try:
                work = dist.all_reduce(buf.view(dtype), group=self.reducers[col.ranks], async_op=True)
            except RuntimeError as e:
                raise LostPeer(self._failed(col, e)) from e
            started.append(([leaf for _, leaf in these], buf, work))
        return started

    def _start_shards(self, c: int, col: Collective) -> _Then:
        """The sharded form: this rank's slices of the gradients it holds go to the shards' owners by an
        `all_to_all`; this rank sums its shard's replicas in replica order and divides (as `replica_mean`), and
        an `all_gather` of the shards follows. On the CPU the exchange and the sum run on the `_Serial` thread,
        which starts a rank's collectives in the order they come; on a GPU all of it is queued at once, on a side
        stream."""
        group, n = self.reducers[col.ranks], len(col.ranks)
        jobs = []
        for sh in col.shards(self.rank):
            def buf(role: str, numel: int, sh: Shards = sh) -> torch.Tensor:
                return self.buffers.get((c, sh.dtype, role), numel * sh.dtype.itemsize, sh.dtype)
            jobs.append((sh, sh.pack(self.envs, col, buf("send", sum(sh.send_counts))),
                         buf("recv", sum(sh.recv_counts)), buf("mine", sh.size), buf("out", n * sh.size)))
        timeout = self.timeout

        def exchange() -> list:
            gathers = []
            for sh, send, recv, mine, out in jobs:
                work = dist.all_to_all_single(recv, send, list(sh.recv_counts), list(sh.send_counts), group=group,
                                              async_op=True)
                if self.cuda:
                    work.wait()  # the side stream waits
                else:
                    work.wait(timeout)
                sh.mean(recv, mine)
                gathers.append(dist.all_gather_single(out, mine, group=group, async_op=True))
            return gathers

        try:
            if not self.cuda:
                if not _SERIAL:
                    _SERIAL.append(_Serial())
                return _Then(_SERIAL[0].submit(exchange), [job[-1] for job in jobs])
            side = _SIDE.get(self.buffers.device)
            if side is None:
                side = _SIDE[self.buffers.device] = torch.cuda.Stream(self.buffers.device)
            side.wait_stream(torch.cuda.current_stream(self.buffers.device))
            done: Future = Future()
            with torch.cuda.stream(side):
                done.set_result(exchange())
            return _Then(done, [job[-1] for job in jobs])
        except RuntimeError as e:
            raise LostPeer(self._failed(col, e)) from e

    def reduce(self, cs: Sequence[int]) -> None:
        """Wait for collectives `cs` (on a GPU: the stream waits); every replica's gradients become their mean,
        as `replica_mean` computes it (the sum in replica order, then divided)."""
        for c in cs:
            col, started = self.wiring.collectives[c], self.started.pop(c)
            if started is None:  # a rank on its own
                means = dict(zip(col.names, replica_mean([[env[x] for x in col.names] for env in self.envs])))
            elif isinstance(started, list):  # a sum
                means = {}
                for leaves, buf, work in started:
                    self._wait(col, work)
                    buf.view(leaves[0][2]).div_(float(self.low.replicas))
                    means.update(zip([x for x, leaf in zip(col.names, col.leaves) if leaf[2] == leaves[0][2]],
                                     _unpack(buf, leaves)))
            else:
                self._wait(col, started)
                means = {}
                for sh, out in zip(col.shards(self.rank), started.outs):
                    means.update(sh.means(out, col))
            for env in self.envs:
                env.update(means)

    def _wait(self, key: int | Collective, work, src: int = -1, name: str = "") -> None:
        """Wait for a receive (message `key`, from `src`, carrying `name` first) or a collective: on a GPU the
        stream waits (see `finish`), on the CPU the rank, at most the timeout. A collective is polled (`_poll`):
        when one of its ranks dies, the others may only learn it from the connection of a survivor next to it."""
        if work is None:
            return
        try:
            if self.cuda:
                work.wait()
                self.pending.append((key, work))
            elif isinstance(key, Collective):
                self._poll(key, work, time.monotonic() + self.timeout.total_seconds())
                work.wait()
            else:
                work.wait(self.timeout)
        except LostPeer:
            raise
        except RuntimeError as e:
            raise LostPeer(self._failed(key, e) if isinstance(key, Collective) else
                           _lost(src, name, e, self.timeout)) from e

    def _poll(self, key: int | Collective, work, deadline: float) -> None:
        """Wait until `work` (message `key`'s or a collective's) is done, raising `LostPeer` at the deadline or
        once another rank has recorded a failure (looked up every heartbeat period), which names the dead rank."""
        look = 0.0
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                if isinstance(key, Collective):
                    raise LostPeer(self._failed(key, TimeoutError("timed out")))
                m = self.wiring.messages[key]
                peer = m.src if m.dst == self.rank else m.dst
                raise LostPeer(f"rank {peer} exchanged nothing for {self.timeout.total_seconds():g} s "
                               f"(message with '{m.values[0][1]}'): rank {peer} is stalled or dead")
            if now > look:
                look = now + HEARTBEAT_S
                if failure_recorded():
                    what = (f"the allreduce of '{key.names[0]}'" if isinstance(key, Collective) else
                            f"the message with '{self.wiring.messages[key].values[0][1]}'")
                    raise LostPeer(f"stopped waiting for {what}: another rank failed")
            time.sleep(2e-4)

    def _failed(self, col: Collective, e: BaseException) -> str:
        """Why an allreduce failed: the peer, when it had one other rank; else the ranks (and the heartbeats
        of the store name the one that stopped, see `record_failure`)."""
        others = [r for r in col.ranks if r != self.rank]
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            return (f"{who} did not join the allreduce of '{col.names[0]}' for {self.timeout.total_seconds():g} s: "
                    f"{who} is stalled or dead")
        if len(others) == 1:
            return _lost(others[0], col.names[0], e, self.timeout)
        return f"lost {who} (in the allreduce of '{col.names[0]}': {type(e).__name__}: {str(e).splitlines()[0]})"

    def run(self) -> None:
        d = self.rank
        if self.cuda:  # after what the caller queued (the batch)
            self.streams[d].wait_stream(torch.cuda.current_stream(self.programs.targets[d]))
            with torch.cuda.stream(self.streams[d]):
                self._run(d)
        else:
            self._run(d)
        self.finish()

    def _run(self, d: int) -> None:
        self.post_receives()
        for i, seg in enumerate(self.programs.devices[d]):
            self.start(self.wiring.start_before[d][i])
            self.receive(self.wiring.recv_before[d][i])
            self.reduce(self.wiring.reduce_before[d][i])
            if not self.run_segment(seg, d):
                name, _, e = self.error
                raise RankError(f"op '{name}' failed: {type(e).__name__}: {e}") from e
            self.send(self.wiring.send_after[d][i])
        self.start(self.wiring.start_before[d][-1])
        for x, name, dim, k, parts in self.wiring.chunks[d]:
            self.envs[0][name] = torch.tensor_split(self.envs[0][x], parts, dim)[k]
        mine = [i for i in self.wiring.final if self.wiring.messages[i].src == d]
        self.send(mine)
        self.receive([i for i in self.wiring.final if self.wiring.messages[i].dst == d])
        if self.posted:  # a receive left posted would take the next step's message
            raise RankError(f"messages {sorted(self.posted)[:5]} were posted but never read (a wiring bug)")
        for c, started in self.started.items():  # collectives this rank only contributed to
            for work in [w for _, _, w in started] if isinstance(started, list) else [started]:
                self._wait(self.wiring.collectives[c], work)
        self.started.clear()

    def finish(self) -> None:
        """Wait for every send (and on a GPU every receive, then the GPU) within the timeout; segment timings
        become (segment index, seconds)."""
        if self.cuda:
            deadline = time.monotonic() + self.timeout.total_seconds()
            for i, w in [*self.pending, *((i, w) for i, _, w in self.sends)]:
                self._poll(i, w, deadline)
            torch.cuda.synchronize(self.programs.targets[self.rank])
        else:
            for i, _, w in self.sends:
                try:
                    w.wait(self.timeout)
                except RuntimeError as e:
                    raise LostPeer(f"a send to rank {self.wiring.messages[i].dst} failed "
                                   f"({type(e).__name__}: {e})") from e
        if self.timings is not None:
            self.timings[:] = [(k, t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3)
                               for k, (_, _, t) in enumerate(self.timings)]


def _lost(src: int, name: str, e: BaseException, timeout: timedelta) -> str:
    if "timed out" in str(e).lower() or "timeout" in str(e).lower():
        return (f"rank {src} sent nothing for {timeout.total_seconds():g} s (waiting for '{name}'): "
                f"rank {src} is stalled or dead")
    return f"lost rank {src} (waiting for '{name}': {type(e).__name__}: {str(e).splitlines()[0]})"


class DistributedStep:
    """One training step of this rank's share of a plan: `loss = step(*shard)`, every rank passing its shard of
    the batch: rank r's B/world samples, rows [r·B/world, (r+1)·B/world) of the whole batch of B the step was
    captured with (`fastt.runtime.shards`; in a data-parallel plan rank r's shard is replica r's share, what
    `DistributedSampler` and a DataLoader of batch B/world give rank r). The rows a plan reads on another rank
    travel there. Every rank may instead pass the same whole batch (nothing travels). The loss comes back on rank
    0, None elsewhere. Rank 0's model and optimizer are the truth after every step; other ranks keep what their
    devices read."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, placed: Placed, wiring: Wiring,
                 timeout_s: float = DEFAULT_TIMEOUT_S, graph: OpGraph | None = None, cluster: Cluster | None = None,
                 costs: MeasuredCosts | None = None, tuner: Tuner | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = timedelta(seconds=timeout_s)
        self.trial: dict | None = None  # fastt's plan against DP, measured (see parallelize_distributed)
        # What `switch` and the tuner place plans with, as on a local ParallelStep (the tuner's log and decisions
        # are rank 0's).
        self.graph, self.cluster, self.costs, self.tuner = graph, cluster, costs, tuner
        # Later plans are compiled for what this one was (`rank_targets`: no rank touches another's GPU).
        self.targets = placed.programs.targets
        self._placed, self.wiring = placed, wiring
        self.buffers = _Buffers(wiring, self.rank, placed.programs.targets[self.rank])
        self._feed: Feed | None = None

    @property
    def placed(self) -> Placed:
        return self._placed

    @placed.setter
    def placed(self, placed: Placed) -> None:
        """Run another plan from the next step on (the tuner's trial or roll-back): its messages are wired."""
        same = placed.programs is self._placed.programs
        self._placed = placed
        if not same:
            self.wiring = wire(placed.lowered, placed.programs)
            self.buffers = _Buffers(self.wiring, self.rank, placed.programs.targets[self.rank])
            self._feed = None

    @property
    def feed(self) -> Feed:
        """Which rows of the batch each rank holds, and those that travel (made when a shard first comes: a
        batch that does not split into the ranks' shards can still run whole)."""
        if self._feed is None:
            low, programs = self.placed.lowered, self.placed.programs
            reads = [[(seg.replica, name) for seg in segs for name in _reads(low, programs, seg)]
                     for segs in programs.devices]
            self._feed = plan_feed(low, programs, reads)
        return self._feed

    @property
    def strategy(self) -> Strategy:
        return self.placed.strategy

    @property
    def simulated_s(self) -> float:
        return self.placed.simulated_s

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor | None:
        t0 = time.perf_counter()
        low, programs = self.placed.lowered, self.placed.programs
        step = low.step
        whole = self.world == 1 or len(batch) > 0 and batch[0].shape[0] == step.batch * low.replicas
        if whole:
            step.check(self.model, self.optimizer, batch, low.replicas)
            guards.check(step.gm, batch, low.replicas)
        else:
            with torch.no_grad(), self._failing():
                shares, weights = self._fed(batch)
        params, buffers, states, _, hypers = step.arguments(self.model, self.optimizer, batch)
        envs = (replica_envs(low, programs, params, buffers, states, batch, hypers) if whole else
                replica_tables(low, programs, params, buffers, states, shares, hypers, weights))
        tuning = self.tuner is not None and self.tuner.active
        run = _RankRun(low, programs, self.wiring, envs, self.rank, self.timeout, self.buffers,
                       [] if tuning else None)
        with torch.no_grad():
            for env in envs:
                for name in low.prelude:  # a view of an input this rank does not hold is read nowhere here
                    if all(a.name in env for a in programs.nodes[name].all_input_nodes):
                        run.call(name, env)
            with self._failing():
                run.run()
        keep = self.wiring.keep[self.rank]
        named = dict(zip(programs.placeholders, [*params, *buffers, *(s for ss in states for s in ss)]))
        for x, name, dim, k, parts in self.wiring.merge[self.rank]:
            torch.tensor_split(named[x], parts, dim)[k].copy_(envs[0][name])
        for x, (k, value) in keep.items():
            new = envs[k][value]
            target = named[x]
            if isinstance(target, torch.nn.Parameter):
                target.data = new
            elif new is not target:
                target.copy_(new)
        loss = weighted_loss(envs, programs) if self.rank == 0 else None
        stepped(self.optimizer)
        if tuning:
            self._tune(time.perf_counter() - t0, run.timings)
        return loss

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """A failure of this rank (not a refused batch) is recorded as the job's, and raised as a RankError."""
        try:
            yield
        except FasttError:
            raise
        except Exception as e:
            raise RankError(record_failure(f"rank {self.rank}: {e}" if isinstance(e, RankError)
                                           else f"rank {self.rank}: {type(e).__name__}: {e}",
                                           lost_peer=isinstance(e, LostPeer))) from e

    def _fed(self, shard: Sequence[torch.Tensor]) -> tuple[list[list[torch.Tensor | None]], list[float]]:
        """Per replica, the inputs this rank holds (None where it holds none) from its shard and the rows the
        others send (`Feed`), and every replica's loss weight. A shard one rank refuses (its shape, a change of
        the model or optimizer, a guard of a share it checks) is refused by every rank, nothing trained."""
        low, feed, r = self.placed.lowered, self.feed, self.placed.lowered.replicas
        why = _bad_shard(feed, shard)
        if why:  # zeros of the right shape keep the exchange in step; every rank refuses below
            shard = [torch.zeros((feed.shard, *sample), dtype=dtype, device=self.buffers.device)
                     for sample, dtype in feed.leaves]
        else:
            try:  # the shard's shape is right: only the model and optimizer are left to check
                low.step.check(self.model, self.optimizer, [x[:1].expand(feed.share, *x.shape[1:]) for x in shard])
            except FasttError as e:
                why = str(e)
        shares = feed.shares(self.rank, shard, self._exchange(feed, shard))
        counts = [0.0] * r
        for k in [k for k, c in enumerate(feed.checker) if c == self.rank and not why]:
            try:
                guards.check(low.step.gm, shares[k])
            except FasttError as e:
                why = f"replica {k}'s share: {e}" if r > 1 else str(e)
                break
            if low.weights.counts and r > 1:
                counts[k] = float(low.weights.count(*shares[k]))
        return shares, low.weights.weighed(self._agree(why, counts))

    def _exchange(self, feed: Feed, shard: Sequence[torch.Tensor]) -> dict[Piece, torch.Tensor]:
        """The rows of other ranks' shards this rank needs, received while it sends the rows others need from
        its own: one message per direction, before any of the step's own (each direction keeps its order)."""
        groups, device = directions(self.buffers.device), self.buffers.device
        posted = []
        for src, pieces in feed.receives(self.rank).items():
            leaves = [feed.leaf(p) for p in pieces]
            buf = self.buffers.get(("feed", "in", src), _packed_size(leaves))
            posted.append((src, pieces, leaves, buf, dist.irecv(buf, src, group=groups[src, self.rank])))
        sent = []
        for dst, pieces in feed.sends(self.rank).items():
            pairs = [(feed.rows(self.rank, shard[p.input], p.lo, p.hi), feed.leaf(p)) for p in pieces]
            buf = _pack(pairs, self.buffers.get(("feed", "out", dst), _packed_size([leaf for _, leaf in pairs])))
            sent.append((dst, dist.isend(buf, dst, group=groups[self.rank, dst])))
        received = {}
        for src, pieces, leaves, buf, work in posted:
            _done(work, self.timeout, device, lambda e, src=src: _lost(src, "rows of the batch", e, self.timeout))
            received.update(zip(pieces, _unpack(buf, leaves)))
        for dst, work in sent:
            _done(work, self.timeout, device,
                  lambda e, dst=dst: f"a send to rank {dst} failed ({type(e).__name__}: {e})")
        return received

    def _agree(self, why: str, counts: list[float]) -> list[float]:
        """Every replica's count, from the rank that checks it (one all_gather); if any rank refused its shard
        (`why`), every rank raises its reason."""
        mine = torch.tensor([1.0 if why else 0.0, *counts], dtype=torch.float64, device=self.buffers.device)
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.float64, device=mine.device)
        work = dist.all_gather_single(everyone, mine, async_op=True)
        _done(work, self.timeout, mine.device,
              lambda e: f"a rank did not join the check of the batch's shards ({type(e).__name__}: {e})")
        table = everyone.view(self.world, -1).tolist()
        refused = [rank for rank, row in enumerate(table) if row[0]]
        if refused:
            whys: list = [None] * self.world
            dist.all_gather_object(whys, why)
            raise FasttError(f"rank {refused[0]} refused the batch: {whys[refused[0]]}")
        return [table[c][1 + k] for k, c in enumerate(self.feed.checker)]

    def _tune(self, seconds: float, timings: list) -> None:
        """FastT's loop across the ranks: rank 0's tuner observes every rank's segment times and this step's
        time (its own); when it switches plans (a trial or a roll-back), every rank places the same plan and
        takes rank 0's model and optimizer state first, since the others only keep what their devices read."""
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, timings)

        def observe() -> tuple:  # may replan, which takes rank 0 a while
            before, segs = self.placed, self.placed.programs.devices
            self.tuner.observe(self, seconds, [(segs[d][i], d, s) for d, ts in enumerate(everyone) for i, s in ts])
            changed = self.placed.strategy != before.strategy
            return self.placed.strategy.to_json() if changed else None, self.tuner.active

        box = [alone_on_rank0(observe)]
        dist.broadcast_object_list(box, src=0)
        switch, self.tuner.active = box[0]
        if switch is not None:
            self.switch(Strategy.from_json(switch), self.placed if self.rank == 0 else None)

    def switch(self, strategy: Strategy, placed: Placed | None = None) -> None:
        """Run `strategy` from the next step on. Every rank calls it with the same strategy (`placed`: this
        rank's placement of it, if made already): it is placed and wired, and every rank takes rank 0's model and
        optimizer state, since the others only kept what their devices read."""
        if placed is None:
            placed = place(self.graph, strategy, self.cluster, self.costs, self.targets)
        self.placed = placed
        _check_same(self.wiring)
        sync_from_rank0(self.model, self.optimizer, placed.lowered.step)


def _bad_shard(feed: Feed, shard: Sequence[torch.Tensor]) -> str:
    """Why `shard` is not a shard of the step's batch ('' if it is)."""
    want = [(feed.shard, *sample) for sample, _ in feed.leaves]
    got = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in shard]
    if got != want or any(x.dtype != dtype for x, (_, dtype) in zip(shard, feed.leaves)):
        return (f"its shard's shapes are {got}, not {want} (its rows of the batch of {feed.shard * feed.world} "
                f"over {feed.world} ranks; or pass the whole batch on every rank)")
    return ""


def _done(work, timeout: timedelta, device: torch.device, lost: Callable[[BaseException], str]) -> None:
    """Wait for `work` at most `timeout` (on a GPU polled: its `wait` only makes the stream wait), raising
    LostPeer(lost(the error)) when it fails."""
    try:
        if device.type == "cuda":
            deadline = time.monotonic() + timeout.total_seconds()
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
                time.sleep(2e-4)
        work.wait(timeout)
    except (RuntimeError, TimeoutError) as e:
        raise LostPeer(lost(e)) from e


def record_failure(message: str, lost_peer: bool = False) -> str:
    """Record `message` as the job's first failure in the process group's store unless one is there; returns
    the message with the first failure appended when that was another. `lost_peer`: this rank lost a connection
    or timed out, which may be a rank further away that died: the ranks whose heartbeat stopped are named."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        if lost_peer and not store.check([FAILED_KEY]):
            dead = silent_ranks(store)
            if dead:
                message += f"; rank {', '.join(map(str, dead))} stopped (no heartbeat)"
        first = store.compare_set(FAILED_KEY, "", message).decode()
        store.set(_failed_key(dist.get_rank()), "1")
    except Exception:  # noqa: BLE001 - the store may be gone with the process that hosted it
        if lost_peer and dist.get_rank() != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            message += "; rank 0 stopped (the store it hosts is gone)"  # started without torchrun's agent
        return message
    return message if first == message else f"{message} (first failure in the job: {first})"


def failure_recorded() -> bool:
    """Whether a rank has recorded the job's first failure (False when the store cannot say)."""
    try:
        return dist.distributed_c10d._get_default_store().check([FAILED_KEY])
    except Exception:  # noqa: BLE001 - the store is gone with rank 0: a timeout or a lost connection follows
        return False


def await_reports(wait_s: float = 25.0) -> None:
    """Before a failed rank 0 exits: wait (at most `wait_s`) until every other rank has recorded its failure or
    stopped beating. Started without torchrun, rank 0 hosts the store, where the others read the job's first
    failure and the heartbeats that name a dead rank (a collective does not say which of its ranks is gone, and
    a rank may only learn of it when a survivor next to it exits)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            missing = [r for r in range(1, dist.get_world_size()) if not store.check([_failed_key(r)])]
            if set(missing) <= set(silent_ranks(store, missing)):
                return
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read it
        return


HEARTBEAT_S = 0.5


def start_heartbeat() -> Callable[[], None]:
    """Count this rank's heartbeats in the store, from a thread: a rank that dies stops counting. Returns the
    function that stops it (call it before the process group is destroyed)."""
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(_beat_key(rank), 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            stop.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, daemon=True, name="fastt-heartbeat")
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join()

    return halt


_ALONE = itertools.count()


def alone_on_rank0(fn: Callable[[], object]) -> object:
    """`fn()` on rank 0 while the others wait for it, however long it takes (planning, calibrating, the eager
    check: a barrier or broadcast would time out): each waits for a key in the store as long as rank 0's
    heartbeat goes on, and names rank 0 when it stops. Every rank calls it at the same point, like a collective.
    Returns fn's result on rank 0, None elsewhere."""
    store, key = dist.distributed_c10d._get_default_store(), f"fastt/alone/{next(_ALONE)}"
    if dist.get_rank() == 0:
        out = fn()
        store.set(key, "1")
        return out
    me, nap, beats, moved, look = dist.get_rank(), 1e-4, 0, time.monotonic(), 0.0
    while True:
        try:
            if store.check([key]):
                return None
            now = time.monotonic()
            if now > look:  # rank 0's heartbeat, every heartbeat period
                look = now + HEARTBEAT_S
                count = store.add(_beat_key(0), 0)
                if count != beats:
                    beats, moved = count, now
                elif beats and now - moved > 4 * HEARTBEAT_S:
                    raise LostPeer(record_failure(f"rank {me}: rank 0 stopped (no heartbeat) while the others "
                                                  "waited for it"))
                if failure_recorded():
                    raise LostPeer(record_failure(f"rank {me}: stopped waiting for rank 0: a rank failed"))
        except LostPeer:
            raise
        except Exception as e:  # the store is gone with rank 0 (started without torchrun)
            raise LostPeer(record_failure(f"rank {me}: lost rank 0 while it worked alone ({type(e).__name__}: {e})",
                                          lost_peer=True)) from e
        time.sleep(nap)
        nap = min(2 * nap, 0.01)


def silent_ranks(store, ranks: Sequence[int] | None = None, wait_s: float = 4 * HEARTBEAT_S) -> list[int]:
    """The other ranks (of `ranks`, default all) whose heartbeat count did not move in `wait_s` (ranks that never
    beat are left out)."""
    me = dist.get_rank()
    ranks = [r for r in (range(dist.get_world_size()) if ranks is None else ranks) if r != me]
    if not ranks:
        return []
    keys = [_beat_key(r) for r in ranks]
    before = [store.add(k, 0) for k in keys]
    time.sleep(wait_s)
    return [r for r, k, b in zip(ranks, keys, before) if b and store.add(k, 0) == b]


def rank_device() -> torch.device:
    """The device this rank runs on: its current GPU when the process group runs NCCL, else the CPU."""
    if "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_targets(device: torch.device) -> tuple[torch.device, ...]:
    """What a rank compiles a plan for: every device on its own (it only runs its own device's program)."""
    return (device,) * dist.get_world_size()


def _synchronized(device: torch.device) -> float:
    """perf_counter once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _hop(x: torch.Tensor, other: int, sending: bool, groups: dict) -> None:
    """One message of x between this rank and `other`, the way the runtime sends one."""
    leaf = [(x.shape, x.stride(), x.dtype)]
    rank = dist.get_rank()
    if sending:
        dist.isend(_pack([(x, leaf[0])]), other, group=groups[rank, other]).wait()
    else:
        buf = torch.empty(_packed_size(leaf), dtype=torch.uint8, device=x.device)
        dist.irecv(buf, other, group=groups[other, rank]).wait()
        _unpack(buf, leaf)


def measure_p2p(peer: int, groups: dict, device: torch.device,
                sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22, 2**24),
                repeats: int = 5) -> tuple[list[int], list[float]]:
    """Seconds a message of each size takes from rank 0 to `peer` the way the runtime sends one (packed into a
    buffer, `isend`, `irecv` into a fresh buffer, unpacked): half a ping-pong, median of repeats. Rank 0 and
    `peer` call it together (with `directions(device)`, which every rank makes), other ranks do not."""
    rank, times = dist.get_rank(), []
    other = peer if rank == 0 else 0
    for n in sizes:
        x = torch.rand(n // 4, device=device)
        ts = []
        for _ in range(repeats + 1):
            t0 = _synchronized(device)
            _hop(x, other, rank == 0, groups)
            _hop(x, other, rank != 0, groups)
            ts.append((_synchronized(device) - t0) / 2)
        times.append(statistics.median(ts[1:]))
    return list(sizes), times


def _average(xs: Sequence[torch.Tensor], leaves: Sequence[tuple], group: dist.ProcessGroup,
             buf: torch.Tensor) -> None:
    """Two ranks average tensors the way the runtime's collectives do for two replicas (in a buffer kept from
    step to step): pack, `all_reduce`, divide, unpack."""
    _pack(list(zip(xs, leaves)), buf)
    dist.all_reduce(buf.view(leaves[0][2]), group=group)
    buf.view(leaves[0][2]).div_(2.0)
    _unpack(buf, leaves)


GATHER_SHAPES = ((16, 16), (256, 16), (16, 2**16), (256, 2**12), (16, 2**18))  # (tensors, floats each)


def measure_gather(group: dist.ProcessGroup, device: torch.device,
                   shapes: Sequence[tuple[int, int]] = GATHER_SHAPES,
                   repeats: int = 9) -> tuple[list[tuple[int, int]], list[float]]:
    """Seconds the two ranks of `group` take to average `k` tensors of `f` floats each (`shapes`: (k, f)), the
    way the runtime's collectives do (`_average`), median of repeats: ([(bytes, tensors)], seconds). The
    group's ranks call it together."""
    points, times = [], []
    for k, f in shapes:
        xs = [torch.rand(f, device=device) for _ in range(k)]
        leaves = [(x.shape, x.stride(), x.dtype) for x in xs]
        buf = torch.empty(_packed_size(leaves), dtype=torch.uint8, device=device)
        ts = []
        for _ in range(repeats + 1):
            t0 = _synchronized(device)
            _average(xs, leaves, group, buf)
            ts.append(_synchronized(device) - t0)
        points.append((4 * k * f, k))
        times.append(statistics.median(ts[1:]))
    return points, times


def fit_gather(points: Sequence[tuple[int, int]], seconds: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of time = a + b·bytes + c·tensors: (a, b, c), each ≥ 0. Absolute errors: the megabytes that
    gradients come in are what matter, and the cost per byte of small exchanges (from cache) is lower."""
    secs = np.asarray(seconds, dtype=float)
    a_mat = np.array([(1.0, b, k) for b, k in points], dtype=float)
    coef, *_ = np.linalg.lstsq(a_mat, secs, rcond=None)
    a, b, c = (max(float(x), 0.0) for x in coef)
    return a, b, c


def rank_cluster(device: torch.device | None = None) -> Cluster:
    """The process group's ranks as a Cluster, one device per rank: its share of a node's cores, calibrated
    (gloo), or its GPU (NCCL: `rank:R@cuda:I`, costed from the GPU's name, as `cuda_cluster` does). Nodes come
    from torchrun's LOCAL_WORLD_SIZE; one link per (ordered) pair of nodes, whose latency and bandwidth are
    fitted (least squares) on messages measured for each link class: within a node (rank 0 to rank 1) and
    between nodes (rank 0 to the first rank of node 1). Gradients are averaged by the runtime's collectives (a
    gather: `Cluster.gather`), whose cost between two ranks is fitted on measured ones (`measure_gather`), across
    nodes when there are several. Every rank calls it; all get rank 0's numbers (and on GPUs their own GPU)."""
    device = device or rank_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = [r // per_node for r in range(world)]
    peers = {"intra": 1 if world > 1 and node[1] == 0 else None, "inter": per_node if per_node < world else None}
    fitted: dict[str, tuple[float, float]] = {}
    gather, groups = None, directions(device)
    pairs = reducers([(0, peer) for peer in peers.values() if peer is not None], device)
    for cls, peer in peers.items():  # the gather across nodes (measured last) is the slower one
        if peer is None:
            continue
        if rank in (0, peer):
            sizes, secs = measure_p2p(peer, groups, device)
            points, times = measure_gather(pairs[0, peer], device)
            if rank == 0:
                fitted[cls] = fit_transfers(sizes, secs, relative=True)
                gather = fit_gather(points, times)
        dist.barrier()
    cpu = device.type == "cpu"
    speed = alone_on_rank0(lambda: calibrate_cpu(cpu_cluster(1)).devices[0] if cpu else None)
    box = [(fitted, speed, gather) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    fitted, dev, gather = box[0]
    if cpu:
        devices = tuple(replace(dev, name=f"rank:{r}", memory_bytes=dev.memory_bytes // per_node, node=node[r])
                        for r in range(world))
    else:  # every rank's GPU is taken to be of this rank's kind; each is named after its place on its node
        gpu = cuda_cluster([device.index]).devices[0]
        devices = tuple(replace(gpu, name=f"rank:{r}@cuda:{r % per_node}", node=node[r]) for r in range(world))
    # One link per pair of nodes, shared by all their ranks: on a node, messages go through the host's TCP
    # stack on the cores that compute (two ranks exchanging take twice as long as one sending); between
    # nodes, through one connection.
    backend = "gloo" if cpu else "nccl"
    links, index, routes = [], {}, {}
    for i, j in itertools.permutations(range(world), 2):
        pair = (node[i], node[j])
        if pair not in index:
            cls = "intra" if node[i] == node[j] else "inter"
            index[pair] = len(links)
            name = f"n{node[i]}" if cls == "intra" else f"n{node[i]}->n{node[j]}"
            links.append(Link(f"{backend}-{cls}:{name}", fitted[cls][1], fitted[cls][0]))
        routes[i, j] = (index[pair],)
    return Cluster(f"{backend}:{world}", devices, tuple(links), routes, gather)


def parallelize_distributed(model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer,
                            example_inputs: Sequence[torch.Tensor], planner: str = "fastt",
                            strategy: Strategy | None = None, cl: Cluster | None = None,
                            timeout_s: float = DEFAULT_TIMEOUT_S, trial_steps: int = 3,
                            tune: bool | Tuner = False, clip_grad_norm: float | None = None) -> DistributedStep:
    """`parallelize` over an initialized process group, one device per rank (gloo: the CPU; NCCL: the rank's
    current GPU, where the model and inputs must be): every rank calls it with the same model, optimizer and
    inputs. Every rank captures the step and measures its op times (at once, so they
    include what the ranks cost each other); rank 0 plans and sends the plan to all. `example_inputs` is a whole
    batch (`whole_batch` makes one of the ranks' shards); training then passes each rank its shard
    (`DistributedStep`).

    The `fastt` planner keeps its plan only if it measures faster than data parallelism (FastT's rule): both run
    `trial_steps` steps first, the model and optimizer restored after (0: no trial). `step.trial` has the times.
    `tune=True` (or a configured `Tuner`) instead starts from data parallelism when it fits and runs FastT's
    tuning loop in the first steps of training, as the local runtime does (`fastt.runtime.tune`); rank 0's
    tuner decides and logs."""
    from ..api import capture, plan, simulate
    from . import measure_step

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    home = {t.device for t in [*model.parameters(), *example_inputs]}
    if home != {device}:
        raise FasttError(f"rank {rank}: the model and its inputs are on {', '.join(sorted(map(str, home)))}, not on "
                         f"this rank's device {device}: move them there first")
    cl = cl or rank_cluster(device)
    graph = capture(model, loss_fn, optimizer, example_inputs, name=type(model).__name__,
                    clip_grad_norm=clip_grad_norm)
    threads = torch.get_num_threads()
    tuner = Tuner() if tune is True else tune or None
    if strategy is None and tuner is not None and replicable(graph, world):
        dp = plan(graph, cl, "dp")
        strategy = dp if simulate(graph, dp, cl).fits else None
    planned = strategy is None and planner == "fastt"
    if strategy is None and planner != "fastt":
        strategy = plan(graph, cl, planner)
    batches = ([graph.batch // strategy.replicas] if strategy is not None and tuner is None else
               [graph.batch] + ([graph.batch // world] if replicable(graph, world) else []))
    costs = measure_step(graph, model, optimizer, example_inputs, batches, threads, 1)
    if strategy is None:
        strategy = alone_on_rank0(lambda: plan(graph, cl, "fastt", measured=costs))
    box = [strategy.to_json() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    strategy = Strategy.from_json(box[0])
    step = _placed_step(model, optimizer, graph, strategy, cl, costs, timeout_s, tuner)
    if planned and tuner is None and trial_steps and world > 1 and replicable(graph, world):
        dp = plan(graph, cl, "dp")
        same = replace(dp, planner=strategy.planner).to_json() == strategy.to_json()
        if not same and simulate(graph, dp, cl, costs).fits:
            rival = _placed_step(model, optimizer, graph, dp, cl, costs, timeout_s)
            mine = shard_of(example_inputs, rank, world)  # as training runs: each rank its shard
            times = [_trial(s, mine, trial_steps) for s in (step, rival)]
            step = step if times[0] <= times[1] else rival
            step.trial = {"fastt_plan_s": times[0], "dp_s": times[1], "kept": step.strategy.planner}
    return step


def _placed_step(model, optimizer, graph, strategy: Strategy, cl: Cluster, costs, timeout_s: float,
                 tuner: Tuner | None = None) -> DistributedStep:
    """The DistributedStep of `strategy`, after checking that every rank compiled the same messages."""
    placed = place(graph, strategy, cl, costs, rank_targets(rank_device()))
    wiring = wire(placed.lowered, placed.programs)
    _check_same(wiring)
    return DistributedStep(model, optimizer, placed, wiring, timeout_s, graph, cl, costs, tuner)


def _check_same(wiring: Wiring) -> None:
    """Every rank compiled the same messages (a digest of them, compared across ranks)."""
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha1(repr((wiring.messages, wiring.collectives)).encode()).hexdigest())
    if len(set(digests)) != 1:
        raise FasttError("the ranks compiled different programs: do all ranks build the same model and inputs?")


def whole_batch(shard: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The whole batch that the ranks' shards make (rank 0's rows first), on every rank: one all_gather per
    input. Every rank calls it, like a collective."""
    out = []
    for x in shard:
        x = x.contiguous()
        whole = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(whole, x)
        out.append(whole)
    return out


def sync_from_rank0(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step) -> None:
    """Every rank's parameters, buffers and optimizer state become rank 0's (one broadcast of one buffer)."""
    params, buffers, states = bind(model, optimizer, step.param_names, step.state_keys, create=True)
    tensors = [*params, *buffers, *(s for ss in states for s in ss)]
    leaves = [(t.shape, torch.empty(t.shape, device="meta").stride(), t.dtype) for t in tensors]
    buf = (_pack(list(zip(tensors, leaves))) if dist.get_rank() == 0 else
           torch.empty(_packed_size(leaves), dtype=torch.uint8, device=tensors[0].device))
    dist.broadcast(buf, src=0)
    if dist.get_rank() == 0:
        return
    with torch.no_grad():
        for t, new in zip(tensors, _unpack(buf, leaves)):
            if isinstance(t, torch.nn.Parameter):
                t.data = new
            else:
                t.copy_(new)


def _trial(step: DistributedStep, batch: Sequence[torch.Tensor], steps: int) -> float:
    """Median seconds of `steps` steps (after one warm-up) of `step`'s plan, timed on rank 0 between barriers;
    every rank gets rank 0's time. The model and optimizer get their state back after (copies of them would be
    other tensors to the step's check)."""
    saved = copy.deepcopy((step.model.state_dict(), step.optimizer.state_dict()))
    times = []
    device = step.buffers.device
    for _ in range(steps + 1):
        _synchronized(device)
        dist.barrier()
        t0 = time.perf_counter()
        step(*batch)
        dist.barrier()
        times.append(_synchronized(device) - t0)
    step.model.load_state_dict(saved[0])
    step.optimizer.load_state_dict(saved[1])
    box = [statistics.median(times[1:])]
    dist.broadcast_object_list(box, src=0)
    return box[0]
