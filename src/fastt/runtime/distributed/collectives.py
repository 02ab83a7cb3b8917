"""The allreduces of a step as collectives of ranks (`ReduceCall`), how a rank takes part in the sharded form
(`Shards`), and the one order every rank starts them in (`order_collectives`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ...errors import FasttError
from ...lower import Lowered
from ..programs import Programs, row_counts, rows
from .packing import Leaf, flat, leaf_view


class Slice(NamedTuple):
    """Elements [lo, hi) of replica `replica`'s gradient `grad` (an index into its collective's names)."""

    replica: int
    grad: int
    lo: int
    hi: int


@dataclass(frozen=True)
class ReduceCall:
    """Allreduce ops whose gradients `ranks` average together in one call of collectives: the ranks that hold
    one of the gradients or read the mean. (Not `fastt.links.Collective`, the simulator's allreduce holding
    links: this is what the ranks call, one `all_reduce`, or the sharded pair of an `all_to_all` and an
    `all_gather`, for a bundle of allreduce ops.) `names`: the gradients, each with the rank that holds it per
    replica (`sources`) and its `Leaf` (`leaves`). Two replicas: each rank adds up the ones it holds (or
    zeros) and an `all_reduce` sums them. More: the mean's vector is cut into one shard per rank (`shards`);
    an `all_to_all` brings every replica's part of a shard to the rank that owns it, which sums them in
    replica order, as eager data parallelism does, and an `all_gather` of the shards gives every rank the
    mean: the traffic of a ring `all_reduce`, whose own sum of more than two would go in an order of its own.
    Either way every rank gets eager's mean bit for bit. A reduce-scatter (`rows`: per part, the rank that
    updates it) is that `all_to_all` alone, cut at the gradients' row parts (`RowShards`)."""

    ranks: tuple[int, ...]
    ops: tuple[int, ...]
    names: tuple[str, ...]
    sources: tuple[tuple[int, ...], ...]
    leaves: tuple[Leaf, ...]
    rows: tuple[int, ...] = ()

    def shards(self, rank: int) -> list[Shards]:
        """How `rank` takes part in the sharded form, one entry per dtype of the gradients."""
        return self._shards[rank]

    def row_shards(self, rank: int) -> list[RowShards]:
        """How `rank` takes part in a reduce-scatter, one entry per dtype of the gradients."""
        return self._row_shards[rank]

    @cached_property
    def _row_shards(self) -> dict[int, list[RowShards]]:
        parts = len(self.rows)
        out: dict[int, list[RowShards]] = {r: [] for r in self.ranks}

        def numel(j: int, p: int) -> int:
            shape = self.leaves[j].shape
            return row_counts(shape[0], parts)[p] * torch.Size(shape[1:]).numel()
        for dtype in dict.fromkeys(leaf.dtype for leaf in self.leaves):
            js = [j for j, leaf in enumerate(self.leaves) if leaf.dtype == dtype]
            # what the owner of each part gets, in one order: by part, gradient, replica
            order = {o: [RowPiece(k, j, p) for p in range(parts) if self.rows[p] == o for j in js
                         for k in range(parts)] for o in self.ranks}
            for me in self.ranks:
                send = [x for o in self.ranks for x in order[o] if self.sources[x.grad][x.replica] == me]
                at, where, recv = 0, {}, []
                for r in self.ranks:
                    mine = [x for x in order[me] if self.sources[x.grad][x.replica] == r]
                    for x in mine:
                        where[x] = (at, at + numel(x.grad, x.part))
                        at = where[x][1]
                    recv.append(sum(numel(x.grad, x.part) for x in mine))
                sums = tuple((j, p, tuple(where[RowPiece(k, j, p)] for k in range(parts)))
                             for p in range(parts) if self.rows[p] == me for j in js)
                sent = [sum(numel(x.grad, x.part) for x in order[o] if self.sources[x.grad][x.replica] == me)
                        for o in self.ranks]
                out[me].append(RowShards(dtype, parts, tuple(send), tuple(sent), tuple(recv), sums))
        return out

    @cached_property
    def _shards(self) -> dict[int, list[Shards]]:  # read every step: made once
        out: dict[int, list[Shards]] = {r: [] for r in self.ranks}
        for dtype in dict.fromkeys(leaf.dtype for leaf in self.leaves):
            for me, sh in self._cut(dtype).items():
                out[me].append(sh)
        return out

    def _cut(self, dtype: torch.dtype) -> dict[int, Shards]:
        """Every rank's `Shards` of the gradients of one dtype."""
        n, replicas = len(self.ranks), len(self.sources[0])
        js = [j for j, leaf in enumerate(self.leaves) if leaf.dtype == dtype]
        ends = list(itertools.accumulate(self.leaves[j].numel for j in js))
        size = max(1, -(-ends[-1] // n))
        # pieces[r][i]: what rank r sends the owner of shard i, in (replica, vector position) order, each
        # with its position in the vector
        pieces: dict[int, list[list[tuple[Slice, int]]]] = {r: [[] for _ in range(n)] for r in self.ranks}
        for k in range(replicas):
            for j, a, b in zip(js, [0, *ends], ends):
                for i in range(a // size, -(-b // size)):
                    lo, hi = max(a, i * size), min(b, (i + 1) * size)
                    if hi > lo:
                        pieces[self.sources[j][k]][i].append((Slice(k, j, lo - a, hi - a), lo))
        out = {}
        for i, me in enumerate(self.ranks):
            rows: list[list[tuple[int, int, int]]] = [[] for _ in range(replicas)]
            at = 0
            for r in self.ranks:
                for s, pos in pieces[r][i]:
                    rows[s.replica].append((pos, at, at + s.hi - s.lo))
                    at += s.hi - s.lo
            out[me] = Shards(
                dtype, tuple(js), size,
                tuple(s for ps in pieces[me] for s, _ in ps),
                tuple(sum(s.hi - s.lo for s, _ in ps) for ps in pieces[me]),
                tuple(sum(s.hi - s.lo for s, _ in pieces[r][i]) for r in self.ranks),
                tuple(_merged(sorted(row)) for row in rows))
        return out


@dataclass(frozen=True)
class Shards:
    """One dtype of a collective of more than two replicas, as one of its ranks sees it. The mean's vector
    (the gradients `names`, flat, one after another) is cut into one shard of `size` elements per rank of the
    collective, in rank order (the last one padded). The rank sends slices of the gradients it holds (`send`,
    in the order sent: by owner, replica, position), `send_counts` elements to each rank; it receives
    `recv_counts` from each, which put side by side hold every replica's part of its own shard: `rows[k]`,
    ranges of that buffer that make replica k's part, in order."""

    dtype: torch.dtype
    names: tuple[int, ...]
    size: int
    send: tuple[Slice, ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    rows: tuple[tuple[tuple[int, int], ...], ...]

    def pack(self, envs: Sequence[dict], col: ReduceCall, out: torch.Tensor) -> torch.Tensor:
        """What this rank sends (`envs`: its replicas' tables), into `out`."""
        flats = {}
        for k, j, _, _ in self.send:
            if (k, j) not in flats:
                flats[k, j] = flat(envs[k][col.names[j]], col.leaves[j])
        if self.send:
            torch.cat([flats[k, j][lo:hi] for k, j, lo, hi in self.send], out=out)
        return out

    def mean(self, recv: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's shard of the mean into `out`, from what it received: the replicas' parts summed in
        replica order, then divided, as `replica_mean` does."""
        rows = [[recv[a:b] for a, b in rs] for rs in self.rows]
        if not rows[0]:
            return
        parts = [r[0] if len(r) == 1 else torch.cat(r) for r in rows]
        total = out[:parts[0].numel()]
        torch.add(parts[0], parts[1], out=total)
        for part in parts[2:]:
            total.add_(part)
        torch._foreach_div_([total], float(len(parts)))

    def means(self, gathered: torch.Tensor, col: ReduceCall) -> dict[str, torch.Tensor]:
        """The mean gradients, views of the gathered shards."""
        out, at = {}, 0
        for j in self.names:
            out[col.names[j]] = leaf_view(gathered, at, col.leaves[j])
            at += col.leaves[j].numel
        return out


class RowPiece(NamedTuple):
    """Row part `part` of replica `replica`'s gradient `grad` (an index into its collective's names)."""

    replica: int
    grad: int
    part: int


@dataclass(frozen=True)
class RowShards:
    """One dtype of a reduce-scatter, as one of its ranks sees it: each gradient is cut into `parts` row parts
    as torch.tensor_split cuts dim 0, and part p of every replica's gradient goes to the rank that updates
    part p. The rank sends `send` (by owner, then part, gradient, replica), `send_counts` elements to each
    rank, and receives `recv_counts` from each; `sums` lists what it adds up: (gradient, part, the ranges of
    its receive buffer that hold replica k's part, k in order)."""

    dtype: torch.dtype
    parts: int
    send: tuple[RowPiece, ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    sums: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]

    def pack(self, envs: Sequence[dict], col: ReduceCall, out: torch.Tensor) -> torch.Tensor:
        """What this rank sends (`envs`: its replicas' tables), into `out`."""
        if self.send:
            torch.cat([rows(envs[x.replica][col.names[x.grad]], self.parts, x.part).reshape(-1)
                       for x in self.send], out=out)
        return out

    def means(self, recv: torch.Tensor, col: ReduceCall) -> dict[tuple[int, int], torch.Tensor]:
        """(gradient, part) -> that part of the mean, fresh: the replicas' parts summed in replica order, then
        divided, as `replica_mean` (and the sharded form, `Shards.mean`) does."""
        out = {}
        for j, p, ranges in self.sums:
            xs = [recv[a:b] for a, b in ranges]
            total = torch.add(xs[0], xs[1])
            for x in xs[2:]:
                total.add_(x)
            torch._foreach_div_([total], float(len(xs)))
            shape = col.leaves[j].shape
            out[j, p] = total.view(row_counts(shape[0], self.parts)[p], *shape[1:])
        return out


@dataclass(frozen=True)
class RowGather:
    """The all-gather of sharded updates' new parameters at the step's end: part p of `names[i]` (its rows of
    a tensor of `leaves[i]`) is made on rank `owners[i][p]`, and every rank of `ranks` gets it whole. Per
    dtype one `all_gather` of each rank's parts, padded to the most any rank has (`pieces`)."""

    ranks: tuple[int, ...]
    names: tuple[str, ...]
    leaves: tuple[Leaf, ...]
    owners: tuple[tuple[int, ...], ...]

    def numel(self, i: int, p: int) -> int:
        shape = self.leaves[i].shape
        return row_counts(shape[0], len(self.owners[i]))[p] * torch.Size(shape[1:]).numel()

    def pieces(self, rank: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        """The (name, part) pieces of `dtype` that `rank` makes, in the order it sends them."""
        return [(i, p) for i, leaf in enumerate(self.leaves) if leaf.dtype == dtype
                for p, o in enumerate(self.owners[i]) if o == rank]

    def size(self, dtype: torch.dtype) -> int:
        """Elements of `dtype` a rank sends: the most any rank makes."""
        return max(sum(self.numel(i, p) for i, p in self.pieces(r, dtype)) for r in self.ranks)

    def pack(self, envs: Sequence[dict], rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What `rank` sends of `dtype` (`envs`: its replicas' tables, part p in replica p's): its parts, then
        zeros up to `size`."""
        send, mine = torch.zeros(self.size(dtype), dtype=dtype, device=device), self.pieces(rank, dtype)
        if mine:
            n = sum(self.numel(i, p) for i, p in mine)
            torch.cat([envs[p][self.names[i]].reshape(-1) for i, p in mine], out=send[:n])
        return send

    def parts(self, out: torch.Tensor, dtype: torch.dtype) -> dict[tuple[int, int], torch.Tensor]:
        """(name, part) -> its elements in `out`, the gathered buffer of `dtype` (one block a rank)."""
        made, size = {}, self.size(dtype)
        for b, r in enumerate(self.ranks):
            at = b * size
            for i, p in self.pieces(r, dtype):
                made[i, p] = out[at:at + self.numel(i, p)]
                at += self.numel(i, p)
        return made

    def wholes(self, made: dict[tuple[int, int], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each name's tensor whole, its parts (`made`: (name, part) -> the part) joined in order."""
        return {name: torch.cat([made[i, p].reshape(-1) for p in range(len(self.owners[i]))]).view(leaf.shape)
                for i, (name, leaf) in enumerate(zip(self.names, self.leaves))}


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


Bounds = tuple[tuple[tuple[int, ...], ...], ...]  # per rank, per segment (or its boundaries): indices


def frozen(lists: Sequence[Sequence[Sequence[int]]]) -> Bounds:
    return tuple(tuple(tuple(x) for x in xs) for xs in lists)


class CollectiveOrder(NamedTuple):
    """The collectives in the order every rank starts them; per rank, those it starts before each segment (one
    more entry: after the last) and those it waits for before each."""

    collectives: tuple[ReduceCall, ...]
    start_before: Bounds
    reduce_before: Bounds


def order_collectives(low: Lowered, programs: Programs, send_after: Sequence, segment_of: dict,
                      first_read: list[dict], recv_before: list, leaf: dict[str, Leaf],
                      owners: dict[int, tuple[int, ...]]) -> CollectiveOrder:
    """The allreduces as collectives, in one order every rank starts them in.

    A rank takes part in an allreduce if it holds one of its gradients or reads its mean. It could start it
    once its own gradients are made, but ranks must start the collectives they share in the same order. The
    order is that of a run of the programs in which every segment takes one unit of time: an allreduce is
    ready at T, when the last of its ranks has made its gradients; allreduces of the same ranks ready at the
    same T go in one collective. A rank starts each collective after its own gradients of it and after the
    collectives before it: all of those were ready by T, so in that run every collective still completes at T,
    before any rank reads it, even if it must wait for the ones its ranks started before it
    (`executor._Serial` runs a rank's sharded collectives one at a time). That run waits for the same things
    as a real one, whatever order the ranks happen to run in (a rank waits only for messages and collectives),
    so a real run cannot deadlock either. Reduce-scatters (`owners`: allreduce -> the rank updating each row
    part) bundle only with reduce-scatters of the same owners."""
    ready, sources, ranks = _members(low, segment_of, first_read)
    unit = _UnitRun(programs.devices, ready, ranks)
    unit.run(send_after, recv_before, first_read)
    bundles: dict[tuple, list[int]] = {}
    for a in sorted(low.allreduces, key=lambda a: (unit.ready_time(a), ranks[a], owners.get(a, ()), a)):
        bundles.setdefault((unit.ready_time(a), ranks[a], owners.get(a, ())), []).append(a)
    return _bundled(low, programs.devices, bundles, ready, first_read, sources, leaf)


def _members(low: Lowered, segment_of: dict, first_read: list[dict]) -> tuple[dict, dict, dict]:
    """(per (rank, allreduce) the rank's last segment making one of its gradients (-1: none, it only reads the
    mean), per gradient the rank holding it per replica, per allreduce its ranks)."""
    ready: dict[tuple[int, int], int] = {}
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
    return ready, sources, {a: tuple(sorted(ds)) for a, ds in members.items()}


class _UnitRun:
    """A run of the programs in which every segment takes one unit of time: `finish[d]`, the finish of each
    of rank d's segments run so far; `ready_at`, the time each allreduce became ready (once known)."""

    def __init__(self, segs: Sequence[Sequence], ready: dict[tuple[int, int], int],
                 ranks: dict[int, tuple[int, ...]]) -> None:
        self.segs, self.ready, self.ranks = segs, ready, ranks
        self.finish: list[list[int]] = [[] for _ in segs]
        self.ready_at: dict[int, int] = {}

    def done(self, d: int, i: int) -> int | None:
        """When rank d's segment i finished (0 for none before the first), None if it has not yet run."""
        return 0 if i < 0 else self.finish[d][i] if i < len(self.finish[d]) else None

    def ready_time(self, a: int) -> int | None:
        """When every rank of allreduce `a` had made its gradients of it, None if one has not yet."""
        if a not in self.ready_at:
            ts = [self.done(d, self.ready[d, a]) for d in self.ranks[a]]
            if None in ts:
                return None
            self.ready_at[a] = max(ts)
        return self.ready_at[a]

    def run(self, send_after: Sequence, recv_before: list, first_read: list[dict]) -> None:
        """Run each segment once what it waits for is done: the one before, its messages, its allreduces."""
        segs = self.segs
        sent_at = {m: (d, i) for d, ms in enumerate(send_after) for i, xs in enumerate(ms) for m in xs}
        waits = [{i: [a for a, j in first.items() if j == i] for i in range(len(s))}
                 for first, s in zip(first_read, segs)]
        moved = True
        while moved:
            moved = False
            for d in range(len(segs)):
                while len(self.finish[d]) < len(segs[d]):
                    i = len(self.finish[d])
                    ts = [self.done(d, i - 1), *(self.done(*sent_at[m]) for m in recv_before[d][i]),
                          *(self.ready_time(a) for a in waits[d][i])]
                    if None in ts:
                        break
                    self.finish[d].append(max(ts) + 1)
                    moved = True
        if any(len(f) < len(s) for f, s in zip(self.finish, segs)):
            raise FasttError("the devices' programs wait for each other in a cycle: this plan cannot run")


def _bundled(low: Lowered, segs: Sequence[Sequence], bundles: dict[tuple, list[int]], ready: dict,
             first_read: list[dict], sources: dict, leaf: dict[str, Leaf]) -> CollectiveOrder:
    """The collectives of `bundles` ((ready time, ranks, owners of row parts) -> allreduces, in order) and
    where each rank starts and waits for them."""
    collectives = []
    start = [[[] for _ in range(len(s) + 1)] for s in segs]
    wait = [[[] for _ in s] for s in segs]
    at = [0] * len(segs)  # per rank, where it started its last collective
    for c, ((_, group, owners), ops) in enumerate(bundles.items()):
        names = tuple(dict.fromkeys(name for a in ops for name in low.allreduces[a]))
        collectives.append(ReduceCall(group, tuple(ops), names, tuple(sources[x] for x in names),
                                      tuple(leaf[x] for x in names), owners))
        for d in group:
            at[d] = max(at[d], *(ready[d, a] + 1 for a in ops))
            start[d][at[d]].append(c)
            reads = [first_read[d][a] for a in ops if a in first_read[d]]
            if reads:
                if min(reads) < at[d]:  # cannot happen (see order_collectives)
                    name = low.graph.ops[ops[0]].name
                    raise FasttError(f"rank {d} would read allreduce '{name}' before it starts")
                wait[d][min(reads)].append(c)
    return CollectiveOrder(tuple(collectives), frozen(start), frozen(wait))
