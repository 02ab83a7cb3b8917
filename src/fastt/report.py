"""Reports: exports of a simulated Timeline (a Chrome/Perfetto trace and a Gantt chart PNG), and the text of a
real training run's results (`fastt run`, `python -m fastt.launch`).

The trace has one process for devices (pid 0, one thread per device) and one for links (pid 1, one thread per
link); a transfer appears on every link of its route, an allreduce on every link of its ring. Times are µs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastt.graph import ALLREDUCE, COMPUTE, INPUT, UPDATE, OpGraph
from fastt.links import Collective
from fastt.simulate import Timeline

DEVICES_PID, LINKS_PID = 0, 1
# Colors by op kind for the Gantt chart; transfers and allreduces are drawn on link rows.
KIND_COLORS = {INPUT: "#9e9e9e", COMPUTE: "#1f77b4", UPDATE: "#2ca02c", ALLREDUCE: "#d62728",
               "transfer": "#ff7f0e"}


def chrome_trace(timeline: Timeline, g: OpGraph) -> dict[str, Any]:
    """The timeline as Chrome trace events ({"traceEvents": [...]}, load in chrome://tracing or Perfetto)."""
    us = 1e6
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": DEVICES_PID, "args": {"name": "devices"}},
        {"name": "process_name", "ph": "M", "pid": LINKS_PID, "args": {"name": "links"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": DEVICES_PID, "tid": d, "args": {"name": name}}
               for d, name in enumerate(timeline.device_names)]
    events += [{"name": "thread_name", "ph": "M", "pid": LINKS_PID, "tid": k, "args": {"name": name}}
               for k, name in enumerate(timeline.link_names)]
    for i in _placed(timeline):
        op = g.ops[i]
        events.append({"name": op.name, "cat": op.kind, "ph": "X", "pid": DEVICES_PID,
                       "tid": int(timeline.device[i]), "ts": timeline.start[i] * us,
                       "dur": (timeline.end[i] - timeline.start[i]) * us,
                       "args": {"target": op.target, "out_bytes": op.out_bytes}})
    for t in timeline.transfers:
        name = f"{g.ops[t.op].name} {t.src}->{t.dst}"
        events += [{"name": name, "cat": "transfer", "ph": "X", "pid": LINKS_PID, "tid": k,
                    "ts": t.start * us,
                    "dur": (t.end - t.start) * us, "args": {"bytes": t.nbytes}} for k in t.links]
    for c in timeline.collectives:
        events += [{"name": collective_name(g, c), "cat": ALLREDUCE, "ph": "X", "pid": LINKS_PID, "tid": k,
                    "ts": c.start * us, "dur": (c.end - c.start) * us,
                    "args": {"bytes": c.nbytes, "group": list(c.group)}} for k in c.links]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def run_trace(planner: str, index: int, spans: list, device_names: list[str], timeline: Timeline,
              g: OpGraph) -> list[dict[str, Any]]:
    """A measured step of `planner`'s plan beside its simulated one, as Chrome trace events: process 10·index
    holds the measured segments and allreduce means (`spans`: (a segment, None for an allreduce mean or the
    name of a whole step run as one, device, start, end) in seconds, from `ParallelStep.profiled`), one thread
    per device, from the step's first segment; 10·index + 1 and + 2 the simulated devices and links
    (`chrome_trace`). Perfetto shows them one above the other."""
    us, base = 1e6, 10 * index
    t0 = min((s[2] for s in spans), default=0.0)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": base, "args": {"name": f"{planner}: measured"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": base, "tid": d, "args": {"name": name}}
               for d, name in enumerate(device_names)]
    for seg, d, start, end in spans:
        name = ("allreduce mean" if seg is None else seg if isinstance(seg, str) else
                seg.tasks[0].name if len(seg.tasks) == 1 else
                f"{seg.tasks[0].name} .. {seg.tasks[-1].name} ({len(seg.tasks)} ops)")
        events.append({"name": name, "cat": "measured", "ph": "X", "pid": base, "tid": d,
                       "ts": (start - t0) * us, "dur": (end - start) * us})
    for e in chrome_trace(timeline, g)["traceEvents"]:
        e = {**e, "pid": base + 1 + e["pid"]}
        if e["name"] == "process_name":
            e["args"] = {"name": f"{planner}: simulated {e['args']['name']}"}
        events.append(e)
    return events


def write_trace(timeline: Timeline, g: OpGraph, path: str | Path) -> None:
    """Write `chrome_trace` as JSON to `path`."""
    Path(path).write_text(json.dumps(chrome_trace(timeline, g)))


