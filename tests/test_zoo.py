"""Tests of the model zoo: every model trains a real step at test size, builds fake at paper size, and traces."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from fastt.capture import capture_step
from fastt.errors import FasttError
from fastt.zoo import DISTINCT, NAMES, VARIANTS, Workload, default_batch, get
from fastt.zoo.recommendation import CRITEO_KAGGLE_ROWS, EMBEDDING_DIM

# Parameter counts at paper size, from the literature / reference implementations.
PAPER_PARAMS: dict[str, float] = {
    "lenet": 61_706,                  # LeNet-5
    "alexnet": 61.1e6,                # torchvision alexnet
    "vgg19": 143.7e6,                 # torchvision vgg19
    "inception_v3": 23.83e6,          # torchvision inception_v3 (27.2M) minus its 3.3M auxiliary head
    "resnet50": 25.6e6,               # torchvision resnet50
    "resnet200": 64.7e6,              # He et al. 2016 / timm resnet200
    "transformer": 60.5e6,            # Transformer-base: 44.1M + tied 32000x512 embedding (65M with 37k vocab)
    "bert-base": 110e6,               # Devlin et al. 2019
    "bert-large": 340e6,              # Devlin et al. 2019
    "bert-large-seq64": 340e6,        # BERT-large
    "gpt2": 124.4e6,                  # GPT-2 small
    "gpt2-medium": 355e6,             # GPT-2 medium (354.8M in transformers; 345M in the GPT-2 paper)
    "gpt2-large": 774e6,              # GPT-2 large (774.0M in transformers; 762M in the GPT-2 paper)
    "rnnlm": 66e6,                    # Zaremba et al. 2014, large PTB model
    "gnmt": 160e6,                    # MLPerf GNMT v2 (shared embedding)
    "mlp": 150.8e6,                   # our own: 1024-8192-8192-8192-1000
    "llama": 1.1e9,                   # TinyLlama-1.1B (Zhang et al. 2024)
    "distilbert-padded": 66e6,        # DistilBERT (Sanh et al. 2019), with its MLM head 67.0M
    "dlrm": 33_762_577 * 16 + 475_985,  # DLRM's Criteo Kaggle config: its 26 tables' rows x 16, and the MLPs
}

HAS_DROPOUT = ("alexnet", "vgg19", "inception_v3", "transformer", "bert-base", "bert-large", "gpt2", "rnnlm",
               "gnmt", "mlp", "distilbert-padded")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run on one thread: an upper bound for the timings on two idle cores, and immune to the multi-second
    stalls two OpenMP threads suffer when another process holds one of the two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def n_params(w: Workload) -> int:
    return sum(p.numel() for p in w.model.parameters())


def train_step(w: Workload) -> torch.Tensor:
    loss = w.loss_fn(w.model(*w.example_inputs[:-1]), w.example_inputs[-1])
    w.optimizer.zero_grad()
    loss.backward()
    w.optimizer.step()
    return loss


def trace(w: Workload) -> torch.fx.GraphModule:
    """fastt's own capture of the whole training step."""
    return capture_step(w.model, w.loss_fn, w.optimizer, w.example_inputs).gm


@pytest.mark.parametrize("name", DISTINCT)
def test_test_size_trains_fast(name: str) -> None:
    w = get(name)
    assert w.fake_mode is None and w.size == "test" and w.batch == default_batch(name)
    assert w.model.training
    before = [p.detach().clone() for p in w.model.parameters()]
    # The first step also pays for first-touch allocations and the optimizer state: keep the better of two.
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        loss = train_step(w)
        times.append(time.perf_counter() - t0)
    assert math.isfinite(loss.item())
    assert min(times) < 1.0, f"{name}: train step took {min(times):.2f}s"
    changed = sum(not torch.equal(a, p) for a, p in zip(before, w.model.parameters()))
    assert changed == len(before), f"{name}: only {changed}/{len(before)} parameters were updated"


@pytest.mark.parametrize("name", NAMES)
def test_paper_size_is_fake_with_reference_param_count(name: str) -> None:
    t0 = time.perf_counter()
    w = get(name, "paper")
    assert time.perf_counter() - t0 < 10
    assert w.fake_mode is not None and w.batch == default_batch(name, "paper")
    assert all(isinstance(p, FakeTensor) for p in w.model.parameters())
    assert all(isinstance(x, FakeTensor) for x in w.example_inputs)
    assert all(x.shape[0] == w.batch for x in w.example_inputs)
    ref = PAPER_PARAMS[name]
    assert abs(n_params(w) - ref) / ref < 0.02, f"{name}: {n_params(w):,} params, reference {ref:,.0f}"


