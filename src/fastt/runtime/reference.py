"""Plain eager training steps: the oracle fastt's runtime is checked against."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def batch_like(inputs: Sequence[torch.Tensor], seed: int) -> tuple[torch.Tensor, ...]:
    """Another batch shaped like `inputs`: float inputs redrawn, integer ones (tokens, labels) permuted along the
    batch so they stay in range."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=g, dtype=x.dtype) if x.is_floating_point()
                 else x[torch.randperm(x.shape[0], generator=g)] for x in inputs)


def eager_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
               batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ordinary training step: zero_grad, forward, backward, optimizer.step."""
    optimizer.zero_grad()
    loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()


def eager_dp_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                  batch: Sequence[torch.Tensor], replicas: int) -> torch.Tensor:
    """Data parallelism emulated in eager mode, as DDP computes it: each replica's share of the batch on its own
    copy of the buffers (per-device batch-norm statistics), gradients averaged in replica order, replica 0's
    buffers kept; returns the mean of the replicas' losses."""
    b = batch[0].shape[0] // replicas
    buffers = dict(model.named_buffers())
    start = {n: v.clone() for n, v in buffers.items()}
    grads, losses, kept = [], [], {}
    for k in range(replicas):
        with torch.no_grad():
            for n, v in start.items():
                buffers[n].copy_(v)
        optimizer.zero_grad()
        share = [x[k * b:(k + 1) * b] for x in batch]
        loss = loss_fn(model(*share[:-1]), share[-1])
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        if k == 0:
            kept = {n: v.clone() for n, v in buffers.items()}
    for i, p in enumerate(model.parameters()):
        if grads[0][i] is None:
            continue
        total = grads[0][i]
        for g in grads[1:]:
            total = total + g[i]
        p.grad = total / replicas
    with torch.no_grad():
        for n, v in kept.items():
            buffers[n].copy_(v)
    optimizer.step()
    return sum(losses) / replicas


def eager_reference_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                         batch: Sequence[torch.Tensor], replicas: int) -> torch.Tensor:
    """What a plan with `replicas` replicas computes, in eager mode: `eager_dp_step`, or `eager_step` for one."""
    if replicas > 1:
        return eager_dp_step(model, loss_fn, optimizer, batch, replicas)
    return eager_step(model, loss_fn, optimizer, batch)


def max_param_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference of any parameter or buffer, relative to that tensor's largest magnitude."""
    return max((((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item()
                for x, y in zip(a.state_dict().values(), b.state_dict().values()) if x.is_floating_point()),
               default=0.0)
