"""Capture one whole training step (forward, backward, optimizer update) as a torch.fx graph of aten ops.

The step is written functionally and traced with `make_fx(functionalize(...), tracing_mode="fake")`:

    step(params, buffers, states, *batch) -> (loss, grads, new_params, new_states)

Gradients come from `torch.func.grad_and_value`; the update repeats torch.optim's default single-tensor update
op for op on clones of the parameters and state (functionalize turns its in-place ops into pure ones), with
the optimizer's hyperparameters baked in as constants (`Step.run` refuses to run if they change). Buffers
(batch-norm running stats) are updated in place, exactly as eager mode does. `Step.run` executes the captured
graph on real tensors and writes the results back into the model and the optimizer, so the model's parameters
and the optimizer's state stay the truth. Custom autograd.Functions are traced with their own backward
(`autograd_functions`), and a grouped matmul in float32 on the CPU with the fake kernel PyTorch's
lacks (`fake_kernels`).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from math import inf

import torch
import torch.utils.checkpoint as ckpt
from torch import nn
from torch._guards import detect_fake_mode
from torch.func import functional_call, functionalize
from torch.fx import GraphModule

from . import guards, precision
from .autograd_functions import custom_functions
from .errors import FasttError, FasttWarning
from .fake_kernels import cpu_kernels
from .loss import Reduction, reduction_of

# Per optimizer class: the state keys it keeps per parameter, in the order the graph takes them.
_STATE_KEYS: dict[type, Callable[[dict], tuple[str, ...]]] = {
    torch.optim.SGD: lambda g: ("momentum_buffer",) if g["momentum"] != 0 else (),
    torch.optim.Adam: lambda g: (("step", "exp_avg", "exp_avg_sq")
                                 + (("max_exp_avg_sq",) if g["amsgrad"] else ())),
    torch.optim.AdamW: lambda g: (("step", "exp_avg", "exp_avg_sq")
                                  + (("max_exp_avg_sq",) if g["amsgrad"] else ())),
    torch.optim.Adamax: lambda g: ("step", "exp_avg", "exp_inf"),
    torch.optim.Adagrad: lambda g: ("step", "sum"),
    torch.optim.RMSprop: lambda g: (("step", "square_avg")
                                    + (("momentum_buffer",) if g["momentum"] > 0 else ())
                                    + (("grad_avg",) if g["centered"] else ())),
}


def _state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    return _of_class(_STATE_KEYS, optimizer)(group)


def _new_state(optimizer: torch.optim.Optimizer, key: str, p: torch.Tensor) -> torch.Tensor:
    """The state tensor torch.optim creates on the first step (zeros; Adam's step counter 0.0; Adagrad makes
    its own when constructed)."""
    if key == "step":
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.zeros_like(p, memory_format=torch.preserve_format)


# Per optimizer class: the hyperparameters its update reads from a param group, as eager's update computes
# them from the group in Python (1 - beta1, ...). They are inputs of the step, read from the group at every
# call, so that an LR schedule works. A zero weight decay or momentum skips ops, as in eager: whether it is
# zero is part of the step's structure.
def _adam_keys(g: dict, decoupled: bool) -> tuple[str, ...]:
    wd = () if g["weight_decay"] == 0 else ("1-lr*weight_decay",) if decoupled or g.get(
        "decoupled_weight_decay", False) else ("weight_decay",)
    return ("lr", "beta1", "beta2", "1-beta1", "1-beta2", "eps") + wd


_HYPER_KEYS: dict[type, Callable[[dict], tuple[str, ...]]] = {
    torch.optim.SGD: lambda g: ("-lr",) + (("momentum",) if g["momentum"] != 0 else ())
    + (("weight_decay",) if g["weight_decay"] != 0 else ()),
    torch.optim.Adam: lambda g: _adam_keys(g, False),
    torch.optim.AdamW: lambda g: _adam_keys(g, True),
    torch.optim.Adamax: lambda g: (("lr", "beta1", "beta2", "1-beta1", "eps")
                                   + (("weight_decay",) if g["weight_decay"] != 0 else ())),
    torch.optim.Adagrad: lambda g: (("lr", "lr_decay", "eps")
                                    + (("weight_decay",) if g["weight_decay"] != 0 else ())),
    torch.optim.RMSprop: lambda g: (("-lr", "alpha", "1-alpha", "eps")
                                    + (("momentum",) if g["momentum"] > 0 else ())
                                    + (("weight_decay",) if g["weight_decay"] != 0 else ())),
}
_HYPER_VALUES: dict[str, Callable[[Callable[[str], float]], float]] = {
    "lr": lambda v: v("lr"), "-lr": lambda v: -v("lr"), "momentum": lambda v: v("momentum"),
    "weight_decay": lambda v: v("weight_decay"), "eps": lambda v: v("eps"),
    "beta1": lambda v: v("beta1"), "beta2": lambda v: v("beta2"),
    "1-beta1": lambda v: 1 - v("beta1"), "1-beta2": lambda v: 1 - v("beta2"),
    "1-lr*weight_decay": lambda v: 1 - v("lr") * v("weight_decay"),
    "lr_decay": lambda v: v("lr_decay"), "alpha": lambda v: v("alpha"), "1-alpha": lambda v: 1 - v("alpha"),
}


def _of_class(table: dict, optimizer: torch.optim.Optimizer):
    for cls in type(optimizer).__mro__:
        if cls in table:
            return table[cls]
    supported = ", ".join(c.__name__ for c in _STATE_KEYS)
    raise FasttError(f"unsupported optimizer {type(optimizer).__name__}: fastt captures {supported}")


def _reader(group: dict) -> Callable[[str], float]:
    def value(key: str) -> float:
        x = group["betas"][int(key[-1]) - 1] if key in ("beta1", "beta2") else group[key]
        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                raise FasttError(f"optimizer hyperparameter {key} holds {x.numel()} values: fastt takes one")
            x = x.item()
        return float(x)
    return value


def hyper_keys(optimizer: torch.optim.Optimizer) -> list[tuple[str, ...]]:
    """Per param group, the hyperparameters its update reads (the step's `hyper` inputs, in order)."""
    return [_of_class(_HYPER_KEYS, optimizer)(g) for g in optimizer.param_groups]


def hyper_values(optimizer: torch.optim.Optimizer, keys: Sequence[tuple[str, ...]]) -> list[float]:
    """The step's hyperparameter inputs, read from the optimizer's param groups now (an LR schedule's
    value)."""
    out = []
    for g, ks in zip(optimizer.param_groups, keys):
        value = _reader(g)
        out += [_HYPER_VALUES[k](value) for k in ks]
    return out


def _update(optimizer: torch.optim.Optimizer, group: dict, hyper: dict[str, torch.Tensor], ps: list,
            grads: list, states: list[list]) -> None:
    """One optimizer step, in place on `ps` and `states` (clones inside the trace), `hyper` holding the
    group's hyperparameters (0-dim tensors in the trace, Python numbers once `_scalar_inputs` has rewritten
    the graph).

    The arithmetic follows torch.optim's default single-tensor path op for op (same kernels, same order), so
    the captured step reproduces eager training to rounding; `x.add(y * h)` becomes eager's `x.add(y,
    alpha=h)` (one fused multiply-add). Adam's bias corrections are computed from the step counter as float64
    tensors, as eager does with Python floats, so one graph serves every step.
    """
    wd, maximize = hyper.get("weight_decay"), group["maximize"]
    for p, g, st in zip(ps, grads, states):
        g = -g if maximize else g
        if isinstance(optimizer, torch.optim.SGD):
            if wd is not None:
                g = g.add(p * wd)
            if "momentum" in hyper:
                buf = st[0].mul_(hyper["momentum"]).add_(g)
                g = g.add(buf * hyper["momentum"]) if group["nesterov"] else buf
            p.add_(g * hyper["-lr"])
            continue
        if isinstance(optimizer, (torch.optim.Adagrad, torch.optim.RMSprop)):
            _adagrad_or_rmsprop(optimizer, group, hyper, p, g, st)
            continue
        if isinstance(optimizer, torch.optim.Adamax):
            _adamax(hyper, p, g, st)
            continue
        step, exp_avg, exp_avg_sq = st[0], st[1], st[2]
        step.add_(1)
        if "1-lr*weight_decay" in hyper:
            p.mul_(hyper["1-lr*weight_decay"])
        elif wd is not None:
            g = g.add(p * wd)
        exp_avg.lerp_(g, hyper["1-beta1"])
        # addcmul(g, g, value=v) computes self + (v * g) * g: keep that order.
        exp_avg_sq.mul_(hyper["beta2"]).addcmul_(g * hyper["1-beta2"], g)
        step64 = step.to(torch.float64)
        # lr / t is t.reciprocal() * lr for a tensor t, as eager's Python float over the step counter rounds
        # here.
        step_size = ((1 - hyper["beta1"] ** step64).reciprocal() * hyper["lr"]).to(p.dtype)
        bias_correction2_sqrt = (1 - hyper["beta2"] ** step64).sqrt().to(p.dtype)
        if group["amsgrad"]:
            st[3].copy_(torch.maximum(st[3], exp_avg_sq))
            exp_avg_sq = st[3]
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hyper["eps"])
        # addcdiv computes self + value * t1 / t2, left to right: keep that order.
        p.add_(exp_avg.mul(-step_size).div(denom))