@pytest.mark.parametrize("name", DISTINCT)
def test_test_size_traces(name: str) -> None:
    g = trace(get(name))
    assert len(g.graph.nodes) > 10


# A variant's paper size is its base's graph with more or wider layers or another length: the same capture.
@pytest.mark.slow
@pytest.mark.parametrize("name", DISTINCT)
def test_paper_size_traces(name: str) -> None:
    g = trace(get(name, "paper"))
    assert len(g.graph.nodes) > 10


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_is_its_base_at_test_size_and_differs_at_paper_size(name: str) -> None:
    base = VARIANTS[name]
    w, b = get(name), get(base)
    assert default_batch(name) == default_batch(base)
    shapes = [[(n, p.shape) for n, p in x.model.named_parameters()] for x in (w, b)]
    assert shapes[0] == shapes[1]
    assert all(torch.equal(p, q) for p, q in zip(w.model.parameters(), b.model.parameters()))
    assert all(torch.equal(x, y) for x, y in zip(w.example_inputs, b.example_inputs))
    w, b = get(name, "paper"), get(base, "paper")
    assert n_params(w) != n_params(b) or w.example_inputs[0].shape != b.example_inputs[0].shape


def test_dlrm_paper_size_has_the_criteo_kaggle_tables() -> None:
    w = get("dlrm", "paper")
    tables = [t.weight.shape for t in w.model.tables]
    assert tables == [torch.Size([n, EMBEDDING_DIM]) for n in CRITEO_KAGGLE_ROWS] and len(tables) == 26
    assert [m.in_features for m in w.model.bottom if isinstance(m, torch.nn.Linear)] == [13, 512, 256, 64]
    pairs = 27 * 26 // 2  # the dot products of the bottom MLP's output and the 26 embeddings, each pair once
    assert [m.in_features for m in w.model.top if isinstance(m, torch.nn.Linear)] == [16 + pairs, 512, 256]
    dense, sparse, clicks = w.example_inputs
    assert dense.shape == (128, 13) and sparse.shape == (128, 26) and clicks.shape == (128,)


def test_dlrm_test_size_batch_is_in_range() -> None:
    w = get("dlrm")
    _, sparse, clicks = w.example_inputs
    rows = torch.tensor([t.num_embeddings for t in w.model.tables])
    assert int(rows.max()) <= 256 and bool(((sparse >= 0) & (sparse < rows)).all())
    assert set(clicks.tolist()) == {0, 1} and w.batch % 4 == 0


@pytest.mark.parametrize("name", HAS_DROPOUT)
def test_dropout_off_is_deterministic(name: str) -> None:
    w = get(name, batch=4, dropout=False)
    x = w.example_inputs[:-1]
    with torch.no_grad():
        assert torch.equal(w.model(*x), w.model(*x))
    w = get(name, batch=4, dropout=True)
    with torch.no_grad():
        assert not torch.equal(w.model(*x), w.model(*x))


@pytest.mark.parametrize("name", ["lenet", "transformer", "gnmt"])
def test_seed_reproducible(name: str) -> None:
    a, b, c = get(name, seed=3), get(name, seed=3), get(name, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs))
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])


def test_options() -> None:
    w = get("mlp", batch=8, optimizer="adam")
    assert w.batch == 8 and all(x.shape[0] == 8 for x in w.example_inputs)
    assert type(w.optimizer) is torch.optim.Adam
    assert type(get("mlp", optimizer="adamw").optimizer) is torch.optim.AdamW
    sgd = get("mlp").optimizer
    assert type(sgd) is torch.optim.SGD and sgd.defaults["lr"] == 0.01 and sgd.defaults["momentum"] == 0.9
    assert get("mlp", fake=True).fake_mode is not None
    w = get("lenet", "paper", fake=False, batch=2)
    assert w.fake_mode is None and not isinstance(w.example_inputs[0], FakeTensor)


@pytest.mark.parametrize("kwargs", [{"name": "resnet51"}, {"name": "mlp", "size": "huge"},
                                    {"name": "mlp", "optimizer": "lamb"}, {"name": "mlp", "batch": 0}])
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(FasttError) as e:
        get(**kwargs)
    assert "\n" not in str(e.value)
    if "size" not in kwargs and "optimizer" not in kwargs and "batch" not in kwargs:
        assert all(n in str(e.value) for n in NAMES)


def test_import_is_light() -> None:
    code = "import sys, fastt.zoo; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
