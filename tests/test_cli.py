"""The `fastt` command line, run as a user runs it: a subprocess per command, files written in a temp folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastt.cluster import gpu_cluster

_SCRIPT = Path(sys.executable).with_name("fastt")
FASTT = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "fastt.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

DYNAMIC_MODEL = '''
import torch
from torch import nn


class Dynamic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if self.fc(x).sum() > 0:  # a branch on the model's values: no one graph serves every step
            return self.fc(x)
        return -self.fc(x)


def make():
    model = Dynamic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, nn.functional.cross_entropy, opt, (torch.randn(16, 8), torch.randint(0, 4, (16,)))
'''


def fastt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*FASTT, *args], check=False, cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=300)


def fastt_many(cases: dict[str, list[str]], cwd: Path) -> dict[str, subprocess.CompletedProcess]:
    """Several independent commands at once (each is mostly interpreter start-up and capture)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(fastt, *args, cwd=cwd) for k, args in cases.items()}
        return {k: f.result() for k, f in futures.items()}


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


MLP = ["--model", "mlp", "--size", "test", "--cluster", "2xV100"]


@pytest.mark.slow
def test_compare_paper_models_json(tmp_path: Path) -> None:
    models, planners = ["vgg19", "inception_v3", "bert-large"], ["single", "dp"]
    t0 = time.perf_counter()
    r = ok(fastt("compare", "--model", ",".join(models), "--cluster", "4xV100", "--planners", ",".join(planners),
                 "--json", cwd=tmp_path))
    wall = time.perf_counter() - t0
    out = json.loads(r.stdout)  # one JSON object and nothing else
    assert set(out) == {"cluster", "results"} and out["cluster"] == "4xV100"
    rows = {(row["model"], row["planner"]): row for row in out["results"]}
    assert set(rows) == {(m, p) for m in models for p in planners}
    for row in rows.values():
        assert isinstance(row["iteration_s"], float)
        assert row["iteration_s"] >= row["lower_bound_s"] > 0
        assert row["plan_s"] >= 0
        assert isinstance(row["fits"], bool) and row["fits"]
        assert row["splits"] == 0
        mem = row["peak_memory_bytes"]
        assert len(mem) == 4 and all(isinstance(b, int) and b >= 0 for b in mem)
        assert row["speedup_over_dp"] > 0
    for m in models:
        single, dp = rows[m, "single"], rows[m, "dp"]
        assert dp["speedup_over_dp"] == 1
        assert dp["iteration_s"] < single["iteration_s"], m
        assert single["speedup_over_dp"] == pytest.approx(dp["iteration_s"] / single["iteration_s"])
        assert single["peak_memory_bytes"][1:] == [0, 0, 0]  # everything on device 0
        assert len(set(dp["peak_memory_bytes"])) == 1  # replicas are alike
    assert wall < 60, f"fastt compare took {wall:.1f} s for three paper-size models"


def test_simulate_trace_gantt_and_saved_strategy(tmp_path: Path) -> None:
    r = fastt_many({"simulate": ["simulate", *MLP, "--planner", "dp", "--trace", "t.json", "--gantt", "g.png",
                                 "--json"],
                    "plan": ["plan", *MLP, "--planner", "dp", "--out", "s.json", "--json"]}, tmp_path)
    inline = json.loads(ok(r["simulate"]).stdout)
    assert inline["planner"] == "dp" and inline["fits"] is True
    assert inline["iteration_s"] >= inline["lower_bound_s"] > 0
    assert inline["trace"] == "t.json" and inline["gantt"] == "g.png"

    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert spans
    for e in spans:
        assert {"ts", "dur", "pid", "tid"} <= set(e), e
        assert e["dur"] >= 0 and e["ts"] >= 0
    assert {e["tid"] for e in spans if e["pid"] == 0} == {0, 1}  # ops on both devices
    assert any(e.get("cat") == "allreduce" for e in spans)
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG_MAGIC

    planned = json.loads(ok(r["plan"]).stdout)
    assert planned["out"] == "s.json" and planned["iteration_s"] == inline["iteration_s"]
    assert json.loads((tmp_path / "s.json").read_text())["format"] == "fastt.strategy"
    saved = json.loads(ok(fastt("simulate", *MLP, "--strategy", "s.json", "--json", cwd=tmp_path)).stdout)
    assert saved["planner"] == "dp"
    assert saved["iteration_s"] == inline["iteration_s"]
    assert saved["peak_memory_bytes"] == inline["peak_memory_bytes"]


