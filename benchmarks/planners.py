"""Every planner on every zoo model at paper size, on several clusters, judged by the simulator.

Writes out/planners.json and docs/benchmarks.md (the table there is generated from the JSON by this script).
Usage:
  .venv/bin/python benchmarks/planners.py            # the full table (tens of minutes on 2 cores)
  .venv/bin/python benchmarks/planners.py --small    # what CI runs: two small models, two clusters, no doc
  --out DIR: the folder the JSON is written to (and --render reads it from); default out/
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

import fastt
from fastt import zoo
from fastt.errors import FasttError
from fastt.plan import PLANNERS
from fastt.plan.portfolio import OPTIONAL

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = "2xV100,4xV100,8xV100,8xA100-pcie,2x4xV100"


def run(models: list[str], clusters: list[str], planners: list[str], size: str) -> list[dict]:
    rows = []
    bar = tqdm(total=len(models) * len(clusters) * len(planners), file=sys.stderr)
    for m in models:
        w = zoo.get(m, size)
        graph = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=m)
        for c in clusters:
            cl = fastt.cluster(c)
            for p in planners:
                bar.set_postfix_str(f"{m} {c} {p}")
                t0 = time.perf_counter()
                try:
                    strategy = fastt.plan(graph, cl, p)
                except FasttError:
                    if p not in OPTIONAL:
                        raise
                    bar.update()  # an expert plan that does not apply here (no tables, ...): "-" in the table
                    continue
                plan_s = time.perf_counter() - t0
                tl = fastt.simulate(graph, strategy, cl)
                rows.append({"model": m, "cluster": c, "planner": p, "batch": graph.batch,
                             "iteration_s": tl.iteration_s, "lower_bound_s": tl.lower_bound_s, "plan_s": plan_s,
                             "fits": bool(tl.fits), "splits": len(strategy.splits),
                             "peak_memory_bytes": [int(b) for b in tl.peak_memory_bytes]})
                bar.update()
    bar.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    """Speedups over DP per case, fastt against the best other planner, and the geometric mean."""
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["model"], r["cluster"]), {})[r["planner"]] = r
    speedups, worse = [], []
    for (m, c), by in cases.items():
        if "fastt" in by and "dp" in by:
            speedups.append(by["dp"]["iteration_s"] / by["fastt"]["iteration_s"])
        others = [r for p, r in by.items() if p != "fastt" and r["fits"]]
        if "fastt" in by and others and by["fastt"]["iteration_s"] > min(r["iteration_s"] for r in others):
            best = min(others, key=lambda r: r["iteration_s"])
            worse.append(f"{m} on {c}: fastt {by['fastt']['iteration_s'] * 1e3:.1f} ms, "
                         f"{best['planner']} {best['iteration_s'] * 1e3:.1f} ms")
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups)) if speedups else None
    return {"geomean_speedup_over_dp": geo, "cases": len(cases), "fastt_not_best": worse}


def render(rows: list[dict], summary: dict, cmd: str) -> str:
    planners = list(dict.fromkeys(r["planner"] for r in rows))
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["model"], r["cluster"]), {})[r["planner"]] = r
    head = "| model | cluster | batch | " + " | ".join(planners) + " | fastt vs DP | fastt plan s | splits |"
    lines = [head, "|" + "---|" * (len(planners) + 6)]
    for (m, c), by in cases.items():
        cells = [f"{by[p]['iteration_s'] * 1e3:.1f}{'' if by[p]['fits'] else ' (OOM)'}" if p in by else "-"
                 for p in planners]
        f, dp = by.get("fastt"), by.get("dp")
        sp = f"{dp['iteration_s'] / f['iteration_s']:.2f}x" if f and dp else "-"
        tail = f" | {sp} | {f['plan_s']:.1f} | {f['splits']} |" if f else " | - | - | - |"
        lines.append(f"| {m} | {c} | {next(iter(by.values()))['batch']} | " + " | ".join(cells) + tail)
    geo = summary["geomean_speedup_over_dp"]
    geo = f"{geo:.2f}x" if geo else "- (needs the fastt and dp planners)"
    worse = "\n".join(f"- {w}" for w in summary["fastt_not_best"]) or "- none: fastt is the fastest on every case."
    split_cases = [f"{m} on {c}" for (m, c), by in cases.items() if by.get("fastt", {}).get("splits")]
    dp_only = [f"{m} on {c}" for (m, c), by in cases.items()
               if by.get("dp", {}).get("fits") and not any(r["fits"] for p, r in by.items() if p not in ("dp", "fastt"))]
    dp_misfit = [f"{m} on {c}" for (m, c), by in cases.items() if not by.get("dp", {}).get("fits", True)]
    slow = [f"{m} on {c} ({by['fastt']['plan_s']:.0f} s)" for (m, c), by in cases.items()
            if by.get("fastt", {}).get("plan_s", 0) > 10]
    notes = f"""## Reading the table

