"""Model files for `fastt run --model tests/distributed_models.py:FUNCTION --launcher torchrun` (test_distributed):
each function returns (model, loss_fn, optimizer, example_inputs); `tokens` returns a Dataset for `--data`.

A tagger's losses reduce over the batch as users write them: a sum, a mean, and a mean over the labels not -100
(each example row has another number of them, and `batch_like` moves the rows, so the ranks' shards count
differently). `frozen` is the zoo's transformer with its encoder and embeddings frozen, as when fine-tuning.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from fastt import zoo

ROWS, LENGTH, VOCAB, CLASSES = 8, 6, 32, 5


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(x)))


def tagged(g: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels, row r with r % 5 of them -100."""
    x = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    y = torch.randint(0, CLASSES, (rows, LENGTH), generator=g)
    for r in range(rows):
        y[r, :r % (LENGTH - 1)] = -100
    return x, y


def _tagger(loss_fn) -> tuple:
    torch.manual_seed(0)
    model = Tagger()
    return model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), \
        tagged(torch.Generator().manual_seed(0), ROWS)


def summed() -> tuple:
    return _tagger(lambda out, y: F.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1).clamp(min=0),
                                                  reduction="sum"))


def mean() -> tuple:
    return _tagger(lambda out, y: F.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1).clamp(min=0)))


def masked() -> tuple:
    return _tagger(lambda out, y: F.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1)))  # -100 not counted


def frozen() -> tuple:
    w = zoo.get("transformer", "test", dropout=False)
    for n, p in w.model.named_parameters():
        if "encoder" in n or "embed" in n:
            p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in w.model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    return w.model, w.loss_fn, opt, w.example_inputs


def tokens() -> TensorDataset:
    """40 tagged sentences: 5 batches of 8 an epoch on 2 ranks, each rank reading 4 of every 8."""
    return TensorDataset(*tagged(torch.Generator().manual_seed(1), 40))