def _adamax(hyper: dict[str, torch.Tensor], p: torch.Tensor, g: torch.Tensor, st: list) -> None:
    """Adamax's update of one parameter, op for op as torch.optim's single-tensor path (see `_update`)."""
    step, exp_avg, exp_inf = st
    step.add_(1)
    if "weight_decay" in hyper:
        g = g.add(p * hyper["weight_decay"])
    exp_avg.lerp_(g, hyper["1-beta1"])
    exp_inf.copy_(torch.maximum(exp_inf.mul_(hyper["beta2"]), g.abs().add_(hyper["eps"])))
    clr = ((1 - hyper["beta1"] ** step.to(torch.float64)).reciprocal() * hyper["lr"]).to(p.dtype)
    p.add_(exp_avg.mul(-clr).div(exp_inf))


def _adagrad_or_rmsprop(optimizer: torch.optim.Optimizer, group: dict, hyper: dict[str, torch.Tensor],
                        p: torch.Tensor, g: torch.Tensor, st: list) -> None:
    """Adagrad's or RMSprop's update of one parameter, op for op as torch.optim's single-tensor path (see
    `_update`; `addcdiv_(t1, t2, value=v)` computes `(v * t1) / t2`, `addcmul_` likewise `(v * t1) * t2`)."""
    st[0].add_(1)
    if "weight_decay" in hyper:
        g = g.add(p * hyper["weight_decay"])
    if isinstance(optimizer, torch.optim.Adagrad):
        # eager's Python float lr / (1 + (step - 1) * lr_decay), in float64 from the step counter
        clr = ((st[0].to(torch.float64) - 1) * hyper["lr_decay"] + 1).reciprocal() * hyper["lr"]
        std = st[1].addcmul_(g, g).sqrt().add_(hyper["eps"])
        p.add_(g.mul(-clr.to(p.dtype)).div(std))
        return
    square_avg = st[1].mul_(hyper["alpha"]).addcmul_(g * hyper["1-alpha"], g)
    if group["centered"]:
        grad_avg = st[-1].lerp_(g, hyper["1-alpha"])
        avg = square_avg.addcmul(grad_avg.neg(), grad_avg).sqrt_()
    else:
        avg = square_avg.sqrt()
    avg = avg.add_(hyper["eps"])
    if "momentum" in hyper:
        buf = st[2].mul_(hyper["momentum"]).add_(g.div(avg))
        p.add_(buf * hyper["-lr"])
    else:
        p.add_(g.mul(hyper["-lr"]).div(avg))


