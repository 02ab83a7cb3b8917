"""fastt, data parallelism, OS-DPOS, the spread search and the expert planners on the zoo at paper size, on the
clusters where DP waits on the network (COMM_BOUND) and on NVLink nodes (NVLINK), judged by the simulator.

Writes out/planners.json and docs/benchmarks.md (the table there is generated from the JSON by this script).
Usage:
  .venv/bin/python benchmarks/planners.py            # the full tables (about an hour on 2 cores)
  .venv/bin/python benchmarks/planners.py --small    # what CI runs: two small models, two clusters, no doc
  --out DIR: the folder the JSON is written to (and --render reads it from); default out/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import fastt
from fastt import zoo
from fastt.errors import FasttError
from fastt.layers import where
from fastt.plan.portfolio import OPTIONAL
from fastt.precision import NAMES, dtype_of
from fastt.simulate import human_bytes, inter_node_bytes
from fastt.strategy import Strategy

ROOT = Path(__file__).resolve().parent.parent
COMM_BOUND = ("8xA100-pcie", "2x4xV100", "2x4xV100-pcie", "2x4xA100@25Gbps", "4x1xV100@10Gbps")
NVLINK = ("4xV100", "8xV100", "8xA100")
MODELS = ("lenet", "mlp", "alexnet", "vgg19", "inception_v3", "resnet50", "transformer", "bert-base", "bert-large",
          "gpt2", "gnmt", "dlrm")
PLANNERS_SHOWN = ("fastt", "dp", "os-dpos", "search", "owt", "table-wise", "pipeline", "megatron", "zero",
                  "one-node")
TOYS = ("lenet", "mlp")  # left out of the means: tiny steps where launch and allreduce latency are all there is


def run(models: list[str], clusters: list[str], planners: list[str], size: str,
        precision: str = "fp32") -> list[dict]:
    rows = []
    bar = tqdm(total=len(models) * len(clusters) * len(planners), file=sys.stderr)
    autocast = dtype_of(precision)
    for m in models:
        w = zoo.get(m, size)
        graph = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=m, autocast=autocast)
        for c in clusters:
            cl = fastt.cluster(c)
            if autocast is torch.bfloat16 and any(d.bf16_flops == 0 for d in cl.devices):
                bar.update(len(planners))  # no bf16 tensor cores (V100): fastt refuses bf16 there
                continue
            plans = {}
            for p in planners:
                bar.set_postfix_str(f"{m} {c} {p}")
                if p == "fastt":
                    forget_steps(graph)
                t0 = time.perf_counter()
                try:
                    strategy = fastt.plan(graph, cl, p)
                except FasttError:
                    if p not in OPTIONAL:
                        raise
                    bar.update()  # an expert plan that does not apply here (no tables, ...): "-" in the table
                    continue
                plan_s = time.perf_counter() - t0
                plans[p] = strategy
                tl = fastt.simulate(graph, strategy, cl)
                rows.append({"model": m, "cluster": c, "planner": p, "batch": graph.batch,
                             "iteration_s": tl.iteration_s, "lower_bound_s": tl.lower_bound_s, "plan_s": plan_s,
                             "fits": bool(tl.fits), "splits": len(strategy.splits),
                             "peak_memory_bytes": [int(b) for b in tl.peak_memory_bytes],
                             "inter_node_bytes": inter_node_bytes(tl, cl),
                             "busy_s": list(tl.busy_s), "link_busy_s": list(tl.link_busy_s)})
                if p == "fastt":  # the plan in its own words: which layers went where
                    rows[-1]["words"] = where(graph, strategy.holders, [d.node for d in cl.devices],
                                              strategy.sharded, strategy.chained)
                bar.update()
            fastt_row = next((r for r in rows[::-1] if r["model"] == m and r["cluster"] == c and r["planner"] == "fastt"), None)
            if fastt_row is not None:
                fastt_row["source"] = source(plans)
    bar.close()
    return rows


def forget_steps(graph: fastt.OpGraph) -> None:
    """Drop the steps at other batches that earlier plans made (derived or captured again), so that fastt's
    planning time counts them, as a user's first plan of a captured step does."""
    for made in (graph.recapture, getattr(graph.recapture, "traced", None)):
        if made is not None:
            made.cache_clear()
    graph.__dict__.pop("_replicated", None)


