"""Train a model with fastt's plans over torch.distributed, one process per device (gloo on CPU, NCCL on GPU):

    torchrun --nproc-per-node 2 -m fastt.launch --model mlp --size test --planners fastt,dp --steps 50 --check
    torchrun --nproc-per-node 4 -m fastt.launch --device cuda --model bert-base --steps 50   # a GPU per rank

Every rank builds the same workload (seed 0) and trains on its own shard of every batch (rows
[r·B/world, (r+1)·B/world) of a batch of B, the model's example batch size): of batches like the example one
(`batch_like`), or with `--data FILE.py:FUNCTION` of the torch Dataset that function returns, read through a
`DistributedSampler` (shuffled, seed 0, a new order every epoch) and a DataLoader of B/world samples, as a DDP
training script reads it. While the plan is one process (the whole step on rank 0,
`DistributedStep.one_process`), every rank reads the whole batch instead, as one process does, and no rows
travel. `--check` compares every step with the plain one-device eager step on the whole
batch (with `--data`, the ranks' shards gathered). Rank 0 prints the result (as `fastt run` does) and, with
`--out`, writes it as JSON. Multi-node: run torchrun on every node with `--nnodes`, `--node-rank` and a
rendezvous endpoint, as usual. A rank that fails or loses a peer exits non-zero with a message naming the rank
that failed first; `--timeout` bounds how long a rank waits for a peer.

`--tune`: `fastt` starts data-parallel and tunes its plan in the first steps (FastT's loop, as
`fastt run --tune` does locally): rank 0's tuner sees every rank's segment times; when it switches plans,
every rank does, taking rank 0's model and optimizer state.

`FASTT_FAULT=RANK:STEP:kill|raise|oom` makes that rank die (SIGKILL) or raise at the start of that step, or
run out of memory at its first matrix multiply in it (fault tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import FasttError, one_line_warnings
from .precision import NAMES, dtype_of
from .strategy import Strategy
from .zoo import OPTIMIZERS


def _use_gpu() -> None:
    """Make GPU LOCAL_RANK this process's device, refusing more ranks on a node than it has GPUs (NCCL cannot
    run two ranks of a group on one GPU)."""
    local, per_node = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < per_node:
        raise SystemExit(f"fastt: --device cuda runs one rank per GPU: {per_node} ranks on this node, but "
                         f"{have} GPU(s) visible")
    torch.cuda.set_device(local)


def fault_spec(text: str) -> tuple[int, int, str] | None:
    """FASTT_FAULT's (rank, step, kill|raise|oom), None when it is empty;
    a FasttError saying the form otherwise."""
    if not text:
        return None
    m = re.fullmatch(r"(\d+):(\d+):(kill|raise|oom)", text.strip())
    if m is None:
        raise FasttError(f"FASTT_FAULT={text!r}: expected RANK:STEP:kill, RANK:STEP:raise or RANK:STEP:oom "
                         "(e.g. 1:2:kill), or leave it unset")
    return int(m[1]), int(m[2]), m[3]


def _fault(rank: int, step: int) -> contextlib.AbstractContextManager:
    """What FASTT_FAULT does to this rank's step: nothing (a null context), die or raise now, or run out of
    memory inside it (the context to run it in)."""
    from .runtime.oom import FailAllocation

    spec = fault_spec(os.environ.get("FASTT_FAULT", ""))
    if spec is None or spec[:2] != (rank, step):
        return contextlib.nullcontext()
    if spec[2] == "oom":
        print(f"fastt: FASTT_FAULT: this process runs out of memory in step {step}", file=sys.stderr,
              flush=True)
        return FailAllocation()
    if spec[2] == "kill":
        print(f"fastt: FASTT_FAULT: this process kills itself at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"fault injected at step {step} (FASTT_FAULT)")


def batches(steps: int, inputs: Sequence[torch.Tensor], loader: torch.utils.data.DataLoader | None,
            device: torch.device, whole: bool, one_process: Callable[[], bool] = lambda: False
            ) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
    """`steps` batches, like `inputs` or from `loader` (`_loader`'s, from its first epoch): what this rank
    passes the step, its shard of each or, while `one_process()` (the plan runs the whole step on rank 0),
    the whole batch as one process reads it, so that no rows travel; and, if `whole`, the whole batch (a
    collective then, where the rank holds its shard only)."""
    from .runtime.distributed import whole_batch
    from .runtime.reference import batch_like
    from .runtime.shards import shard_of

    if loader is None:
        for i in range(steps):
            b = [x.to(device) for x in batch_like(inputs, i)]
            mine = b if one_process() else shard_of(b, dist.get_rank(), dist.get_world_size())
            yield mine, b if whole else None
        return
    loader.batch_sampler.whole = one_process  # the sampler reads it as each batch is drawn
    step, epoch = 0, 0
    while step < steps:
        loader.batch_sampler.set_epoch(epoch)
        for b in loader:
            mine = [x.to(device) for x in b]
            yield mine, (mine if one_process() else whole_batch(mine)) if whole else None
            step += 1
            if step == steps:
                return
        epoch += 1


class _Batches(torch.utils.data.Sampler):
    """Rank `rank`'s batches of `batch` samples' shards: the indices a `DistributedSampler` (shuffled, seed 0,
    a new order every epoch) and a DataLoader of batch/world samples give it, as a DDP training script reads
    them; or, while `whole()`, the same step's shards of every rank side by side, rank 0's first: the whole
    batch, as one process reads it."""

    def __init__(self, data: torch.utils.data.Dataset, batch: int, rank: int, world: int,
                 whole: Callable[[], bool]) -> None:
        from torch.utils.data import DistributedSampler

        self.samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)
                         for r in range(world)]
        self.rank, self.shard, self.whole = rank, batch // world, whole

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.samplers[0]) // self.shard  # whole batches only (drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        orders = [list(s) for s in self.samplers]
        for i in range(len(self)):
            ranks = orders if self.whole() else [orders[self.rank]]
            yield [j for order in ranks for j in order[i * self.shard:(i + 1) * self.shard]]


def _dataset(spec: str) -> torch.utils.data.Dataset:
    """The torch Dataset the function `spec` returns (`--data`)."""
    from torch.utils.data import Dataset

    from .workload import call_file

    data = call_file(spec)
    if not isinstance(data, Dataset):
        raise FasttError(f"--data {spec} returned {type(data).__name__}, not a torch.utils.data.Dataset")
    return data


def _loader(data: torch.utils.data.Dataset, spec: str, batch: int, rank: int,
            world: int) -> torch.utils.data.DataLoader:
    """Rank `rank`'s DataLoader of `data` (`--data spec`): its shard of every batch of `batch` samples, or the
    whole batch while its sampler's `whole()` (`_Batches`; `batches` sets it)."""
    from torch.utils.data import DataLoader

    if batch % world:
        raise FasttError(f"a batch of {batch} does not split into {world} ranks' shards: use a batch "
                         f"divisible by {world}")
    loader = DataLoader(data, batch_sampler=_Batches(data, batch, rank, world, lambda: False))
    if not len(loader):
        raise FasttError(f"--data {spec}: its {len(data)} samples make no batch of {batch} "
                         f"over {world} ranks")
    return loader


def train(args: argparse.Namespace) -> dict | None:
    """Every planner from the same start, their steps taken in turn, BLOCK steps at a time (as `fastt run`
    does locally, `runtime.bench.run_planners`: a slow moment of the machine falls on all of them, not on one
    planner's run of steps); rank 0 returns the `fastt run` result dict."""
    from .runtime.bench import BLOCK
    from .runtime.distributed import rank_cluster, rank_device
    from .workload import load_workload, model_name

    rank, device = dist.get_rank(), rank_device()

    def make() -> tuple:  # on this rank's device (the optimizer holds the same Parameters)
        torch.manual_seed(0)
        name, model, loss_fn, opt, inputs = load_workload(args.model, args.size, args.batch, args.optimizer)
        return name, model.to(device), loss_fn, opt, tuple(x.to(device) for x in inputs)

    # Batches of the example's size; a bad --data fails before the ranks calibrate.
    data = _dataset(args.data) if args.data else None
    size = make()[4][0].shape[0] if data is not None else 0

    def loader() -> torch.utils.data.DataLoader | None:  # each planner its own
        return None if data is None else _loader(data, args.data, size, rank, dist.get_world_size())

    loader()
    cl = rank_cluster(device)
    runs = [_Eager(args, make) if planner == "eager" else _Planner(args, planner, make, loader(), cl)
            for planner in args.planners.split(",")]
    for start in range(0, args.steps, BLOCK):
        for run in runs:
            run.block(start, min(start + BLOCK, args.steps))
    results = [run.result() for run in runs]
    worst = max([r.get("max_step_rel_diff", 0.0) for r in results if not r.get("not_compared")], default=0.0)
    if rank != 0:
        return None
    clip = args.clip_grad_norm
    return {"model": model_name(args.model), "devices": cl.name, "launcher": "torchrun",
            "nodes": len({d.node for d in cl.devices}),
            "links": {lk.name.split(":")[0]: {"latency_s": lk.latency, "bandwidth": lk.bandwidth}
                      for lk in cl.links},
            "gather": dict(zip(("latency_s", "s_per_byte", "s_per_tensor"), cl.gather or ())),
            "comm_s_per_byte": cl.devices[0].comm_s_per_byte,
            "steps": args.steps, "results": results,
            "max_param_rel_diff": worst if args.check or args.check_steps else None,
            "not_compared": {r["planner"]: {"why": r["not_compared"],
                                            "max_param_rel_diff": r["max_step_rel_diff"]}
                             for r in results if r.get("not_compared")},
            "clip_grad_norm": clip,
            "precision": args.precision}


class _Planner:
    """One planner's training: its plan placed (`parallelize_distributed`, timed: `setup_s`) on its own copy
    of the workload, its steps timed on every rank and checked against the eager step on rank 0."""

    def __init__(self, args: argparse.Namespace, planner: str, make: Callable[[], tuple],
                 loader: torch.utils.data.DataLoader | None, cl) -> None:
        from .runtime.distributed import parallelize_distributed, rank_device
        from .runtime.trial import TRIAL_STEPS

        self.args, self.planner, self.rank = args, planner, dist.get_rank()
        self.clip, self.autocast = args.clip_grad_norm, dtype_of(args.precision)
        _, self.model, loss_fn, self.opt, inputs = make()
        strategy = Strategy.load(args.strategy) if args.strategy else None
        t0 = time.perf_counter()
        self.step = step = parallelize_distributed(
            self.model, loss_fn, self.opt, inputs, planner, strategy=strategy, cl=cl, timeout_s=args.timeout,
            trial_steps=TRIAL_STEPS if args.trial else 0, tune=args.tune and planner == "fastt",
            clip_grad_norm=self.clip, autocast=self.autocast, whole_batches=True)
        self.setup_s = time.perf_counter() - t0
        if args.save_plans and self.rank == 0:
            os.makedirs(args.save_plans, exist_ok=True)
            step.strategy.save(os.path.join(args.save_plans, f"{planner}.json"))
        self.check = args.check or args.check_steps
        self.ref = make() if self.check and self.rank == 0 else None
        self.times: list[float] = []
        self.diffs: list[float] = []
        self.tuned = 0
        self.batches = batches(args.steps, inputs, loader, rank_device(), self.check,
                               lambda: step.one_process)

    def block(self, lo: int, hi: int) -> None:
        """Steps lo..hi-1."""
        from .runtime.reference import drawing_again, eager_reference_step, max_param_rel_diff, take_state

        step, ref = self.step, self.ref
        for i in range(lo, hi):
            mine, whole = next(self.batches)
            if ref is not None:  # the reference takes this step from our state, drawing what the step will
                take_state(self.model, self.opt, ref[1], ref[3])
                with drawing_again():
                    eager_reference_step(ref[1], ref[2], ref[3], whole, step.strategy.replicas, self.clip,
                                         self.autocast)
            dist.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            with _fault(self.rank, i):  # the others are in the step, waiting for this rank
                step(*mine)  # on a GPU it ends once the GPU is done
            self.times.append(time.perf_counter() - t0)
            if self.check:  # rank 0's model is read: it gets what the other ranks keep
                step.sync()
            self.tuned += step.tuner is not None and step.tuner.active
            if ref is not None:
                self.diffs.append(max_param_rel_diff(ref[1], self.model))

    def result(self) -> dict:
        """This planner's row (a collective: every rank's times are gathered, the slowest rank's counting)."""
        from .runtime.bench import counted_steps
        from .runtime.reference import not_compared

        step = self.step
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.times)
        times = [max(ts) for ts in zip(*everyone)]  # a step ends when its slowest rank's does
        counted = counted_steps(len(times), self.tuned + 1)
        measured = statistics.median(times[k] for k in counted)
        row = {"planner": self.planner, "measured_iteration_s": measured, "counted_steps": counted,
               "simulated_iteration_s": step.simulated_s, "error": (step.simulated_s - measured) / measured,
               "replicas": step.strategy.replicas, "splits": len(step.strategy.splits),
               "setup_s": self.setup_s, "joins_s": step.joins_s(),
               "whole_batch": step.one_process,  # the last step's: every rank read the whole batch
               "trial": step.trial._asdict() if step.trial else None,
               "tuning": [vars(r) for r in step.tuner.rounds] if step.tuner is not None else None}
        if self.diffs:
            row["max_step_rel_diff"] = row["max_param_rel_diff"] = max(self.diffs)
            row["not_compared"] = not_compared(step.graph.fx.gm, len(set(step.strategy.placement.values())),
                                               step.strategy.replicas)
        return row