def test_not_fitting_names_device_and_bytes(tmp_path: Path) -> None:
    base = gpu_cluster("v100", 2)
    tiny = replace(base, name="tiny", devices=tuple(replace(d, name=f"tiny:{i}", memory_bytes=10**6)
                                                    for i, d in enumerate(base.devices)))
    tiny.save(tmp_path / "tiny.json")
    args = ["--model", "mlp", "--size", "test", "--cluster", "tiny.json"]
    r = fastt_many({"json": ["simulate", *args, "--planner", "dp", "--json"],
                    "human": ["compare", *args, "--planners", "single,dp"]},
                   tmp_path)
    summary = json.loads(ok(r["json"]).stdout)
    assert summary["fits"] is False
    assert all(b > 10**6 for b in summary["peak_memory_bytes"])
    assert len(summary["oom"]) == 2 and "tiny:1" in summary["oom"][1]
    table = ok(r["human"]).stdout
    for planner in ("single", "dp"):
        assert re.search(rf"^mlp +{planner} .* NO ", table, re.MULTILINE), table
    bytes_ = r"\d+\.\d (GB|MB|kB)"
    assert re.search(rf"mlp/single does not fit: device 0 \(tiny:0\) needs {bytes_}, has 1\.0 MB", table), table
    assert re.search(rf"mlp/dp does not fit: .*device 1 \(tiny:1\) needs {bytes_}, has 1\.0 MB", table), table


