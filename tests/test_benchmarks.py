"""The benchmark scripts run (at their small size, as CI does) and report what the docs quote."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_foundation_benchmark_small() -> None:
    out = subprocess.run([sys.executable, "benchmarks/foundation.py", "--small"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["capture_s"] > 0 and r["simulate_s"] > 0 and r["compare_wall_s"] > 0
    full = json.loads((ROOT / "out/foundation.json").read_text())
    assert {x["planner"] for x in full["compare"]["results"]} == {"single", "dp"}


def test_planner_benchmark_small() -> None:
    out = subprocess.run([sys.executable, "benchmarks/planners.py", "--small"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["cases"] == 4 and summary["geomean_speedup_over_dp"] >= 1.0  # fastt is never slower than DP
    rows = json.loads((ROOT / "out/planners-small.json").read_text())["rows"]
    assert {r["planner"] for r in rows} >= {"fastt", "dp", "dpos", "heft", "m-topo", "m-etf", "m-sct"}


def test_runtime_benchmark_small() -> None:
    out = subprocess.run([sys.executable, "benchmarks/runtime.py", "--small"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["median_abs_error"] >= 0 and set(summary["fastt_over_single"]) == {"mlp", "lenet"}
    rows = json.loads((ROOT / "out/runtime-small.json").read_text())
    assert {r["planner"] for r in rows["accuracy"]} == {"fastt", "dp", "single"}
    assert all(r["tuning"] and r["tuning"][0]["plan"].startswith("dp") for r in rows["speed"])
    assert all(r["best_speedup"] > 0 for r in rows["ceiling"])


def test_distributed_benchmark_small() -> None:
    out = subprocess.run([sys.executable, "benchmarks/distributed.py", "--small"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["median_abs_error"] >= 0 and summary["median_abs_error_with_dpos"] >= 0
    assert set(summary["fastt_over_one_process"]) == {"mlp"}
    rows = json.loads((ROOT / "out/distributed-small.json").read_text())["rows"]
    assert {r["planner"] for r in rows[0]["results"]} == {"fastt", "dp", "single", "dpos", "eager"}
    assert set(rows[0]["gather"]) == {"latency_s", "s_per_byte", "s_per_tensor"}
