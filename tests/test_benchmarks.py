"""The benchmark scripts run fresh at their small size (as CI does) into a temporary folder; what each wrote is
checked against the times it is computed from, and the docs' tables render from it."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_tune import kept_plan

from fastt.plan.portfolio import OPTIONAL

ROOT = Path(__file__).resolve().parent.parent
# The simulator's median |simulated - measured| / measured in one small run. The docs quote 9% (runtime) and 5%
# (distributed) at full size; a small run (2 to 4 steps, on a busy machine) is noisier, hence this bound: a
# simulator off by a factor of 2 or more either way (a unit slip, one device's work left out) fails it.
MAX_MEDIAN_ERROR = 0.5


def bench(name: str, out: Path, *args: str) -> dict:
    """Runs benchmarks/<name>.py --small --out `out` [args]: the summary it prints. It must leave docs/ as it
    was."""
    docs = {p: p.read_bytes() for p in (ROOT / "docs").iterdir()}
    stdout = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--small", "--out", str(out), *args],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert {p: p.read_bytes() for p in (ROOT / "docs").iterdir()} == docs, f"{name}.py --small wrote docs/"
    return json.loads(stdout.strip().splitlines()[-1])


def script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (for its `render`)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def positive(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def test_foundation_benchmark_small(tmp_path: Path) -> None:
    s = bench("foundation", tmp_path)
    assert positive(s["capture_s"], s["rss_gib"], s["simulate_s"], s["compare_wall_s"])
    full = json.loads((tmp_path / "foundation.json").read_text())
    assert json.loads((tmp_path / "capture_cost.json").read_text()) == full["capture"]
    c = full["capture"]
    assert c["model"] == "mlp" and 0 < c["ops"] <= c["fx_nodes"] and positive(c["total_s"], c["roofline_s"])
    assert (full["simulate"]["ops"], full["simulate"]["devices"]) == (5000, 8)
    rows = {(r["model"], r["planner"]): r for r in full["compare"]["results"]}
    assert sorted(rows) == [("mlp", "dp"), ("mlp", "single")] and len(full["compare"]["results"]) == 2
    dp = rows["mlp", "dp"]["iteration_s"]
    for r in rows.values():
        assert positive(r["iteration_s"], r["lower_bound_s"]) and r["lower_bound_s"] <= r["iteration_s"]
        assert r["speedup_over_dp"] == pytest.approx(dp / r["iteration_s"]) and len(r["peak_memory_bytes"]) == 4
    # the docs: one device does all the work the bound shares among four
    assert rows["mlp", "single"]["iteration_s"] == pytest.approx(4 * rows["mlp", "single"]["lower_bound_s"])
    doc = script("foundation").render(full, "fastt compare")
    assert "| mlp | single |" in doc and "| mlp | dp |" in doc


def test_planner_benchmark_small(tmp_path: Path) -> None:
    summary = bench("planners", tmp_path)
    data = json.loads((tmp_path / "planners-small.json").read_text())
    assert data["summary"] == summary
    rows, clusters = data["rows"], {"2xV100": 2, "4xV100": 4}
    keys = [(r["model"], r["cluster"], r["planner"]) for r in rows]
    shown = script("planners").PLANNERS_SHOWN
    always = [p for p in shown if p not in OPTIONAL]  # the others plan where they apply (mlp has no tables)
    assert set(itertools.product(["mlp", "lenet"], clusters, always)) <= set(keys)
    assert {p for _, _, p in keys} <= set(shown) and ("mlp", "2xV100", "table-wise") not in keys
    planned = shown
    for r in rows:
        assert positive(r["iteration_s"], r["lower_bound_s"]) and r["lower_bound_s"] <= r["iteration_s"] * (1 + 1e-9)
        assert r["plan_s"] >= 0 and len(r["peak_memory_bytes"]) == clusters[r["cluster"]]
    by = {k: r for k, r in zip(keys, rows)}
    speedups = []
    for m, c in itertools.product(["mlp", "lenet"], clusters):
        fastt = by[m, c, "fastt"]["iteration_s"]
        speedups.append(by[m, c, "dp"]["iteration_s"] / fastt)
        # fastt starts from the best of a portfolio of the other planners: never slower than one that fits
        others = [by[m, c, p]["iteration_s"] for p in planned if p != "fastt" and (m, c, p) in by and by[m, c, p]["fits"]]
        assert fastt <= min(others) * (1 + 1e-9), (m, c)
    assert summary["cases"] == 4 and summary["fastt_not_best"] == []
    assert summary["geomean_speedup_over_dp"] == {}  # mlp and lenet are left out of the means
    assert min(speedups) >= 1 - 1e-9
    doc = script("planners").render(rows, summary, "benchmarks/planners.py --small")
    assert all(f"| {m} | {c} | " in doc for m, c in itertools.product(["mlp", "lenet"], clusters))


def test_memory_benchmark_small(tmp_path: Path) -> None:
    """lenet at test size on 40 MB devices: each planner's largest batch, fastt's at least 1.5x DP's (it
    accumulates gradients and pipelines where DP runs out), its samples/s the batch over its step, and fastt
    fits twice DP's largest batch; the doc's block renders every row."""
    summary = bench("memory", tmp_path)
    cases = json.loads((tmp_path / "memory-small.json").read_text())["cases"]
    assert len(cases) == 1 and cases[0]["model"] == "lenet"
    rows = {r["planner"]: r for r in cases[0]["rows"]}
    assert set(rows) == {"dp", "zero", "pipeline", "fastt"}
    assert summary == {f"lenet/{cases[0]['cluster']}/{p}": r["max_batch"] for p, r in rows.items()}
    assert rows["fastt"]["max_batch"] >= 1.5 * rows["dp"]["max_batch"] > 0
    for r in rows.values():
        assert r["max_batch"] % 2 == 0
        if r["max_batch"]:
            assert r["samples_per_s"] == pytest.approx(r["max_batch"] / r["iteration_s"])
    twice = cases[0]["fastt_at_twice_dp"]
    assert twice["batch"] == 2 * rows["dp"]["max_batch"] and twice["fits"]
    assert "micro-batches a device" in twice["plan"]  # DP does not fit there: accumulation or a pipeline
    assert rows["dp"]["plan"] == "2 shards" and rows["zero"]["plan"] == "2 shards, updates sharded"
    block = script("memory").render(cases, "benchmarks/memory.py --small")
    assert block.startswith("<!-- memory") and block.endswith("<!-- /memory -->")
    assert all(f"| lenet | {cases[0]['cluster']} | {p} | {r['max_batch']} |" in block for p, r in rows.items())


def test_runtime_benchmark_small(tmp_path: Path) -> None:
    summary = bench("runtime", tmp_path)
    out = json.loads((tmp_path / "runtime-small.json").read_text())
    models = ["mlp", "lenet"]
    assert [r["model"] for r in out["speed"]] == models and [r["model"] for r in out["ceiling"]] == models
    for r in out["speed"]:
        t = r["seconds"]
        assert set(t) == {"fastt", "dp", "single", "eager"} and positive(*t.values())
        for other in ("single", "dp", "eager"):
            assert r[f"fastt_over_{other}"] == pytest.approx(t[other] / t["fastt"])
        plan = r["fastt_plan"]
        # fastt races DP against one device with every core first; only where DP wins does it tune
        assert r["trial"]["kept"] in ("dp", "single") and positive(r["trial"]["one_device_s"])
        if r["trial"]["kept"] == "single":
            assert not r["tuning"] and plan == {"replicas": 1, "splits": 0}
            continue
        assert r["tuning"][0]["plan"].startswith("dp (2 replicas")  # tuning starts data-parallel
        assert all(positive(x["measured_s"], x["simulated_s"]) for x in r["tuning"])
        ends_on = re.fullmatch(r".* \((\d+) replicas?, (\d+) splits\)", kept_plan(r["tuning"])["plan"])
        assert (int(ends_on[1]), int(ends_on[2])) == (plan["replicas"], plan["splits"]), r["tuning"]
    assert summary["fastt_over_single"] == {r["model"]: r["fastt_over_single"] for r in out["speed"]}
    for r in out["ceiling"]:
        assert positive(r["alone_s"], r["together_s"]) and r["batch_per_device"] == 32
        assert r["best_speedup"] == pytest.approx(2 * r["alone_s"] / r["together_s"])
    acc = out["accuracy"]
    assert sorted((r["model"], r["planner"]) for r in acc) == sorted(itertools.product(models, ["fastt", "dp", "single"]))
    for r in acc:
        assert positive(r["measured_s"], r["simulated_s"])
        assert r["error"] == pytest.approx((r["simulated_s"] - r["measured_s"]) / r["measured_s"])
    median = statistics.median(abs(r["error"]) for r in acc)
    assert summary["median_abs_error"] == pytest.approx(median) and median < MAX_MEDIAN_ERROR, acc
    assert [r["model"] for r in out["overhead"]] == models
    for r in out["overhead"]:
        assert positive(r["eager_s"], r["fastt_s"], r["hyper_s"], r["check_s"])
        assert r["hyper_s"] + r["check_s"] < r["fastt_s"]
        assert r["overhead"] == pytest.approx(r["fastt_s"] / r["eager_s"] - 1)
    assert summary["median_overhead"] == pytest.approx(statistics.median(r["overhead"] for r in out["overhead"]))
    doc = script("runtime").render(out, "python benchmarks/runtime.py --small")
    assert all(f"| {m} | {p} |" in doc for m, p in itertools.product(models, ["fastt", "dp", "single"]))


def test_runtime_sides_small(tmp_path: Path) -> None:
    """--sides: fastt against DP and eager, each model run twice; the noise is the largest change of one
    planner's time, and fastt is flagged only where it is slower by more than that."""
    summary = bench("runtime", tmp_path, "--sides")
    rows = json.loads((tmp_path / "runtime-sides-small.json").read_text())["sides"]
    models = ["mlp", "lenet"]
    assert [r["model"] for r in rows] == models
    for r in rows:
        t = r["seconds"]
        assert set(t) == {"fastt", "dp", "eager"} and all(len(x) == 2 and positive(*x) for x in t.values())
        assert r["noise"] == pytest.approx(max(max(x) / min(x) - 1 for x in t.values()))
        assert len(r["kept"]) == 2 and set(r["kept"]) <= {"fastt", "dp", "single"}
        mean = {p: statistics.mean(x) for p, x in t.items()}
        assert r["slower_than"] == [p for p in ("dp", "eager") if mean["fastt"] > mean[p] * (1 + r["noise"])]
    assert summary["slower"] == {r["model"]: r["slower_than"] for r in rows if r["slower_than"]}
    block = script("runtime").render_sides(rows, "python benchmarks/runtime.py --sides")
    assert "## fastt against data parallelism and plain PyTorch" in block
    assert all(re.search(rf"^\| {m} \| [\d.]+ / [\d.]+ \|", block, re.MULTILINE) for m in models)


