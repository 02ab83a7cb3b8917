"""Orchestration: `parallelize` over a process group (`parallelize_distributed`): every rank captures and
measures, rank 0 plans, every rank places and wires the same plan; and the whole batch of the ranks' shards
(`whole_batch`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...cluster import Cluster
from ...coarsen import capture_graph
from ...cost import measure_step
from ...errors import FasttError
from ...plan.basic import single_device
from ...precision import check_scaler
from ...strategy import Strategy
from ..decide import decide, tuner_of
from ..programs import place
from ..shards import shard_of
from ..trial import TRIAL_STEPS, raced
from ..tune import Tuner
from .calibrate import measure_agreement, rank_cluster, rank_device, rank_targets, synchronized
from .faults import DEFAULT_TIMEOUT_S, alone_on_rank0
from .step import DistributedStep, EagerRankStep, check_same, racing, whole_state
from .wiring import wire


def parallelize_distributed(model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer,
                            example_inputs: Sequence[torch.Tensor], planner: str = "fastt",
                            strategy: Strategy | None = None, cl: Cluster | None = None,
                            timeout_s: float = DEFAULT_TIMEOUT_S, trial_steps: int = TRIAL_STEPS,
                            tune: bool | Tuner = False,
                            clip_grad_norm: float | None = None,
                            autocast: torch.dtype | None = None,
                            grad_scaler: torch.amp.GradScaler | None = None,
                            whole_batches: bool = False) -> DistributedStep:
    """`parallelize` over an initialized process group, one device per rank (gloo: the CPU; NCCL: the rank's
    current GPU, where the model and inputs must be): every rank calls it with the same model, optimizer and
    inputs. Every rank captures the step and measures its op times (at once, so they include what the ranks
    cost each other); rank 0 plans and sends the plan to all. `example_inputs` is a whole batch (`whole_batch`
    makes one of the ranks' shards); training then passes each rank its shard (`DistributedStep`).

    The `fastt` planner keeps its plan only if it measures faster than data parallelism (FastT's rule) and
    than one process (the whole step on rank 0's device as the user's eager step, `EagerRankStep`, the other
    ranks sending it their shards' rows; a one-process `strategy` given runs so too): all
    run `trial_steps` steps first, each rank on its shard, the model and optimizer restored after (0: no
    trial; `fastt.runtime.trial`, as `parallelize` does). `step.trial` has the times. `tune=True` (or a
    configured `Tuner`) instead starts from data parallelism when it fits and runs FastT's tuning loop in the
    first steps of training, as the local runtime does (`fastt.runtime.tune`); rank 0's tuner decides and
    logs. `autocast`: the forward runs under `torch.autocast` in that dtype, and an enabled `grad_scaler` is
    refused, as `parallelize`'s. `whole_batches`: the training loop passes every rank the whole batch while
    the plan is one process (`DistributedStep.one_process`), as `fastt run`'s does, so the trial races one
    process on the whole batch too (no rows travel); else on the ranks' shards."""
    check_scaler(grad_scaler)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    home = {t.device for t in [*model.parameters(), *example_inputs]}
    if home != {device}:
        raise FasttError(f"rank {rank}: the model and its inputs are on {', '.join(sorted(map(str, home)))}, "
                         f"not on this rank's device {device}: move them there first")
    cl = cl or rank_cluster(device)
    host = (example_inputs, measure_agreement(device) if world > 1 else 0.0)  # for the simulated step
    whole_state(model, optimizer)  # a zero step's rows on other ranks would capture another step
    graph = capture_graph(model, loss_fn, optimizer, example_inputs, name=type(model).__name__,
                          clip_grad_norm=clip_grad_norm, autocast=autocast)
    threads = torch.get_num_threads()
    tuner = tuner_of(tune)
    chosen = decide(graph, cl, n_devices=world, planner=planner, strategy=strategy, tuner=tuner,
                    measure=lambda batches, _: measure_step(graph, model, optimizer, example_inputs, batches,
                                                            threads, 1),
                    alone=alone_on_rank0)
    given = strategy is not None
    strategy, costs = chosen.strategy, chosen.costs
    box = [strategy.to_json() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    strategy = Strategy.from_json(box[0])
    eager = {"loss_fn": loss_fn, "clip_grad_norm": clip_grad_norm, "autocast": autocast}
    # a one-process plan given (the trial's rival kept, saved and resumed) runs as that rival does
    alone = given and tuner is None and set(strategy.placement.values()) == {0}
    step = _placed_step(model, optimizer, graph, strategy, cl, costs, timeout_s, tuner, host,
                        eager if alone else None)
    if chosen.planned and tuner is None:  # the tuner measures and rolls back itself
        mine = shard_of(example_inputs, rank, world)  # as training runs: each rank its shard
        def rival(s: Strategy) -> DistributedStep:
            return _placed_step(model, optimizer, graph, s, cl, costs, timeout_s, host=host)

        # One process: the whole step on rank 0's device as the user's eager step (the others send their
        # shards' rows and wait)
        one = (None if world < 2 else  # fastt's own one-device plan too: the eager step may run it faster
               lambda: _placed_step(model, optimizer, graph, single_device(graph, cl), cl, costs, timeout_s,
                                    host=host, eager=eager))
        def clock(s: DistributedStep, *batch: torch.Tensor) -> float:  # as the training loop feeds it
            return _between_barriers(s, *(example_inputs if whole_batches and s.one_process else batch))

        with racing(optimizer):  # every rank's own state is put back after, the same on every rank
            step = raced(step, rival, mine, trial_steps, clock, _rank0s, alone=one)
    return step


def _placed_step(model, optimizer, graph, strategy: Strategy, cl: Cluster, costs, timeout_s: float,
                 tuner: Tuner | None = None, host: tuple = (None, 0.0),
                 eager: dict | None = None) -> DistributedStep:
    """The DistributedStep of `strategy` (`host`: a whole batch it takes and the ranks' agreement's
    seconds, for its simulated time), after checking that every rank compiled the same messages; with
    `eager` (the loss, clip and autocast), a one-device plan's `EagerRankStep`."""
    placed = place(graph, strategy, cl, costs, rank_targets(rank_device()))
    wiring = wire(placed.lowered, placed.programs)
    check_same(wiring)
    if eager is not None:
        return EagerRankStep(model, optimizer, placed, wiring, timeout_s, graph, cl, costs, tuner, *host,
                             **eager)
    return DistributedStep(model, optimizer, placed, wiring, timeout_s, graph, cl, costs, tuner, *host)


def whole_batch(shard: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The whole batch that the ranks' shards make (rank 0's rows first), on every rank: one all_gather per
    input. Every rank calls it, like a collective."""
    out = []
    for x in shard:
        x = x.contiguous()
        whole = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                            device=x.device)
        dist.all_gather_single(whole, x)
        out.append(whole)
    return out


def _between_barriers(step: DistributedStep, *batch: torch.Tensor) -> float:
    """Seconds of one step of every rank: from a barrier before it to one after, the device's work done."""
    device = step.buffers.device
    step.whole_state()  # after a rival's sharded step: not this step's time
    synchronized(device)
    dist.barrier()
    t0 = time.perf_counter()
    step(*batch)
    dist.barrier()
    return synchronized(device) - t0


def _rank0s(times: list[float]) -> list[float]:
    """Rank 0's times on every rank, so that every rank keeps the same plan."""
    box = [times]
    dist.broadcast_object_list(box, src=0)
    return box[0]