- `fastt` is OS-DPOS started from the best of a portfolio (DPOS, data parallelism, DPOS on the data-parallel
  graph, one device, HEFT, m-ETF, m-SCT, m-TOPO: see `src/fastt/plan/osdpos.py`), so it is never slower than
  those by construction; the `dpos` column is FastT's DPOS alone.
- Its gains over DP come from cases where data parallelism is a poor plan in this cost model: tiny steps where
  launch and allreduce latency dominate (lenet), and models whose parameters dwarf their compute (mlp: 150 M
  parameters for a 256-sample batch), where a model-parallel schedule avoids the allreduce. Elsewhere DP is
  already close to the lower bound (on 4xV100, 1.06-1.16x of it for vgg19, inception_v3, transformer and
  bert-base: `fastt compare --model vgg19,inception_v3,transformer,bert-base --cluster 4xV100`, column /LB):
  gradients are allreduced while the backward pass runs, so there is little left to win, and the geometric mean
  stays below FastT's reported 1.30x. FastT measured against TensorFlow 1.x's data parallelism; ours is
  simulated DDP-style DP with ideal overlap.
- The split loop (steps 2-4 of OS-DPOS) kept a split in {len(split_cases)} case(s): {", ".join(split_cases) or "none"}.
  Starting from the data-parallel graph every device is busy with its own replica, so splitting one
  critical-path op across devices only moves work; FastT stops at the first op no split helps.
- Memory: cases where only data parallelism fits (every model-parallel plan runs out of memory):
  {", ".join(dp_only) or "none"}. Cases where DP does not fit: {", ".join(dp_misfit) or "none"} — so the target
  "DP does not fit at some batch and `fastt` finds a plan that fits and beats DP's largest batch" is not shown
  by this table.
- Planning time: `fastt`'s search budget is 6 s, but capturing the step again at batch/N for data parallelism
  is not bounded by it: {", ".join(slow) or "no case"} took longer than 10 s in all.
"""
    return f"""# Planner benchmarks

Generated by `{cmd}` from `out/planners.json` (simulated iteration times in ms, roofline costs; "(OOM)": the plan
does not fit in device memory). Rerun the command to refresh.

Geometric-mean speedup of `fastt` over data parallelism across {summary['cases']} cases: **{geo}**.

Cases where `fastt` is not the fastest plan that fits:
{worse}

{chr(10).join(lines)}

{notes}"""


def main() -> None:
    ap = argparse.ArgumentParser()
    what = ap.add_mutually_exclusive_group()  # --small never writes the doc, --render only writes it
    what.add_argument("--small", action="store_true")
    what.add_argument("--render", action="store_true", help="only rewrite docs/benchmarks.md from planners.json")
    ap.add_argument("--out", type=Path, default=ROOT / "out", help="folder for the JSON (default: out/)")
    ap.add_argument("--models", default=",".join(zoo.NAMES))
    ap.add_argument("--clusters", default=CLUSTERS)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    a = ap.parse_args()
    if a.render:
        d = json.loads((a.out / "planners.json").read_text())
        (ROOT / "docs/benchmarks.md").write_text(render(d["rows"], d["summary"], "benchmarks/planners.py"))
        return
    if a.small:
        models, clusters, size = ["mlp", "lenet"], ["2xV100", "4xV100"], "test"
    else:
        models, clusters, size = a.models.split(","), a.clusters.split(","), "paper"
    rows = run(models, clusters, a.planners.split(","), size)
    summary = summarize(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / ("planners-small.json" if a.small else "planners.json")
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if not a.small:
        (ROOT / "docs/benchmarks.md").write_text(render(rows, summary, " ".join(["benchmarks/planners.py", *sys.argv[1:]])))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