def source(plans: dict[str, Strategy]) -> str:
    """Whose plan fastt kept: the planner that made the same plan; that plan with its replicated updates
    sharded (the portfolio's `with_sharded_updates`); else fastt's own variant of one, its splits chained."""
    def maker(plan: Strategy) -> str | None:
        return next((p for p, s in plans.items() if p != "fastt" and dataclasses.replace(s, planner="fastt") == plan),
                    None)

    f = plans["fastt"]
    if (p := maker(f)) is not None:
        return p
    if f.sharded and (p := maker(dataclasses.replace(f, sharded=()))) is not None:
        return p + "+sharded"
    return "chained" if f.chained else "other"


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: list[dict]) -> dict:
    """Speedups over DP per case and their geometric means per cluster set (toys left out), and the cases where
    fastt is slower than another planner's plan that fits."""
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["model"], r["cluster"]), {})[r["planner"]] = r
    speedups: dict[str, list[float]] = {"comm-bound": [], "nvlink": [], "other": []}
    worse = []
    for (m, c), by in cases.items():
        if "fastt" in by and "dp" in by and m not in TOYS:
            group = "comm-bound" if c in COMM_BOUND else "nvlink" if c in NVLINK else "other"
            speedups[group].append(by["dp"]["iteration_s"] / by["fastt"]["iteration_s"])
        others = [r for p, r in by.items() if p != "fastt" and r["fits"]]
        if "fastt" in by and others and by["fastt"]["iteration_s"] > min(r["iteration_s"] for r in others) * (1 + 1e-9):
            best = min(others, key=lambda r: r["iteration_s"])
            worse.append(f"{m} on {c}: fastt {by['fastt']['iteration_s'] * 1e3:.1f} ms, "
                         f"{best['planner']} {best['iteration_s'] * 1e3:.1f} ms")
    return {"geomean_speedup_over_dp": {k: _geomean(v) for k, v in speedups.items() if v},
            "cases": len(cases), "fastt_not_best": worse}


