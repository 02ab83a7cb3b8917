"""A recommendation model of the zoo: DLRM (Naumov et al. 2019). Its embedding tables hold most of its memory
and do almost none of its compute, so they want model parallelism where its MLPs want data parallelism.

The builder has the signature ``build(size, batch, dropout) -> (model, loss_fn, (dense, sparse, clicks))``:
dense features ``(batch, 13)`` float, categorical features ``(batch, 26)`` int64 (column i an index into
table i) and 0/1 click labels ``(batch,)`` int64; the loss is binary cross entropy on the logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastt.zoo.vision import Built

# Rows of the 26 tables: the distinct values of each categorical feature of the Criteo Kaggle (Display
# Advertising Challenge) training set, as the DLRM repository's data loader (dlrm_data_pytorch.py,
# --data-set=kaggle) counts them and its Kaggle runs pass as --arch-embedding-size; 33.76M rows in all.
CRITEO_KAGGLE_ROWS: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
    5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
DENSE_FEATURES = 13
EMBEDDING_DIM = 16  # --arch-sparse-feature-size=16 (bench/dlrm_s_criteo_kaggle.sh)
BOTTOM_MLP: tuple[int, ...] = (512, 256, 64, EMBEDDING_DIM)  # --arch-mlp-bot=13-512-256-64-16
TOP_MLP: tuple[int, ...] = (512, 256, 1)  # --arch-mlp-top=512-256-1; its input width (367) follows
TEST_ROWS = 256  # a test-size table holds at most this many rows


def _mlp(dims: Sequence[int], last_relu: bool) -> nn.Sequential:
    """Linear layers with a ReLU after each (after the last too only if `last_relu`)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM: the dense features through the bottom MLP, each categorical feature through its own table, the
    dot products of every pair of those 1 + tables vectors, and the top MLP over the bottom MLP's output and
    those products.

    The tables are plain ``nn.Embedding`` with dense gradients, as a user's model has them by default (the
    DLRM repository uses ``nn.EmbeddingBag(mode="sum", sparse=True)``; with one index per feature, as in
    Criteo, a sum bag is that one row). They start uniform in +-1/sqrt(rows), as DLRM initialises them, so
    the dot products of the interaction start small whatever a table's size."""

    def __init__(self, rows: Sequence[int], dim: int = EMBEDDING_DIM, bottom: Sequence[int] = BOTTOM_MLP,
                 top: Sequence[int] = TOP_MLP) -> None:
        super().__init__()
        self.bottom = _mlp((DENSE_FEATURES, *bottom), last_relu=True)
        self.tables = nn.ModuleList(nn.Embedding(n, dim) for n in rows)
        for t in self.tables:
            nn.init.uniform_(t.weight, -t.num_embeddings ** -0.5, t.num_embeddings ** -0.5)
        vectors = len(rows) + 1
        self.top = _mlp((bottom[-1] + vectors * (vectors - 1) // 2, *top), last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        features = torch.stack([x, *(t(sparse[:, i]) for i, t in enumerate(self.tables))], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        # each pair once: the strictly lower triangle (DLRM's default, --arch-interaction-itself off)
        i, j = torch.tril_indices(features.shape[1], features.shape[1], -1, device=dense.device)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)


def click_loss(logits: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
    """Binary cross entropy of click logits ``(batch,)`` against 0/1 labels, averaged over the batch."""
    return F.binary_cross_entropy_with_logits(logits, clicks.to(logits.dtype))


def dlrm(size: str, batch: int, dropout: bool) -> Built:
    """DLRM in the DLRM repository's Criteo Kaggle configuration (bench/dlrm_s_criteo_kaggle.sh): embedding
    dimension 16, bottom MLP 13-512-256-64-16, top MLP 367-512-256-1, BCE loss; DLRM has no dropout, so
    ``dropout`` changes nothing. paper: the 26 Criteo Kaggle tables (33.76M rows: 540.2M of the 540.7M
    params), batch 128 (the configuration's --mini-batch-size). test: the same net with each table cut to at
    most 256 rows (4,814 rows; 553,009 params, 476k of them the MLPs'), batch 64. Dense features are
    log(1 + count) of random counts (DLRM's transform of Criteo's integer features), indices uniform in each
    table's range, clicks 0/1 at random."""
    del dropout
    rows = CRITEO_KAGGLE_ROWS if size == "paper" else tuple(min(n, TEST_ROWS) for n in CRITEO_KAGGLE_ROWS)
    dense = torch.log1p(torch.randint(0, 1000, (batch, DENSE_FEATURES)).float())
    sparse = torch.stack([torch.randint(0, n, (batch,)) for n in rows], dim=1)
    clicks = torch.randint(0, 2, (batch,))
    return DLRM(rows), click_loss, (dense, sparse, clicks)
