"""`fastt run --launcher torchrun`: torchrun on this machine, one `python -m fastt.launch` rank per device.

torchrun and its ranks run in a process group of their own, their output in a log file (kept, and named in the
error, only when the job fails), so that the command's stderr is its own one line. SIGINT and SIGTERM to fastt
go to the whole group, and fastt waits for it to be gone: no rank outlives the command, and its temporary
folder is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .cluster import cluster, cuda_cluster
from .errors import FasttError, Interrupted
from .netns import capped


def run_torchrun(a: argparse.Namespace, planners: Sequence[str]) -> dict:
    """`fastt run` with one process per device: torchrun on this machine running `python -m fastt.launch`.
    torchrun's own output goes to a log file, kept (and named) only if the job fails. With `a.network` (a
    `netns.Network`), torchrun and its ranks run in a network namespace of their own, its loopback capped."""
    nproc, device, env = _torchrun_ranks(a.devices)
    fd, log_path = tempfile.mkstemp(prefix="fastt-torchrun-", suffix=".log")
    keep_log = False
    try:
        with tempfile.TemporaryDirectory() as tmp, os.fdopen(fd, "w") as log:
            out_path = Path(tmp) / "run.json"
            cmd = _torchrun_command(a, planners, nproc, device, out_path)
            net = a.network
            # torchrun's own temporary files too, so that they go with the folder even when it is killed
            rc = run_group(capped(net, cmd) if net else cmd, {**env, "TMPDIR": tmp}, log)
            if rc != 0 or not out_path.is_file():
                keep_log = True
                raise FasttError(f"torchrun failed: {_rank_failure(Path(log_path))} "
                                 f"(torchrun's log: {log_path})")
            out = json.loads(out_path.read_text())
            return {**out, "network": net.rate} if net else out
    finally:
        if not keep_log:
            Path(log_path).unlink(missing_ok=True)


def _torchrun_ranks(devices: str) -> tuple[int, str, dict[str, str]]:
    """(ranks, device kind, environment) of `--launcher torchrun --devices SPEC`."""
    spec, env = devices.strip().lower(), dict(os.environ)
    if re.fullmatch(r"cpu:\d+", spec):
        return len(cluster(spec)), "cpu", env
    if m := re.fullmatch(r"cuda(?::(\d+(?:,\d+)*))?", spec):  # a GPU per rank: those named, or all
        ids = None if m[1] is None else [int(i) for i in m[1].split(",")]
        if ids is not None and len(set(ids)) < len(ids):
            raise FasttError("--launcher torchrun runs one rank per GPU (NCCL cannot put two on one): "
                             f"{devices} names a GPU twice; use --launcher local for streams of one GPU")
        nproc = len(cuda_cluster(ids))
        if ids is not None:  # GPU LOCAL_RANK of each rank is the one named (ids count visible GPUs)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible.split(",")[i] if visible else str(i) for i in ids)
        return nproc, "cuda", env
    raise FasttError("--launcher torchrun runs cpu:N (a process per CPU device, gloo) or cuda[:i,j,...] "
                     "(a process per GPU, NCCL)")


def _torchrun_command(a: argparse.Namespace, planners: Sequence[str], nproc: int, device: str,
                      out_path: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "fastt.launch", "--device", device, "--model", a.model, "--size", a.size,
            *(["--optimizer", a.optimizer] if a.optimizer else []),
            "--planners", ",".join(planners), "--steps", str(a.steps), "--timeout", str(a.timeout),
            "--out", str(out_path), *(["--batch", str(a.batch)] if a.batch else []),
            *(["--check"] if a.check else []), *(["--tune"] if a.tune else []),
            *([] if a.trial else ["--no-trial"]),
            *(["--clip-grad-norm", str(a.clip_grad_norm)] if a.clip_grad_norm is not None else []),
            "--precision", a.precision,
            *(["--data", a.data] if a.data else [])]


def _rank_failure(log: Path) -> str:
    """What the job's failure was: a rank that died of a signal, as torchrun saw it first (a killed rank says
    nothing; its peers may only say they lost it), else the first failure the ranks recorded (every survivor
    reports it), else the rank torchrun saw fail, else the end of torchrun's log."""
    text = log.read_text(errors="replace")
    root = text.split("Root Cause", 1)[1] if "Root Cause" in text else ""
    rank = re.search(r"\brank\s*:\s*(\d+)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG\w+)\))?\s*$", root, re.MULTILINE)
    died = (f"rank {rank[1]} died ({f'killed by {code[2]}' if code[2] else f'exit code {code[1]}'})"
            if rank and code else None)
    if died and code[2]:
        return f"{died} without a word: was it killed, or out of memory?"
    said = [line[len("fastt: "):] for line in text.splitlines()
            if line.startswith("fastt: ") and "kills itself" not in line]
    first = [m[1] for line in said if (m := re.search(r"\(first failure in the job: (.*)\)$", line))]
    if first or said:
        return (first or said)[0]
    return died or " ".join(text.strip().splitlines()[-1:])[-300:] or "no output"


def run_group(cmd: Sequence[str], env: dict[str, str], log) -> int:
    """Run `cmd` in a process group of its own, its output to `log`, and return its exit code. SIGINT and
    SIGTERM to this process go to the whole group (torchrun and every rank); this waits until the group is
    gone, then raises Interrupted, so that no rank outlives the command."""
    got: list[int] = []
    proc: list[subprocess.Popen] = []

    def forward(signum: int, _frame) -> None:
        got.append(signum)
        if proc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc[0].pid, signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True))
        if got:  # a signal while it started
            forward(got[0], None)
        while proc[0].poll() is None and not got:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc[0].wait(timeout=0.5)
        if got:
            _stop_group(proc[0])
            raise Interrupted(got[0])
        return proc[0].returncode
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _stop_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Wait until no process of `proc`'s group is left (reaping `proc`), killing the group after `grace_s`: a
    rank in a collective may not see the signal until its peers' timeout. Gives up a second after the kill on
    processes that are gone but not yet reaped by their new parent."""
    kill_at = time.monotonic() + grace_s
    while time.monotonic() < kill_at + 1.0:
        proc.poll()
        try:
            os.killpg(proc.pid, signal.SIGKILL if time.monotonic() > kill_at else 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