BAD_INPUTS = {
    "unknown model": (["plan", "--model", "resnet9000", "--cluster", "2xV100"], "unknown model 'resnet9000'"),
    "malformed cluster": (["plan", *MLP[:4], "--cluster", "4xFOO"], "bad cluster spec '4xFOO'"),
    "strategy not JSON": (["simulate", *MLP, "--strategy", "not_json.json"], "not valid JSON"),
    "strategy unknown op": (["simulate", *MLP, "--strategy", "unknown_op.json"], "unknown op 'no_such_op'"),
    # compare without --json: the failure comes while its progress bar is up
    "data-dependent model": (["compare", "--model", "dynamic.py:make", "--cluster", "2xV100", "--planners",
                              "single,dp"], "computed from the model, not from the batch alone"),
    "unknown planner": (["compare", *MLP, "--planners", "single,zzz"], "unknown planner 'zzz'"),
    "unknown subcommand": (["frobnicate", "--model", "mlp"], "invalid choice: 'frobnicate'"),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    d = tmp_path_factory.mktemp("bad")
    (d / "not_json.json").write_text("placement: everything on gpu 0\n")
    (d / "dynamic.py").write_text(DYNAMIC_MODEL)
    (d / "unknown_op.json").write_text(json.dumps({
        "format": "fastt.strategy", "version": 1, "planner": "hand", "n_devices": 2, "replicas": 1, "splits": [],
        "placement": {"no_such_op": 0}, "order": [["no_such_op"], []], "holders": {}}))
    return fastt_many({k: args for k, (args, _) in BAD_INPUTS.items()}, d)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line(case: str, bad_runs: dict[str, subprocess.CompletedProcess]) -> None:
    r = bad_runs[case]
    assert r.returncode == 2, f"exit {r.returncode}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{r.stderr!r}"
    assert lines[0].startswith("fastt: error: ")
    assert BAD_INPUTS[case][1] in lines[0]
    assert r.stdout == ""


def test_demo_compares_planners(tmp_path: Path) -> None:
    from test_network import CANNOT

    r = ok(fastt("demo", "--run-model", "mlp", "--models", "mlp", "--clusters", "2xV100", "--mixed-models",
                 "lenet", "--mixed-cluster", "2x2xV100", "--network-model", "mlp", cwd=tmp_path))
    out = r.stdout
    if CANNOT is None:  # a run over a loopback capped at 1gbit: fastt's plan beside DP's, measured
        real, slow, example, simulated, mixed = out.split("\n\n", 4)
        assert slow.startswith("mlp trained for real on gloo:2 over a loopback capped at 1gbit"), slow
        assert [line.split()[0] for line in slow.splitlines()[1:3]] == ["fastt", "dp"]
        assert re.search(r"over this slow network DP's measured step is \d+\.\dx fastt's", slow)
    else:  # one line says why, and the demo goes on
        real, example, simulated, mixed = out.split("\n\n", 3)
        assert "fastt: demo: no run over a slow network here: --network 1gbit: cannot" in r.stderr, r.stderr
    assert real.startswith("mlp trained for real on cpu:2")
    accuracy = re.match(r"digits: test accuracy (\S+)%", example)
    assert accuracy and float(accuracy.group(1)) >= 90 and (tmp_path / "digits_loss.png").is_file()
    assert [line.split()[0] for line in real.splitlines()[1:5]] == ["fastt", "dp", "single", "eager"]
    diff = re.search(r"largest relative parameter difference from eager: (\S+)", real)
    assert diff and float(diff.group(1)) <= 1e-5
    out = simulated
    assert out.startswith("cluster 2xV100-nvlink: 2 x V100")
    rows = [line.split() for line in out.splitlines() if line.startswith("mlp ")]
    assert [row[1] for row in rows] == ["fastt", "dp", "single", "dpos", "heft", "m-sct"]
    assert all(row[-2] == "yes" for row in rows)
    assert mixed.startswith("Mixed plans, where DP's gradients cross the nodes:\ncluster 2x2xV100-nvlink")
    planned = {line.split()[1]: float(line.split()[3]) for line in mixed.splitlines() if line.startswith("lenet ")}
    assert set(planned) == {"fastt", "dp", "os-dpos", "search", "owt", "pipeline", "zero", "one-node"}
    assert "lenet/table-wise: no plan" in mixed
    assert planned["fastt"] <= min(planned.values())
    dp = rows[1]
    assert dp[4] == "1.00x"


def test_simulate_with_measured_costs_caches_them(tmp_path: Path) -> None:
    args = ["simulate", "--model", "mlp", "--size", "test", "--cluster", "cpu:2", "--planner", "dp",
            "--costs", "measured", "--cost-file", "costs.json", "--json"]
    first = json.loads(ok(fastt(*args, cwd=tmp_path)).stdout)
    cached = json.loads((tmp_path / "costs.json").read_text())
    assert cached["format"] == "fastt.costs" and all(v > 0 for v in cached["seconds"].values())
    second = json.loads(ok(fastt(*args, cwd=tmp_path)).stdout)  # read from the file, not measured again
    assert first["iteration_s"] > 0 and second["iteration_s"] > 0
    bad = fastt("simulate", *MLP, "--costs", "measured", cwd=tmp_path)
    assert bad.returncode == 2 and "use a cpu:N cluster" in bad.stderr


def test_run_trains_for_real_and_checks_against_eager(tmp_path: Path) -> None:
    r = ok(fastt("run", "--model", "mlp", "--devices", "cpu:2", "--planners", "fastt,dp,single,eager",
                 "--steps", "4", "--check", "--json", cwd=tmp_path))
    out = json.loads(r.stdout)
    assert out["model"] == "mlp" and out["devices"] == "cpu:2" and out["steps"] == 4
    assert [x["planner"] for x in out["results"]] == ["fastt", "dp", "single", "eager"]
    for x in out["results"]:
        assert x["measured_iteration_s"] > 0
        if x["planner"] != "eager":
            sim, measured = x["simulated_iteration_s"], x["measured_iteration_s"]
            assert sim > 0 and x["error"] == pytest.approx((sim - measured) / measured)
            # each device's busy time in the last step: within that step, on the devices the plan uses
            n = 1 if x["planner"] == "single" or x["trial"] and x["trial"]["kept"] == "single" else 2
            assert len(x["busy_s"]) == len(x["simulated_busy_s"]) >= n
            assert all(b > 0 for b in x["busy_s"][:n]) and all(b > 0 for b in x["simulated_busy_s"][:n])
    # fastt's plan, where the trial keeps it, may split the mlp's matmuls as megatron does: their parts' sums
    # round otherwise and flip relu masks within an ulp of zero, 2.3e-5 after these 4 steps (measured)
    assert out["max_param_rel_diff"] <= (1e-4 if any(x.get("splits") for x in out["results"]) else 1e-5)
    bad = fastt("run", "--model", "mlp", "--devices", "4xV100", "--steps", "1", cwd=tmp_path)
    assert bad.returncode == 2 and "local runtime runs cpu:N" in bad.stderr


def test_run_trace_puts_the_measured_step_beside_the_simulated_one(tmp_path: Path) -> None:
    """`fastt run --trace`: per planner a measured process (a thread per device, the last step's segments and
    allreduce means, which add up to the busy time the run reports) above its simulated devices and links;
    refused in one line where it cannot record threads (torchrun)."""
    r = ok(fastt("run", "--model", "mlp", "--devices", "cpu:2", "--planners", "dp,single", "--steps", "3",
                 "--no-trial", "--json", "--trace", "t.json", cwd=tmp_path))
    out = json.loads(r.stdout)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "dp: measured", 1: "dp: simulated devices", 2: "dp: simulated links",
                     10: "single: measured", 11: "single: simulated devices", 12: "single: simulated links"}
    for pid, x in zip((0, 10), out["results"]):
        spans = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        for d, busy in enumerate(x["busy_s"]):
            seg = sum(e["dur"] for e in spans if e["tid"] == d and e["name"] != "allreduce mean") / 1e6
            assert seg == pytest.approx(busy, rel=1e-6, abs=1e-9), (x["planner"], d)
        assert min(e["ts"] for e in spans) == 0 and all(e["dur"] > 0 for e in spans)
        assert any(e["pid"] == pid + 1 and e["ph"] == "X" for e in events)  # the simulated ops
    assert {e["tid"] for e in events if e["pid"] == 0 and e["ph"] == "X"} == {0, 1}
    bad = fastt("run", "--model", "mlp", "--launcher", "torchrun", "--devices", "cpu:2", "--trace", "u.json",
                cwd=tmp_path)
    assert bad.returncode == 2 and "--trace records the local launcher" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1