_aten = torch.ops.aten


def _scalar_inputs(gm: GraphModule, scalars: Sequence[torch.fx.Node]) -> None:
    """Rewrite the traced graph so that the placeholders `scalars` (hyperparameters and the loss weight,
    traced as 0-dim tensors) are Python numbers, used as eager uses them: `x * h` and `x + h` take the number
    (a wrapped scalar), `x.add(y * h)` becomes `x.add(y, alpha=h)` (eager's fused multiply-add, which a tensor
    cannot reach), `lerp(x, y, h)` and `h ** t` their Scalar overloads. No tensor is made for them at run
    time."""
    graph = gm.graph
    for h in scalars:
        for cast in [u for u in h.users if u.target is _aten._to_copy.default]:
            cast.replace_all_uses_with(h)
            graph.erase_node(cast)
        for use in list(h.users):
            t, args = use.target, use.args
            if t in (_aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor, _aten.div.Tensor) and args[1] is h:
                fused = next(iter(use.users)) if t is _aten.mul.Tensor and len(use.users) == 1 else None
                if fused is not None and fused.target is _aten.add.Tensor and fused.args[1] is use \
                        and not fused.kwargs:
                    fused.args, fused.kwargs = (fused.args[0], args[0]), {"alpha": h}
                    graph.erase_node(use)
            elif t is _aten.lerp.Tensor and args[2] is h:
                use.target = _aten.lerp.Scalar
            elif t is _aten.pow.Tensor_Tensor and args[0] is h:
                use.target = _aten.pow.Scalar
            else:
                raise AssertionError(f"a hyperparameter is read by {use.format_node()}: make it a number "
                                     "there")
        h.meta["val"] = 1.0
    gm.recompile()


