"""Where a step's time goes: fastt's runtime against plain eager PyTorch on the same device, timed, then under
cProfile (the host's Python) and torch.profiler (aten calls on the host, kernels on the GPU).

    python benchmarks/gpu_profile.py --model inception_v3 --devices cuda:0 --planner single

Prints the median step of each, the top functions by own time, and the profiler's tables; with --out DIR it
also writes each one's profiler trace (chrome://tracing, gzipped) and the cProfile statistics there."""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import pstats
import shutil
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fastt.cluster import cluster, torch_device
from fastt.runtime import local
from fastt.runtime.reference import batch_like, eager_step
from fastt.runtime.step import parallelize
from fastt.runtime.trial import timed
from fastt.workload import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="inception_v3")
    ap.add_argument("--size", default="test")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--planner", default="single")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    home = torch.device(torch_device(cluster(a.devices).devices[0]))
    cuda = home.type == "cuda"
    torch.manual_seed(0)
    _, model, loss_fn, opt, inputs = load_workload(a.model, a.size, a.batch, None)
    model, inputs = model.to(home), tuple(x.to(home) for x in inputs)
    batches = [tuple(x.to(home) for x in batch_like(inputs, i)) for i in range(a.steps)]
    step = parallelize(model, loss_fn, opt, inputs, a.devices, a.planner, trial=False)
    runs = {"eager": lambda *b: eager_step(model, loss_fn, opt, b), "fastt": step}
    for name, fn in runs.items():
        times = [timed(fn, *b) for b in batches]
        print(f"{name}: median step {1e3 * statistics.median(times[1:]):.1f} ms "
              f"(min {1e3 * min(times[1:]):.1f}) over {len(times) - 1} steps")
    print(f"fastt simulated: {1e3 * step.simulated_s:.1f} ms; aten calls in the step: "
          f"{step.graph.fx_nodes}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    # Up to Python 3.11 cProfile sees only the thread it was enabled on: the devices' threads get their own.
    # From 3.12 it sees every thread (sys.monitoring) and refuses a second profiler.
    threads: list[cProfile.Profile] = []
    device = local._Run.run_device

    def profiled(run: local._Run, d: int) -> None:
        threads.append(cProfile.Profile())
        threads[-1].runcall(device, run, d)

    if sys.version_info < (3, 12):
        local._Run.run_device = profiled
    for name, fn in runs.items():
        threads.clear()
        prof = cProfile.Profile()
        prof.enable()
        for b in batches[:3]:
            fn(*b)
        if cuda:
            torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, *threads, stream=text).sort_stats("tottime")
        stats.print_stats(a.rows)
        print(f"\n## cProfile, {name}, 3 steps, by own time, every thread\n{text.getvalue()}")
        if a.out:
            stats.dump_stats(a.out / f"{name}.pstats")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as p:
            for b in batches[:3]:
                fn(*b)
            if cuda:
                torch.cuda.synchronize()
        print(f"\n## torch.profiler, {name}, 3 steps, by host time\n"
              f"{p.key_averages().table(sort_by='self_cpu_time_total', row_limit=a.rows)}")
        if cuda:
            print(f"\n## torch.profiler, {name}, 3 steps, by GPU time\n"
                  f"{p.key_averages().table(sort_by='self_cuda_time_total', row_limit=a.rows)}")
        if a.out:
            trace = a.out / f"{name}.json"
            p.export_chrome_trace(str(trace))
            with trace.open("rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                shutil.copyfileobj(f, g)
            trace.unlink()


if __name__ == "__main__":
    main()
