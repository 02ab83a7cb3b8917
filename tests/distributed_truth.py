"""Run by test_distributed under torchrun (2 ranks): the pipeline planner's plan of the mlp keeps its last layers
on rank 1 alone, so their new values stay there after a step. Rank 0 then refuses to hand out its stale model
(`state_dict`, a forward) or optimizer state; after `step.sync()` on every rank its model and Adam's state are
eager's step from the same state (step by step: the micro-batches sum the gradient in another order). Writes {"refused": [...], "truth": n, "diff": d, "state_diff": s} to the file argv[1].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_truth.py OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from fastt.errors import FasttError
from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.reference import batch_like, eager_reference_step, max_param_rel_diff, take_state
from fastt.workload import load_workload

STEPS = 4


def make() -> tuple:
    torch.manual_seed(0)
    return load_workload("mlp", "test", None, "adam")


def beside_eager(step, model, opt, ref: tuple | None, b: tuple) -> None:
    """One step of `step` on batch `b` and, on rank 0 (where `ref`, a second copy of the workload, is given),
    eager's step of `ref` from the model's state before it."""
    if ref is not None:
        take_state(model, opt, ref[1], ref[3])
        eager_reference_step(ref[1], ref[2], ref[3], b, 1)
    step(*b)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _, model, loss_fn, opt, inputs = make()
    step = parallelize_distributed(model, loss_fn, opt, inputs, "pipeline", cl=rank_cluster())
    ref = make() if rank == 0 else None
    for i in range(STEPS):
        if i:
            step.sync()
        beside_eager(step, model, opt, ref, batch_like(inputs, i))
    refused = []
    if rank == 0:
        for read in (model.state_dict, opt.state_dict, lambda: model(*inputs[:-1])):
            try:
                read()
            except FasttError as e:
                refused.append(str(e))
    step.sync()
    if rank == 0:
        pairs = [(opt.state[p][k], ref[3].state[q][k]) for p, q in zip(model.parameters(), ref[1].parameters())
                 for k in ("exp_avg", "exp_avg_sq")]
        state_diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs)
        with open(out, "w") as f:
            json.dump({"refused": refused, "truth": len(step.wiring.truth),
                       "diff": max_param_rel_diff(ref[1], model), "state_diff": state_diff}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
