"""Run by test_distributed under torchrun (2 ranks): train data-parallel, switch every rank to the one-device plan,
then back (`DistributedStep.switch`, what the tuner does), comparing every step on rank 0 with eager's step from
the same state. Rank 1 sits out the one-device steps, so its copy of the model is stale when DP comes back: the
switch must hand it rank 0's state. With `zero` (argv[3]) training starts with sharded updates, which leave rank 1
only its rows of the optimizer state, then goes to DP, the one-device plan and back to zero. Writes
{"replicas": [...], "diffs": [...]} to the file argv[2].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_switch.py MODEL OUT [zero]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from fastt.api import plan
from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.reference import batch_like, eager_reference_step, max_param_rel_diff
from fastt.workload import load_workload

SWITCHES = {"dp": {3: "single", 6: "dp"},  # step -> the plan every rank runs from that step on
            "zero": {3: "dp", 6: "single", 9: "zero"}}


def make(name: str) -> tuple:
    torch.manual_seed(0)
    return load_workload(name, "test", None, "adam")


def main(name: str, out: str, first: str = "dp") -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _, model, loss_fn, opt, inputs = make(name)
    cl = rank_cluster()
    step = parallelize_distributed(model, loss_fn, opt, inputs, first, cl=cl)
    plans = {name: plan(step.graph, cl, name) for name in ("dp", "single", "zero")}
    switch = SWITCHES[first]
    ref = make(name) if rank == 0 else None
    replicas, diffs = [], []
    for i in range(3 * len(switch) + 3):
        if i in switch:
            step.switch(plans[switch[i]])
        b = batch_like(inputs, i)
        replicas.append(step.strategy.replicas)
        if ref is not None:  # eager takes this step from our state
            ref[1].load_state_dict(model.state_dict())
            for p, q in zip(ref[1].parameters(), model.parameters()):
                ref[3].state[p] = {k: v.clone() for k, v in opt.state[q].items()}
            eager_reference_step(ref[1], ref[2], ref[3], b, replicas[-1])
        step(*b)
        step.sync()  # rank 0 reads its model: it gets what rank 1 keeps
        if ref is not None:
            diffs.append(max_param_rel_diff(ref[1], model))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"replicas": replicas, "diffs": diffs}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
