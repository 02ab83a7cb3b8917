"""Measured memory: the peak bytes each device of a placed step really holds, to check the simulator's.

Worker devices share the process's memory, so a device's memory is counted the way a GPU would hold it: the
residents the plan gives it (its parameters, optimizer state and buffers), the batch its ops are given (the
caller's tensors, held for the whole step), and the storage its thread
allocates while the step runs, from the moment an op makes a tensor until the last tensor viewing that
storage is gone (`StorageMeter`, a dispatch mode on the device's thread, sees every aten op's results). Values
handed to another device are not copied on CPU; they count as a GPU would hold them: on the readers' devices
from the end of the maker's segment, on the maker while its own segments still read them
(`local._Run.release`), and a resident read where it is not held as a copy there (`foreign_residents`).
The counting is `meter.StorageMeter`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..graph import INPUT, RESIDENT
from ..shard import held
from .meter import StorageMeter
from .step import ParallelStep
from .trial import restored


def held_bytes(step: ParallelStep) -> list[int]:
    """Bytes of the residents each device holds under the step's plan (`shard.held`: a sharded update's
    state only its rows), and of the batch it is given."""
    g, s = step.lowered.graph, step.strategy
    out = held(g, {g.index[name]: devs for name, devs in s.holders.items()},
               [s.placement.get(op.name, -1) for op in g.ops], s.n_devices)
    for op in g.ops:
        if op.kind == INPUT and op.name in s.placement:
            out[s.placement[op.name]] += op.out_bytes
    return out


def foreign_residents(step: ParallelStep) -> frozenset[tuple[str, int]]:
    """(node, device) of each resident (parameter, state, buffer) that an op on a device that does not hold it
    reads: a GPU would hold a copy there."""
    g, s = step.lowered.graph, step.strategy
    return frozenset((g.ops[i].nodes[0], s.placement[g.ops[j].name]) for i, op in enumerate(g.ops)
                     if op.kind in RESIDENT for j in g.succs[i]
                     if s.placement.get(g.ops[j].name, -1) not in (-1, *s.holders.get(op.name, ())))


def measured_peaks(step: ParallelStep, batch: Sequence[torch.Tensor]) -> list[int]:
    """The peak bytes each device holds during one step on `batch`: its residents and what its thread
    allocates. The model and the optimizer are put back afterwards."""
    meter = StorageMeter(step.strategy.n_devices, foreign_residents(step))
    with restored(step.model, step.optimizer):
        step.meter = meter
        try:
            step(*batch)
        finally:
            step.meter = None
    return [held + peak for held, peak in zip(held_bytes(step), meter.peak)]
