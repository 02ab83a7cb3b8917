"""Capture one whole training step (forward, backward, optimizer update) as a torch.fx graph of aten ops.

The step is written functionally and traced with `make_fx(functionalize(...), tracing_mode="fake")`:

    step(params, buffers, states, *batch) -> (loss, grads, new_params, new_states)

Gradients come from `torch.func.grad_and_value`; the update repeats torch.optim's default single-tensor
update op for op on clones of the parameters and state (functionalize turns its in-place ops into pure ones),
with the optimizer's hyperparameters baked in as constants (`Step.run` refuses to run if they change). Buffers (batch-norm running stats) are updated in place, exactly as
eager mode does. `Step.run` executes the captured graph on real tensors and writes the results back into the
model and the optimizer, so the model's parameters and the optimizer's state stay the truth.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.func import functional_call, functionalize
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from .errors import FasttError

# Per optimizer class: the state keys it keeps per parameter, in the order the graph takes them.
_STATE_KEYS: dict[type, Callable[[dict], tuple[str, ...]]] = {
    torch.optim.SGD: lambda g: ("momentum_buffer",) if g["momentum"] != 0 else (),
    torch.optim.Adam: lambda g: ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ()),
    torch.optim.AdamW: lambda g: ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ()),
}


def _state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    for cls in type(optimizer).__mro__:
        if cls in _STATE_KEYS:
            return _STATE_KEYS[cls](group)
    supported = ", ".join(c.__name__ for c in _STATE_KEYS)
    raise FasttError(f"unsupported optimizer {type(optimizer).__name__}: fastt captures {supported}")


def _new_state(optimizer: torch.optim.Optimizer, key: str, p: torch.Tensor) -> torch.Tensor:
    """The state tensor torch.optim creates on the first step (zeros; Adam's step counter 0.0)."""
    if key == "step":
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _update(optimizer: torch.optim.Optimizer, group: dict, ps: list, grads: list, states: list[list]) -> None:
    """One optimizer step, in place on `ps` and `states` (clones inside the trace).

    The arithmetic follows torch.optim's default single-tensor path op for op (same kernels, same order), so
    the captured step reproduces eager training to rounding. Adam's bias corrections are computed from the
    step counter as float64 tensors, as eager does with Python floats, so one graph serves every step.
    """
    lr, wd, maximize = group["lr"], group["weight_decay"], group["maximize"]
    for p, g, st in zip(ps, grads, states):
        g = -g if maximize else g
        if isinstance(optimizer, torch.optim.SGD):
            if wd != 0:
                g = g.add(p, alpha=wd)
            if group["momentum"] != 0:
                buf = st[0].mul_(group["momentum"]).add_(g)
                g = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
            p.add_(g, alpha=-lr)
            continue
        step, exp_avg, exp_avg_sq = st[0], st[1], st[2]
        beta1, beta2 = group["betas"]
        step.add_(1)
        if wd != 0:
            if isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False):
                p.mul_(1 - lr * wd)
            else:
                g = g.add(p, alpha=wd)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step64 = step.to(torch.float64)
        step_size = (lr / (1 - beta1 ** step64)).to(p.dtype)
        bias_correction2_sqrt = (1 - beta2 ** step64).sqrt().to(p.dtype)
        if group["amsgrad"]:
            st[3].copy_(torch.maximum(st[3], exp_avg_sq))
            exp_avg_sq = st[3]
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        # addcdiv computes self + value * t1 / t2, left to right: keep that order.
        p.add_(exp_avg.mul(-step_size).div(denom))


def _check_supported(optimizer: torch.optim.Optimizer, group: dict) -> None:
    if isinstance(optimizer, torch.optim.SGD) and group["momentum"] != 0 and group["dampening"] != 0:
        raise FasttError("SGD with dampening is not supported yet: use dampening=0 (the default)")
    for flag in ("foreach", "fused", "capturable", "differentiable"):
        if group.get(flag):
            raise FasttError(f"optimizer option {flag}=True is not supported: fastt runs the default update")


@dataclass
class Step:
    """A captured training step and how a model and optimizer bind to its inputs and outputs.

    `roles[k]` says what the k-th placeholder of `gm` is: ("param", name), ("buffer", name),
    ("state", "param name:key") or ("input", index); `outputs` likewise names the graph outputs.
    """

    gm: GraphModule
    param_names: list[str]
    buffer_names: list[str]
    state_keys: list[tuple[str, ...]]
    roles: list[tuple[str, str]]
    outputs: list[tuple[str, str]]
    batch: int
    signature: tuple = field(default=(), repr=False)

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer, *batch: torch.Tensor) -> torch.Tensor:
        """Run one training step with real tensors through the captured graph; returns the loss."""
        if _signature(model, optimizer, batch) != self.signature:
            raise FasttError("model, optimizer hyperparameters or batch shapes changed since capture: capture again")
        params, buffers, states = bind(model, optimizer, self.param_names, self.state_keys, create=True)
        with torch.no_grad():
            out = self.gm(params, buffers, states, *batch)
            n = len(params)
            loss, new_params, new_states = out[0], out[1 + n:1 + 2 * n], out[1 + 2 * n:]
            for p, new in zip(params, new_params):
                p.copy_(new)
            for s, new in zip([t for ss in states for t in ss], new_states):
                s.copy_(new)
        return loss


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
        raise FasttError(f"{len(missing)} trainable parameters are not in the optimizer: add them or freeze them")
    return out


