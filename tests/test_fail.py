"""Every bad input of issue 20 is one line on stderr and exit code 2 (an interrupt: 128 + the signal), run as a
user runs it (a subprocess per command); an interrupted `fastt run --launcher torchrun` leaves no process and no
temporary file behind; and random garbage in a cluster or strategy file is never anything but a FasttError.

The quick commands run at once, four at a time (each is mostly interpreter start-up, 3-4 s of CPU: torch, scipy,
sympy); the torchrun ones are the slow ones (a few seconds of start-up for their ranks). To keep the file short,
the rows marked in-process run `fastt.cli.main` here, with its stderr captured: they are refused before any
torch work and their code path is the same; every row of the issue's table has a subprocess of its own kind.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import ENV, FASTT

import fastt
from fastt.cluster import MAX_DEVICES, cpu_threads, gpu_cluster
from fastt.cluster_file import from_dict
from fastt.errors import FasttError
from fastt.strategy import Strategy
from fastt.workload import load_workload

MODELS = '''
import torch
from torch import nn


def _parts(batch=8, optimizer="sgd"):
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(m.parameters(), lr=0.1)
    return m, nn.functional.cross_entropy, opt, (torch.randn(batch, 4), torch.randint(0, 2, (batch,)))


def three():
    return _parts()[:3]


def five():
    return (*_parts(), 5)


def number():
    return 3


def plain():
    return _parts()


def sized(batch=8, optimizer="sgd"):
    return _parts(batch, optimizer)


def vector_loss():  # a loss of shape (1,): one element, but not a scalar
    m, _, opt, inputs = _parts()
    return m, lambda out, y: out.sum().reshape(1), opt, inputs
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the models above (m.py), bad cluster files, and garbage cluster and strategy files."""
    d = tmp_path_factory.mktemp("fail")
    (d / "m.py").write_text(MODELS)
    for name, (dev, key, value) in {"nan": (1, "flops", math.nan), "huge": (0, "memory_bytes", 1e30)}.items():
        data = gpu_cluster("V100", 2).to_dict()
        data["devices"][dev][key] = value
        (d / f"{name}.json").write_text(json.dumps(data))  # json writes NaN, as a hand-edited file may hold it
    (d / "junk-cluster.json").write_text(json.dumps({"devices": [{"name": [1, {"a": None}], "kind": 3}],
                                                     "links": "fast", "routes": [[None]]}))
    (d / "junk-strategy.json").write_text(json.dumps({"format": "fastt-strategy", "version": 1, "planner": 7,
                                                      "placement": [], "order": {"a": [1.5]}}))
    return d


def fastt_cmd(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FASTT, *args], check=False, cwd=cwd, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=300)


def one_line(r: subprocess.CompletedProcess, *said: str, code: int = 2) -> str:
    """The one line on stderr, after checking the exit code and that it says each of `said`."""
    lines = r.stderr.splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0].startswith("fastt: ") and all(s in lines[0] for s in said), lines[0]
    assert "Traceback" not in r.stderr
    return lines[0]


