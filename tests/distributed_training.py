"""Run by test_distributed under torchrun (2 ranks): a zoo model trained as a user's loop trains it, each rank
passing its shard of every batch, with every LR scheduler family and gradient clipping, equals the plain
one-device eager step at every step (from the same state, rtol 1e-5: a sum in another order rounds differently,
and training amplifies that over the steps; SGD, since Adam's first steps amplify it to the size of lr). Writes
{planner: {schedule: {"diff", "loss_diff", "warned", "replicas"}}} to the file argv[3].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_training.py MODEL PLANNERS OUT
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from test_training import params_close

from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.distributed.step import EagerRankStep
from fastt.runtime.reference import batch_like, eager_step, take_state
from fastt.runtime.shards import shard_of
from fastt.workload import load_workload

STEPS = 20
SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),  # momentum too
    "warmup": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: min(1.0, (i + 1) / 5)),
}


def make(name: str) -> tuple:
    torch.manual_seed(0)
    return load_workload(name, "test", None, "sgd")[1:]


def clip_for(name: str) -> float:
    """A third of the first gradient's norm: clipping changes the first steps at least."""
    model, loss_fn, _, inputs = make(name)
    loss_fn(model(*inputs[:-1]), inputs[-1]).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) / 3


def train(step, model, opt, ref: tuple, inputs, schedule: str, clip: float) -> dict:
    """STEPS steps from the model's present state under `schedule`, each compared on rank 0 with eager's step."""
    rank = dist.get_rank()
    sched = SCHEDULES[schedule](opt)
    worst, loss_diff, warned = 0.0, 0.0, []
    for i in range(STEPS):
        whole = batch_like(inputs, i)
        if rank == 0:
            take_state(model, opt, ref[0], ref[2])
        loss = step(*shard_of(whole, rank, dist.get_world_size()))
        step.sync()  # rank 0 reads its model: it gets what the others keep
        if rank == 0:
            eager = eager_step(ref[0], ref[1], ref[2], whole, clip)
            worst = max(worst, params_close(ref[0], model))
            loss_diff = max(loss_diff, float((loss - eager).abs() / eager.abs()))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            sched.step()  # warns if the optimizer never stepped
        warned += [str(w.message) for w in said]
    return {"diff": worst, "loss_diff": loss_diff, "warned": warned, "replicas": step.strategy.replicas}


def main(name: str, planners: str, path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # eager's kernels as each rank's
    cl, clip = rank_cluster(), clip_for(name)
    out = {}
    for planner in planners.split(","):
        model, loss_fn, opt, inputs = make(name)
        ref = make(name)[:3]
        start = copy.deepcopy((model.state_dict(), opt.state_dict()))
        step = parallelize_distributed(model, loss_fn, opt, inputs, planner, cl=cl, clip_grad_norm=clip)
        if dist.get_rank() == 0:  # alone, before any step: a dry run calls no collective (it would hang)
            step._dry()
        step(*shard_of(batch_like(inputs, 0), dist.get_rank(), dist.get_world_size()))  # the optimizer's
        step.sync()  # state exists, rank 0 holds all of it
        before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        dry = step._dry()
        out.setdefault("host", {})[planner] = {  # the simulated step's parts; its dry run changes nothing
            "unchanged": same(before, (model.state_dict(), opt.state_dict())), "dry_once_s": dry,
            "simulated_s": step.simulated_s, "placed_s": step.placed.simulated_s, "dry_s": step.host_seconds(),
            "feed_s": step.feed.seconds(cl), "pieces": len(step.feed.pieces), "agree_s": step.agreement_s(),
            "joins_s": step.joins_s(), "eager": isinstance(step, EagerRankStep)}
        out[planner] = {}
        for schedule in SCHEDULES:
            model.load_state_dict(start[0])  # every rank starts each schedule from the same state
            opt.load_state_dict(copy.deepcopy(start[1]))
            out[planner][schedule] = train(step, model, opt, ref, inputs, schedule, clip)
    finish(out, path)


def same(a: object, b: object) -> bool:
    """Two nests of tensors and numbers alike, bit for bit."""
    xs, ys = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(xs) == len(ys) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                      for x, y in zip(xs, ys))


def finish(out: dict, path: str) -> None:
    """Rank 0 writes `out` to `path` as JSON; every rank leaves the process group."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