def write_gantt(timeline: Timeline, g: OpGraph, path: str | Path) -> None:
    """Draw a Gantt chart PNG: one row per device and per busy link, bars colored by op kind."""
    # A Figure without pyplot renders with Agg and touches no global state.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    unit, scale = _time_unit(timeline.iteration_s)
    rows = _gantt_rows(timeline, g, scale)
    fig = Figure(figsize=(12, 1.2 + 0.4 * len(rows)), dpi=100)
    ax = fig.add_subplot()
    label_bars = sum(len(bars) for _, bars in rows) <= 60  # names only fit when there are few bars
    for y, (_, bars) in enumerate(rows):
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for start, width, kind, _ in bars:
            by_kind.setdefault(kind, []).append((start, width))
        for kind, spans in by_kind.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=KIND_COLORS.get(kind, "#8c564b"),
                           edgecolor="white" if len(spans) < 200 else "none", linewidth=0.5)
        if label_bars:
            for start, width, _, name in bars:
                ax.text(start + width / 2, y, name, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max(timeline.iteration_s * scale, 1e-9))
    ax.set_xlabel(f"time ({unit})")
    title = f"{g.name}: {timeline.iteration_s * scale:.4g} {unit} per step"
    ax.set_title(title + (f" ({timeline.planner})" if timeline.planner else ""))
    kinds = sorted({kind for _, bars in rows for _, _, kind, _ in bars})
    ax.legend(handles=[Patch(color=KIND_COLORS.get(k, "#8c564b"), label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # outside, so it hides no bar
    fig.tight_layout()
    fig.savefig(path)


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit that shows `seconds` with a few digits before the point, and its scale from seconds."""
    for unit, scale in (("s", 1.0), ("ms", 1e3)):
        if seconds * scale >= 1:
            return unit, scale
    return "µs", 1e6


def _gantt_rows(timeline: Timeline, g: OpGraph,
                ms: float) -> list[tuple[str, list[tuple[float, float, str, str]]]]:
    """(row label, [(start, width, kind, name)]) for every device, then every link that carried something.

    Times are seconds times `ms`, the chart's scale.
    """
    devices: list[list[tuple[float, float, str, str]]] = [[] for _ in timeline.device_names]
    for i in _placed(timeline):
        op = g.ops[i]
        devices[int(timeline.device[i])].append(
            (timeline.start[i] * ms, (timeline.end[i] - timeline.start[i]) * ms, op.kind, op.name))
    links: list[list[tuple[float, float, str, str]]] = [[] for _ in timeline.link_names]
    for t in timeline.transfers:
        for k in t.links:
            links[k].append((t.start * ms, (t.end - t.start) * ms, "transfer", g.ops[t.op].name))
    for c in timeline.collectives:
        for k in c.links:
            links[k].append((c.start * ms, (c.end - c.start) * ms, ALLREDUCE, collective_name(g, c)))
    return ([(name, bars) for name, bars in zip(timeline.device_names, devices)]
            + [(name, bars) for name, bars in zip(timeline.link_names, links) if bars])


def collective_name(g: OpGraph, c: Collective) -> str:
    """A (possibly fused) allreduce's label: its first op's name, and how many more ran with it."""
    name = g.ops[c.ops[0]].name
    return f"{name} (+{len(c.ops) - 1} fused)" if len(c.ops) > 1 else name


def _placed(timeline: Timeline) -> list[int]:
    return [int(i) for i in (timeline.device >= 0).nonzero()[0]]


def format_run(out: dict) -> str:
    """The text of a `fastt run` result (the dict `--json` prints): measured and simulated time per planner,
    the time `parallelize` took (setup), and which plan the `fastt` planner's trial against data parallelism
    kept."""
    over = f" over a loopback capped at {out['network']}" if out.get("network") else ""
    from .runtime.bench import BLOCK

    lines = [(f"{out['model']} trained for real on {out['devices']}{over}, {out['steps']} steps, the "
              f"planners' in turn, {BLOCK} at a time (median step time after the first, less the first of "
              "each later block)")]
    for r in out["results"]:
        simulated = r["simulated_iteration_s"]
        sim = f"{simulated * 1e3:9.1f}" if simulated is not None else "        -"
        err = f"{r['error'] * 100:+.0f}%" if r["error"] is not None else ""
        setup = f"  setup {r['setup_s']:.1f} s" if r.get("setup_s") is not None else ""
        lines.append(f"  {r['planner']:<8} measured {r['measured_iteration_s'] * 1e3:9.1f} ms  "
                     f"simulated {sim} ms  {err:>5}{setup}".rstrip())
    for r in out["results"]:
        if r.get("busy_s"):
            used = [d for d, (m, s) in enumerate(zip(r["busy_s"], r["simulated_busy_s"])) if m or s]
            pairs = ", ".join(f"{r['busy_s'][d] * 1e3:.1f}/{r['simulated_busy_s'][d] * 1e3:.1f}"
                              for d in used)
            means = ", ".join(f"{r['allreduce_s'][d] * 1e3:.1f}" for d in used)
            lines.append(f"  {r['planner']}: last step's busy ms per device, measured/simulated: {pairs}; "
                         f"allreduce means computed {means} (simulated on links: "
                         f"{r['simulated_allreduce_s'] * 1e3:.1f})")
    # the one-device rival: locally a worker device with every core; under torchrun rank 0's device alone
    one = "one process" if out.get("launcher") == "torchrun" else "one device on every core"
    whole = "; one process read the whole batch on every rank: no rows sent"
    for r in out["results"]:
        if t := r.get("trial"):
            rivals = [f"{name} {t[k] * 1e3:.1f} ms" for name, k in (("dp", "dp_s"), (one, "one_device_s"))
                      if t.get(k) is not None]
            kept = one if t["kept"] == "single" else t["kept"]
            lines.append(f"  trial: {r['planner']}'s plan {t['fastt_plan_s'] * 1e3:.1f} ms, "
                         f"{', '.join(rivals)} a step ({t['steps']} steps each): kept {kept} "
                         f"(its setup time includes the trial{whole if r.get('whole_batch') else ''})")
    tuned = [r for r in out["results"] if r.get("tuning")]
    if tuned:
        runs = len(tuned[0]["tuning"])
        lines.append(f"  {tuned[0]['planner']} tuned its plan in the first steps ({runs} plan(s) run); "
                     "its time is the median after tuning")
    apart = out.get("not_compared") or {}  # random draws not eager's (`reference.not_compared`)
    compared = sum(r["planner"] != "eager" for r in out["results"]) > len(apart)
    if out["max_param_rel_diff"] is not None and compared:
        lines.append(f"  largest relative parameter difference from eager: {out['max_param_rel_diff']:.2e}")
    for planner, c in apart.items():
        lines.append(f"  {planner} not compared with eager ({c['max_param_rel_diff']:.2e} after a step): "
                     f"{c['why']}")
    return "\n".join(lines)