def test_runtime_benchmark_in_bf16_beside_fp32_small(tmp_path: Path) -> None:
    """--precision bf16: each planner's simulated vs measured time in fp32 and in bf16 from one run; its block
    of docs/runtime.md survives a rewrite of the rest."""
    summary = bench("runtime", tmp_path, "--precision", "bf16")
    rows = json.loads((tmp_path / "runtime-bf16-small.json").read_text())["accuracy"]
    assert sorted((r["model"], r["planner"], r["precision"]) for r in rows) == sorted(
        itertools.product(["mlp", "lenet"], ["fastt", "dp", "single"], ["fp32", "bf16"]))
    for r in rows:
        assert positive(r["measured_s"], r["simulated_s"])
        assert r["error"] == pytest.approx((r["simulated_s"] - r["measured_s"]) / r["measured_s"])
    for prec in ("fp32", "bf16"):
        median = statistics.median(abs(r["error"]) for r in rows if r["precision"] == prec)
        assert summary[prec] == pytest.approx(median) and median < MAX_MEDIAN_ERROR, rows
    runtime = script("runtime")
    block = runtime.render_precision(rows, "python benchmarks/runtime.py --precision bf16")
    assert block.startswith(runtime.BEGIN_PRECISION) and block.rstrip().endswith(runtime.END_PRECISION)
    assert all(f"| mlp | {p} |" in block for p in ("fastt", "dp", "single"))
    sides = runtime.render_sides([], "python benchmarks/runtime.py --sides")
    old = "# Runtime benchmarks\n\nold tables\n\n" + block + "\n" + sides
    new = runtime.with_blocks("# Runtime benchmarks\n\nnew tables\n", old)  # the full run keeps both blocks
    assert new == "# Runtime benchmarks\n\nnew tables\n\n" + block + "\n" + sides
    assert runtime.tables_of(old) == "# Runtime benchmarks\n\nold tables\n\n"
    again = runtime.with_blocks(runtime.tables_of(old), old, block.replace("bf16", "fp16"))  # a block replaced
    assert again.count("<!--") == 4 and "fp16" in again and again.endswith(sides)