def _check_supported(optimizer: torch.optim.Optimizer, group: dict) -> None:
    if isinstance(optimizer, torch.optim.SGD) and group["momentum"] != 0 and group["dampening"] != 0:
        raise FasttError("SGD with dampening is not supported yet: use dampening=0 (the default)")
    for flag in ("foreach", "fused", "capturable", "differentiable"):
        if group.get(flag):
            raise FasttError(f"optimizer option {flag}=True is not supported: fastt runs the default update")


@dataclass
class Step:
    """A captured training step and how a model and optimizer bind to its inputs and outputs.

    `roles[k]` says what the k-th placeholder of `gm` is: ("param", name), ("buffer", name), ("state", "param
    name:key"), ("input", index), ("hyper", "group:key") (a hyperparameter of a param group, read from the
    optimizer at every call) or ("weight", "") (the factor the loss's gradient is scaled by: 1 for the whole
    batch, a replica's share of the whole batch's loss under data parallelism); `outputs` likewise names the
    graph outputs. Buffers include frozen parameters (`requires_grad=False`): read, never updated. `reduction`
    says how the loss reduces over the batch (`fastt.loss`), which data parallelism needs. `autocast`: the
    dtype the forward was captured under `torch.autocast` in (None: none).
    """

    gm: GraphModule
    param_names: list[str]
    buffer_names: list[str]
    state_keys: list[tuple[str, ...]]
    roles: list[tuple[str, str]]
    outputs: list[tuple[str, str]]
    batch: int
    hyper_keys: list[tuple[str, ...]] = field(default_factory=list)
    reduction: Reduction | None = None
    structure: dict = field(default_factory=dict, repr=False)
    autocast: torch.dtype | None = None
    derived: bool = False  # derived from a capture at another batch, for planning only (`fastt.rebatch`)

    def check(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
              replicas: int = 1) -> None:
        """Refuse a model, optimizer or batch (of `replicas` times this step's) that this captured step cannot
        run, naming what changed."""
        want = [((shape[0] * replicas, *shape[1:]) if replicas > 1 and shape else shape, dtype)
                for shape, dtype in self.structure["the batch's shapes and dtypes"]]
        why = batch_mismatch(batch, want)
        if why:
            raise FasttError(f"{why}: pass a batch like the example inputs the step was captured with, or "
                             "capture again with such a batch")
        share = [x[:x.shape[0] // replicas] if replicas > 1 and x.dim() else x for x in batch]
        changed = _changed(self.structure, _structure(model, optimizer, share))
        if changed:
            raise FasttError(f"{changed} since the step was captured: the captured step cannot run it; "
                             "capture again (parallelize again) after such a change")

    def arguments(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
                  create: bool = True) -> tuple[list, list, list, list, list[float]]:
        """(params, buffers, states, batch, hyperparameters): the step's inputs, the weight input aside."""
        params, buffers, states = bind(model, optimizer, self.param_names, self.state_keys, create=create,
                                       buffer_names=self.buffer_names)
        return params, buffers, states, list(batch), hyper_values(optimizer, self.hyper_keys)

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor) -> torch.Tensor:
        """Run one training step with real tensors through the captured graph; returns the loss."""
        if self.derived:
            raise FasttError("this step was derived for planning (fastt.rebatch) and does not run: run "
                             "the step captured at its batch")
        self.check(model, optimizer, batch)
        guards.check(self.gm, batch)
        params, buffers, states, batch, hypers = self.arguments(model, optimizer, batch)
        with torch.no_grad():
            out = self.gm(params, buffers, states, *batch, hypers, 1.0)
            n = len(params)
            loss, new_params, new_states = out[0], out[1 + n:1 + 2 * n], out[1 + 2 * n:]
            for p, new in zip(params, new_params):
                p.copy_(new)
            for s, new in zip([t for ss in states for t in ss], new_states):
                s.copy_(new)
        return loss


def stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that the optimizer stepped, as its own `step` does: an LR scheduler warns when it is stepped
    before the optimizer ever was (the flag its wrapper of `optimizer.step` sets)."""
    optimizer._opt_called = True


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _groups(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[tuple[dict, list[int]]]:
    """Each optimizer param group with the positions of its parameters among `params`."""
    pos = {id(p): i for i, p in enumerate(params)}
    out = []
    seen = set()
    for g in optimizer.param_groups:
        idx = [pos[id(p)] for p in g["params"] if id(p) in pos]
        seen.update(idx)
        out.append((g, idx))
    missing = [i for i in range(len(params)) if i not in seen]
    if missing:
        raise FasttError(f"{len(missing)} trainable parameters are not in the optimizer: add them or freeze "
                         "them")
    return out


def _buffer_names(model: nn.Module) -> list[str]:
    """The model's tensors the step reads and never trains: its buffers, then its frozen parameters."""
    return [n for n, _ in model.named_buffers()] + [n for n, p in model.named_parameters()
                                                    if not p.requires_grad]


def bind(model, optimizer, names, state_keys, create: bool, buffer_names: Sequence[str] | None = None):
    """The model's params and buffers (frozen parameters included) and the optimizer's state tensors, in graph
    order."""
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    fixed = {**dict(model.named_buffers()), **named}
    buffers = [fixed[n] for n in (_buffer_names(model) if buffer_names is None else buffer_names)]
    states = []
    for p, keys in zip(params, state_keys):
        st = optimizer.state[p]
        if create:
            for k in keys:
                if st.get(k) is None:
                    st[k] = _new_state(optimizer, k, p)
        states.append([st.get(k) if st.get(k) is not None else _new_state(optimizer, k, p) for k in keys])
    return params, buffers, states


# Param group options that change the update's ops (the hyperparameters' values do not: they are inputs).
_FLAGS = ("nesterov", "dampening", "amsgrad", "maximize", "decoupled_weight_decay", "foreach", "fused",
          "capturable", "differentiable")


def batch_mismatch(batch: Sequence[object], want: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> str:
    """Why the tensors passed to a step are not `want`'s (shape, dtype) each, naming the first argument that
    differs; '' when they are."""
    if len(batch) != len(want):
        return (f"step(...) got {len(batch)} argument(s), the captured step takes {len(want)} (the model's "
                "inputs, then the target)")
    for i, (x, (shape, dtype)) in enumerate(zip(batch, want)):
        if not isinstance(x, torch.Tensor):
            return f"step(...) argument {i} is of type {type(x).__name__}, not a tensor"
        if x.dtype != dtype or tuple(x.shape) != tuple(shape):
            return (f"step(...) argument {i} is a {x.dtype} tensor of shape {tuple(x.shape)}, the captured "
                    f"step's is {dtype} of shape {tuple(shape)}")
    return ""


def _structure(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor]) -> dict:
    """What the captured step is specialised to, each item named as a user would say it. Tensors are known by
    identity (a replaced layer is another tensor), cheaply: this runs before every step."""
    out: dict[str, object] = {
        "the optimizer's class": type(optimizer).__name__,
        "the trainable parameters": _Tensors(p for p in model.parameters() if p.requires_grad),
        "the number of param groups": len(optimizer.param_groups),
        "the batch's shapes and dtypes": tuple((tuple(t.shape), t.dtype) for t in batch),
        "the modules in eval mode": _Evaluating(model),
    }
    for i, g in enumerate(optimizer.param_groups):
        out[f"param group {i}'s parameters"] = _Tensors(g["params"])
        out[f"param group {i}'s nonzero hyperparameters"] = _of_class(_HYPER_KEYS, optimizer)(g)
        out.update({f"param group {i}'s {f}": g[f] for f in _FLAGS if f in g})
    return out


class _Evaluating(tuple):
    """Whether each module is in eval mode (`module.training` False: batch norm's running statistics, dropout
    off), which the step is traced with, as the user's own step runs them; shown by the names of those that
    are."""

    def __new__(cls, model: nn.Module):
        self = super().__new__(cls, (not m.training for m in model.modules()))
        self.model = model
        return self

    def __str__(self) -> str:
        named = zip(self.model.named_modules(), self)
        names = [f"'{name}'" if name else "the model" for (name, _), off in named if off]
        return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" if names else "none"


class _Tensors(tuple):
    """Tensors compared by identity, shown by number."""

    def __new__(cls, tensors):
        return super().__new__(cls, map(id, tensors))

    def __str__(self) -> str:
        return f"{len(self)} tensors"


def _changed(old: dict, new: dict) -> str:
    """The first item of `_structure` that differs, as '<what> changed (<old> -> <new>)'; '' if none."""
    for k in dict.fromkeys([*old, *new]):
        if old.get(k) != new.get(k):
            a, b = (str(x.get(k, "absent")) for x in (old, new))
            return f"{k} changed ({a[:80]} -> {b[:80]})"
    return ""


class _WithLoss(nn.Module):
    """The model and its loss as one module, so that functional_call swaps the parameters for both (a loss_fn
    may read them: a weight penalty)."""

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        # a list: a loss module's own tensors stay out of the swap
        self.model, self.loss_fn = model, [loss_fn]

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.loss_fn[0](self.model(*batch[:-1]), batch[-1])


def check_clip(clip_grad_norm: float | None) -> None:
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float))
                                           and 0 < clip_grad_norm < inf):
        raise FasttError(f"clip_grad_norm must be a positive number (the largest global gradient norm), got "
                         f"{clip_grad_norm!r}")


