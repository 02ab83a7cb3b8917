"""The local runtime measured on this machine's CPU worker devices, as ratios in one run.

Three tables, written to out/runtime.json and docs/runtime.md (generated from the JSON by this script):
1. Speed on cpu:2 at batch sizes where the average op takes over 100 µs: `fastt` (tuned while training, FastT's
   loop) against one device, data parallelism and plain eager PyTorch using both cores.
2. Simulated vs measured iteration time for `fastt`, `dp` and `single` on every zoo model at test size.
3. Runtime overhead on one device (cpu:1, all cores) against plain eager PyTorch with the same thread count, and
   the parts of it spent each call reading the hyperparameters from the param groups, and checking that the
   model, optimizer and batch are what the step was captured for.
4. Peak memory per device on cpu:2 for `single`, `dp` and `fastt`'s own plan on every zoo model at test size:
   measured in a real step (`fastt.runtime.memory`) beside the simulator's.
Plus the machine's ceiling for two worker devices: one device's step alone vs two copies of it at once.

Usage:
  .venv/bin/python benchmarks/runtime.py            # everything (about 45 minutes on 2 cores)
  .venv/bin/python benchmarks/runtime.py --only memory   # the memory table alone (about 20 minutes)
  .venv/bin/python benchmarks/runtime.py --small    # what CI runs: small models, few steps, no doc
  .venv/bin/python benchmarks/runtime.py --render   # only rewrite docs/runtime.md from out/runtime.json
  --out DIR: the folder the JSON is written to and read from (default out/)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from fastt import guards, zoo
from fastt.capture import hyper_values
from fastt.runtime import parallelize
from fastt.runtime.bench import run_planners
from fastt.runtime.memory import measured_peaks
from fastt.runtime.programs import release_points
from fastt.runtime.reference import batch_like, eager_step
from fastt.simulate import simulate_plan

ROOT = Path(__file__).resolve().parent.parent
RECURRENT = ("rnnlm", "gnmt")
# Batch sizes where the average op of the step takes over 100 µs on one worker device here.
SPEED = {"vgg19": 64, "resnet50": 64, "inception_v3": 128, "transformer": 32, "bert-base": 32}


def make(name: str, batch: int | None):
    def build() -> tuple:
        torch.manual_seed(0)
        w = zoo.get(name, "test", batch=batch, dropout=False)
        return name, w.model, w.loss_fn, w.optimizer, w.example_inputs
    return build


def speed(models: dict[str, int], steps: int) -> list[dict]:
    rows = []
    for name, batch in models.items():
        print(f"speed: {name} batch {batch}", file=sys.stderr)
        with torch.backends.mkldnn.flags(enabled=name not in RECURRENT):
            out = run_planners(make(name, batch), "cpu:2", ["fastt", "dp", "single", "eager"], steps, check=False,
                               tune=True)
        t = {r["planner"]: r["measured_iteration_s"] for r in out["results"]}
        fastt = next(r for r in out["results"] if r["planner"] == "fastt")
        rows.append({"model": name, "batch": batch, "seconds": t, "tuning": fastt["tuning"], "trial": fastt["trial"],
                     "fastt_plan": {"replicas": fastt["replicas"], "splits": fastt["splits"]},
                     "fastt_over_single": t["single"] / t["fastt"], "fastt_over_dp": t["dp"] / t["fastt"],
                     "fastt_over_eager": t["eager"] / t["fastt"]})
    return rows


def accuracy(models: list[str], steps: int) -> list[dict]:
    rows = []
    for name in models:
        print(f"accuracy: {name}", file=sys.stderr)
        with torch.backends.mkldnn.flags(enabled=name not in RECURRENT):
            # fastt's own plan (no trial against DP): how well each planner's plan is simulated.
            out = run_planners(make(name, None), "cpu:2", ["fastt", "dp", "single"], steps, check=False,
                               trial=False)
        rows += [{"model": name, "planner": r["planner"], "measured_s": r["measured_iteration_s"],
                  "simulated_s": r["simulated_iteration_s"], "error": r["error"]} for r in out["results"]]
    return rows


def overhead(models: list[str], steps: int) -> list[dict]:
    """fastt's runtime with the one-device plan on cpu:1 against eager, steps interleaved, the fastest step of
    each (noise only adds time: a loaded machine stalls a step at its threads' barriers); `hyper_s`:
    what reading the hyperparameters from the param groups costs a call (`capture.hyper_values`), `check_s`:
    checking the model, optimizer and batch against what the step was captured for (`Step.check`, guards)."""
    rows = []
    for name in models:
        print(f"overhead: {name}", file=sys.stderr)
        ref, ours = zoo.get(name, dropout=False), zoo.get(name, dropout=False)
        with torch.backends.mkldnn.flags(enabled=name not in RECURRENT):
            step = parallelize(ours.model, ours.loss_fn, ours.optimizer, ours.example_inputs, "cpu:1", "single")
            eager, fastt, hyper, checks = [], [], [], []
            captured = step.lowered.step
            for i in range(steps + 2):
                b = batch_like(ref.example_inputs, i)
                t0 = time.perf_counter()
                eager_step(ref.model, ref.loss_fn, ref.optimizer, b)
                t1 = time.perf_counter()
                step(*b)
                t2 = time.perf_counter()
                hyper_values(ours.optimizer, captured.hyper_keys)
                t3 = time.perf_counter()
                captured.check(ours.model, ours.optimizer, b)
                guards.check(captured.gm, b)
                eager.append(t1 - t0)
                fastt.append(t2 - t1)
                hyper.append(t3 - t2)
                checks.append(time.perf_counter() - t3)
        e, f = min(eager[2:]), min(fastt[2:])
        rows.append({"model": name, "threads": torch.get_num_threads(), "eager_s": e, "fastt_s": f,
                     "overhead": f / e - 1, "hyper_s": min(hyper[2:]),
                     "check_s": min(checks[2:])})
    return rows


def memory(models: list[str]) -> list[dict]:
    """Each device's measured peak (`memory.measured_peaks`: residents, what its thread allocates, what it
    receives) beside the simulator's, for one device, data parallelism and fastt's own plan."""
    rows = []
    for name in models:
        print(f"memory: {name}", file=sys.stderr)
        for planner in ("single", "dp", "fastt"):
            w = zoo.get(name, dropout=False)
            with torch.backends.mkldnn.flags(enabled=name not in RECURRENT):
                step = parallelize(w.model, w.loss_fn, w.optimizer, w.example_inputs, "cpu:2", planner,
                                   trial=False)
                measured = measured_peaks(step, w.example_inputs)
            tl = simulate_plan(step.graph, step.strategy, step.cluster, step.costs,
                               release=release_points(step.lowered, step.placed.programs))
            used = [d for d, m in enumerate(measured) if m]
            rows.append({"model": name, "planner": planner, "replicas": step.strategy.replicas,
                         "splits": len(step.strategy.splits), "measured": [measured[d] for d in used],
                         "simulated": [int(tl.peak_memory_bytes[d]) for d in used]})
    return rows


def ceiling(models: dict[str, int], runs: int) -> list[dict]:
    """One worker device's share of a data-parallel step (half the batch, one thread) alone, and two at once:
    2 × alone / together is the most any plan on two worker devices can gain here."""
    rows = []
    for name, batch in models.items():
        copies = [zoo.get(name, "test", batch=batch // 2, dropout=False) for _ in range(2)]
        b = batch_like(copies[0].example_inputs, 0)

        def work(w: zoo.Workload, b: tuple = b) -> None:
            old = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for _ in range(runs):
                    eager_step(w.model, w.loss_fn, w.optimizer, b)
            finally:  # the main thread runs it too: the tables after this one use every core again
                torch.set_num_threads(old)
        for w in copies:
            work(w)  # warm-up
        t0 = time.perf_counter()
        work(copies[0])
        alone = time.perf_counter() - t0
        threads = [threading.Thread(target=work, args=(w,)) for w in copies]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = time.perf_counter() - t0
        rows.append({"model": name, "batch_per_device": batch // 2, "alone_s": alone / runs,
                     "together_s": together / runs, "best_speedup": 2 * alone / together})
    return rows


def render(out: dict, cmd: str) -> str:
    ms = 1e3
    lines = ["# Runtime benchmarks", "", (f"Generated by `{cmd}` from `out/runtime.json` "
             f"({out['machine']}). Times are medians over the steps, in ms; ratios come from one run."
             + (f" Rerun on their own later (`--only`): {', '.join(out['rerun'])}." if out.get("rerun") else "")),
             "",
             "## Speed on cpu:2 (two worker devices, one core each)", "",
             ("`fastt` races data parallelism against one device with every core (3 steps each), then, where DP "
             "won, tunes its plan during the first steps (FastT's loop); its time is the median after tuning. "
             "`eager` is plain PyTorch on both cores (intra-op threads)."), "",
             ("| model | batch | fastt | dp | single | eager (2 threads) | fastt vs single | vs dp | vs eager | "
             "fastt's plan |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["speed"]:
        s = r["seconds"]
        plan = f"{r['fastt_plan']['replicas']} replica(s), {r['fastt_plan']['splits']} split(s)"
        if (r.get("trial") or {}).get("kept") == "single":
            plan = "one device, every core (the race)"
        lines.append(f"| {r['model']} | {r['batch']} | {s['fastt'] * ms:.1f} | {s['dp'] * ms:.1f} | "
                     f"{s['single'] * ms:.1f} | {s['eager'] * ms:.1f} | {r['fastt_over_single']:.2f}x | "
                     f"{r['fastt_over_dp']:.2f}x | {r['fastt_over_eager']:.2f}x | {plan} |")
    lines += ["", "### The machine's ceiling for two worker devices", "",
              ("Half of the batch on one thread, alone and with a second copy running at the same time "
              "(plain eager steps). Two devices can gain at most `2 × alone / together` over one."), "",
              "| model | batch per device | alone | together | best speedup of 2 devices |", "|---|---|---|---|---|"]
    for r in out["ceiling"]:
        lines.append(f"| {r['model']} | {r['batch_per_device']} | {r['alone_s'] * ms:.1f} | "
                     f"{r['together_s'] * ms:.1f} | {r['best_speedup']:.2f}x |")
    errors = [abs(r["error"]) for r in out["accuracy"]]
    lines += ["", "## Simulated vs measured iteration time (cpu:2, test size)", "",
              (f"Median absolute error over {len(errors)} runs: **{statistics.median(errors):.0%}**. "
              "Op times are measured before planning with every worker device busy (two copies of the step at "
              "once) unless the plan uses one device; without tuning, nothing is refitted. `fastt` is its own "
              "plan, not raced against data parallelism first (`trial=False`)."), "",
              "| model | planner | measured | simulated | error |", "|---|---|---|---|---|"]
    for r in out["accuracy"]:
        lines.append(f"| {r['model']} | {r['planner']} | {r['measured_s'] * ms:.1f} | {r['simulated_s'] * ms:.1f} "
                     f"| {r['error']:+.0%} |")
    over = [r["overhead"] for r in out["overhead"]]
    hyper = [r["hyper_s"] / r["fastt_s"] for r in out["overhead"] if "hyper_s" in r]
    checks = [r["check_s"] / r["fastt_s"] for r in out["overhead"] if "check_s" in r]
    lines += ["", "## Runtime overhead on one device", "",
              (f"The one-device plan on cpu:1 against plain eager PyTorch with the same threads, steps interleaved, "
               "the fastest of each (noise only adds time; other tables give medians). "
              f"Median overhead: **{statistics.median(over):+.1%}**."
               + (f" Of a step, reading the hyperparameters from the param groups takes at most "
                  f"**{max(hyper):.3%}**, and checking that the model, optimizer and batch are what the step was "
                  f"captured for at most **{max(checks):.2%}** (median {statistics.median(checks):.2%})."
                  if hyper else "")), "",
              "| model | threads | eager | fastt | overhead | hyperparameters | checks |",
              "|---|---|---|---|---|---|---|"]
    for r in out["overhead"]:
        parts = [f"{r[k] * ms:.3f} ({r[k] / r['fastt_s']:.2%})" if k in r else "-" for k in ("hyper_s", "check_s")]
        lines.append(f"| {r['model']} | {r['threads']} | {r['eager_s'] * ms:.1f} | {r['fastt_s'] * ms:.1f} | "
                     f"{r['overhead']:+.1%} | {' | '.join(parts)} |")
    if out.get("memory"):
        ratios = [s / m for r in out["memory"] for m, s in zip(r["measured"], r["simulated"])]
        lines += ["", "## Peak memory per device (cpu:2, test size)", "",
                  ("Measured in one real step (`fastt.runtime.memory`): a device's residents, the batch it is "
                   "given, what its thread allocates, what it receives and the allreduce means its replicas read, "
                   "as a GPU would hold them (worker devices share the process's memory, so this is counted, not "
                   "read off an allocator). Under data parallelism the measured peak varies from run to run with "
                   "how far apart the devices run; the simulator's is the worst case (docs/design.md). "
                   f"Simulated over measured, per device: median **{statistics.median(ratios):.2f}**, from "
                   f"{min(ratios):.2f} to {max(ratios):.2f}; issue 17 asks for 1.00 to 1.25."), "",
                  "| model | planner | plan | measured MB | simulated MB | simulated / measured |",
                  "|---|---|---|---|---|---|"]
        for r in out["memory"]:
            mb = lambda xs: " ".join(f"{x / 1e6:.1f}" for x in xs)
            rel = " ".join(f"{s / m:.2f}" for m, s in zip(r["measured"], r["simulated"]))
            lines.append(f"| {r['model']} | {r['planner']} | {r['replicas']} replica(s), {r['splits']} split(s) | "
                         f"{mb(r['measured'])} | {mb(r['simulated'])} | {rel} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--render", action="store_true", help="only rewrite docs/runtime.md from out/runtime.json")
    ap.add_argument("--only", choices=["accuracy", "overhead", "memory"],
                    help="rerun this table alone (e.g. after a simulator change), keeping the others from the JSON")
    ap.add_argument("--out", type=Path, default=ROOT / "out", help="folder for the JSON (default: out/)")
    a = ap.parse_args()
    cmd = "python benchmarks/runtime.py"
    path = a.out / ("runtime-small.json" if a.small else "runtime.json")
    if (a.only or a.render) and not path.is_file():
        sys.exit(f"{path} is missing: run `{cmd}` (everything) first")
    if a.only:
        out = json.loads(path.read_text())
        models = ["mlp", "lenet"] if a.small else list(zoo.DISTINCT)
        out[a.only] = (accuracy(models, 2 if a.small else 10) if a.only == "accuracy" else
                       memory(models) if a.only == "memory" else
                       overhead([m for m in models if m != "gnmt"], 4 if a.small else 20))
        out["rerun"] = sorted({*out.get("rerun", []), a.only})
        path.write_text(json.dumps(out, indent=1))
    elif not a.render:
        speed_models = {"mlp": 64, "lenet": 64} if a.small else SPEED
        zoo_models = ["mlp", "lenet"] if a.small else list(zoo.DISTINCT)
        steps = 4 if a.small else 20
        out = {"machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}", "rerun": [],
               "speed": speed(speed_models, steps + 12), "ceiling": ceiling(speed_models, 2 if a.small else 5),
               "accuracy": accuracy(zoo_models, steps // 2),
               "overhead": overhead(["mlp", "lenet"] if a.small else [m for m in zoo.DISTINCT if m != "gnmt"],
                                    steps),
               "memory": memory(zoo_models)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
    out = json.loads(path.read_text())
    if not a.small:
        (ROOT / "docs" / "runtime.md").write_text(render(out, cmd))
    print(json.dumps({"median_abs_error": statistics.median(abs(r["error"]) for r in out["accuracy"]),
                      "median_overhead": statistics.median(r["overhead"] for r in out["overhead"]),
                      "fastt_over_single": {r["model"]: r["fastt_over_single"] for r in out["speed"]}}))


if __name__ == "__main__":
    main()