def test_distributed_benchmark_small(tmp_path: Path) -> None:
    summary = bench("distributed", tmp_path)
    data = json.loads((tmp_path / "distributed-small.json").read_text())
    (row,) = data["rows"]
    assert row["model"] == "mlp" and row["steps"] == 4
    t = {r["planner"]: r for r in row["results"]}
    assert sorted(t) == sorted(["fastt", "dp", "single", "dpos", "eager"]) and len(row["results"]) == 5
    assert all(positive(r["measured_iteration_s"]) for r in t.values()) and t["eager"]["error"] is None
    for p in ("fastt", "dp", "single", "dpos"):
        sim, measured = t[p]["simulated_iteration_s"], t[p]["measured_iteration_s"]
        assert positive(sim) and t[p]["error"] == pytest.approx((sim - measured) / measured)
    one = t["eager"]["measured_iteration_s"]
    assert row["fastt_over_one_process"] == pytest.approx(one / t["fastt"]["measured_iteration_s"])
    assert row["dp_over_one_process"] == pytest.approx(one / t["dp"]["measured_iteration_s"])
    assert summary["fastt_over_one_process"] == {"mlp": row["fastt_over_one_process"]}
    assert summary["dp_over_one_process"] == {"mlp": row["dp_over_one_process"]}
    median = statistics.median(abs(t[p]["error"]) for p in ("fastt", "dp", "single"))
    assert summary["median_abs_error"] == pytest.approx(median) and median < MAX_MEDIAN_ERROR, row["results"]
    every = statistics.median(abs(t[p]["error"]) for p in ("fastt", "dp", "single", "dpos"))
    assert summary["median_abs_error_with_dpos"] == pytest.approx(every)
    g, link = row["gather"], row["links"]["gloo-intra"]  # least-squares fits: costs that cannot be negative
    assert set(g) == {"latency_s", "s_per_byte", "s_per_tensor"} and positive(g["s_per_byte"])
    assert min(g["latency_s"], g["s_per_tensor"], link["latency_s"]) >= 0 and positive(link["bandwidth"])
    doc = script("distributed").render(data)
    assert "| mlp | fastt |" in doc and "Fitted gloo link" in doc and "Fitted gather" in doc


