"""Run by test_distributed under torchrun (2 ranks): owt's plan of vgg19 with its classifier in parts over the
ranks (`megatron.held_in_parts`; at test size classifier.3 column-parallel, classifier.6 row-parallel, each
rank holding its part of both weights and their momentum), the convolutions data-parallel. Each step starts from the state
of the one before (`sync`), and eager's step from that same state is the reference (step by step: the parts'
sums add in another order than eager's). Writes {"splits": n, "diff": d} to the file argv[1].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_parts.py OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from distributed_truth import beside_eager

import fastt
from fastt import zoo
from fastt.plan import get_planner
from fastt.plan.megatron import held_in_parts
from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.reference import batch_like, max_param_rel_diff
from fastt.strategy import Strategy

STEPS = 3


def make() -> tuple:
    torch.manual_seed(0)
    w = zoo.get("vgg19", "test", dropout=False)
    return "vgg19", w.model, w.loss_fn, w.optimizer, w.example_inputs


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _, model, loss_fn, opt, inputs = make()
    cl = rank_cluster()
    plan = [None]
    if rank == 0:  # rank 0 plans, as parallelize_distributed does, and every rank runs that plan
        g = fastt.capture(model, loss_fn, opt, inputs)
        plan = [held_in_parts(g, cl, get_planner("owt")(g, cl)).to_json()]
    dist.broadcast_object_list(plan, src=0)
    s = Strategy.from_json(plan[0])
    step = parallelize_distributed(model, loss_fn, opt, inputs, strategy=s, cl=cl)
    ref = make() if rank == 0 else None
    diffs = []
    for i in range(STEPS):
        step.sync()
        beside_eager(step, model, opt, ref, batch_like(inputs, i))
        step.sync()
        if ref is not None:
            diffs.append(max_param_rel_diff(ref[1], model))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"splits": len(s.splits), "diff": max(diffs)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