NOWHERE = "no-such-folder/out"
TEST = ("--size", "test")
# row: (arguments, environment, exit code, what its line says); IN_PROCESS: rows run by cli.main here.
ROWS: dict[str, tuple[list[str], dict, int, tuple[str, ...]]] = {
    "returns 3 items": (["plan", "--model", "m.py:three", "--cluster", "2xV100"], {}, 2, ("returned 3 items",)),
    "returns 5 items": (["simulate", "--model", "m.py:five", "--cluster", "2xV100"], {}, 2, ("returned 5 items",)),
    "returns an int": (["plan", "--model", "m.py:number", "--cluster", "2xV100"], {}, 2, ("type int",)),
    "NaN flops": (["plan", "--model", "mlp", *TEST, "--cluster", "nan.json"], {}, 2, ("device 1: flops", "nan")),
    "huge memory": (["plan", "--model", "mlp", *TEST, "--cluster", "huge.json"], {}, 2,
                    ("device 0: memory_bytes", "1e+30")),
    "100000 devices": (["plan", "--model", "mlp", *TEST, "--cluster", "100000xV100"], {}, 2,
                       (f"at most {MAX_DEVICES}",)),
    "cpu:N over the cores": (["run", "--model", "mlp", "--devices", f"cpu:{cpu_threads(1) + 1}", "--planners", "eager",
                              "--steps", "1"], {}, 0, ("warning", f"on {cpu_threads(1)} cores")),
    "--batch to a function without it": (["plan", "--model", "m.py:plain", "--cluster", "2xV100", "--batch", "16"],
                                         {}, 2, ("takes no 'batch'",)),
    "--optimizer to a function without it": (["plan", "--model", "m.py:plain", "--cluster", "2xV100", "--optimizer",
                                              "adam"], {}, 2, ("takes no 'optimizer'",)),
    "--steps 0": (["run", "--model", "mlp", "--steps", "0"], {}, 2, ("--steps", "'0'")),
    "--budget -1": (["plan", "--model", "mlp", "--cluster", "2xV100", "--budget", "-1"], {}, 2, ("--budget",)),
    "--budget nan": (["plan", "--model", "mlp", "--cluster", "2xV100", "--budget", "nan"], {}, 2, ("--budget",)),
    "--out unwritable": (["plan", "--model", "resnet50", "--cluster", "8xA100", "--out", f"{NOWHERE}/s.json"], {}, 2,
                         ("cannot write",)),
    "--trace unwritable": (["simulate", "--model", "mlp", *TEST, "--cluster", "2xV100", "--trace",
                            f"{NOWHERE}/t.json"], {}, 2, ("cannot write",)),
    "--gantt unwritable": (["simulate", "--model", "mlp", *TEST, "--cluster", "2xV100", "--gantt",
                            f"{NOWHERE}/g.png"], {}, 2, ("cannot write",)),
    "non-scalar loss": (["plan", "--model", "m.py:vector_loss", "--cluster", "2xV100"], {}, 2,
                        ("must return a scalar", "(1,)")),
    "FASTT_FAULT garbage": (["run", "--model", "mlp", "--launcher", "torchrun"], {"FASTT_FAULT": "garbage"}, 2,
                            ("FASTT_FAULT",)),
    "garbage cluster file": (["plan", "--model", "mlp", *TEST, "--cluster", "junk-cluster.json"], {}, 2,
                             ("junk-cluster.json",)),
    "garbage strategy file": (["simulate", "--model", "mlp", *TEST, "--cluster", "2xV100", "--strategy",
                               "junk-strategy.json"], {}, 2, ("strategy",)),
}
# the rows left to subprocesses: a model file's error, a warning, the launcher's environment (each a fresh
# interpreter importing torch: 2-3 s of a core)
IN_PROCESS = set(ROWS) - {"returns 3 items", "cpu:N over the cores", "FASTT_FAULT garbage"}


