"""Run by test_distributed under torchrun (2 or 3 ranks): the `zero` planner's sharded updates (ZeRO's stage 2),
each rank passing its shard of every batch, STEPS steps, every one compared on rank 0 with the plain one-device
eager step from the same state (rtol 1e-5: data parallelism's mean sums the replicas, eager one batch) and with
the local runtime's zero step (bit for bit: the same replicas, the same sums); after training rank 0's optimizer
state is compared with eager's after its last step, and each rank's held optimizer state is measured. Writes
{model: {optimizer: {...}}} to the file argv[4].

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_zero.py MODELS OPTIMIZERS BATCH OUT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from distributed_training import finish
from test_training import params_close

from fastt.runtime import parallelize
from fastt.runtime.distributed import parallelize_distributed, rank_cluster
from fastt.runtime.reference import batch_like, eager_step, take_state
from fastt.runtime.shards import shard_of
from fastt.workload import load_workload

STEPS = 20
PLANNER = "zero"


def make(name: str, optimizer: str, batch: int | None) -> tuple:
    torch.manual_seed(0)
    return load_workload(name, "test", batch, optimizer)[1:]


def state_diff(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    """The largest difference of any optimizer state tensor, relative to its largest magnitude."""
    worst = 0.0
    for p, q in zip(a.state_dict()["state"].values(), b.state_dict()["state"].values()):
        for k, x in p.items():
            y = q[k]
            assert x.shape == y.shape, (k, x.shape, y.shape)
            worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp_min(1e-12)))
    return worst


def held_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(x.numel() * x.element_size() for s in opt.state.values() for x in s.values()
               if isinstance(x, torch.Tensor))


def train(name: str, optimizer: str, batch: int | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn, opt, inputs = make(name, optimizer, batch)
    ref = make(name, optimizer, batch)[:3] if rank == 0 else None
    local = make(name, optimizer, batch)[:3] if rank == 0 else None
    step = parallelize_distributed(model, loss_fn, opt, inputs, PLANNER, cl=rank_cluster())
    local_step = (parallelize(local[0], local[1], local[2], inputs, devices=f"cpu:{world}",
                              strategy=step.strategy, trial=False) if rank == 0 else None)
    diffs, local_worst = [], 0.0
    for i in range(STEPS):
        whole = batch_like(inputs, i)
        if rank == 0:
            take_state(model, opt, ref[0], ref[2])
            take_state(model, opt, local[0], local[2])
        step(*shard_of(whole, rank, world))
        step.sync()  # rank 0 reads its model: it gets what the others keep
        if rank == 0:
            eager_step(ref[0], ref[1], ref[2], whole)
            local_step(*whole)
            diffs.append(params_close(ref[0], model))
            local_worst = max(local_worst, max(float((x - y).abs().max()) for x, y in
                                               zip(local[0].state_dict().values(), model.state_dict().values())))
    held: list = [None] * world
    dist.all_gather_object(held, held_bytes(opt))
    out = {"sharded": len(step.strategy.sharded), "replicas": step.strategy.replicas, "diffs": diffs,
           "local_diff": local_worst, "held": held}
    if rank == 0:
        out["state_diff"] = state_diff(ref[2], opt)
        out["local_state_diff"] = state_diff(local[2], opt)
        out["whole"] = held_bytes(ref[2])
    out["then_dp"] = then_dp(model, loss_fn, opt, inputs, ref)
    return out


def then_dp(model, loss_fn, opt, inputs, ref: tuple | None) -> list[float]:
    """Data parallelism on the same model and optimizer after zero (each rank updating from its own copy of the
    state, so rank 1's must be whole and right): 2 steps, each compared on rank 0 with eager's from the same
    state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = parallelize_distributed(model, loss_fn, opt, inputs, "dp", cl=rank_cluster())
    diffs = []
    for i in range(2):
        whole = batch_like(inputs, STEPS + i)
        if rank == 0:
            take_state(model, opt, ref[0], ref[2])
        step(*shard_of(whole, rank, world))
        step.sync()
        if rank == 0:
            eager_step(ref[0], ref[1], ref[2], whole)
            diffs.append(params_close(ref[0], model))
    return diffs


def main(models: str, optimizers: str, batch: str, path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # eager's kernels as each rank's
    out = {name: {o: train(name, o, int(batch) or None) for o in optimizers.split(",")}
           for name in models.split(",")}
    finish(out, path)


if __name__ == "__main__":
    main(*sys.argv[1:5])