def render(rows: list[dict], summary: dict, cmd: str) -> str:
    planners = list(dict.fromkeys(r["planner"] for r in rows))
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["model"], r["cluster"]), {})[r["planner"]] = r
    head = ("| model | cluster | batch | " + " | ".join(planners)
            + " | fastt vs DP | /LB | binds | fastt's | fastt plan s |")
    lines = [head, "|" + "---|" * (len(planners) + 8)]
    for (m, c), by in cases.items():
        cells = [f"{by[p]['iteration_s'] * 1e3:.1f}{'' if by[p]['fits'] else ' (OOM)'}" if p in by else "-"
                 for p in planners]
        f, dp = by.get("fastt"), by.get("dp")
        sp = f"{dp['iteration_s'] / f['iteration_s']:.2f}x" if f and dp else "-"
        tail = (f" | {sp} | {f['iteration_s'] / f['lower_bound_s']:.2f} | {binds(f)} | {f.get('source', '-')} | "
                f"{f['plan_s']:.1f} |" if f else " | - | - | - | - | - |")
        lines.append(f"| {m} | {c} | {next(iter(by.values()))['batch']} | " + " | ".join(cells) + tail)
    geo = ", ".join(f"{k} clusters **{v:.2f}x**" for k, v in summary["geomean_speedup_over_dp"].items()) or "-"
    worse = "\n".join(f"- {w}" for w in summary["fastt_not_best"]) or "- none: fastt is the fastest on every case."
    won = {}
    for (m, c), by in cases.items():
        f = by.get("fastt")
        if f and f.get("source"):
            won[f["source"]] = won.get(f["source"], 0) + 1
    slow = [f"{m} on {c} ({by['fastt']['plan_s']:.0f} s)" for (m, c), by in cases.items()
            if by.get("fastt", {}).get("plan_s", 0) > 10]
    misfit = [f"{m} on {c}" for (m, c), by in cases.items() if not by.get("dp", {}).get("fits", True)]
    left_out = [m for m in MODELS if m not in {m for m, _ in cases}]
    notes = f"""## Reading the table

- `fastt` is the fastest simulated of the expert plans that apply (`owt`, `table-wise`, `pipeline`), data
  parallelism on one node (`one-node`: made where the compute a node's devices each run, n/m shards of the
  step at batch/n, is below DP's time: the link between nodes costs DP more than the other nodes gain it),
  the spread search's (`search`: a spread per layer, every device, a node's devices or one device, chosen on a linear cost
  model by local search and an ILP that HiGHS solves; docs/design.md, "The search") and OS-DPOS's (FastT's
  algorithm, `os-dpos`). A column is "-" where an expert plan does not apply (no embedding tables, one node...).
- Whose plan fastt kept, over the cases ("+sharded": that plan with its replicated updates sharded;
  "chained": a plan with chained splits, its best plan's chained or owt's large linear layers in parts over a node's
  devices (`megatron.held_in_parts`: vgg19, alexnet); "other": none of these): {", ".join(f"{k} {v}" for k, v in sorted(won.items())) or "-"}.
- /LB is fastt's time over the simulator's lower bound (the critical path with every op on its fastest device,
  or the total work spread evenly, whichever is larger): what is left to win, at most. "binds" says what keeps
  fastt's plan there, read off its simulated step: "link" where the busiest link is busy at least 80% of the
  step and more than any device, "compute" where the busiest device is (beside the devices' mean: where it is
  far below, the plan's work is uneven, or it runs work the bound counts once, such as updates on every
  replica), else "waits" (devices and links idle on each other: latency, the order, a pipeline's bubble).
- Cases where DP does not fit: {", ".join(misfit) or "none"}.
- Planning took longer than 10 s in: {", ".join(slow) or "no case"}{
    f" (of the models run; not run: {', '.join(left_out)})" if left_out else ""}.
- Simulated with roofline costs (GPU kernels at the fraction of peak their size reaches, `fastt.cost`); these plans run on the local and the distributed runtimes (tests/test_mixed.py,
  tests/test_search.py check that training with them equals eager PyTorch), but their speed on real GPUs has not
  been measured here (no GPU was lent).
"""
    return f"""# Planner benchmarks

Generated by `{cmd}` from `out/planners.json` (simulated iteration times in ms, roofline costs with GPU kernel efficiency; "(OOM)": the plan
does not fit in device memory). Rerun the command to refresh.

Geometric-mean speedup of `fastt` over data parallelism ({summary['cases']} cases; lenet and mlp left out): {geo}.

Cases where `fastt` is not the fastest plan that fits:
{worse}

{chr(10).join(lines)}

{notes}
{wins(cases)}"""


def binds(r: dict) -> str:
    """What binds a simulated step (the notes under the table)."""
    t = r["iteration_s"]
    if "busy_s" not in r or t <= 0:
        return "-"
    dev, link = max(r["busy_s"]) / t, max(r["link_busy_s"], default=0.0) / t
    mean = sum(r["busy_s"]) / len(r["busy_s"]) / t
    if link >= 0.8 and link > dev:
        return f"link {link:.0%}"
    if dev >= 0.8:
        return f"compute {dev:.0%} (mean {mean:.0%})"
    return f"waits (device {dev:.0%}, link {link:.0%})"


WORDS = 6  # runs of layers shown per plan