@pytest.fixture(scope="module")
def ran(files: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every row's command, four at a time, plus the runs that must succeed quietly."""
    cases = {k: (args, env) for k, (args, env, _, _) in ROWS.items() if k not in IN_PROCESS}
    cases["file model by name"] = (["compare", "--model", f"{files / 'm.py'}:sized", "--cluster", "2xV100",
                                    "--planners", "dp", "--batch", "16", "--optimizer", "adam"], {})
    cases["quiet run"] = (["run", "--model", "mlp", "--devices", "cpu:1", "--planners", "dp", "--steps", "1"], {})
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(fastt_cmd, *args, cwd=files, env=env) for k, (args, env) in cases.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("row", [r for r in ROWS if r not in IN_PROCESS])
def test_each_bad_input_is_one_line(row: str, ran: dict) -> None:
    _, _, code, said = ROWS[row]
    one_line(ran[row], *said, code=code)


@pytest.mark.parametrize("row", sorted(IN_PROCESS))
def test_each_bad_input_is_one_line_in_process(row: str, files: Path, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from fastt import cli

    args, env, code, said = ROWS[row]
    monkeypatch.chdir(files)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = cli.main(args)
    out = capsys.readouterr()
    one_line(subprocess.CompletedProcess(args, got, out.out, out.err), *said, code=code)


def test_fastt_debug_shows_the_traceback(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTT_DEBUG=1: the error is raised out of main (Python prints its traceback), not turned into a line."""
    from fastt import cli

    monkeypatch.chdir(files)
    monkeypatch.setenv("FASTT_DEBUG", "1")
    with pytest.raises(FasttError, match="returned an object of type int"):
        cli.main(ROWS["returns an int"][0])


def test_a_file_model_takes_batch_and_optimizer_and_is_named_by_its_function(ran: dict) -> None:
    """The table names the model m:sized, not the whole path, and shows the batch the function was given."""
    r = ran["file model by name"]
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("m:sized"))
    assert row.split()[:3] == ["m:sized", "dp", "16"] and "m.py" not in r.stdout, r.stdout


def test_the_optimizer_option_reaches_a_file_model(files: Path) -> None:
    _, _, opt, inputs = load_workload(f"{files / 'm.py'}:sized", "test", 4, "adam")[1:]
    assert isinstance(opt, torch.optim.Adam) and inputs[0].shape[0] == 4


def test_a_run_says_nothing_on_stderr(ran: dict) -> None:
    """No oneDNN "TF32 acceleration" warning from the flags fastt sets."""
    r = ran["quiet run"]
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]


def test_a_wrong_batch_to_step_names_the_argument() -> None:
    """In-process: the Python API raises, there is no command line. The count, a dtype, a shape, a non-tensor."""
    from fastt.capture import capture_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    step = capture_step(model, torch.nn.functional.cross_entropy, opt, (x, y))
    for batch, said in [((x,), "got 1 argument(s), the captured step takes 2"),
                        ((x, y.float()), ("argument 1 is a torch.float32 tensor of shape (8,), the captured step's "
                                         "is torch.int64")),
                        ((x[:, :3], y), "argument 0 is a torch.float32 tensor of shape (8, 3)"),
                        ((x, 3), "argument 1 is of type int, not a tensor")]:
        with pytest.raises(FasttError, match=r"^step\(\.\.\.\) ") as e:
            step.run(model, opt, *batch)
        assert said in str(e.value)
    step.run(model, opt, x, y)  # the right batch still runs
    graph = fastt.capture(model, torch.nn.functional.cross_entropy, opt, (x, y))
    for batch in [(x,), (x.double(), y)]:  # measuring the step: a worker's KeyError or a kernel's dtype error
        with pytest.raises(FasttError, match=r"^measure: example_inputs are"):
            fastt.measure(graph, model, opt, batch, progress=False)


# ---------------------------------------------------------------------------------------------------------------
# torchrun: a killed rank, and signals to the command


def _tagged(tag: str) -> list[tuple[int, str]]:
    """Live processes (not zombies) whose environment carries FASTT_TEST_TAG=tag: the command and everything it
    started, however they were re-parented or re-grouped."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"FASTT_TEST_TAG={tag}".encode() not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found.append((int(pid), cmdline))
    return found


TORCHRUN = ["run", "--model", "mlp", "--launcher", "torchrun", "--planners", "dp", "--no-trial",
            "--timeout", "10"]


def test_a_killed_rank_is_named_in_one_line(tmp_path: Path) -> None:
    r = fastt_cmd(*TORCHRUN, "--steps", "3", cwd=tmp_path, env={"FASTT_FAULT": "1:1:kill"})
    line = one_line(r, "torchrun failed: rank 1 died (killed by SIGKILL)", "torchrun's log: ")
    log = Path(line.rsplit("torchrun's log: ", 1)[1].rstrip(")"))
    assert "Root Cause" in log.read_text()  # torchrun's account is kept, out of stderr
    log.unlink()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_rank_and_leaves_no_files(sig: signal.Signals, tmp_path: Path) -> None:
    """SIGINT or SIGTERM to the command alone, as a job scheduler sends it, once its ranks train: it exits
    128 + the signal in one line, no process it started is left 10 s later, and its temporary folder (TMPDIR
    here) is empty."""
    tag, tmp = uuid.uuid4().hex, tmp_path / "tmp"
    tmp.mkdir()
    env = {**ENV, "FASTT_TEST_TAG": tag, "TMPDIR": str(tmp)}
    p = subprocess.Popen([*FASTT, *TORCHRUN, "--steps", "100000"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while sum("-m fastt.launch" in c for _, c in _tagged(tag)) < 2 and p.poll() is None:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(1.0)  # into their steps
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        stopped = time.monotonic()
        while _tagged(tag) and time.monotonic() - stopped < 10:
            time.sleep(0.1)
        assert _tagged(tag) == [] and list(tmp.iterdir()) == []
        assert p.returncode == 128 + sig and err.splitlines() == [
            f"fastt: interrupted ({sig.name}); nothing it started is left running"], err[-3000:]
    finally:
        for pid, _ in _tagged(tag):  # only what this test started
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_during_start_up_is_one_line(tmp_path: Path) -> None:
    """SIGINT while torch loads: once the process has mapped torch's library (fastt's package is loading then;
    a fixed delay sent it, on a loaded machine, before Python had reached fastt at all)."""
    p = subprocess.Popen([*FASTT, "run", "--model", "mlp"], cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "libtorch" not in Path(f"/proc/{p.pid}/maps").read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and len(err.splitlines()) == 1 and err.startswith("fastt: interrupted"), err[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# Garbage in the parsers: random junk anywhere in a valid cluster or strategy file

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats() | st.text(max_size=6)
    | st.sampled_from(["0", "1", "V100:0", "nan", "1e400", "-1", "0,1", "1,0", "a,b,c"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


def _strings(doc: object) -> list[str]:
    """Every string in doc, keys too (op, device and link names: junk that gets past a type check)."""
    if isinstance(doc, dict):
        return [*doc, *(t for v in doc.values() for t in _strings(v))]
    if isinstance(doc, list):
        return [t for v in doc for t in _strings(v)]
    return [doc] if isinstance(doc, str) else []


def _like(value: object, names: list[str]) -> st.SearchStrategy:
    """Junk of value's own type: small or negative numbers, another name, a list shortened or repeated."""
    if isinstance(value, bool) or value is None:
        return JUNK
    if isinstance(value, (int, float)):
        return st.sampled_from([0, 1, 2, 3, -1, 0.5, 1e30, math.inf, math.nan])
    if isinstance(value, str):
        return st.sampled_from(names or [""])
    if isinstance(value, list):
        return st.sampled_from([[], value[:1], value[1:], value + value[:1], value[::-1]])
    return st.just({})


def _mutated(draw, doc: object) -> object:
    """doc with 1-3 values somewhere inside (or doc itself) replaced by junk, of any type or of its own."""
    doc, names = copy.deepcopy(doc), sorted(set(_strings(doc)))
    for _ in range(draw(st.integers(1, 3))):
        node = doc
        while isinstance(node, (dict, list)) and node:
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)) or not node[key] or draw(st.booleans()):
                node[key] = draw(JUNK | _like(node[key], names))
                break
            node = node[key]
        else:
            doc = draw(JUNK)
    return doc


CLUSTER_DOCS = [gpu_cluster("V100", 2).to_dict(), gpu_cluster("A100", 1, nodes=2).to_dict()]
GARBAGE = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@GARBAGE
@given(st.data())
def test_garbage_in_a_cluster_file_is_a_fastt_error(data: st.DataObject) -> None:
    doc = _mutated(data.draw, data.draw(st.sampled_from(CLUSTER_DOCS)))
    try:
        cl = from_dict(doc)
    except FasttError:
        return
    assert all(math.isfinite(d.flops) and d.memory_bytes > 0 for d in cl.devices)
    assert len(cl.routes) == len(cl.devices) * (len(cl.devices) - 1)


@pytest.fixture(scope="module")
def tiny() -> tuple:
    """A captured two-layer step and a valid strategy of it on 2xV100 (what the strategy garbage mutates)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = fastt.capture(model, torch.nn.functional.cross_entropy, opt, (torch.randn(8, 4), torch.randint(0, 2, (8,))))
    return g, json.loads(fastt.plan(g, "2xV100", "dpos").to_json())


@GARBAGE
@given(st.data())
def test_garbage_in_a_strategy_file_is_a_fastt_error(tiny: tuple, data: st.DataObject) -> None:
    """Parsed, then simulated as `fastt simulate --strategy` does: a FasttError or a timeline, nothing else."""
    g, doc = tiny
    text = data.draw(st.sampled_from([None, "text"]))
    text = data.draw(st.text(max_size=20)) if text else json.dumps(_mutated(data.draw, doc))
    try:
        fastt.simulate(g, Strategy.from_json(text), "2xV100")
    except FasttError:
        pass



def test_fastts_warnings_are_one_line_each_once(capsys: pytest.CaptureFixture) -> None:
    """What fastt did otherwise than the user's code asked (activation checkpoints traced as plain calls) is one
    line on stderr, once however often it is said (every capture says it); on a rank but the first, nothing."""
    import warnings

    from fastt.errors import FasttWarning, one_line_warnings

    with one_line_warnings():
        for _ in range(2):
            warnings.warn("traced as plain calls", FasttWarning, stacklevel=1)
    assert capsys.readouterr().err == "fastt: warning: traced as plain calls\n"
    with one_line_warnings(show=False):
        warnings.warn("traced as plain calls", FasttWarning, stacklevel=1)
    assert capsys.readouterr().err == ""