def _clipped(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """The gradients scaled to global norm at most `max_norm`, computed as `clip_grad_norm_` does (the norm of
    the per-gradient norms, max_norm / (norm + 1e-6) clamped to 1). Under data parallelism the updates read
    the averaged gradients, so this is the norm of the whole batch's gradient, as with DDP."""
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coef for g in grads]


def _step_fn(model, loss_fn, optimizer, names, buffer_names, groups, hyper_keys, clip_grad_norm, low):
    def step(params, buffers, states, *rest):
        *batch, hypers, weight = rest

        def loss_of(ps, bufs):
            tensors = {f"model.{n}": t for n, t in [*zip(names, ps), *zip(buffer_names, bufs)]}
            with precision.autocast(low, batch):
                loss = functional_call(_WithLoss(model, loss_fn), tensors, tuple(batch))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise FasttError("loss_fn must return a scalar tensor "
                                 "(reduce the loss with a mean or a sum), got "
                                 + (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                                    else type(loss).__name__))
            return loss * weight.to(loss.dtype), loss

        grads, (_, loss) = torch.func.grad_and_value(loss_of, has_aux=True)(list(params), list(buffers))
        applied = _clipped(grads, clip_grad_norm) if clip_grad_norm is not None and grads else grads
        new_params = [p.clone() for p in params]
        new_states = [[s.clone() for s in ss] for ss in states]
        given = iter(hypers)
        for (group, idx), keys in zip(groups, hyper_keys):
            hyper = {k: next(given) for k in keys}
            _update(optimizer, group, hyper, [new_params[i] for i in idx], [applied[i] for i in idx],
                    [new_states[i] for i in idx])
        return [loss, *grads, *new_params, *[s for ss in new_states for s in ss]]

    return step


