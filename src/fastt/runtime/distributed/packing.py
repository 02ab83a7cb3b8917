"""The wire format: the tensors of a message in one byte buffer, each laid out as the captured step laid it
out (its `Leaf`), at offsets aligned to `ALIGN`, so the receiver views them back without copying."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

ALIGN = 16  # bytes: every tensor in a message buffer starts at a multiple, so it can be viewed as its dtype


class Leaf(NamedTuple):
    """A tensor as the captured step made it, which is how it travels: its shape, strides and dtype."""

    shape: Sequence[int]
    stride: Sequence[int]
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> Leaf:
        """The leaf of tensor `x` as it is."""
        return cls(x.shape, x.stride(), x.dtype)

    @classmethod
    def contiguous(cls, shape: Sequence[int], dtype: torch.dtype) -> Leaf:
        """The leaf of a contiguous tensor of `shape`: strides as torch lays them out, computed (a meta
        tensor to read them off cost 20-30 µs, paid per piece of every step's rows)."""
        stride, size = [], 1
        for n in reversed(shape):
            stride.append(size)
            size *= max(n, 1)
        return cls(torch.Size(shape), tuple(reversed(stride)), dtype)

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


def dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
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


def nbytes(leaf: Leaf | None) -> int:
    """The bytes a tensor takes in a message buffer (a None none), rounded up to ALIGN."""
    if leaf is None:
        return 0
    n = leaf.numel * leaf.dtype.itemsize
    return -(-n // ALIGN) * ALIGN


def packed_size(leaves: Sequence[Leaf | None]) -> int:
    """The bytes of the buffer that `pack` makes of tensors with these leaves."""
    return sum(nbytes(leaf) for leaf in leaves)


@functools.cache
def _zeros(device: torch.device) -> torch.Tensor:
    """ALIGN zero bytes on `device`, made once: what pads a tensor in a buffer."""
    return torch.zeros(ALIGN, dtype=torch.uint8, device=device)


def _pad(n: int, device: torch.device) -> torch.Tensor:
    return _zeros(device)[:n]


def flat(x: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    """`x`'s elements as a vector laid out with the captured step's strides (`leaf`): a dense tensor's in its
    memory order (a view when `x` has those strides), another's contiguous."""
    if not dense(leaf.shape, leaf.stride):
        return x.contiguous().view(-1)
    if tuple(x.stride()) != tuple(leaf.stride):
        x = torch.empty_strided(leaf.shape, leaf.stride, dtype=x.dtype, device=x.device).copy_(x)
    return _wire_view(x)


def leaf_view(typed: torch.Tensor, at: int, leaf: Leaf) -> torch.Tensor:
    """The tensor `flat` laid out from element `at` of `typed` (a vector of its dtype): a view when dense."""
    shape, stride, dtype = leaf
    if dense(shape, stride):  # as_strided counts from the start of the storage, not of typed
        return typed.as_strided(shape, stride, typed.storage_offset() + at)
    numel = leaf.numel
    if any(st == 0 and n > 1 for n, st in zip(shape, stride)):  # an expanded tensor: no copy_ can write
        return typed[at:at + numel].view(shape).clone()  # into its strides, so its elements, contiguous
    out = torch.empty_strided(shape, stride, dtype=dtype, device=typed.device)
    return out.copy_(typed[at:at + numel].view(shape))


def pack(pairs: Sequence[tuple[torch.Tensor | None, Leaf | None]],
         out: torch.Tensor | None = None) -> torch.Tensor:
    """One byte buffer holding the tensors of a message, each laid out with the captured step's strides (dense
    ones in their memory order, others contiguous), at offsets aligned to ALIGN: one `cat` of their bytes
    (into `out` when given)."""
    pieces = []
    for x, leaf in pairs:
        if leaf is None or not x.numel():
            continue  # a None has no bytes, an empty tensor ALIGN-rounded 0
        raw = flat(x, leaf).view(torch.uint8)
        pieces.append(raw)
        if nbytes(leaf) > raw.numel():
            pieces.append(_pad(nbytes(leaf) - raw.numel(), raw.device))
    if not pieces:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(pieces) if out is None else torch.cat(pieces, out=out)


def unpack(buf: torch.Tensor, leaves: Sequence[Leaf | None]) -> list[torch.Tensor | None]:
    """The tensors `pack` put in `buf`, with the captured step's shapes and strides (views when dense)."""
    out, off, typed = [], 0, {}
    for leaf in leaves:
        if leaf is None:
            out.append(None)
            continue
        dtype = leaf.dtype
        view = typed.get(dtype)
        if view is None:
            view = typed[dtype] = buf.view(dtype)
        out.append(leaf_view(view, off // dtype.itemsize, leaf))
        off += nbytes(leaf)
    return out
