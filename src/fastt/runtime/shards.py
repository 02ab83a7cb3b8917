"""The batch per rank: each rank of the distributed runtime reads only its own shard of the batch, and the
rows a plan needs elsewhere travel between the ranks at the start of the step.

The whole batch of B samples (the one the step was captured with) is the ranks' shards side by side: rank r's
is rows [r·B/world, (r+1)·B/world), as `DistributedSampler` gives each rank its own samples. Replica k of a
plan with R replicas computes rows [k·B/R, (k+1)·B/R) (`local.replica_envs`), so in a data-parallel plan (R =
world) rank r's shard is replica r's share and nothing travels. Where a rank runs ops of a replica whose rows
are on other ranks (the one-device plan reads the whole batch on rank 0; a model-parallel or split plan),
those rows are sent to it (`Feed`), before any of the step's own messages.

A replica's share is checked against the step's guards and counted for the loss weights (`fastt.loss`) by one
rank, its `checker`; the ranks then agree (one small all_gather) so that a batch one rank refuses is refused
by every rank, and every rank weighs every replica with the same counts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cluster import Cluster
from ..errors import FasttError
from ..lower import Lowered
from .programs import Programs


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of the whole batch's input `input`, which rank `src`'s shard holds and rank `dst`
    needs."""

    src: int
    dst: int
    input: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Feed:
    """Who holds which rows of the batch in a step. `shard`, `share`: the rows of a rank's shard and of a
    replica's share; `held[d]`: the (replica, input) pairs rank d holds (those its segments read, and every
    input of the replicas it checks); `checker[k]`: the rank that checks replica k's share (its guards) and
    counts it: the rank whose shard holds it, else the first that reads it; `pieces`: the rows that travel,
    grouped by (src, dst) in the order they are packed; `leaves[i]`: input i's (shape of one sample,
    dtype)."""

    world: int
    shard: int
    share: int
    held: tuple[tuple[tuple[int, int], ...], ...]
    checker: tuple[int, ...]
    pieces: tuple[Piece, ...]
    leaves: tuple[tuple[tuple[int, ...], torch.dtype], ...]

    def sends(self, rank: int) -> dict[int, list[Piece]]:
        """The pieces `rank` sends, per receiving rank (one message each)."""
        return self._between(rank, sending=True)

    def receives(self, rank: int) -> dict[int, list[Piece]]:
        """The pieces `rank` receives, per sending rank."""
        return self._between(rank, sending=False)

    def _between(self, rank: int, sending: bool) -> dict[int, list[Piece]]:
        out: dict[int, list[Piece]] = {}
        for p in self.pieces:
            mine, peer = (p.src, p.dst) if sending else (p.dst, p.src)
            if mine == rank:
                out.setdefault(peer, []).append(p)
        return out

    def leaf(self, p: Piece) -> tuple:
        """(shape, dtype) of a piece as it travels (contiguous: `Leaf.contiguous`)."""
        sample, dtype = self.leaves[p.input]
        return torch.Size((p.hi - p.lo, *sample)), dtype

    def seconds(self, cluster: Cluster) -> float:
        """Simulated seconds of the pieces on `cluster` (a device per rank) before the step's own work: one
        message per (sender, receiver), each link carrying one at a time."""
        return cluster.messages_time(
            (src, dst, sum(math.prod(self.leaf(p)[0]) * self.leaves[p.input][1].itemsize for p in pieces))
            for (src, dst), pieces in itertools.groupby(self.pieces, lambda p: (p.src, p.dst)))

    def rows(self, rank: int, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the whole batch from `x`, input x of `rank`'s shard."""
        return x[lo - rank * self.shard:hi - rank * self.shard]

    def shares(self, rank: int, shard: Sequence[torch.Tensor],
               received: dict[Piece, torch.Tensor]) -> list[list[torch.Tensor | None]]:
        """Per replica, its inputs as `rank` holds them (None where it does not): its own shard's rows and the
        pieces it received, in row order."""
        out: list[list[torch.Tensor | None]] = [[None] * len(self.leaves) for _ in self.checker]
        for k, i in self.held[rank]:
            parts = [self.rows(rank, shard[i], lo, hi) if src == rank
                     else received[Piece(src, rank, i, lo, hi)]
                     for src, lo, hi in spans(k, self.share, self.shard)]
            out[k][i] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out


def spans(k: int, share: int, shard: int) -> list[tuple[int, int, int]]:
    """(rank, first row, end row) of each shard that replica k's share spans, in row order."""
    a, b = k * share, (k + 1) * share
    return [(r, max(a, r * shard), min(b, (r + 1) * shard)) for r in range(a // shard, -(-b // shard))]


def inputs_of(low: Lowered, programs: Programs) -> list[str]:
    """The placeholders of the step's inputs (the batch), in order."""
    return [name for name, role in zip(programs.placeholders, low.step.roles, strict=True)
            if role[0] == "input"]


def input_roots(low: Lowered, programs: Programs) -> dict[str, frozenset[int]]:
    """The step's inputs and the prelude's views of them, each with the inputs (positions) its value comes
    from."""
    roots = {name: frozenset({i}) for i, name in enumerate(inputs_of(low, programs))}
    for name in low.prelude:
        got = frozenset().union(*(roots.get(a.name, frozenset())
                                  for a in programs.nodes[name].all_input_nodes))
        if got:
            roots[name] = got
    return roots


def plan_feed(low: Lowered, programs: Programs, reads: Sequence[Sequence[tuple[int, str]]]) -> Feed:
    """The feed of a step whose rank d reads `reads[d]` ((replica, value name) pairs) from its tables."""
    world, replicas = len(programs.devices), low.replicas
    batch = low.step.batch * replicas
    if batch % world:
        raise FasttError(f"a batch of {batch} does not split into {world} ranks' shards: use a batch "
                         f"divisible by {world}")
    shard, share = batch // world, low.step.batch
    roots = input_roots(low, programs)
    vals = [programs.nodes[name].meta["val"] for name in inputs_of(low, programs)]
    leaves = tuple((tuple(v.shape[1:]), v.dtype) for v in vals)
    wants = [{(k, i) for k, name in rank_reads for i in roots.get(name, ())} for rank_reads in reads]
    checker = []
    for k in range(replicas):
        whole = [r for r in range(world) if r * shard <= k * share and (k + 1) * share <= (r + 1) * shard]
        readers = [r for r in range(world) if any(kk == k for kk, _ in wants[r])]
        checker.append((whole or readers or [0])[0])
    held = [sorted(w | {(k, i) for k, c in enumerate(checker) if c == d for i in range(len(leaves))})
            for d, w in enumerate(wants)]
    pieces = [Piece(src, d, i, lo, hi) for d in range(world) for k, i in held[d]
              for src, lo, hi in spans(k, share, shard) if src != d]
    pieces.sort(key=lambda p: (p.src, p.dst, p.lo, p.input))  # both ends pack a message in this order
    return Feed(world, shard, share, tuple(map(tuple, held)), tuple(checker), tuple(pieces), leaves)


def shard_of(batch: Sequence[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """Rank `rank`'s shard of a whole batch: its rows [rank·B/world, (rank+1)·B/world)."""
    s = batch[0].shape[0] // world
    return [x[rank * s:(rank + 1) * s] for x in batch]
