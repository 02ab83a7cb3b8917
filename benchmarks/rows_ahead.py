"""One process's rows, taken a step ahead or not: rank 0's time to take the other rank's rows of the batch
(`DistributedStep._fed`) and the whole step, with rank 0's receive of the next step's rows posted during this
step (`_Ahead`, now) and posted at the step's start (as before 2026-12-07), each in a loop without barriers and
timed from a barrier before each step, beside plain eager on rank 0. Two torchrun ranks in a private network
namespace whose loopback is capped at RATE; the ways alternate within one run, medians of medians.

Usage (root, unshare and tc, as `fastt run --network`):
  .venv/bin/python benchmarks/rows_ahead.py --model dlrm --rate 1gbit --steps 100      # about a minute
  .venv/bin/python benchmarks/rows_ahead.py --model resnet50 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ["at-start, barriers", "ahead, barriers", "at-start", "ahead", "eager"]


def rank_main(model_name: str, steps: int, repeats: int) -> None:
    """One rank's part: the one-process plan, every way in turn, `repeats` times."""
    import torch
    import torch.distributed as dist

    import fastt
    import fastt.runtime.distributed.step as S
    from fastt.runtime.distributed import parallelize_distributed, rank_cluster
    from fastt.runtime.shards import shard_of
    from fastt.workload import load_workload

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, model, loss_fn, opt, inputs = load_workload(model_name, "test", None, "sgd")
    cl = rank_cluster()
    g = fastt.capture(model, loss_fn, opt, inputs)
    step = parallelize_distributed(model, loss_fn, opt, inputs, strategy=fastt.plan(g, cl, "single"), cl=cl)
    shard, whole = shard_of(inputs, rank, world), [x.clone() for x in inputs]

    ahead = (S._Ahead.posted, S._Ahead.post_next, S._Ahead.__dict__["tag"])

    kept: dict = {}  # one buffer per direction, kept from step to step as `Buffers` keeps it

    def at_start(self, group, src, nbytes):  # the receive posted when the step begins, gloo's default tag
        buf = kept.setdefault((src, nbytes), torch.empty(nbytes, dtype=torch.uint8))
        return buf, dist.irecv(buf, src, group=group), None

    before = (at_start, lambda self, group, src, buf, now: None, staticmethod(lambda nbytes: 0))
    fed: list[float] = []
    taking = step._fed

    def timed_fed(*a, **k):
        t = time.perf_counter()
        out = taking(*a, **k)
        fed.append(time.perf_counter() - t)
        return out

    step._fed = timed_fed
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    feds: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(repeats):
        for way in WAYS:
            S._Ahead.posted, S._Ahead.post_next, S._Ahead.tag = before if way.startswith("at-start") else ahead
            fed.clear()
            per: list[float] = []
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                if way.endswith("barriers"):
                    dist.barrier()
                    t1 = time.perf_counter()
                    step(*shard)
                    per.append(time.perf_counter() - t1)
                elif way != "eager":
                    step(*shard)
                elif rank == 0:
                    step.eager(whole)
            dist.barrier()
            times[way].append(statistics.median(per) if per else (time.perf_counter() - t0) / steps)
            if fed:
                feds[way].append(statistics.median(fed))
    if rank == 0:
        print(f"{model_name}: ms a step (rank 0's time to take the rows)")
        for way in WAYS:
            took = f" ({statistics.median(feds[way]) * 1e3:.2f})" if feds[way] else ""
            print(f"  {way:20s} {statistics.median(times[way]) * 1e3:8.2f}{took}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dlrm")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # torchrun's ranks
    a = ap.parse_args()
    if a.rank:
        rank_main(a.model, a.steps, a.repeats)
        return
    sys.path.insert(0, str(ROOT / "src"))
    from fastt import netns

    if why := netns.unavailable():
        raise SystemExit(f"benchmarks/rows_ahead.py: cannot make a capped network namespace: {why}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--rank", "--model", a.model, "--steps", str(a.steps), "--repeats", str(a.repeats)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(netns.capped(netns.network(a.rate), cmd), env=env, capture_output=True, text=True,
                       check=False, timeout=1800)
    print(r.stdout, end="")
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])


if __name__ == "__main__":
    main()
