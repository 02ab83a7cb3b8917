"""Mixed precision: the autocast dtypes by name, and the autocast a step's forward is captured under.

A step captured with `autocast=torch.bfloat16` (or float16) runs its forward (model and loss) under
`torch.autocast(device_type, dtype)`, as a user's eager loop does: the graph then holds autocast's casts and
the low-precision tensors, while parameters, gradients and optimizer state stay in their own dtype (float32),
since autocast casts copies and autograd returns each gradient in its parameter's dtype. Loss scaling
(`torch.amp.GradScaler`) is not captured, and an enabled scaler is refused (`check_scaler`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from .errors import FasttError

# --precision names -> the autocast dtype (None: no autocast, the model's own dtypes)
NAMES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LOW = (torch.bfloat16, torch.float16)


def dtype_of(name: str) -> torch.dtype | None:
    """The autocast dtype a precision name stands for (None for fp32)."""
    if name not in NAMES:
        raise FasttError(f"unknown precision {name!r}: choose one of {', '.join(NAMES)}")
    return NAMES[name]


def name_of(dtype: torch.dtype | None) -> str:
    """The precision name of an autocast dtype (fp32 for None)."""
    return next(k for k, v in NAMES.items() if v == dtype)


def check(dtype: torch.dtype | None) -> torch.dtype | None:
    """`dtype` if autocast can run a step in it (None, bfloat16 or float16), else a FasttError."""
    if dtype is not None and dtype not in LOW:
        raise FasttError(f"autocast={dtype} is not a mixed precision fastt captures: pass torch.bfloat16, "
                         "torch.float16 or None")
    return dtype


def check_scaler(scaler: object) -> None:
    """Refuse an enabled `torch.amp.GradScaler` (one that would scale the loss) in one line; None and a
    disabled scaler (`enabled=False`, a no-op) pass. fastt's step runs the backward and the optimizer's update
    itself, so a scaler's `scale(loss).backward()` and `step(optimizer)` have nothing to act on, and the
    captured step has no loss scaling, inf/nan check or skipped update of its own yet."""
    if scaler is None or isinstance(scaler, torch.amp.GradScaler) and not scaler.is_enabled():
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise FasttError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    raise FasttError("fastt does not capture torch.amp.GradScaler's loss scaling yet: its step runs the "
                     "backward and the update itself, so scaler.scale(loss).backward() and "
                     "scaler.step(optimizer) have nothing to act on; train with autocast=torch.bfloat16, "
                     "which needs no loss scaling, or fp16 without a scaler (gradients may underflow)")


def device_type(tensors: Sequence[torch.Tensor]) -> str:
    """The autocast device type of a step's tensors: "cuda" if any is on a GPU, else "cpu"."""
    return "cuda" if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors) else "cpu"


@contextlib.contextmanager
def autocast(dtype: torch.dtype | None, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """`torch.autocast` in `dtype` on the device of `tensors`; nothing when `dtype` is None."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type(tensors), dtype=dtype):
        yield
