"""`fastt run --launcher torchrun --network RATE`: the ranks in a private network namespace, its loopback capped.

Training there equals eager PyTorch as on the plain loopback; a killed rank ends every rank within 30 s, named;
the machine's own loopback is left as it was and nothing the run started outlives it. Where this process cannot
make a namespace (not root, no unshare or tc), those tests are skipped with the reason, and the command's one-line
refusal is checked instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_cli import ENV, FASTT
from test_fail import _tagged

from fastt import netns
from fastt.errors import FasttError

RUN = ["run", "--model", "mlp", "--launcher", "torchrun", "--devices", "cpu:2", "--network", "1gbit"]


def _cannot() -> str | None:
    """Why no capped namespace can be made here, None when one can."""
    why = netns.unavailable()
    if why is None:
        try:
            netns.check(netns.network("1gbit"))
        except FasttError as e:
            why = str(e)
    return why


CANNOT = _cannot()
needs_namespace = pytest.mark.skipif(CANNOT is not None, reason=f"cannot make a capped namespace: {CANNOT}")


def fastt(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*FASTT, *args], capture_output=True, text=True, cwd=cwd, env={**ENV, **(env or {})},
                          timeout=timeout, check=False)


def host_loopback() -> str:
    """This machine's loopback qdisc, read (never changed) from the test's own namespace."""
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                          check=False).stdout


@pytest.mark.parametrize(("rate", "bits"), [("1gbit", 1e9), ("100Mbit", 1e8), ("125mbps", 1e9),
                                            ("1gibit", 2**30), ("2500", 2500.0)])
def test_rates_read_as_tc_reads_them(rate: str, bits: float) -> None:
    assert netns.network(rate).bits_per_s == bits
    assert netns.network(rate).burst_bytes >= 128 * 1024


def test_a_bad_rate_is_one_line(tmp_path: Path) -> None:
    r = fastt(*RUN[:-1], "fast", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "--network" in r.stderr, r.stderr


def test_network_with_the_local_launcher_is_refused(tmp_path: Path) -> None:
    r = fastt("run", "--model", "mlp", "--network", "1gbit", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        ("fastt: error: --network 1gbit caps the loopback between the ranks' processes: use it with --launcher "
         "torchrun --devices cpu:N")], r.stderr


def test_without_unshare_or_tc_it_says_so_in_one_line(tmp_path: Path) -> None:
    r = fastt(*RUN, cwd=tmp_path, env={"PATH": str(tmp_path)})  # the CLI runs by its full path
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "unshare, ip, tc not found" in r.stderr and "run without --network" in r.stderr


@pytest.mark.skipif(not hasattr(os, "geteuid") or sys.platform != "linux", reason="Linux users")
def test_without_root_it_says_so_in_one_line(tmp_path: Path) -> None:
    """As root, the command is run as nobody (uid 65534); otherwise as this user."""
    tmp_path.chmod(0o777)
    as_nobody = {"user": 65534, "group": 65534} if os.geteuid() == 0 else {}
    try:
        subprocess.run([*FASTT, "--help"], capture_output=True, timeout=120, check=True, env=ENV, **as_nobody)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"root, and nobody cannot run this Python to show the refusal: {e}")
    r = subprocess.run([*FASTT, *RUN], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**ENV, "HOME": str(tmp_path)}, check=False, **as_nobody)
    if netns.unavailable() is not None and "not found" in netns.unavailable():
        pytest.skip(f"the tools are missing, which another test checks: {netns.unavailable()}")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "needs root" in r.stderr, r.stderr


@needs_namespace
def test_training_under_a_capped_network_equals_eager(tmp_path: Path) -> None:
    """dp and fastt, each step checked against the one-device eager step (1e-4 of a tensor's largest magnitude:
    fastt's mlp plan on two ranks can be megatron-like, whose parts' sums flip relu masks, 2.3e-5 measured); the cap is measured
    (the fitted link's bandwidth under 1 Gbit/s), the machine's loopback is as before, and nothing the run
    started is left."""
    before, tag = host_loopback(), uuid.uuid4().hex
    r = fastt(*RUN, "--planners", "dp,fastt", "--steps", "4", "--check", "--json", cwd=tmp_path,
              env={"FASTT_TEST_TAG": tag})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["network"] == "1gbit" and out["max_param_rel_diff"] <= 1e-4
    assert [x["planner"] for x in out["results"]] == ["dp", "fastt"]
    assert all(x["simulated_iteration_s"] > 0 for x in out["results"])
    (link,) = out["links"].values()
    assert link["bandwidth"] * 8 < 1.25e9  # bytes/s fitted through the cap (the loopback alone: many Gbit/s)
    assert host_loopback() == before and _tagged(tag) == []


@needs_namespace
def test_a_killed_rank_under_a_capped_network_ends_every_rank_within_30_s(tmp_path: Path) -> None:
    """From the kill (its line in torchrun's log) to the command's end; its one line names the rank."""
    tag = uuid.uuid4().hex
    p = subprocess.Popen([*FASTT, *RUN, "--planners", "dp", "--no-trial", "--steps", "8", "--timeout", "10"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**ENV, "TMPDIR": str(tmp_path), "FASTT_FAULT": "1:2:kill", "FASTT_TEST_TAG": tag})
    killed, deadline = None, time.monotonic() + 240
    while killed is None and p.poll() is None and time.monotonic() < deadline:
        if any("kills itself" in log.read_text(errors="replace") for log in tmp_path.glob("fastt-torchrun-*.log")):
            killed = time.monotonic()
        time.sleep(0.05)
    _, err = p.communicate(timeout=120)
    assert killed is not None and time.monotonic() - killed < 30, err
    assert p.returncode == 2 and err.startswith("fastt: error: torchrun failed: rank 1 died (killed by SIGKILL)"), err
    assert _tagged(tag) == []
