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
    device) is one tensor here."""

    def __init__(self, devices: int) -> None:
        self.live, self.peak = [0] * devices, [0] * devices
        self._storages: dict[int, list] = {}  # storage -> [devices, bytes, tensors on it still alive]
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
                entry = self._storages[key] = [set(), storage.nbytes(), 0]
                self._add(entry, device)
            entry[2] += 1
        weakref.finalize(t, self._gone, key)

    def hold(self, devices: Sequence[int], t: torch.Tensor) -> None:
        """Count tensor t's storage (made during the step) on each of `devices` too."""
        with self._lock:
            entry = self._storages.get(t.untyped_storage()._cdata)
            for d in devices if entry is not None else ():
                self._add(entry, d)

    def drop(self, device: int, t: torch.Tensor) -> None:
        """Device `device` is done with tensor t's storage: stop counting it there, unless it is the last
        device counting it (it then goes when the storage does)."""
        with self._lock:
            entry = self._storages.get(t.untyped_storage()._cdata)
            if entry is not None and device in entry[0] and len(entry[0]) > 1:
                entry[0].discard(device)
                self.live[device] -= entry[1]

    def _add(self, entry: list, device: int) -> None:
        if device not in entry[0]:
            entry[0].add(device)
            self.live[device] += entry[1]
            self.peak[device] = max(self.peak[device], self.live[device])

    def _gone(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[2] -= 1
            if not entry[2]:
                for d in entry[0]:
                    self.live[d] -= entry[1]
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
