"""Run by test_distributed under torchrun (2 ranks): a one-process plan given (the trial's rival kept, saved
and resumed) runs as rank 0's eager step, the other rank sending its shard's rows. Every step from the same state
equals the plain eager step of the whole batch, the loss comes back on rank 0 (None on rank 1), and `.grad` is
left as it was; switched to data parallelism, the next step is eager's too, and so are the steps after a switch
back to one process (rank 0's receive of rank 1's next rows, posted during the last one-process step, stays
posted through data parallelism's messages, which must not land in it, and takes the rows when one process
runs again). Writes {"eager": bool, "diff": d, "loss_diff": l, "grads_kept": bool, "others": [...]} to the
file argv[1] (rank 0).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_eager.py OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import fastt
from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.distributed.step import EagerRankStep
from fastt.runtime.reference import batch_like, eager_step, max_param_rel_diff, take_state
from fastt.runtime.shards import shard_of
from fastt.workload import load_workload

STEPS = 3


def make() -> tuple:
    torch.manual_seed(0)
    return load_workload("mlp", "test", None, "adam")


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _, model, loss_fn, opt, inputs = make()
    cl = rank_cluster()
    g = fastt.capture(model, loss_fn, opt, inputs)
    step = parallelize_distributed(model, loss_fn, opt, inputs, strategy=fastt.plan(g, cl, "single"), cl=cl)
    eager = isinstance(step, EagerRankStep)
    ref = make() if rank == 0 else None
    marked = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, mark in zip(model.parameters(), marked):
        p.grad = mark
    diff = loss_diff = 0.0
    others = []
    for i in range(STEPS + 3):
        if i == STEPS:  # switched to data parallelism: the runtime runs it, from rank 0's state
            step.switch(fastt.plan(g, cl, "dp"))
        if i == STEPS + 1:  # and back
            step.switch(fastt.plan(g, cl, "single"))
        b = batch_like(inputs, i)
        if ref is not None:
            take_state(model, opt, ref[1], ref[3])
            expected = eager_step(ref[1], ref[2], ref[3], b)
        loss = step(*shard_of(b, rank, world))
        if ref is not None:
            diff = max(diff, max_param_rel_diff(ref[1], model))
            loss_diff = max(loss_diff, float((loss - expected).abs() / expected.abs()))
        else:
            others.append(loss)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"eager": eager, "diff": diff, "loss_diff": loss_diff,
                       "grads_kept": all(p.grad is mark for p, mark in zip(model.parameters(), marked))}, f)
    else:
        assert others == [None] * (STEPS + 3), others
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