@contextlib.contextmanager
def _portable_kernels():
    """Trace composite ops (nn.LSTM, batch norm) into their native aten decomposition, not oneDNN's or cuDNN's
    fused kernels (`mkldnn_rnn_layer`, `_cudnn_rnn`, whose weights cannot be traced with fake tensors): the
    graph must run on any device, and its per-timestep ops are what a planner places. Eager CPU training picks
    the oneDNN kernel, which rounds differently; with it off they match bit for bit. (Convolutions are one
    aten op either way and still run on cuDNN.)"""
    with fused_kernels(False):
        yield


@contextlib.contextmanager
def _plain_checkpoints() -> Iterator[list]:
    """Activation checkpoints (`torch.utils.checkpoint`, reentrant or not: what transformers'
    `gradient_checkpointing_enable` and `checkpoint_sequential` call) traced as plain calls of their function.
    torch.func's gradients refuse the saved-tensor hooks a checkpoint recomputes through; a plain call
    computes the same values and gradients, and draws the same random numbers (a checkpoint replays the
    generators' state when it recomputes). The step then keeps the activations the checkpoint would have
    recomputed in the backward, and the memory model counts them. `requires_grad_(True)` on a tensor of the
    trace (transformers' `enable_input_require_grads`, which reentrant checkpoints need in eager) does
    nothing: the step's gradients are the parameters', through every op. Yields the checkpointed functions
    called (a trace made twice, `guards.trace`, calls them twice)."""
    called: list = []

    def without_hooks(function: Callable, *_: object, **__: object) -> Iterator[None]:
        called.append(function)
        yield

    class Plain:
        @staticmethod
        def apply(function: Callable, _preserve: bool, *args: object) -> object:
            called.append(function)
            return function(*args)

    def requires_grad_(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        try:
            return differentiable(t, requires_grad)
        except RuntimeError as e:  # the gradient is of the parameters, through every op: nothing to turn on
            if requires_grad and "functorch transform" in str(e):
                return t
            raise

    saved = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction
    differentiable = torch.Tensor.requires_grad_
    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = without_hooks, Plain
    torch.Tensor.requires_grad_ = requires_grad_
    try:
        yield called
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = saved
        torch.Tensor.requires_grad_ = differentiable


@contextlib.contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """`torch.backends.mkldnn.flags(enabled=...)` and cuDNN's, quietly: on a build without Intel GPU support
    the mkldnn flags warn, on entry and on exit, that "TF32 acceleration on top of oneDNN is available for
    Intel GPUs" (a setting fastt leaves alone), which would be the only line on stderr of every
    `fastt run`."""
    flags = contextlib.ExitStack()
    with _no_tf32_note():
        flags.enter_context(torch.backends.mkldnn.flags(enabled=enabled))
        flags.enter_context(torch.backends.cudnn.flags(enabled=enabled))
    try:
        yield
    finally:
        with _no_tf32_note():
            flags.close()


@contextlib.contextmanager
def _no_tf32_note() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN", category=UserWarning)
        yield


def _read_inputs_not_their_clones(gm: GraphModule) -> None:
    """Where the step reads a plain clone of an input that it neither returns, writes nor aliases, read the
    input itself. `_step_fn` runs torch.optim's in-place update on clones of the parameters and state, and
    functionalize turns its ops into pure ones, so each such clone is an exact copy that is only read: one
    more copy of every parameter and state a step, which eager's in-place update never makes. The graph only:
    the caller recompiles `gm` (`_scalar_inputs` does; a recompile of gnmt's 20000 nodes takes 0.2 s)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = set(out.all_input_nodes)
    for n in list(gm.graph.nodes):
        if (n.target is torch.ops.aten.clone.default and not n.kwargs and n.args[0].op == "placeholder"
                and n not in returned and all(_only_reads(u, n) for u in n.users)):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)


def _only_reads(user: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether aten op `user` reads `value` without writing it or returning an alias of it."""
    schema = getattr(user.target, "_schema", None)
    if schema is None or any(r.alias_info is not None for r in schema.returns):
        return False
    given = [*zip(schema.arguments, user.args), *((a, user.kwargs[a.name]) for a in schema.arguments
                                                  if a.name in user.kwargs)]
    return not any(a.alias_info is not None and a.alias_info.is_write
                   for a, v in given if v is value or isinstance(v, (list, tuple)) and value in v)


def capture_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 example_inputs: Sequence[torch.Tensor], clip_grad_norm: float | None = None,
                 autocast: torch.dtype | None = None) -> Step:
    """Trace one training step of `model` into a Step (aten ops, fake tensors: no real memory needed).

    Convention: `loss = loss_fn(model(*example_inputs[:-1]), example_inputs[-1])`. With `clip_grad_norm`, the
    gradients are clipped to that global norm before the update, as `torch.nn.utils.clip_grad_norm_` does.
    With `autocast` (torch.bfloat16 or torch.float16) the forward and the loss run under `torch.autocast` on
    the model's device, the backward and the update outside it, as in an eager loop (`fastt.precision`).
    """
    check_clip(clip_grad_norm)
    precision.check(autocast)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise FasttError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile, slow to import here
    if compiled is not None and isinstance(model, compiled.OptimizedModule):
        raise FasttError("the model is torch.compile's wrapper, which fastt cannot trace: pass the module "
                         "itself (`model._orig_mod`, the same parameters); fastt runs the step its own way")
    example_inputs = tuple(example_inputs)
    if len(example_inputs) < 2:
        raise FasttError("example_inputs must hold the model's inputs followed by the target")
    trainable = _trainable(model)
    names = [n for n, _ in trainable]
    groups = _groups(optimizer, [p for _, p in trainable])
    state_keys = [()] * len(names)
    for g, idx in groups:
        _check_supported(optimizer, g)
        for i in idx:
            state_keys[i] = _state_keys(optimizer, g)
    buffer_names = _buffer_names(model)
    keys = hyper_keys(optimizer)
    fake_mode = detect_fake_mode((*[p for _, p in trainable], *example_inputs))
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx:
        params, buffers, states = bind(model, optimizer, names, state_keys, create=False)
        hypers = [torch.tensor(v, dtype=torch.float64) for v in hyper_values(optimizer, keys)]
        weight = torch.ones((), dtype=torch.float64)
    fn = _step_fn(model, loss_fn, optimizer, names, buffer_names, groups, keys, clip_grad_norm, autocast)
    try:
        with _portable_kernels(), _plain_checkpoints() as checkpointed, custom_functions(), cpu_kernels():
            gm = guards.trace(functionalize(fn), (params, buffers, states, *example_inputs, hypers, weight),
                              example_inputs)
        if checkpointed:
            warnings.warn("the model's activation checkpoints (torch.utils.checkpoint) are traced as plain "
                          "calls: the plan keeps their activations for the backward instead of recomputing "
                          "them, and fastt's memory model counts them (the same values and gradients)",
                          FasttWarning, stacklevel=2)
    except FasttError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FasttError(f"could not trace the training step ({type(e).__name__}: {msg}); fastt needs a "
                         "model that fake tensors trace (its Python may branch on the batch's values "
                         "only)") from e
    gm.graph.eliminate_dead_code()
    _read_inputs_not_their_clones(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    _scalar_inputs(gm, placeholders[len(placeholders) - sum(map(len, keys)) - 1:])
    roles = ([("param", n) for n in names] + [("buffer", n) for n in buffer_names]
             + [("state", f"{n}:{k}") for n, keys in zip(names, state_keys) for k in keys]
             + [("input", str(i)) for i in range(len(example_inputs))]
             + [("hyper", f"{g}:{k}") for g, ks in enumerate(keys) for k in ks] + [("weight", "")])
    outputs = ([("loss", "")] + [("grad", n) for n in names] + [("param", n) for n in names]
               + [("state", f"{n}:{k}") for n, keys in zip(names, state_keys) for k in keys])
    batch = int(example_inputs[0].shape[0]) if example_inputs[0].dim() else 1
    return Step(gm=gm, param_names=names, buffer_names=buffer_names, state_keys=state_keys, roles=roles,
                outputs=outputs, batch=batch, hyper_keys=keys, reduction=reduction_of(gm, roles),
                structure=_structure(model, optimizer, example_inputs), autocast=autocast)
