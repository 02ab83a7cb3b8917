"""Fake kernels for the trace where PyTorch's refuse what its CPU kernels run.

`aten._grouped_mm` (one matmul per group of rows: transformers' Mixtral and other mixtures of experts run
their experts with it by default) takes float32 on the CPU, but its fake kernel copies the CUDA kernel's check
and refuses anything but bfloat16, so a float32 MoE model that eager PyTorch trains on the CPU could not be
traced. While `cpu_kernels()` is active, a grouped matmul of CPU tensors in another dtype gets the output
PyTorch's own fake kernel would give; bfloat16, and any other device, keep PyTorch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._meta_registrations import _create_grouped_mm_output_tensor
from torch._subclasses import fake_impls


def _is_grouped_mm(func: torch._ops.OpOverload) -> bool:
    return func is torch.ops.aten._grouped_mm.default


def _grouped_mm(mode: Any, func: torch._ops.OpOverload, a: torch.Tensor, b: torch.Tensor,
                offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> Any:
    if a.dtype == b.dtype == torch.bfloat16 or a.device.type != "cpu":
        return NotImplemented  # PyTorch's own
    with mode:
        return _create_grouped_mm_output_tensor(a, b, offs, out_dtype)


@contextlib.contextmanager
def cpu_kernels() -> Iterator[None]:
    """While tracing: the fake kernels above before PyTorch's."""
    rule = (_is_grouped_mm, _grouped_mm)
    fake_impls.op_implementations_checks.insert(0, rule)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(rule)
