"""Checkpoints that a run killed at any moment cannot spoil: written to a temporary file, then renamed over
the previous one, so the path always holds a whole checkpoint."""

from __future__ import annotations

import os

import torch


def save(obj: object, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)`, atomically: until the new checkpoint is whole on disk, `path` holds the
    previous one. A process killed while saving leaves at most `path.tmp`, which the next save overwrites."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint
    os.replace(tmp, path)
    # The rename itself survives a power cut only once the directory is on disk too.
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