def test_planner_summary_means_speedups_per_cluster_set_without_the_toys() -> None:
    summarize = script("planners").summarize

    def row(m: str, c: str, p: str, t: float) -> dict:
        return {"model": m, "cluster": c, "planner": p, "iteration_s": t, "fits": True}
    rows = [row("vgg19", "2x4xV100", "dp", 2.0), row("vgg19", "2x4xV100", "fastt", 1.0),
            row("bert-large", "2x4xV100", "dp", 8.0), row("bert-large", "2x4xV100", "fastt", 1.0),
            row("vgg19", "8xV100", "dp", 1.1), row("vgg19", "8xV100", "fastt", 1.0),
            row("vgg19", "8xV100", "owt", 0.9), row("lenet", "2x4xV100", "dp", 9.0), row("lenet", "2x4xV100", "fastt", 1.0)]
    s = summarize(rows)
    assert s["geomean_speedup_over_dp"] == {"comm-bound": pytest.approx(4.0), "nvlink": pytest.approx(1.1)}
    assert s["cases"] == 4 and s["fastt_not_best"] == ["vgg19 on 8xV100: fastt 1000.0 ms, owt 900.0 ms"]


def test_planner_doc_says_what_binds_each_case_and_where_fastt_wins_in_its_plans_words() -> None:
    planners = script("planners")

    def row(m: str, p: str, t: float, busy: list[float], links: list[float], **more: object) -> dict:
        return {"model": m, "cluster": "2x4xV100", "planner": p, "iteration_s": t, "fits": True, "splits": 0,
                "busy_s": busy, "link_busy_s": links, "inter_node_bytes": int(4.7e9 if p == "dp" else 2e6), **more}
    assert planners.binds(row("vgg19", "fastt", 1.0, [0.5, 0.6], [0.9, 0.1])) == "link 90%"
    assert planners.binds(row("vgg19", "fastt", 1.0, [0.95, 0.45], [0.9])) == "compute 95% (mean 70%)"
    assert planners.binds(row("vgg19", "fastt", 2.0, [1.0, 0.5], [0.6])) == "waits (device 50%, link 30%)"
    words = [["features.0 … features.34 (16 layers)", "every device"], ["classifier.0", "device 3"]]
    cases = {("vgg19", "2x4xV100"): {"dp": row("vgg19", "dp", 2.0, [2.0], [1.5]),
                                     "fastt": row("vgg19", "fastt", 1.0, [1.0], [0.1], words=words,
                                                  source="chained")},
             ("alexnet", "2x4xV100"): {"dp": row("alexnet", "dp", 1.2, [1.0], [0.5]),  # 1.2x: not a win
                                       "fastt": row("alexnet", "fastt", 1.0, [1.0], [0.1], words=words)},
             ("mlp", "2x4xV100"): {"dp": row("mlp", "dp", 9.0, [1.0], [0.5]),  # a toy
                                   "fastt": row("mlp", "fastt", 1.0, [1.0], [0.1], words=words)}}
    text = planners.wins(cases)
    (line,) = [x for x in text.splitlines() if x.startswith("- ")]
    assert line == ("- vgg19 on 2x4xV100, 2.00x (chained; between nodes 2.0 MB a step against DP's 4.7 GB): "
                    "features.0 … features.34 (16 layers): every device; classifier.0: device 3.")


