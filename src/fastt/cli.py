"""The `fastt` command line: plan, simulate, compare, demo. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from . import api, netns, zoo
from .capture import check_clip, fused_kernels
from .cluster import Cluster, cluster, cpu_threads
from .cost import MeasuredCosts, calibrate_cpu, check_bf16, measure_step
from .errors import FasttError, Interrupted, one_line_warnings
from .graph import OpGraph, replica_of
from .launch import fault_spec, positive_float, positive_int, precision_option, training_options
from .layers import where
from .plan import PLANNERS, get_planner
from .plan.portfolio import OPTIONAL
from .precision import dtype_of
from .report import format_run, run_trace, write_gantt, write_trace
from .simulate import inter_node_bytes
from .split import graph_for
from .strategy import Strategy
from .torchrun import run_torchrun
from .workload import check_models, is_file_spec, load_workload, model_name


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        raise FasttError(f"{message} (see `{self.prog} --help`)")


def check_writable(*paths: str | None) -> None:
    """Refuse an output file that cannot be written, before the long work (capture, planning) whose result it
    would hold: a file that did not exist is made and removed again."""
    for path in paths:
        if not path:
            continue
        target = Path(path)
        if target.is_dir():
            raise FasttError(f"{path} is a folder: give the name of a file to write")
        existed = target.exists()
        try:
            with open(target, "a"):
                pass
        except OSError as e:
            raise FasttError(f"cannot write {path}: {e.strerror}; "
                             "give a path in a folder you can write") from None
        if not existed:
            target.unlink()


def load_graph(spec: str, size: str, batch: int | None, optimizer: str | None,
               autocast: torch.dtype | None = None) -> OpGraph:
    """Capture the training step of a model spec (see load_workload), its forward under `torch.autocast` in
    `autocast` if given."""
    name, model, loss_fn, opt, inputs = load_workload(spec, size, batch, optimizer)
    return api.capture(model, loss_fn, opt, inputs, name=name, autocast=autocast)


def precision_for(a: argparse.Namespace, cl: Cluster | None = None) -> torch.dtype | None:
    """The autocast dtype of `--precision`, refused before the capture where the cluster cannot run it."""
    dtype = dtype_of(a.precision)
    if dtype == torch.bfloat16 and cl is not None:
        check_bf16(cl)
    return dtype


def measured_costs(workload: tuple, graph: OpGraph, strategy: Strategy,
                   cost_file: str | None) -> MeasuredCosts:
    """Op times measured on this CPU for the graphs `strategy` runs (the step at batch/replicas), cached in
    `cost_file` when given."""
    if cost_file and Path(cost_file).is_file():
        return MeasuredCosts.load(cost_file)
    _, model, _, opt, inputs = workload
    if any(getattr(x, "fake_mode", None) is not None or type(x).__name__ == "FakeTensor" for x in inputs):
        raise FasttError("measured costs need real tensors: use --size test (paper sizes are traced fake)")
    from .runtime.step import busy_devices

    costs = measure_step(graph, model, opt, inputs, [graph.batch // strategy.replicas],
                         max(1, torch.get_num_threads() // strategy.n_devices), busy_devices(strategy))
    if cost_file:
        costs.save(cost_file)
    return costs


def _gb(n: float) -> float:
    return round(n / 1e9, 2)


def compare(models: Sequence[str], cl: Cluster, planners: Sequence[str], size: str, batch: int | None,
            optimizer: str | None, progress: bool = True, budget_s: float | None = None,
            autocast: torch.dtype | None = None) -> list[dict]:
    """Every planner on every model, simulated (the forward under `torch.autocast` in `autocast`, if given):
    the rows of `fastt compare`."""
    check_models(models)
    rows = []
    # Only on a terminal (disable=None), and cleared on an error, so that a failure leaves one line on stderr.
    bar = tqdm(total=len(models) * len(planners), desc="compare", disable=None if progress else True,
               file=sys.stderr)
    try:
        rows = _compare_rows(models, cl, planners, size, batch, optimizer, bar, budget_s, autocast)
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()
    return rows


def _compare_rows(models: Sequence[str], cl: Cluster, planners: Sequence[str], size: str, batch: int | None,
                  optimizer: str | None, bar: tqdm, budget_s: float | None,
                  autocast: torch.dtype | None) -> list[dict]:
    rows = []
    for m in models:
        bar.set_postfix_str(f"capturing {m}")
        graph = load_graph(m, size, batch, optimizer, autocast)
        results = {}
        for p in planners:
            bar.set_postfix_str(f"{m}: {p}")
            t0 = time.perf_counter()
            try:
                strategy = api.plan(graph, cl, p, budget_s=budget_s)
            except FasttError as e:
                if p not in OPTIONAL:
                    raise
                # an expert plan that does not apply
                rows.append({"model": model_name(m), "planner": p, "skipped": str(e)})
                bar.update()
                continue
            plan_s = time.perf_counter() - t0
            results[p] = (api.simulate(graph, strategy, cl), plan_s, strategy)
            bar.update()
        dp_time = results["dp"][0].iteration_s if "dp" in results else None
        for p, (tl, plan_s, strategy) in results.items():
            rows.append({
                "model": model_name(m), "planner": p, "iteration_s": tl.iteration_s,
                "lower_bound_s": tl.lower_bound_s,
                "lower_bound_ratio": tl.iteration_s / tl.lower_bound_s if tl.lower_bound_s else None,
                "speedup_over_dp": dp_time / tl.iteration_s if dp_time else None, "plan_s": plan_s,
                "peak_memory_bytes": [int(b) for b in tl.peak_memory_bytes], "fits": bool(tl.fits),
                "tight": list(tl.tight), "oom": list(tl.oom), "splits": len(strategy.splits),
                "ops": len(graph.ops),
                "fx_nodes": graph.fx_nodes, "batch": graph.batch,
                "inter_node_bytes": inter_node_bytes(tl, cl),
            })
    return rows


def largest_batches(model: str, cl: Cluster, planners: Sequence[str], size: str, optimizer: str | None,
                    budget_s: float | None = None, autocast: torch.dtype | None = None) -> list[dict]:
    """For each planner, the largest batch (a multiple of the device count, to within an eighth) whose plan
    the simulator fits on `cl`, its samples/s and what the plan is (`plan_words`): doubling from the model's
    batch, then bisecting. Each batch is a capture of its own, shared by the planners."""
    n = len(cl.devices)
    graphs: dict[int | None, OpGraph] = {None: load_graph(model, size, None, optimizer, autocast)}

    def run(b: int, p: str):  # p's plan at batch b and its simulated timeline, None where p has no plan
        if b not in graphs:
            graphs[b] = load_graph(model, size, b, optimizer, autocast)
        try:
            s = api.plan(graphs[b], cl, p, budget_s=budget_s)
        except FasttError:
            if p not in OPTIONAL:
                raise
            return None
        return s, api.simulate(graphs[b], s, cl)
    start = max(n, graphs[None].batch // n * n)
    rows = []
    for p in planners:
        timelines: dict = {}

        def fits(b: int, p: str = p, t: dict = timelines) -> bool:
            if b not in t:
                t[b] = run(b, p)
            return t[b] is not None and t[b][1].fits
        lo = _largest(start, n, fits)
        s, tl = timelines.get(lo) or (None, None)
        rows.append({"model": model_name(model), "planner": p, "max_batch": lo,
                     "iteration_s": tl.iteration_s if tl else None,
                     "samples_per_s": lo / tl.iteration_s if tl else 0.0,
                     "peak_memory_bytes": [int(b) for b in tl.peak_memory_bytes] if tl else [],
                     "plan": plan_words(s) if s else "-"})
    return rows


def plan_words(s: Strategy) -> str:
    """What a plan at a memory-bound batch is, in a few words: the shards of the batch it runs, the most of
    them one device runs (more than one: micro-batches, one after the other, as gradient accumulation and
    pipelines run them), and whether its updates are sharded."""
    per_device: dict[int, set[int]] = {}
    for name, d in s.placement.items():
        per_device.setdefault(d, set()).add(replica_of(name))
    most = max(map(len, per_device.values()), default=1)
    words = [f"{s.replicas} shard{'s' * (s.replicas > 1)}"]
    if most > 1:
        words.append(f"{most} micro-batches a device")
    if s.sharded:
        words.append("updates sharded")
    return ", ".join(words)


def _largest(start: int, n: int, fits) -> int:
    """The largest multiple of n for which fits(batch) holds (0 if none does), to within an eighth, assuming
    fitting is monotone: doubling (or halving) from `start`, then bisecting; at most 64 x start."""
    lo, hi = (start, None) if fits(start) else (0, start)
    while hi is None and lo < 64 * start:
        lo, hi = (2 * lo, None) if fits(2 * lo) else (lo, 2 * lo)
    while lo == 0 and hi >= 2 * n:
        half = hi // 2 // n * n
        lo, hi = (half, hi) if fits(half) else (0, half)
    while hi is not None and hi - lo > max(n, lo // 8):
        mid = (lo + hi) // 2 // n * n
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def format_largest(rows: list[dict], cl: Cluster) -> str:
    dp = {r["model"]: r for r in rows if r["planner"] == "dp"}
    out = [(f"largest batch that fits on {cl.name} "
            f"({len(cl.devices)} x {_gb(cl.devices[0].memory_bytes):g} GB), simulated"),
           f"{'model':<12}{'planner':<12}{'max batch':>10}{'iter ms':>10}{'samples/s':>11}{'vs DP':>8}  plan"]
    for r in rows:
        base = dp.get(r["model"])
        vs = f"{r['max_batch'] / base['max_batch']:.2f}x" if base and base["max_batch"] else "-"
        it = f"{r['iteration_s'] * 1e3:.1f}" if r["iteration_s"] else "-"
        out.append(f"{r['model']:<12}{r['planner']:<12}{r['max_batch']:>10}{it:>10}"
                   f"{r['samples_per_s']:>11.1f}{vs:>8}  {r['plan']}")
    return "\n".join(out)


def format_table(rows: list[dict], cl: Cluster) -> str:
    head = ("model", "planner", "batch", "iter ms", "vs DP", "/LB", "plan s", "peak GB per device", "fits",
            "splits")
    nodes = len({d.node for d in cl.devices})
    head += ("inter-node GB",) if nodes > 1 else ()
    lines = []
    planned = [r for r in rows if "skipped" not in r]
    for r in planned:
        sp = f"{r['speedup_over_dp']:.2f}x" if r["speedup_over_dp"] else "-"
        lb = f"{r['lower_bound_ratio']:.2f}" if r["lower_bound_ratio"] else "-"
        mem = " ".join(f"{_gb(b):g}" for b in r["peak_memory_bytes"])
        fits = ("tight" if r.get("tight") else "yes") if r["fits"] else "NO"
        lines.append((r["model"], r["planner"], str(r["batch"]), f"{r['iteration_s'] * 1e3:.1f}", sp, lb,
                      f"{r['plan_s']:.2f}", mem, fits, str(r["splits"]))
                     + ((f"{r['inter_node_bytes'] / 1e9:.3f}",) if nodes > 1 else ()))
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [(f"cluster {cl.name}: {len(cl.devices)} x {cl.devices[0].kind}"
            + (f" in {nodes} nodes" if nodes > 1 else "") + f", {_gb(cl.devices[0].memory_bytes):g} GB each"),
           fmt.format(*head)]
    out += [fmt.format(*line) for line in lines]
    out += [f"  {r['model']}/{r['planner']} does not fit: {'; '.join(r['oom'])}" for r in planned
            if not r["fits"]]
    out += [f"  {r['model']}/{r['planner']}: no plan ({r['skipped']})" for r in rows if "skipped" in r]
    return "\n".join(out)


def cmd_compare(a: argparse.Namespace) -> None:
    cl = cluster(a.cluster)
    autocast = precision_for(a, cl)
    planners = [p.strip() for p in a.planners.split(",")]
    for p in planners:
        get_planner(p)
    if a.max_batch:
        models = [m.strip() for m in a.model.split(",")]
        check_models(models)
        rows = [r for m in models
                for r in largest_batches(m, cl, planners, a.size, a.optimizer, a.budget, autocast)]
        print(json.dumps({"cluster": a.cluster, "results": rows}) if a.json else format_largest(rows, cl))
        return
    rows = compare([m.strip() for m in a.model.split(",")], cl, planners, a.size, a.batch, a.optimizer,
                   progress=not a.json, budget_s=a.budget, autocast=autocast)
    if a.json:
        print(json.dumps({"cluster": a.cluster, "results": rows}))
    else:
        print(format_table(rows, cl))


def cmd_plan(a: argparse.Namespace) -> None:
    cl = cluster(a.cluster)
    check_writable(a.out)
    get_planner(a.planner)  # fail before the capture, which may take seconds
    graph = load_graph(a.model, a.size, a.batch, a.optimizer, precision_for(a, cl))
    strategy = api.plan(graph, cl, a.planner, budget_s=a.budget)
    if a.out:
        strategy.save(a.out)
    tl = api.simulate(graph, strategy, cl)
    held = where(graph, strategy.holders, [d.node for d in cl.devices], strategy.sharded, strategy.chained)
    summary = {"model": a.model, "cluster": a.cluster, "planner": a.planner, "precision": a.precision,
               "iteration_s": tl.iteration_s,
               "fits": bool(tl.fits), "out": a.out, "ops": len(graph.ops), "fx_nodes": graph.fx_nodes,
               "layers": [{"layers": names, "held_on": devs} for names, devs in held]}
    print(json.dumps(summary) if a.json else
          f"{model_name(a.model)} on {a.cluster} with {a.planner}: "
          f"{tl.iteration_s * 1e3:.1f} ms per iteration{'' if tl.fits else ' (does not fit)'}; "
          f"{graph.fx_nodes} aten nodes grouped into {len(graph.ops)} ops"
          + (f"; strategy written to {a.out}" if a.out else "")
          + "".join(f"\n  {names}: {devs}" for names, devs in held))


def cmd_simulate(a: argparse.Namespace) -> None:
    cl = cluster(a.cluster)
    check_writable(a.trace, a.gantt, None if a.cost_file and Path(a.cost_file).is_file() else a.cost_file)
    if a.costs == "measured":
        if any(d.kind != "cpu" for d in cl.devices):
            raise FasttError("--costs measured times ops on this machine: use a cpu:N cluster")
        cl = calibrate_cpu(cl)
    # Read the strategy, or check the planner, before the capture, which may take seconds.
    loaded = Strategy.load(a.strategy) if a.strategy else None
    if loaded is None:
        get_planner(a.planner)
    autocast = precision_for(a, cl)
    workload = load_workload(a.model, a.size, a.batch, a.optimizer)
    graph = api.capture(*workload[1:], name=workload[0], autocast=autocast)
    strategy = loaded or api.plan(graph, cl, a.planner, budget_s=a.budget)
    measured = measured_costs(workload, graph, strategy, a.cost_file) if a.costs == "measured" else None
    tl = api.simulate(graph, strategy, cl, measured)
    g = graph_for(graph, strategy)
    if a.trace:
        write_trace(tl, g, a.trace)
    if a.gantt:
        write_gantt(tl, g, a.gantt)
    summary = {"model": a.model, "cluster": a.cluster, "planner": strategy.planner,
               "iteration_s": tl.iteration_s, "lower_bound_s": tl.lower_bound_s, "fits": bool(tl.fits),
               "oom": list(tl.oom), "tight": list(tl.tight),
               "peak_memory_bytes": [int(b) for b in tl.peak_memory_bytes],
               "busy_s": [float(b) for b in tl.busy_s], "critical_path_ops": len(tl.critical_path),
               "inter_node_bytes": inter_node_bytes(tl, cl),
               "trace": a.trace, "gantt": a.gantt}
    if a.json:
        print(json.dumps(summary))
        return
    print(f"{model_name(a.model)} on {cl.name} ({strategy.planner}): {tl.iteration_s * 1e3:.2f} ms per "
          f"iteration, lower bound {tl.lower_bound_s * 1e3:.2f} ms")
    for d, dev in enumerate(cl.devices):
        print(f"  {dev.name}: busy {tl.busy_s[d] * 1e3:.1f} ms, "
              f"peak memory {_gb(tl.peak_memory_bytes[d]):g} GB of {_gb(dev.memory_bytes):g} GB")
    tight = ", ".join(cl.devices[d].name for d in tl.tight)
    print(("  fits" + (f", TIGHT (over 90% of memory: {tight})" if tight else "")) if tl.fits
          else "  DOES NOT FIT: " + "; ".join(tl.oom))
    for path in (a.trace, a.gantt):
        if path:
            print(f"  wrote {path}")


def cmd_run(a: argparse.Namespace) -> None:
    from .runtime.bench import run_planners

    planners = [p.strip() for p in a.planners.split(",")]
    for p in planners:
        if p != "eager":
            get_planner(p)
    check_models([a.model])
    check_clip(a.clip_grad_norm)  # before torchrun starts the ranks
    autocast = precision_for(a)
    fault_spec(os.environ.get("FASTT_FAULT", ""))
    warn_oversubscribed(a.devices)
    if a.data and not (is_file_spec(a.data) and Path(a.data.rsplit(":", 1)[0]).is_file()):
        raise FasttError(f"--data {a.data}: not path/to/file.py:function of an existing file")
    if a.network is not None:
        check_network(a)
    if a.trace is not None:
        if a.launcher != "local" or not _cpu_devices(a.devices):
            raise FasttError("--trace records the local launcher's worker threads: use it with --launcher "
                             "local --devices cpu:N")
        check_writable(a.trace)
    if a.launcher == "torchrun":
        out = run_torchrun(a, planners)
        print(json.dumps(out) if a.json else format_run(out))
        return
    if a.data:
        raise FasttError("--data trains one shard of every batch per rank: use it with --launcher torchrun")
    rnn = a.model in ("rnnlm", "gnmt")

    def make() -> tuple:
        torch.manual_seed(0)
        return load_workload(a.model, a.size, a.batch, a.optimizer)

    # The captured LSTM is the native decomposition: the eager reference runs the same kernels
    # (oneDNN, cuDNN off).
    events: list = []

    def traced(planner: str, index: int, spans: list, step) -> None:  # --trace: measured beside simulated
        names, g = [d.name for d in step.cluster.devices], graph_for(step.graph, step.strategy)
        events.extend(run_trace(planner, index, spans, names, step.timeline(), g))

    with fused_kernels(not rnn):
        out = run_planners(make, a.devices, planners, a.steps, a.check, a.tune, a.clip_grad_norm, a.trial,
                           autocast, traced if a.trace else None)
    if a.trace:
        Path(a.trace).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        out["trace"] = a.trace
    print(json.dumps(out) if a.json else format_run(out) + (f"\n  wrote {a.trace}" if a.trace else ""))


def check_network(a: argparse.Namespace) -> None:
    """`--network`: torchrun's ranks on CPU devices (gloo's traffic goes through the loopback), and a capped
    namespace this process can make; a FasttError saying which is not so."""
    if a.launcher != "torchrun" or not _cpu_devices(a.devices):
        raise FasttError(f"--network {a.network.rate} caps the loopback between the ranks' processes: use it "
                         "with --launcher torchrun --devices cpu:N")
    netns.check(a.network)


def network_rate(text: str) -> netns.Network:
    """An argparse type: `--network RATE` as tc writes a rate."""
    try:
        return netns.network(text)
    except FasttError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def _cpu_devices(devices: str) -> re.Match | None:
    """`cpu:N` read from `devices` (its N the match's group 1), else None."""
    return re.fullmatch(r"cpu:(\d+)", devices.strip().lower())


def warn_oversubscribed(devices: str) -> None:
    """One line on stderr where `cpu:N` asks for more worker devices (or ranks) than this process has cores:
    they run, each waiting for a core, so their measured times say little
    about a machine that has the cores."""
    m = _cpu_devices(devices)
    cores = cpu_threads(1)
    if m and int(m[1]) > cores:
        print(f"fastt: warning: {devices} runs {m[1]} worker devices on {cores} cores, so they wait for each "
              f"other and the measured times read high; use cpu:{cores} or fewer "
              "for times that mean something",
              file=sys.stderr, flush=True)


def cmd_demo(a: argparse.Namespace) -> None:
    """The main job: a real run on this machine's CPU worker devices (fastt tuned in the first steps, FastT's
    loop), a user's training loop around fastt (the digits example, small), then planners compared on
    simulated GPU clusters, and the mixed plans where data parallelism is bound by the
    network between nodes."""
    from .examples import digits
    from .runtime.bench import run_planners

    def make() -> tuple:
        torch.manual_seed(0)
        return load_workload(a.run_model, "test", None, "sgd")

    out = run_planners(make, "cpu:2", ["fastt", "dp", "single", "eager"], 16, check=True, tune=True)
    print(json.dumps(out) if a.json else format_run(out) + "\n")
    demo_network(a)
    # A user's loop end to end: an LR schedule and clipping around fastt, trained to a test accuracy.
    digits.main(["--small", "--plot", "digits_loss.png", *(["--json"] if a.json else [])])
    if not a.json:
        print()
    models = a.models.split(",")
    for spec in a.clusters.split(","):
        cl = cluster(spec)
        rows = compare(models, cl, ["fastt", "dp", "single", "dpos", "heft", "m-sct"], "paper", None, "sgd",
                       progress=not a.json)
        print(json.dumps({"cluster": spec, "results": rows}) if a.json else format_table(rows, cl) + "\n")
    # Where data parallelism waits on the network between nodes: the experts' mixed plans and fastt's choice.
    cl = cluster(a.mixed_cluster)
    rows = compare(a.mixed_models.split(","), cl, ["fastt", "dp", "os-dpos", *OPTIONAL], "paper", None, "sgd",
                   progress=not a.json)
    print(json.dumps({"cluster": a.mixed_cluster, "results": rows}) if a.json else
          "Mixed plans, where DP's gradients cross the nodes:\n" + format_table(rows, cl))


def demo_network(a: argparse.Namespace) -> None:
    """The demo's run over a slow network: `a.network_model` on 2 ranks over a loopback capped at
    `a.network`, fastt's plan and DP measured; where no capped namespace can be made, one line saying so."""
    run = parser().parse_args(["run", "--model", a.network_model, "--launcher", "torchrun",
                               "--devices", "cpu:2", "--network", a.network.rate, "--planners", "fastt,dp",
                               "--steps", "6"])
    try:
        check_network(run)
    except FasttError as e:
        print(f"fastt: demo: no run over a slow network here: {e}", file=sys.stderr, flush=True)
        return
    out = run_torchrun(run, ["fastt", "dp"])
    t = {r["planner"]: r["measured_iteration_s"] for r in out["results"]}
    print(json.dumps(out) if a.json else
          f"{format_run(out)}\n  over this slow network DP's measured step is {t['dp'] / t['fastt']:.1f}x "
          "fastt's\n")


def _common(p: argparse.ArgumentParser, cluster_default: str | None = None) -> None:
    p.add_argument("--model", required=True, help="zoo model name(s) or path/to/file.py:function")
    p.add_argument("--cluster", required=cluster_default is None, default=cluster_default,
                   help="cpu:N, cuda, NxGPU[-link] (4xV100, 8xA100-pcie), MxNxGPU, or a JSON file")
    p.add_argument("--size", default="paper", choices=("test", "paper"),
                   help="zoo model size (default paper)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="batch size (default: the size's; a file model's function gets it as its `batch`)")
    p.add_argument("--optimizer", default=None, choices=zoo.OPTIMIZERS,
                   help="default sgd (a file model's function gets it as its `optimizer`)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    precision_option(p)
    p.add_argument("--budget", type=positive_float, default=None, metavar="SECONDS",
                   help="bound the fastt planner's time, the capture at batch/N included (default 8.5), and "
                        "os-dpos's split search (default 6); each returns the best plan found so far")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="fastt", description="Automatic parallel training plans for PyTorch models (FastT).")
    sub = top.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="plan a model on a cluster")
    _common(p)
    p.add_argument("--planner", default="fastt", help=f"one of {', '.join(PLANNERS)}")
    p.add_argument("--out", help="write the strategy JSON here")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("simulate", help="simulate a strategy")
    _common(p)
    p.add_argument("--strategy", help="strategy JSON from fastt plan --out (default: plan with --planner)")
    p.add_argument("--planner", default="fastt")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--gantt", help="write a Gantt chart PNG here")
    p.add_argument("--costs", choices=("roofline", "measured"), default="roofline",
                   help="measured: time every op on this CPU inside real runs of the step (cpu:N clusters)")
    p.add_argument("--cost-file", help="cache of measured costs: read if it exists, else written")
    p.set_defaults(fn=cmd_simulate)
    p = sub.add_parser("compare", help="compare planners side by side")
    _common(p)
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--max-batch", action="store_true",
                   help="the largest batch each planner's plan fits, and its samples/s "
                        "(a capture per batch tried)")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("run", help="train for real on local devices: measured vs simulated time per planner")
    p.add_argument("--model", required=True, help="zoo model name or path/to/file.py:function")
    p.add_argument("--devices", default="cpu:2",
                   help="cpu:N, or local GPUs: cuda, cuda:0,1 (cuda:0,0: two streams of one GPU)")
    p.add_argument("--planners", default="fastt,dp,single,eager",
                   help="planners, and eager for plain PyTorch")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--check", action="store_true",
                   help="also take every step in plain one-device eager PyTorch from the same state and "
                        "random generators and compare the parameters (a plan over several devices draws "
                        "dropout's masks otherwise: its difference is shown apart, with why)")
    p.add_argument("--tune", action="store_true",
                   help="fastt starts data-parallel and tunes its plan in the first steps (FastT's loop)")
    p.add_argument("--launcher", default="local", choices=("local", "torchrun"),
                   help="local: one process, a thread per device; torchrun: one process per device, gloo on "
                        "cpu:N, NCCL on cuda (python -m fastt.launch; multi-node: run torchrun yourself on "
                        "every node)")
    p.add_argument("--timeout", type=positive_float, default=20.0,
                   help="torchrun: seconds a rank waits for a peer")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="local launcher on cpu:N: write each planner's last measured step beside its "
                        "simulated one as Chrome/Perfetto trace JSON (a process each, a thread per device)")
    p.add_argument("--network", type=network_rate, default=None, metavar="RATE",
                   help="torchrun on cpu:N: run the ranks in a private network namespace whose loopback is "
                        "capped at RATE (tc's form: 1gbit, 100mbit, 10gbit), a slow network on one machine "
                        "(needs root, unshare and tc; the namespace goes with the run)")
    training_options(p)
    p.add_argument("--size", default="test", choices=("test", "paper"))
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--optimizer", default=None, choices=zoo.OPTIMIZERS, help="default sgd")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("demo", help="the main job on built-in defaults")
    p.add_argument("--run-model", default="transformer", help="the zoo model trained for real on cpu:2")
    p.add_argument("--models", default="vgg19,resnet50,inception_v3,bert-base")
    p.add_argument("--clusters", default="4xV100,8xA100-pcie")
    p.add_argument("--mixed-models", default="alexnet,vgg19,dlrm",
                   help="models whose mixed plans are compared on --mixed-cluster")
    p.add_argument("--mixed-cluster", default="2x4xV100")
    p.add_argument("--network", type=network_rate, default=netns.network("1gbit"), metavar="RATE",
                   help="the rate of the demo's run over a slow network (torchrun's ranks in a private "
                        "network namespace, its loopback capped; skipped where none can be made)")
    p.add_argument("--network-model", default="dlrm", help="the zoo model trained over the slow network")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_demo)
    return top


def _terminated(signum: int, _frame) -> None:
    raise Interrupted(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """The `fastt` command: a FasttError is one line on stderr and exit code 2, an interrupt one line
    and 128 + the signal (130 for Ctrl-C); FASTT_DEBUG=1 shows their tracebacks instead."""
    debug = os.environ.get("FASTT_DEBUG") == "1"
    with one_line_warnings():
        return _main(argv, debug)


def _main(argv: Sequence[str] | None, debug: bool) -> int:
    try:
        args = parser().parse_args(argv)
        previous = signal.signal(signal.SIGTERM, _terminated)  # as a job scheduler stops a job: like Ctrl-C
        try:
            args.fn(args)
        finally:
            signal.signal(signal.SIGTERM, previous)
    except FasttError as e:
        if debug:
            raise
        print("fastt: error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if debug:
            raise
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"fastt: interrupted ({signal.Signals(signum).name}); nothing it started is left running",
              file=sys.stderr)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
