"""Custom `torch.autograd.Function`s in the traced step: their forward traced, their own backward giving the
gradient.

fastt traces the step under two torch.func transforms (`functionalize` around `grad_and_value`), which
refuse a custom Function: one with the old-style `forward(ctx, ...)` (no `setup_context`) before it runs, and
any other at `functionalize`, which has no rule for it ("NYI"). Both are common in models as people write
them: transformers' Bloom (its GeLU in training), gradient reversal, straight-through estimators. While
`custom_functions()` is active:
- `functionalize` runs a Function's forward as plain ops, functionalized like any others. The grad transform
  above it has already put the Function's own backward in the autograd graph, so the gradient is the
  Function's, not autograd's of its forward.
- An old-style Function runs as a new-style one that replays its `forward(ctx, ...)` on a recording ctx:
  what the forward saves and sets, its backward reads. The saved tensors are the forward's, held as constants
  of the backward: first-order gradients only, which is all a training step takes.
A Function that changes its input in place (`ctx.mark_dirty`) is refused: the step is traced functionally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.autograd_function import custom_function_call
from torch._subclasses.functional_tensor import FunctorchFunctionalizeAPI
from torch.autograd.function import _is_setup_context_defined

from .errors import FasttError


class _Recorded:
    """The ctx an old-style forward writes to and its backward reads: any attribute the forward sets, as on a
    real ctx, and (apart, under `_fastt`, so that no attribute of the Function's own shadows them) its saved
    tensors, the outputs it marks non-differentiable and whether to materialize missing gradients."""

    def __init__(self, name: str, needs_input_grad: tuple[bool, ...]) -> None:
        self._fastt = SimpleNamespace(name=name, saved=(), non_differentiable=(), materialize=True, marked=())
        self.needs_input_grad = needs_input_grad

    @property
    def saved_tensors(self) -> tuple:
        return self._fastt.saved

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self._fastt.saved = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self._fastt.non_differentiable += tensors

    def set_materialize_grads(self, value: bool) -> None:
        self._fastt.materialize = value

    def mark_dirty(self, *_: torch.Tensor) -> None:
        raise FasttError(f"the custom autograd.Function {self._fastt.name} changes its input in place "
                         "(ctx.mark_dirty): fastt traces the step functionally; return a new tensor from its "
                         "forward instead")


def _new_style(cls: type[torch.autograd.Function], args: tuple) -> type[torch.autograd.Function]:
    """`cls` (an old-style Function) for one call on `args`, as a new-style Function."""
    recorded = _Recorded(cls.__name__, tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(*inputs: Any) -> Any:
            out = cls.forward(recorded, *inputs)
            outs = out if isinstance(out, tuple) else (out,)
            book = recorded._fastt
            book.marked = [k for k, y in enumerate(outs) if any(y is x for x in book.non_differentiable)]
            return out

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
            outs = output if isinstance(output, tuple) else (output,)
            ctx.mark_non_differentiable(*(outs[k] for k in recorded._fastt.marked))
            ctx.set_materialize_grads(recorded._fastt.materialize)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return cls.backward(recorded, *grads)

    Replay.__name__ = Replay.__qualname__ = cls.__name__
    return Replay


def _forward_functionalized(interpreter: Any, function: type[torch.autograd.Function], *operands: Any) -> Any:
    """`functionalize`'s rule for a Function: its forward's ops, functionalized (the grad transform above
    has put its backward in the autograd graph)."""
    api = FunctorchFunctionalizeAPI(interpreter)
    inner = api.unwrap_tensors(operands)
    with api.redispatch_to_next():
        out = api.functionalize(function.forward)(*inner)
    return api.wrap_tensors(out)


@contextlib.contextmanager
def custom_functions() -> Iterator[None]:
    """While tracing: custom autograd.Functions pass torch.func's transforms (the module's docstring)."""
    apply = torch.autograd.Function.apply.__func__

    def traced_apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if _is_setup_context_defined(cls.setup_context) or not torch._C._are_functorch_transforms_active():
            return apply(cls, *args, **kwargs)
        return apply(_new_style(cls, args), *args, **kwargs)

    rules = custom_function_call.functorch_table
    rule = rules.get(TransformType.Functionalize)
    rules[TransformType.Functionalize] = _forward_functionalized
    torch.autograd.Function.apply = classmethod(traced_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = classmethod(apply)
        if rule is None:
            del rules[TransformType.Functionalize]
        else:
            rules[TransformType.Functionalize] = rule