def test_network_benchmark_small(tmp_path: Path) -> None:
    """mlp over a loopback capped at 1gbit on 2 ranks (skipped, with the reason, where no namespace can be made):
    every plan measured beside its simulated time, and the doc generated from the JSON."""
    from fastt import netns

    if why := netns.unavailable():
        pytest.skip(f"cannot make a capped network namespace: {why}")
    summary = bench("network", tmp_path)
    data = json.loads((tmp_path / "network-small.json").read_text())
    (row,) = data["rows"]
    assert row["network"] == "1gbit" and row["devices"] == "gloo:2", row
    t = {r["planner"]: r for r in row["results"]}
    assert sorted(t) == ["dp", "eager", "fastt"] and all(positive(r["measured_iteration_s"]) for r in t.values())
    for p in ("fastt", "dp"):
        sim, measured = t[p]["simulated_iteration_s"], t[p]["measured_iteration_s"]
        assert positive(sim) and t[p]["error"] == pytest.approx((sim - measured) / measured)
    assert summary["dp_over_fastt"] == {"mlp@1gbit": pytest.approx(t["dp"]["measured_iteration_s"]
                                                                  / t["fastt"]["measured_iteration_s"])}
    median = statistics.median(abs(t[p]["error"]) for p in ("fastt", "dp"))
    assert summary["median_abs_error"] == pytest.approx(median) and median < MAX_MEDIAN_ERROR, row["results"]
    doc = script("network").render(data)
    assert "| 2 | 1gbit | mlp |" in doc and "## Targets" in doc
