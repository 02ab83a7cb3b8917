"""Train a small CNN on scikit-learn's handwritten digits with fastt, as a user's training loop does: an LR
schedule (OneCycleLR: warm-up, then cosine annealing), gradient clipping, a progress bar with the loss and the
step time, a checkpoint to resume from, the test accuracy, and a loss-curve PNG.

    python examples/digits.py                       # cpu:2, the fastt planner; reaches >= 95% test accuracy
    python examples/digits.py --small               # a few epochs (what `fastt demo` runs)
    python -m torch.distributed.run --nproc-per-node 2 examples/digits.py --distributed  # a rank per device

Needs scikit-learn (`pip install -e '.[examples]'`). From Python: `fastt.examples.digits.main(["--small"])`
returns the result as a dict.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from .. import checkpoint
from ..errors import FasttError
from ..strategy import Strategy

TARGET_ACCURACY = 0.95  # what the full run reaches (tests/test_example.py checks it)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a max-pool over the 8x8 image, then two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, padding=1),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels): 75/25, stratified; images 1x8x8 in [0, 1]."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise FasttError("the digits example needs scikit-learn: pip install -e '.[examples]'") from None
    d = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(d.images / 16.0, d.target, test_size=0.25,
                                                        stratify=d.target, random_state=seed)
    images = [torch.tensor(x, dtype=torch.float32).unsqueeze(1) for x in (x_train, x_test)]
    labels = [torch.tensor(y, dtype=torch.long) for y in (y_train, y_test)]
    return images[0], labels[0], images[1], labels[1]


def batches(x: torch.Tensor, y: torch.Tensor, size: int, g: torch.Generator):
    """One epoch of shuffled batches, all of `size` (a captured step has one batch shape: the rest is left for
    another epoch's shuffle)."""
    order = torch.randperm(len(x), generator=g)
    for i in range(0, len(x) - size + 1, size):
        idx = order[i:i + size]
        yield x[idx], y[idx]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def plot(losses: Sequence[float], steps_per_epoch: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, label="training loss (batch)")
    k = steps_per_epoch
    epochs = [sum(losses[i:i + k]) / k for i in range(0, len(losses) - k + 1, k)]
    ax.plot([k * (e + 1) for e in range(len(epochs))], epochs, "o-", ms=3, label="epoch mean")
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="examples/digits.py", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a few epochs: the demo's form")
    p.add_argument("--epochs", type=int, default=None, help="default 20 (--small: 4)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="OneCycleLR's peak learning rate")
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--planner", default="fastt")
    p.add_argument("--distributed", action="store_true",
                   help="one process per device under torchrun (parallelize_distributed over gloo)")
    p.add_argument("--checkpoint", default=None,
                   help="save here after every epoch (atomically), and resume from it if it exists")
    p.add_argument("--plot", default="digits_loss.png", help="the loss curve PNG ('' for none)")
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


@dataclass
class Training:
    """The loop's state: the user's objects and its progress, all of which a checkpoint holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    shuffle: torch.Generator
    epoch: int = 0
    losses: list[float] = field(default_factory=list)

    def save(self, path: str, strategy: Strategy) -> None:
        """Checkpoint atomically, with the plan: a resumed run on another plan would round otherwise."""
        checkpoint.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                         "scheduler": self.scheduler.state_dict(), "shuffle": self.shuffle.get_state(),
                         "epoch": self.epoch, "losses": self.losses, "strategy": strategy.to_json()}, path)

    def resume(self, path: str) -> Strategy:
        """Load a checkpoint `save` wrote; returns its plan."""
        ck = torch.load(path)
        self.model.load_state_dict(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        self.shuffle.set_state(ck["shuffle"])
        self.epoch, self.losses = ck["epoch"], ck["losses"]
        return Strategy.from_json(ck["strategy"])


def train(step, t: Training, x: torch.Tensor, y: torch.Tensor, a: argparse.Namespace, epochs: int,
          rank: int) -> None:
    """The user's loop: a step, the scheduler's step; a checkpoint after every epoch (`step.sync()` on every
    rank first: under torchrun rank 0's model then holds what the other ranks kept)."""
    per_epoch = len(x) // a.batch
    bar = tqdm(total=epochs * per_epoch, initial=t.epoch * per_epoch, desc="digits", unit="step",
               disable=rank != 0)
    while t.epoch < epochs:
        for xb, yb in batches(x, y, a.batch, t.shuffle):
            t0 = time.perf_counter()
            loss = step(xb, yb)  # every rank passes the whole batch; the loss comes back on rank 0
            t.scheduler.step()
            if rank == 0:
                t.losses.append(float(loss))
                bar.set_postfix(epoch=t.epoch + 1, loss=f"{t.losses[-1]:.4f}",
                                step_ms=f"{(time.perf_counter() - t0) * 1e3:.1f}", refresh=False)
            bar.update()
        t.epoch += 1
        step.sync()
        if a.checkpoint and rank == 0:
            t.save(a.checkpoint, step.strategy)
    bar.close()


def main(argv: Sequence[str] | None = None) -> dict | None:
    """Train and evaluate; returns the result on rank 0 (None on the other ranks)."""
    a = parser().parse_args(argv)
    epochs = a.epochs or (4 if a.small else 20)
    t0 = time.perf_counter()
    if a.distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = dist.get_rank() if a.distributed else 0
    torch.manual_seed(0)  # every rank builds the same model and draws the same batches
    x_train, y_train, x_test, y_test = digits()
    model = DigitsCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-4)
    per_epoch = len(x_train) // a.batch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=epochs * per_epoch,
                                                pct_start=0.2)
    t = Training(model, opt, sched, torch.Generator().manual_seed(0))
    strategy = t.resume(a.checkpoint) if a.checkpoint and os.path.exists(a.checkpoint) else None
    example, loss_fn = (x_train[:a.batch], y_train[:a.batch]), nn.functional.cross_entropy
    if a.distributed:
        from ..runtime.distributed import parallelize_distributed

        step = parallelize_distributed(model, loss_fn, opt, example, a.planner, strategy=strategy,
                                       clip_grad_norm=1.0)
    else:
        from ..runtime import parallelize

        step = parallelize(model, loss_fn, opt, example, a.devices, a.planner, strategy=strategy,
                           clip_grad_norm=1.0)
    ready = time.perf_counter()
    train(step, t, x_train, y_train, a, epochs, rank)
    result = None
    if rank == 0:
        result = {"accuracy": accuracy(model, x_test, y_test), "target_accuracy": TARGET_ACCURACY,
                  "epochs": epochs, "steps": len(t.losses), "first_loss": t.losses[0],
                  "last_epoch_loss": sum(t.losses[-per_epoch:]) / per_epoch, "planner": step.strategy.planner,
                  "replicas": step.strategy.replicas, "splits": len(step.strategy.splits),
                  "devices": "torchrun" if a.distributed else a.devices, "setup_s": ready - t0,
                  "train_s": time.perf_counter() - ready, "wall_s": time.perf_counter() - t0,
                  "plot": a.plot or None}
        report(result, t.losses, per_epoch, a)
    if a.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return result


def report(result: dict, losses: list[float], per_epoch: int, a: argparse.Namespace) -> None:
    """Print the result (a line, or JSON), and write the loss curve and the JSON file if asked."""
    acc = f"test accuracy {result['accuracy']:.1%}"
    if a.plot:
        plot(losses, per_epoch, a.plot, f"digits on {result['devices']}, planner {a.planner}: {acc}")
    print(json.dumps(result) if a.json else
          f"digits: {acc} after {result['epochs']} epochs ({result['steps']} steps, {result['wall_s']:.1f} "
          f"s, {result['setup_s']:.1f} s of them planning); loss curve: {a.plot or '-'}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