def bind(model, optimizer, names, state_keys, create: bool):
    """The model's params and buffers and the optimizer's state tensors, in graph order."""
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    buffers = [b for _, b in model.named_buffers()]
    states = []
    for p, keys in zip(params, state_keys):
        st = optimizer.state[p]
        if create:
            for k in keys:
                if st.get(k) is None:
                    st[k] = _new_state(optimizer, k, p)
        states.append([st.get(k) if st.get(k) is not None else _new_state(optimizer, k, p) for k in keys])
    return params, buffers, states


def _signature(model, optimizer, batch) -> tuple:
    hyper = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params")) for g in optimizer.param_groups)
    shapes = tuple((tuple(t.shape), t.dtype) for t in batch)
    return hyper, shapes, tuple(n for n, _ in _trainable(model))


def _step_fn(model, loss_fn, optimizer, names, buffer_names, groups):
    def step(params, buffers, states, *batch):
        def loss_of(ps, bufs):
            out = functional_call(model, {**dict(zip(names, ps)), **dict(zip(buffer_names, bufs))},
                                  tuple(batch[:-1]))
            return loss_fn(out, batch[-1])

        grads, loss = torch.func.grad_and_value(loss_of)(list(params), list(buffers))
        new_params = [p.clone() for p in params]
        new_states = [[s.clone() for s in ss] for ss in states]
        for group, idx in groups:
            _update(optimizer, group, [new_params[i] for i in idx], [grads[i] for i in idx],
                    [new_states[i] for i in idx])
        return [loss, *grads, *new_params, *[s for ss in new_states for s in ss]]

    return step


@contextlib.contextmanager
def _portable_kernels():
    """Trace composite ops (nn.LSTM, batch norm) into their native aten decomposition, not oneDNN's or cuDNN's
    fused kernels (`mkldnn_rnn_layer`, `_cudnn_rnn`, whose weights cannot be traced with fake tensors): the graph
    must run on any device, and its per-timestep ops are what a planner places. Eager CPU training picks the
    oneDNN kernel, which rounds differently; with it off they match bit for bit. (Convolutions are one aten op
    either way and still run on cuDNN.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flag's TF32 note about Intel GPUs
        with torch.backends.mkldnn.flags(enabled=False), torch.backends.cudnn.flags(enabled=False):
            yield


def capture_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 example_inputs: Sequence[torch.Tensor]) -> Step:
    """Trace one training step of `model` into a Step (aten ops, fake tensors: no real memory needed).

    Convention: `loss = loss_fn(model(*example_inputs[:-1]), example_inputs[-1])`.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise FasttError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
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
    buffer_names = [n for n, _ in model.named_buffers()]
    fake_mode = detect_fake_mode((*[p for _, p in trainable], *example_inputs))
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx:
        params, buffers, states = bind(model, optimizer, names, state_keys, create=False)
    fn = _step_fn(model, loss_fn, optimizer, names, buffer_names, groups)
    was_training = model.training
    model.train()
    try:
        with _portable_kernels():
            gm = make_fx(functionalize(fn), tracing_mode="fake")(params, buffers, states, *example_inputs)
    except FasttError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FasttError(f"could not trace the training step ({type(e).__name__}: {msg}); fastt needs a model "
                         "without data-dependent Python control flow") from e
    finally:
        model.train(was_training)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    roles = ([("param", n) for n in names] + [("buffer", n) for n in buffer_names]
             + [("state", f"{n}:{k}") for n, keys in zip(names, state_keys) for k in keys]
             + [("input", str(i)) for i in range(len(example_inputs))])
    outputs = ([("loss", "")] + [("grad", n) for n in names] + [("param", n) for n in names]
               + [("state", f"{n}:{k}") for n, keys in zip(names, state_keys) for k in keys])
    batch = int(example_inputs[0].shape[0]) if example_inputs[0].dim() else 1
    return Step(gm=gm, param_names=names, buffer_names=buffer_names, state_keys=state_keys, roles=roles,
                outputs=outputs, batch=batch, signature=_signature(model, optimizer, example_inputs))
