"""Run by test_distributed under torchrun (2 ranks): each rank passing only its shard of the batch trains bit for
bit as every rank passing the whole batch does, and as the plain one-device eager step, under data parallelism
(nothing travels), the one-device plan (rank 1's rows go to rank 0) and a random plan of 4 replicas (rows both
ways), for a mean, a sum and a -100-masked mean (the ranks gather the counts that weigh the replicas). A shard
that takes another branch than the captured step, or has the wrong shape, is refused by every rank, nothing
trained. Writes {"cases": {name: {"same": bool, "diff": float}}, "refused": {name: [message per rank]}} to the
file argv[1].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_shards.py OUT
"""

from __future__ import annotations

import copy
import json
import random
import sys

import distributed_models as models
import torch
import torch.distributed as dist
from test_models import Branchy
from test_runtime import random_topological_rank
from torch.nn import functional as F

import fastt
from fastt.errors import FasttError
from fastt.graph import data_parallel_graph
from fastt.plan.common import strategy_from
from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.distributed.step import EagerRankStep
from fastt.runtime.reference import eager_step, max_param_rel_diff, take_state
from fastt.runtime.shards import shard_of

STEPS = 3
LOSSES = ("mean", "summed", "masked")  # distributed_models' taggers


def batch(i: int) -> list[torch.Tensor]:
    """A batch of 8 tagged rows, each rank's shard counting another number of labels."""
    return list(models.tagged(torch.Generator().manual_seed(i), 8))


def make(loss: str) -> tuple:
    return getattr(models, loss)()[:3]


def plans(loss: str, cl) -> dict:
    model, loss_fn, opt = make(loss)
    g = fastt.capture(model, loss_fn, opt, batch(0))
    dg = data_parallel_graph(g, 4)
    rng = random.Random(0)
    random4 = strategy_from(dg, "random", 2, [rng.randrange(2) for _ in dg.ops],
                            start=random_topological_rank(dg, rng), replicas=4)
    # one device as the runtime runs it: a one-device strategy given runs as the eager step (distributed_eager)
    return {"dp": fastt.plan(g, cl, "dp"), "single": "single", "random4": random4}


def both(loss: str, strategy, cl) -> tuple[bool, float]:
    """STEPS steps: the whole batch on every rank, then, from the same state, each rank's shard; rank 0 compares
    the two (bit for bit) and the shard step with eager's step from that state."""
    model, loss_fn, opt = make(loss)
    ref = make(loss)
    how = {"planner": strategy} if isinstance(strategy, str) else {"strategy": strategy}
    step = parallelize_distributed(model, loss_fn, opt, batch(0), cl=cl, **how)
    same, worst = True, 0.0
    for i in range(STEPS):
        b = batch(i)
        start = copy.deepcopy((model.state_dict(), opt.state_dict()))
        whole_loss = step(*b)
        step.sync()  # rank 0 reads its model: it gets what rank 1 keeps
        after = copy.deepcopy(model.state_dict())
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
        if dist.get_rank() == 0:
            take_state(model, opt, ref[0], ref[2])
            eager = eager_step(ref[0], ref[1], ref[2], b)
        shard_loss = step(*shard_of(b, dist.get_rank(), 2))
        step.sync()
        if dist.get_rank() == 0:
            same &= torch.equal(whole_loss, shard_loss) and all(torch.equal(after[k], v)
                                                                 for k, v in model.state_dict().items())
            worst = max(worst, max_param_rel_diff(ref[0], model), float((shard_loss - eager).abs() / eager.abs()))
    return same, worst


def refusals(cl) -> dict[str, str]:
    """A rank's shard takes the other branch (under dp rank 1 checks it, under single rank 0 does), or has the
    wrong shape (also under one process, rank 0's eager step given, which checks shapes only): the message every
    rank raises, or 'trained'; a model that changed says so."""
    out = {}
    for name, planner, bad, who in [("branch-dp", "dp", "branch", 1), ("branch-single", "single", "branch", 1),
                                    ("shape-dp", "dp", "shape", 1), ("shape-eager", "eager", "shape", 1),
                                    ("shape-eager-rank0", "eager", "shape", 0)]:
        torch.manual_seed(0)
        model = Branchy()
        x, y = torch.rand(8, 4) + 0.1, torch.randint(0, 2, (8,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # the runtime's plan itself: no trial, which may keep one process (whose eager step takes any branch)
        how = ({"strategy": fastt.plan(fastt.capture(model, F.cross_entropy, opt, (x, y)), cl, "single")}
               if planner == "eager" else {"planner": planner, "trial_steps": 0})
        step = parallelize_distributed(model, F.cross_entropy, opt, (x, y), cl=cl, **how)
        assert isinstance(step, EagerRankStep) == (planner == "eager")
        shard = shard_of([x, y], dist.get_rank(), 2)
        if dist.get_rank() == who:
            shard = [-shard[0], shard[1]] if bad == "branch" else [shard[0][:3], shard[1][:3]]
        before = copy.deepcopy(model.state_dict())
        try:
            step(*shard)
            step.sync()
            out[name] = "trained"
        except FasttError as e:
            out[name] = str(e)
        if any(not torch.equal(before[k], v) for k, v in model.state_dict().items()):
            out[name] += " (and the model changed)"
    return out


def main(path: str) -> None:
    dist.init_process_group("gloo")
    cl = rank_cluster()
    cases = {}
    for loss in LOSSES:
        for plan_name, strategy in plans(loss, cl).items():
            same, diff = both(loss, strategy, cl)
            cases[f"{plan_name}/{loss}"] = {"same": same, "diff": diff}
    refused = refusals(cl)
    everyone: list = [None, None]
    dist.all_gather_object(everyone, refused)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"cases": cases, "refused": {k: [r[k] for r in everyone] for k in refused}}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
