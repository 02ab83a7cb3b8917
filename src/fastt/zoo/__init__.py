"""The model zoo: the training workloads of the FastT paper, two that people train today (a Llama, DistilBERT
on padded batches) and three where mixed parallelism matters (DLRM's embedding tables, GPT-2 medium and large,
which do not fit one 16 GB GPU with Adam), at a fast `test` size and the `paper` size.

``get(name, size)`` returns a :class:`Workload`: a model, its loss function, an optimizer over its parameters
and an example batch. One training step is ``loss = loss_fn(model(*example_inputs[:-1]),
example_inputs[-1])``. At ``size="paper"`` everything is built by default inside a ``FakeTensorMode`` (kept as
``fake_mode``), so even BERT-large, GPT-2 large or DLRM's 2 GB of tables cost no real memory and build in well
under a second; tracing it with ``make_fx(..., tracing_mode="fake")`` reuses that mode. Each builder's
docstring documents its sizes and batch. A :data:`VARIANTS` model differs from another only at paper size;
:data:`DISTINCT` leaves them out, for the tests that train every model at test size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fastt.errors import FasttError
from fastt.zoo import recommendation, sequence, vision

NAMES: tuple[str, ...] = ("lenet", "alexnet", "vgg19", "inception_v3", "resnet50", "resnet200", "transformer",
                          "bert-base", "bert-large", "bert-large-seq64", "gpt2", "gpt2-medium", "gpt2-large",
                          "rnnlm", "gnmt", "mlp", "llama", "distilbert-padded", "dlrm")
# variant -> the model whose test size it is (the same config, weights and batch): only the paper sizes differ
VARIANTS: dict[str, str] = {"bert-large-seq64": "bert-large", "gpt2-medium": "gpt2", "gpt2-large": "gpt2"}
DISTINCT: tuple[str, ...] = tuple(n for n in NAMES if n not in VARIANTS)  # one name per test-size computation
SIZES: tuple[str, ...] = ("test", "paper")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw", "adagrad", "rmsprop")

Builder = Callable[[str, int, bool], vision.Built]


def _hf(attr: str) -> Builder:
    """A builder that imports the Hugging Face module (and so transformers) only when called."""

    def build(size: str, batch: int, dropout: bool) -> vision.Built:
        from fastt.zoo import hf

        return getattr(hf, attr)(size, batch, dropout)

    return build


# name -> (builder, default batch at test size, default batch at paper size)
_REGISTRY: dict[str, tuple[Builder, int, int]] = {
    "lenet": (vision.lenet, 512, 64),
    "alexnet": (vision.alexnet, 32, 128),
    "vgg19": (vision.vgg19, 64, 64),
    "inception_v3": (vision.inception_v3, 32, 64),
    "resnet50": (vision.resnet50, 16, 64),
    "resnet200": (vision.resnet200, 16, 32),
    "transformer": (sequence.transformer, 16, 64),
    "bert-base": (_hf("bert_base"), 16, 32),
    "bert-large": (_hf("bert_large"), 16, 32),
    "bert-large-seq64": (_hf("bert_large_seq64"), 16, 32),
    "gpt2": (_hf("gpt2"), 16, 8),
    "gpt2-medium": (_hf("gpt2_medium"), 16, 8),
    "gpt2-large": (_hf("gpt2_large"), 16, 8),
    "rnnlm": (sequence.rnnlm, 64, 64),
    "gnmt": (sequence.gnmt, 64, 128),
    "mlp": (vision.mlp, 256, 256),
    "llama": (_hf("llama"), 16, 8),
    "distilbert-padded": (_hf("distilbert_padded"), 16, 32),
    "dlrm": (recommendation.dlrm, 64, 128),
}
assert tuple(_REGISTRY) == NAMES


@dataclass
class Workload:
    """One training workload: ``loss = loss_fn(model(*example_inputs[:-1]), example_inputs[-1])``, then
    ``optimizer.step()``. ``fake_mode`` is the ``FakeTensorMode`` the tensors were made in, or None if
    real."""

    name: str
    size: str
    batch: int
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    optimizer: torch.optim.Optimizer
    example_inputs: tuple[torch.Tensor, ...]
    fake_mode: torch._subclasses.fake_tensor.FakeTensorMode | None


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.01)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def default_batch(name: str, size: str = "test") -> int:
    """The batch `get(name, size)` uses when none is given."""
    _check(name, size, "sgd")
    return _REGISTRY[name][1 if size == "test" else 2]


def _check(name: str, size: str, optimizer: str) -> None:
    if name not in _REGISTRY:
        raise FasttError(f"unknown zoo model {name!r}; choose one of: {', '.join(NAMES)}")
    if size not in SIZES:
        raise FasttError(f"unknown zoo size {size!r}; choose one of: {', '.join(SIZES)}")
    if optimizer not in OPTIMIZERS:
        raise FasttError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")


def get(name: str, size: str = "test", *, batch: int | None = None, optimizer: str = "sgd",
        dropout: bool = True, fake: bool | None = None, seed: int = 0) -> Workload:
    """Build zoo model `name` at `size` ("test" or "paper") as a ready-to-train :class:`Workload`.

    batch: None for the size's default. optimizer: "sgd" (lr 0.01, momentum 0.9), "adam" (lr 1e-3) or "adamw"
    (lr 1e-3, weight decay 0.01). dropout=False sets every dropout probability to 0. fake (default: size ==
    "paper") builds model, optimizer and inputs inside a fresh FakeTensorMode; otherwise tensors are real and
    seeded with ``torch.manual_seed(seed)``. The model is in training mode.
    """
    _check(name, size, optimizer)
    builder, test_batch, paper_batch = _REGISTRY[name]
    if batch is None:
        batch = test_batch if size == "test" else paper_batch
    if batch < 1:
        raise FasttError(f"zoo batch must be a positive integer, got {batch}")
    if fake is None:
        fake = size == "paper"
    torch.manual_seed(seed)
    mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        with mode:
            model, loss_fn, inputs = builder(size, batch, dropout)
            opt = _optimizer(optimizer, list(model.parameters()))
    else:
        model, loss_fn, inputs = builder(size, batch, dropout)
        opt = _optimizer(optimizer, list(model.parameters()))
    model.train()
    return Workload(name, size, batch, model, loss_fn, opt, tuple(inputs), mode)


__all__ = ["DISTINCT", "NAMES", "OPTIMIZERS", "SIZES", "VARIANTS", "Workload", "default_batch", "get"]