def test_compare_across_nodes_reports_inter_node_traffic(tmp_path: Path) -> None:
    r = ok(fastt("compare", "--model", "transformer", "--cluster", "2x4xV100", "--planners", "dp,dpos", "--json",
                 cwd=tmp_path))
    rows = {row["planner"]: row for row in json.loads(r.stdout)["results"]}
    # DP's ring over 8 GPUs crosses between the nodes twice: each hop carries 2(n-1)/n of the gradients.
    assert rows["dp"]["inter_node_bytes"] > 0 and rows["dpos"]["inter_node_bytes"] >= 0
    table = ok(fastt("compare", "--model", "transformer", "--cluster", "2x4xV100", "--planners", "dp",
                     cwd=tmp_path)).stdout
    assert "in 2 nodes" in table and "inter-node GB" in table
    one_node = json.loads(ok(fastt("compare", "--model", "transformer", "--cluster", "8xV100", "--planners", "dp",
                                   "--json", cwd=tmp_path)).stdout)["results"][0]
    assert one_node["inter_node_bytes"] == 0


def test_run_with_torchrun_launches_one_process_per_device(tmp_path: Path) -> None:
    r = ok(fastt("run", "--model", "mlp", "--devices", "cpu:2", "--launcher", "torchrun", "--planners", "dp,eager",
                 "--steps", "3", "--check", "--json", cwd=tmp_path))
    out = json.loads(r.stdout)
    assert out["devices"] == "gloo:2" and out["launcher"] == "torchrun"
    assert [x["planner"] for x in out["results"]] == ["dp", "eager"] and out["max_param_rel_diff"] <= 1e-5
    bad = fastt("run", "--model", "mlp", "--devices", "4xV100", "--launcher", "torchrun", cwd=tmp_path)
    assert bad.returncode == 2 and "--launcher torchrun runs cpu:N" in bad.stderr
    twice = fastt("run", "--model", "mlp", "--devices", "cuda:0,0", "--launcher", "torchrun", cwd=tmp_path)
    assert twice.returncode == 2 and "one rank per GPU" in twice.stderr


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), st.integers(0, 5000))
def test_largest_batch_is_the_largest_that_fits_within_an_eighth(n: int, start: int, limit: int) -> None:
    from fastt.cli import _largest

    tried = []
    got = _largest(start * n, n, lambda b: tried.append(b) or b <= limit)
    assert got % n == 0 and all(b % n == 0 and b > 0 for b in tried)
    cap = 64 * start * n
    if limit >= cap:
        assert got >= cap
    else:
        assert got <= limit and limit - got < max(n, got // 8) if got else limit < n


def test_compare_max_batch_reports_each_planners_largest_batch(tmp_path: Path) -> None:
    """On two devices too small to hold all of mlp's parameters, their state and the step's new values of
    both (3.2 GB a device under DP at batch 256), DP fits nothing; fastt holds layers once (2.1 GB), so it fits
    a batch."""
    cl = gpu_cluster("V100", 2)
    small = replace(cl, devices=tuple(replace(d, memory_bytes=int(2.5e9)) for d in cl.devices))
    small.save(tmp_path / "small.json")
    r = fastt("compare", "--model", "mlp", "--size", "paper", "--cluster", "small.json", "--planners", "dp,fastt",
              "--max-batch", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {x["planner"]: x for x in json.loads(r.stdout)["results"]}
    assert rows["fastt"]["max_batch"] > rows["dp"]["max_batch"]
    assert rows["fastt"]["samples_per_s"] > 0 and "shard" in rows["fastt"]["plan"]
    assert rows["dp"]["plan"] == "-" if rows["dp"]["max_batch"] == 0 else rows["dp"]["plan"] == "2 shards"