def wins(cases: dict[tuple[str, str], dict[str, dict]]) -> str:
    """Where fastt beats data parallelism by 1.3x or more (toys left out), its plan in its own words: which
    layers are held where, and the bytes it moves between nodes against DP's."""
    out = []
    for (m, c), by in cases.items():
        f, dp = by.get("fastt"), by.get("dp")
        if m in TOYS or not f or not dp or "words" not in f or dp["iteration_s"] < 1.3 * f["iteration_s"]:
            continue
        runs = [f"{layers}: {place}" for layers, place in f["words"]]
        shown = "; ".join(runs[:WORDS]) + (f"; … ({len(runs) - WORDS} more runs)" if len(runs) > WORDS else "")
        split = f", {f['splits']} ops split" if f["splits"] else ""
        out.append(f"- {m} on {c}, {dp['iteration_s'] / f['iteration_s']:.2f}x ({f.get('source', '-')}{split}; "
                   f"between nodes {human_bytes(f['inter_node_bytes'])} a step against DP's "
                   f"{human_bytes(dp['inter_node_bytes'])}): {shown}.")
    if not out:
        return ""
    return ("## Where fastt wins, in its plans' words\n\nEach case where fastt's plan is at least 1.3x faster "
            "than data parallelism (lenet and mlp left out): the runs of consecutive layers held alike "
            "(`fastt.layers.where`, as `fastt compare` prints them), whose plan fastt kept, and what the step moves "
            "between nodes. Layers held once or on one node need no allreduce across the slow link; a layer "
            "\"tensor-parallel\" has its weight in shares.\n\n" + "\n".join(out) + "\n")


def write_doc(doc: Path, text: str, precision: str) -> None:
    """docs/benchmarks.md: the fp32 tables are the file, each other precision's a block in it (between
    `<!-- planners-bf16 -->` and `<!-- /planners-bf16 -->`), and so is benchmarks/precision.py's; a rewrite
    keeps the blocks it does not write."""
    old = doc.read_text() if doc.is_file() else ""
    blocks = {m[1]: m[0] for m in re.finditer(r"<!-- ([\w-]+)[^>]*-->.*?<!-- /\1 -->", old, re.DOTALL)}
    if precision != "fp32":
        key = f"planners-{precision}"
        body = text.replace("# Planner benchmarks", f"## Planner benchmarks in {precision}", 1)
        body = body.replace("## Reading the table", "### Reading the table", 1)
        body = body.replace("## Where fastt wins", "### Where fastt wins", 1)
        left_out = " (the V100 clusters are left out: no bf16 tensor cores)" if precision == "bf16" else ""
        body = body.replace("`out/planners.json`", f"`out/planners-{precision}.json`{left_out}", 1)
        blocks[key] = f"<!-- {key} -->\n{body.rstrip()}\n<!-- /{key} -->"
        text = old[:old.index("<!-- ")].rstrip("\n") + "\n" if "<!-- " in old else old
    doc.write_text(text.rstrip("\n") + "\n\n" + "\n\n".join(blocks.values()) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    what = ap.add_mutually_exclusive_group()  # --small never writes the doc, --render only writes it
    what.add_argument("--small", action="store_true")
    what.add_argument("--render", action="store_true", help="only rewrite docs/benchmarks.md from planners.json")
    ap.add_argument("--out", type=Path, default=ROOT / "out", help="folder for the JSON (default: out/)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clusters", default=",".join(COMM_BOUND + NVLINK))
    ap.add_argument("--planners", default=",".join(PLANNERS_SHOWN))
    ap.add_argument("--precision", default="fp32", choices=tuple(NAMES),
                    help="capture under torch.autocast (bf16: V100 clusters are left out); not fp32: "
                         "out/planners-PRECISION.json and its own table in docs/benchmarks.md")
    a = ap.parse_args()
    doc = ROOT / "docs/benchmarks.md"
    name = "planners.json" if a.precision == "fp32" else f"planners-{a.precision}.json"
    if a.render:
        d = json.loads((a.out / name).read_text())
        write_doc(doc, render(d["rows"], d["summary"], "benchmarks/planners.py"), a.precision)
        return
    if a.small:
        models, clusters, size = ["mlp", "lenet"], ["2xV100", "4xV100"], "test"
    else:
        models, clusters, size = a.models.split(","), a.clusters.split(","), "paper"
    rows = run(models, clusters, a.planners.split(","), size, a.precision)
    summary = summarize(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / ("planners-small.json" if a.small else name)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if not a.small:
        write_doc(doc, render(rows, summary, " ".join(["benchmarks/planners.py", *sys.argv[1:]])), a.precision)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