class _Eager:
    """Plain PyTorch in one process: rank 0's eager steps, the other ranks waiting (the one-process
    baseline)."""

    def __init__(self, args: argparse.Namespace, make: Callable[[], tuple]) -> None:
        _, self.model, self.loss_fn, self.opt, self.inputs = make()
        self.clip, self.autocast = args.clip_grad_norm, dtype_of(args.precision)
        self.times: list[float] = []

    def block(self, lo: int, hi: int) -> None:
        """Steps lo..hi-1 on rank 0."""
        from .runtime.distributed import alone_on_rank0
        from .runtime.reference import batch_like, eager_step
        from .runtime.trial import timed

        def run() -> list[float]:
            batches = [tuple(x.to(self.inputs[0].device) for x in batch_like(self.inputs, i))
                       for i in range(lo, hi)]
            return [timed(eager_step, self.model, self.loss_fn, self.opt, b, self.clip, self.autocast)
                    for b in batches]

        self.times += alone_on_rank0(run) or []
        dist.barrier()

    def result(self) -> dict:
        """The baseline's row: rank 0's median (0 on the other ranks)."""
        from .runtime.bench import counted_steps

        counted = counted_steps(len(self.times), 1) if self.times else []
        return {"planner": "eager", "counted_steps": counted,
                "measured_iteration_s": statistics.median(self.times[k] for k in counted) if counted else 0.0,
                "simulated_iteration_s": None, "error": None}


