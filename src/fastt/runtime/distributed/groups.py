"""The process groups the runtime sends and reduces on: one per direction between two ranks (`directions`) and
one per set of ranks that average gradients together (`reducers`), made once per default process group."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist

Direction = tuple[int, int]  # (src, dst): what rank src sends rank dst

# Groups belong to the default process group they were made in: a new one (after destroy_process_group and
# init_process_group) makes its own, and the old ones go with the old one.
_DIRECTIONS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[Direction, dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary())
_REDUCERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary())


def directions(device: torch.device) -> dict[Direction, dist.ProcessGroup]:
    """A process group of two ranks for every ordered pair (src, dst), carrying only messages from src to dst.
    NCCL matches the messages between two ranks by their order alone (it ignores tags) and runs a group's
    operations in order on one stream. With a group per direction, each direction is a queue whose sends and
    receives pair off one for one, in the order the sender sends (`Wiring.inbox`), and no receive waits behind
    a send going the other way: in one group for both directions, two ranks that both post their receives
    first deadlock. Gloo runs the same way. Every rank makes them together, once per process group, and
    connects each with one message, in one order on all ranks: NCCL connects a group on its first message, so
    a rank that posted its receives first would wait for a peer that waits for it."""
    world = dist.distributed_c10d._get_default_group()
    if world in _DIRECTIONS:
        return _DIRECTIONS[world]
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {pair: dist.new_group(list(pair)) for pair in itertools.permutations(range(size), 2)}
    one = torch.zeros(1, device=device)
    for (src, dst), g in groups.items():
        if rank == src:
            dist.isend(one, dst, group=g).wait()
        elif rank == dst:
            dist.irecv(one, src, group=g).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    _DIRECTIONS[world] = groups
    return groups


def reducers(sets: Iterable[tuple[int, ...]],
             device: torch.device) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group for each tuple of ranks in `sets` (a wiring's collectives'), made when first needed.
    Making a group is a collective of all ranks: every rank calls this with the same sets at the same point.
    New groups are made, then connected with one `all_reduce` each, in sorted order (NCCL connects a group on
    its first collective, which blocks until all its ranks are there; started in the step, that would wait on
    ranks that start their collectives in another group first)."""
    groups = _REDUCERS.setdefault(dist.distributed_c10d._get_default_group(), {})
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
