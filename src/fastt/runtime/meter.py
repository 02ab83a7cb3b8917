"""Counting what each device's thread allocates while a step runs: a dispatch mode per thread."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageMeter:
    """Per device, the bytes of storage its thread's aten ops make, alive now (`live`) and at most (`peak`).
    A storage counts once, on the device that made it, until the last tensor on it that any device saw is
    gone; an op's result on a storage it was given (a view, an in-place op) is not new. `hold` counts a
    storage on more devices: what a GPU would hold as its own copy (an allreduce's mean on every replica's
    device) is one tensor here. `copies` are the residents devices read without holding them, as
    (value, device): a GPU would copy each there, held until `drop`."""

    def __init__(self, devices: int, copies: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.live, self.peak = [0] * devices, [0] * devices
        self.copies = copies
        # storage -> [{device: bytes it counts}, bytes, tensors on it still alive (None: a resident's copies,
        # `hold(given=)`)]
        self._storages: dict[int, list] = {}
        self._lock = threading.Lock()  # a tensor may die on another device's thread

    def on(self, device: int) -> TorchDispatchMode:
        """The dispatch mode that counts for `device` (enter it on that device's thread)."""
        return _Count(self, device)

    def _made(self, device: int, t: torch.Tensor, given: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                if key in given:  # a view of, or a write into, a tensor made before the step
                    return
                entry = self._storages[key] = [{}, storage.nbytes(), 0]
                self._add(entry, device, entry[1])
            elif entry[2] is None:  # a view of a resident's copies
                return
            entry[2] += 1
        weakref.finalize(t, self._gone, key)

    def hold(self, devices: Sequence[int], t: torch.Tensor, given: bool = False) -> None:
        """Count tensor t's storage (made during the step, or `given`: a resident, made before it) on each
        of `devices` too: t's own bytes, as a copy of t (a view of a larger storage copies its elements)."""
        storage = t.untyped_storage()
        nbytes = min(t.numel() * t.element_size(), storage.nbytes())
        with self._lock:
            entry = self._storages.get(storage._cdata)
            if entry is None and given:
                entry = self._storages[storage._cdata] = [{}, storage.nbytes(), None]
            for d in devices if entry is not None else ():
                self._add(entry, d, nbytes)

    def drop(self, device: int, t: torch.Tensor) -> None:
        """Device `device` is done with tensor t's storage: stop counting it there, unless it is the last
        device counting a storage made during the step (it then goes when the storage does)."""
        key = t.untyped_storage()._cdata
        with self._lock:
            entry = self._storages.get(key)
            if entry is not None and device in entry[0] and (len(entry[0]) > 1 or entry[2] is None):
                self.live[device] -= entry[0].pop(device)
                if not entry[0]:
                    del self._storages[key]

    def _add(self, entry: list, device: int, nbytes: int) -> None:
        if device not in entry[0]:
            entry[0][device] = nbytes
            self.live[device] += nbytes
            self.peak[device] = max(self.peak[device], self.live[device])

    def _gone(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[2] -= 1
            if not entry[2]:
                for d, nbytes in entry[0].items():
                    self.live[d] -= nbytes
                del self._storages[key]


class _Count(TorchDispatchMode):
    def __init__(self, meter: StorageMeter, device: int) -> None:
        super().__init__()
        self.meter, self.device = meter, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.meter._made(self.device, t, given)
        return out
