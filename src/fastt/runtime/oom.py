"""A step that runs out of memory: telling that failure from others, and the one message that says so.

`place` refuses a plan whose simulated peak exceeds a device's memory, so a plan that runs has a simulated
peak under every device's memory; it can still run out, because the simulator's peak is checked against
runs on CPU worker devices only (docs/runtime.md: on the safe side, by up to a fifth), not against a GPU's
allocator, and other processes may hold memory on the device. The message names the device, the op and
the plan's simulated peak there beside the device's memory, and what to do: plan with less memory than the
device has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..simulate import Timeline, human_bytes

# What an allocator says when it fails: CUDA's caching allocator raises torch.OutOfMemoryError ("CUDA out of
# memory"); the CPU's raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory").
_SAYS = ("out of memory", "can't allocate memory", "not enough memory")


class Budget(NamedTuple):
    """A device's memory and the simulated peak of the placed plan on it."""

    device: str  # the cluster's name for it
    peak_bytes: int
    memory_bytes: int


def budgets(tl: Timeline) -> tuple[Budget, ...]:
    """Each device's budget under the simulated plan `tl`."""
    return tuple(Budget(*b) for b in zip(tl.device_names, tl.peak_memory_bytes, tl.memory_limit_bytes))


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation that failed (on a GPU, on the CPU, or Python's own)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _SAYS))


class FailAllocation(TorchDispatchMode):
    """Run out of memory on purpose (fault tests, `FASTT_FAULT=RANK:STEP:oom`): on the thread that enters it,
    the first matrix multiply or convolution allocates 4 EiB on its device instead, which that device's
    allocator refuses as it refuses any allocation it cannot make (CUDA's with torch.OutOfMemoryError, the
    CPU's with a RuntimeError); or, given `raises`, raises that error itself."""

    OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.convolution")

    def __init__(self, raises: BaseException | None = None) -> None:
        super().__init__()
        self.raises, self.done = raises, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.done and str(func.overloadpacket) in self.OPS:
            self.done = True
            if self.raises is not None:
                raise self.raises
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            torch.empty(2**62, dtype=torch.uint8, device=device)  # beyond any address space: always refused
        return func(*args, **(kwargs or {}))


def oom_message(where: str, d: int, plan: Sequence[Budget], e: BaseException) -> str:
    """Device d ran out of memory `where` ("in op 'addmm'"): one line, with the plan's peak on d."""
    b = plan[d] if 0 <= d < len(plan) else None
    device = f"device {d}" + (f" ({b.device})" if b is not None else "")
    peak = ("" if b is None else
            f"; the plan's simulated peak there is {human_bytes(b.peak_bytes)} of its "
            f"{human_bytes(b.memory_bytes)}")
    said = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (f"{device} ran out of memory {where}{peak} (the simulator errs by a few percent, and other "
            "processes may hold memory there): plan for less memory than the device has (a cluster file "
            f"with a smaller memory_bytes for it), a smaller batch or more devices "
            f"({type(e).__name__}: {said})")