def positive_int(text: str) -> int:
    """An argparse type: a whole number ≥ 1 (steps, batch sizes)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 1, got {text!r}")
    return n


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, norms)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return x


def precision_option(p: argparse.ArgumentParser) -> None:
    """`--precision`: the forward under `torch.autocast` in bf16 or fp16, or fp32 (no autocast)."""
    p.add_argument("--precision", default="fp32", choices=tuple(NAMES),
                   help="mixed precision: the forward and loss under torch.autocast in bf16 or fp16; master "
                        "weights, gradients and optimizer state stay fp32 (default fp32: no autocast)")


def training_options(p: argparse.ArgumentParser) -> None:
    """The options of a training run that `fastt run` shares."""
    precision_option(p)
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the gradients' global norm to X every step (torch.nn.utils.clip_grad_norm_)")
    p.add_argument("--no-trial", dest="trial", action="store_false",
                   help="keep fastt's plan unmeasured: no trial steps racing it against data parallelism "
                        "before training (FastT's rule: the faster is kept)")
    p.add_argument("--data", default=None, metavar="FILE.py:FUNCTION",
                   help="torchrun: train on the torch Dataset this function returns (items: the model's "
                        "inputs and target), each rank reading its shard of every batch (DistributedSampler; "
                        "batches of the model's example batch size)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastt.launch", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", help="zoo name or path/to/file.py:function")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: a CPU device per rank over gloo; cuda: GPU LOCAL_RANK per rank over NCCL")
    p.add_argument("--size", default="test", choices=["test", "paper"])
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help="default sgd")
    p.add_argument("--planners", default="fastt,dp",
                   help="comma-separated planners, their steps taken in turn, a few at a time")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--check", action="store_true",
                   help="rank 0 also takes every step in plain one-device eager PyTorch from the same state "
                        "and random generators and compares the parameters (per step: training amplifies "
                        "rounding over the steps; a plan over several ranks draws dropout's masks otherwise: "
                        "shown apart)")
    p.add_argument("--check-steps", action="store_true", help="the same as --check")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the result as JSON to this file")
    p.add_argument("--timeout", type=positive_float, default=20.0,
                   help="seconds a rank waits for a peer before giving up")
    p.add_argument("--strategy", default=None,
                   help="run this strategy file (fastt plan --out) instead of planning")
    p.add_argument("--save-plans", default=None,
                   help="rank 0 writes each planner's strategy to DIR/PLANNER.json")
    p.add_argument("--tune", action="store_true",
                   help="fastt starts data-parallel and tunes its plan in the first steps (FastT's loop; "
                        "rank 0 decides, every rank switches) instead of racing its plan against DP before "
                        "training")
    training_options(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from .report import format_run
    from .runtime.distributed import RankError, await_reports, record_failure, said, start_heartbeat

    try:
        fault_spec(os.environ.get("FASTT_FAULT", ""))
    except FasttError as e:
        raise SystemExit(f"fastt: {e}") from None
    if args.device == "cuda":
        _use_gpu()
    # NCCL for GPU tensors; gloo for the CPU's (the store-side control: plans, timings, barriers' objects).
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    stop_heartbeat = start_heartbeat()
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        with one_line_warnings(show=rank == 0):  # every rank captures alike: rank 0 says it once
            out = train(args)
    except (RankError, FasttError, Exception) as e:  # noqa: BLE001 - every failure ends the job, named
        lost = isinstance(e, RuntimeError) and ("gloo" in str(e) or "NCCL" in str(e))  # a barrier lost a peer
        msg = (str(e) if isinstance(e, RankError)
               else record_failure(f"rank {rank}: {type(e).__name__}: {e}", lost))
        print(f"fastt: {msg}", file=sys.stderr, flush=True)
        if os.environ.get("FASTT_DEBUG") == "1":  # as the fastt command: the traceback too
            traceback.print_exc()
        said()
        await_reports(25.0 if rank == 0 else 5.0)  # rank 0 may host the store the others read
        os._exit(1)
    if out is not None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f)
        print(json.dumps(out) if args.json else format_run(out), flush=True)
    stop_heartbeat()
    dist.barrier()  # no rank tears down its connections while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
