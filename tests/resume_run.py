"""The workloads test_resume checkpoints and resumes, and its script: run as a plain process or under torchrun
(2 ranks, --distributed), it trains a workload for --steps steps with fastt, rank 0 checkpointing
(`fastt.checkpoint.save`: model, optimizer, scheduler, plan) after the steps in --save, and writes the final state
to DIR/OUT. --resume starts from DIR/ckpt.pt instead (every rank loads it). Rank 0 prints "saved K" after each
checkpoint.

    python tests/resume_run.py DIR OUT --planner dp --save 3 [--resume] [--die-saving K]
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/resume_run.py DIR OUT --distributed ...
"""

from __future__ import annotations

import argparse
import io
import os
import signal
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fastt import Strategy, checkpoint, zoo
from fastt.runtime import parallelize
from fastt.runtime.reference import batch_like


class BatchNormNet(nn.Module):
    """A small CNN with batch norm: its running statistics and batch count are state to resume too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(8 * 8 * 8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def mlp_adam(steps: int) -> tuple:
    w = zoo.get("mlp", "test", optimizer="adam", dropout=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(w.optimizer, max_lr=0.01, total_steps=steps)
    return w.model, w.loss_fn, w.optimizer, sched, w.example_inputs


def cnn_sgd(steps: int) -> tuple:
    torch.manual_seed(0)
    model = BatchNormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
    inputs = (torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,)))
    return model, nn.functional.cross_entropy, opt, sched, inputs


def cnn_adamw(steps: int) -> tuple:
    model, loss_fn, _, _, inputs = cnn_sgd(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, amsgrad=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return model, loss_fn, opt, sched, inputs


# name -> make(steps) -> (model, loss_fn, optimizer, LR scheduler, example inputs)
WORKLOADS: dict[str, Callable[[int], tuple]] = {"mlp-adam-onecycle": mlp_adam, "cnn-bn-sgd-steplr": cnn_sgd,
                                                "cnn-bn-adamw-cosine": cnn_adamw}


def train(step: Callable, sched, inputs: tuple, steps: range, after: Callable[[int], None] = lambda i: None) -> None:
    """The user's loop: a step, the scheduler's step, then `after(steps done)`."""
    for i in steps:
        step(*batch_like(inputs, i))
        sched.step()
        after(i + 1)


def state(model: nn.Module, opt: torch.optim.Optimizer, sched) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


def load(ck: dict, model: nn.Module, opt: torch.optim.Optimizer, sched) -> None:
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])


def die_while_saving(save: Callable) -> Callable:
    """A torch.save that writes half the checkpoint and then kills the process (SIGKILL: nothing runs after)."""
    def half(obj: object, f) -> None:
        data = io.BytesIO()
        save(obj, data)
        f.write(data.getvalue()[:len(data.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return half


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("out")
    p.add_argument("--workload", default="cnn-bn-adamw-cosine", choices=WORKLOADS)
    p.add_argument("--planner", default="dp")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save", default="3", help="comma-separated steps after which to checkpoint, or 'every'")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--die-saving", type=int, default=None, help="get killed while writing this step's checkpoint")
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--trial-steps", type=int, default=3, help="torchrun: parallelize_distributed's trial_steps")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.distributed:
        from fastt.runtime.distributed import parallelize_distributed

        dist.init_process_group("gloo")
    rank = dist.get_rank() if a.distributed else 0
    model, loss_fn, opt, sched, inputs = WORKLOADS[a.workload](a.steps)
    start, strategy = 0, None
    if a.resume:
        ck = torch.load(a.dir / "ckpt.pt")
        load(ck, model, opt, sched)
        start, strategy = ck["step"], Strategy.from_json(ck["strategy"])
    if a.distributed:
        step = parallelize_distributed(model, loss_fn, opt, inputs, a.planner, strategy=strategy,
                                       trial_steps=a.trial_steps, clip_grad_norm=1.0)
    else:
        step = parallelize(model, loss_fn, opt, inputs, "cpu:2", a.planner, strategy=strategy, clip_grad_norm=1.0)
    saves = range(a.steps + 1) if a.save == "every" else {int(s) for s in a.save.split(",")}

    def save(done: int) -> None:
        if done in saves:
            step.sync()  # every rank: rank 0's model then holds what the others keep
        if done in saves and rank == 0:
            if done == a.die_saving:
                torch.save = die_while_saving(torch.save)
            checkpoint.save({**state(model, opt, sched), "strategy": step.strategy.to_json(), "step": done},
                            a.dir / "ckpt.pt")
            print(f"saved {done}", flush=True)

    train(step, sched, inputs, range(start, a.steps), save)
    step.sync()
    if rank == 0:
        torch.save(state(model, opt, sched), a.dir / a.out)
    if a.distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
