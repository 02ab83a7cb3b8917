"""Mixed precision: the autocast dtypes by name, and the autocast a step's forward is captured under.

A step captured with `autocast=torch.bfloat16` (or float16) runs its forward (model and loss) under
`torch.autocast(device_type, dtype)`, as a user's eager loop does: the graph then holds autocast's casts and
the low-precision tensors, while parameters, gradients and optimizer state stay in their own dtype (float32),
since autocast casts copies and autograd returns each gradient in its parameter's dtype. Loss scaling
(`torch.amp.GradScaler`) is not captured, and an enabled scaler is refused (`check_scaler`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

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
    """`torch.autocast` in `dtype` on the device of `tensors`, for a forward that `torch.func.grad`
    differentiates (`_at_the_op`); nothing when `dtype` is None."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type(tensors), dtype=dtype), _at_the_op():
        yield


# The functions `_at_the_op` swaps in torch.nn.functional, as torch defines them, each with the dtype
# autocast casts its inputs to (None: autocast's own low precision), and how many captures under autocast
# are running: two threads may capture at once, the first swaps them in and the last back.
_POLICY = {"scaled_dot_product_attention": (F.scaled_dot_product_attention, None),
           "binary_cross_entropy_with_logits": (F.binary_cross_entropy_with_logits, torch.float32)}
_swapped = {"count": 0}
_lock = threading.Lock()


@contextlib.contextmanager
def _at_the_op() -> Iterator[None]:
    """Composite ops that autocast casts, run as autocast's own kernel runs them in eager: the floating inputs
    cast to the op's autocast dtype, the inside without autocast.

    Under `torch.func.grad` a composite op is decomposed above autocast, so autocast casts the ops inside it
    once more. Scaled dot-product attention's math path (what eager runs on CPU with dropout) upcasts its
    bf16 inputs and multiplies in fp32; cast again, it multiplies in bf16, and the backward of its dropout's
    product then meets an fp32 operand ("expected scalar type BFloat16 but found Float").
    binary_cross_entropy_with_logits is on autocast's fp32 list; decomposed, it would compute in bf16.
    Neither a torch function mode (off inside a Python function such as `F.multi_head_attention_forward`)
    nor a kernel at the Autocast key (functorch restores autocast for every op inside) can do this, so the
    functions are swapped in `torch.nn.functional` while the forward is traced. A swapped function reads the
    autocast state of the thread that calls it, and outside a functorch transform computes what autocast's
    kernel does, so another thread sees no change."""
    with _lock:
        if _swapped["count"] == 0:
            for name, (fn, to) in _POLICY.items():
                setattr(F, name, _cast_at(fn, to))
        _swapped["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _swapped["count"] -= 1
            if _swapped["count"] == 0:
                for name, (fn, _) in _POLICY.items():
                    setattr(F, name, fn)


def _cast_at(fn: Callable, to: torch.dtype | None) -> Callable:
    """`fn` as autocast's kernel runs it where autocast is on: its floating inputs cast to `to` (None:
    autocast's dtype), its inside without autocast."""
    def run(*args, **kwargs):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = tensors[0].device.type if tensors else "cpu"
        if not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        want = to or torch.get_autocast_dtype(device)
        cast = (lambda t: t.to(want) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        args, kwargs = pytree.tree_map(cast, (args, kwargs))
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)
    return functools.wraps(fn)(run)
