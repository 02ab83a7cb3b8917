"""Plain eager training steps: the oracle fastt's runtime is checked against."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import torch

from ..precision import autocast as autocast_in


def batch_like(inputs: Sequence[torch.Tensor], seed: int) -> tuple[torch.Tensor, ...]:
    """Another batch shaped like `inputs`: float inputs redrawn, integer ones (tokens, labels) permuted along
    the batch so they stay in range."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=g, dtype=x.dtype) if x.is_floating_point()
                 else x[torch.randperm(x.shape[0], generator=g)] for x in inputs)


def eager_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
               batch: Sequence[torch.Tensor], clip_grad_norm: float | None = None,
               autocast: torch.dtype | None = None) -> torch.Tensor:
    """One ordinary training step: zero_grad, forward (under `torch.autocast` in `autocast`, if given),
    backward, (clip_grad_norm_,) optimizer.step."""
    optimizer.zero_grad()
    with autocast_in(autocast, batch):
        loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    return loss.detach()


def eager_dp_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                  batch: Sequence[torch.Tensor], replicas: int,
                  clip_grad_norm: float | None = None, autocast: torch.dtype | None = None) -> torch.Tensor:
    """Data parallelism emulated in eager mode, as DDP computes it: each replica's share of the batch on its
    own copy of the buffers (per-device batch-norm statistics), gradients averaged in replica order, replica
    0's buffers kept; returns the mean of the replicas' losses. The reference only for batch statistics: it
    averages as a mean over equal shares does (a sum or a masked mean would differ from the whole batch's)."""
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
        with autocast_in(autocast, share):
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
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    return sum(losses) / replicas


def batch_statistics(model: torch.nn.Module) -> bool:
    """Whether the model normalises by batch statistics (batch norm in training mode, or without running
    statistics): the one thing data parallelism computes differently from one device (per replica, as DDP
    does)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
               for m in model.modules())


def eager_reference_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                         batch: Sequence[torch.Tensor], replicas: int,
                         clip_grad_norm: float | None = None,
                         autocast: torch.dtype | None = None) -> torch.Tensor:
    """What a plan with `replicas` replicas must compute: the plain one-device eager step (whatever the loss's
    reduction), except for a model with batch statistics, whose replicas normalise their own shares
    (`eager_dp_step`)."""
    if replicas > 1 and batch_statistics(model):
        return eager_dp_step(model, loss_fn, optimizer, batch, replicas, clip_grad_norm, autocast)
    return eager_step(model, loss_fn, optimizer, batch, clip_grad_norm, autocast)


def take_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ref_model: torch.nn.Module,
               ref_optimizer: torch.optim.Optimizer) -> None:
    """The reference starts the next step from a copy of the model's and optimizer's state (hyperparameters
    included): a check per step, since training amplifies rounding (a sum in another order) over the steps."""
    ref_model.load_state_dict(model.state_dict())
    ref_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


def random_draws(gm: torch.fx.GraphModule) -> list[str]:
    """The aten ops of a captured step that draw random numbers (dropout's `bernoulli`, `rand`, attention with
    a dropout probability), each named once, in the step's order."""
    found: dict[str, None] = {}
    for n in gm.graph.nodes:
        tags = getattr(n.target, "tags", ())
        if n.op == "call_function" and torch.Tag.nondeterministic_seeded in tags and _draws(n):
            found[str(n.target)] = None
    return list(found)


def _draws(n: torch.fx.Node) -> bool:
    """Whether a seeded op draws: attention does only with a dropout probability (its `dropout_p`)."""
    names = [a.name for a in n.target._schema.arguments]
    if "dropout_p" not in names:
        return True
    k = names.index("dropout_p")
    p = n.args[k] if k < len(n.args) else n.kwargs.get("dropout_p", 0.0)
    return not isinstance(p, (int, float)) or p > 0


def drawing_again() -> contextlib.AbstractContextManager:
    """A body whose random draws leave no trace: the generators (the CPU's, and every GPU's in use) are put
    back after it as they were, so what follows draws the same numbers (the step a reference step checks)."""
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=gpus)


def not_compared(gm: torch.fx.GraphModule, devices: int, replicas: int) -> str:
    """Why the eager step cannot check a plan's steps exactly, '' where it can: a plan over several devices
    or replicas of a step that draws random numbers draws them otherwise than eager, which draws them for the
    whole batch in order (on one device the plan and the reference draw alike from the same generator
    state)."""
    draws = random_draws(gm) if devices > 1 or replicas > 1 else []
    if not draws:
        return ""
    return (f"its {max(devices, replicas)} {'devices' if devices > 1 else 'replicas'} draw the step's random "
            f"numbers ({', '.join(draws)}) otherwise than eager, which draws them for the whole batch in "
            "order: parameters may differ by more than rounding (with dropout and drop-path at 0 the plan "
            "is checked)")


def max_param_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference of any parameter or buffer, relative to that tensor's largest magnitude, or to a
    thousandth of the model's largest where that is more: a tensor whose true gradient is zero (attention's
    key bias) holds rounding noise, which a sum in another order rounds otherwise, and relative to itself that
    noise would read as a difference of order 1."""
    pairs = [(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())
             if x.is_floating_point() and x.numel()]
    floor = 1e-3 * max((x.abs().max().item() for x, _ in pairs), default=0.0)
    return max((((x - y).abs().max() / x.abs().max().clamp_min(max(floor, 1e-12))).item() for x, y in pairs),
               default=0.0)
