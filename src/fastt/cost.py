"""Costs: how long each op takes on each device, and what a transfer costs on each link.

Two sources, as FastT has: *roofline* estimates from an op's FLOPs (torch.utils.flop_counter) and bytes moved
against a device's peak FLOP/s and memory bandwidth (for named GPUs that are not here), and *measured* times
from running the real step on a real device, each op timed inside whole runs of the step (timing ops in
isolation underestimates them: caches are warm and nothing competes). Transfers are `latency + bytes /
bandwidth` per link, fitted by least squares on measured copies.
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .cluster import Cluster, Device, Link, use_cores
from .errors import FasttError
from .graph import ALLREDUCE, INPUT, RESIDENT, Op, OpGraph, rebatch, whole_share

# The fraction of its peak a GPU kernel reaches, by its size: (size, fraction) points of Calculon's A100
# system file (Isaev et al., "Calculon: A Methodology and Tool for High-Level Co-Design of Systems and Large
# Language Models", SC'23; github.com/calculon-ai/calculon, systems/a100_80g.json), set there from measured
# A100 kernels and validated against Megatron-LM on Selene: a matmul or convolution by its FLOPs, memory
# traffic by its bytes. Calculon steps between the points; here the fraction is interpolated in log(size), so
# that a smaller op never costs more than a larger one, and held at the smallest point below it (Calculon's
# floor for tiny ops, 0.1 and 0.3, stands for the launch cost that `Device.op_overhead_s` charges here). As in
# that file ("no_overlap"), an op's compute and its memory traffic are charged one after the other. The points
# were measured on A100s; the other presets take them as they are.
MATMUL_EFFICIENCY = ((1e9, 0.60), (16e9, 0.90), (128e9, 0.95))
MEMORY_EFFICIENCY = ((1e6, 0.60), (10e6, 0.75), (100e6, 0.90))


def efficiency(size: np.ndarray | float, points: Sequence[tuple[float, float]]) -> np.ndarray:
    """The fraction of peak reached at `size` (FLOPs or bytes), interpolated in log(size) between `points`."""
    return np.interp(np.log(np.maximum(size, 1.0)), [np.log(x) for x, _ in points], [f for _, f in points])


def roofline_time(op: Op, dev: Device) -> float:
    """Seconds for op on dev: launch overhead + its compute (at the peak of its dtype, `Device.peak`) and its
    memory traffic (at the memory bandwidth). On a device with `kernel_efficiency` (a GPU) each runs at the
    fraction of peak its size reaches (`MATMUL_EFFICIENCY`, `MEMORY_EFFICIENCY`) and the two add up; on
    others the slower of the two at peak is the op's time (the plain roofline)."""
    if op.kind in RESIDENT or op.kind in (INPUT, ALLREDUCE):
        return 0.0
    compute = op.flops / dev.peak(op.dtype, _conv(op))
    memory = op.io_bytes / dev.mem_bandwidth
    if dev.kernel_efficiency:
        return float(dev.op_overhead_s + compute / efficiency(op.flops, MATMUL_EFFICIENCY)
                     + memory / efficiency(op.io_bytes, MEMORY_EFFICIENCY))
    return dev.op_overhead_s + max(compute, memory)


def _conv(op: Op) -> bool:
    """Whether an op is a convolution (forward or backward), which cuDNN runs in TF32 by default."""
    return "convolution" in op.target


def check_precision(graph: OpGraph, cluster: Cluster) -> None:
    """Refuse a step that computes in bfloat16 on a GPU without BF16 tensor cores (the V100)."""
    if any(op.dtype == "bfloat16" for op in graph.ops):
        check_bf16(cluster)


def check_bf16(cluster: Cluster) -> None:
    """Refuse bfloat16 on a cluster with a GPU that has no BF16 tensor cores, naming what it has."""
    lacking = sorted({d.kind for d in cluster.devices if d.kind != "cpu" and not d.bf16_flops})
    if lacking:
        raise FasttError(f"{', '.join(lacking)} has no bf16 tensor cores: train in fp16 (--precision fp16, "
                         "autocast=torch.float16) on it")


@dataclass(frozen=True)
class MeasuredCosts:
    """Measured seconds per op signature (mean over runs), for one device kind (e.g. "cpu" with 1 thread)."""

    kind: str
    threads: int
    seconds: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": "fastt.costs", "version": 1, "kind": self.kind,
                                          "threads": self.threads, "seconds": self.seconds}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> MeasuredCosts:
        try:
            d = json.loads(Path(path).read_text())
            return cls(kind=d["kind"], threads=int(d["threads"]),
                       seconds={k: float(v) for k, v in d["seconds"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FasttError(f"cannot read cost file {path}: {e}; measure again") from e


def op_times(graph: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None) -> np.ndarray:
    """times[i, d]: seconds op i takes on device d (the estimate of `roofline_time`, vectorized).

    Measured times are used for devices of the measured kind; an op never measured (another shape) falls back
    to the roofline estimate for that device.
    """
    free = np.array([op.kind in RESIDENT or op.kind in (INPUT, ALLREDUCE) for op in graph.ops])
    check_precision(graph, cluster)
    flops = np.array([op.flops for op in graph.ops], dtype=float)[:, None]
    io = np.array([op.io_bytes for op in graph.ops], dtype=float)[:, None]
    devs = cluster.devices
    # One peak per (dtype, convolution or not) and device: a few distinct rows, not one per op.
    kinds = sorted({(op.dtype, _conv(op)) for op in graph.ops})
    rows = np.array([[d.peak(dt, conv) for d in devs] for dt, conv in kinds])
    peak = rows[[kinds.index((op.dtype, _conv(op))) for op in graph.ops]]
    bw = np.array([d.mem_bandwidth for d in devs])[None, :]
    overhead = np.array([d.op_overhead_s for d in devs])[None, :]
    compute, memory = flops / peak, io / bw
    t = overhead + np.maximum(compute, memory)
    gpu = np.array([d.kernel_efficiency for d in devs])
    if gpu.any():
        slowed = compute / efficiency(flops, MATMUL_EFFICIENCY) + memory / efficiency(io, MEMORY_EFFICIENCY)
        t[:, gpu] = (overhead + slowed)[:, gpu]
    t[free] = 0.0
    if measured is not None:
        cols = [d for d, dev in enumerate(devs) if dev.kind == measured.kind]
        seconds = measured.seconds
        for i, op in enumerate(graph.ops):
            if op.signature in seconds:
                t[i, cols] = seconds[op.signature]
            elif op.split and (whole := whole_share(op.signature)) and whole[0] in seconds:
                # A part never measured: its share of the whole op's measured time, plus its own launch. The
                # roofline's level is not a CPU's: a convolution's backward part at test size, 0.05 ms there,
                # ran 0.9 ms, its share of the whole's measured time.
                oh = overhead[0, cols]
                t[i, cols] = oh + np.maximum(seconds[whole[0]] - oh, 0.0) * whole[1]
    return t


def _cuda_tick() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _elapsed(ticks: Sequence) -> list[float]:
    """Seconds between consecutive clock readings: perf_counter floats or recorded CUDA events."""
    if ticks and isinstance(ticks[0], torch.cuda.Event):
        ticks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(ticks)]
    return list(np.diff(ticks))


def direct(target: Callable) -> Callable:
    """What generated code calls for `target`: for an aten op (`OpOverload`), its C++ entry point without the
    Python `__call__` that only forwards to it, as a C-level `functools.partial` that fx can name (`_direct`);
    any other target as it is. Besides 0.4 µs an op, that keeps the op from pushing a Python frame: CPython
    3.11 frees a thread's frame-stack chunk whenever it empties, and where a segment's big frame leaves a
    chunk nearly full every op's frame took a fresh chunk, a 16 KB mmap, page faults and a munmap (resnet50
    at test size, one device on a worker thread: 955 page faults a step, 82 ms against 70 on the main thread,
    where the frame fell elsewhere)."""
    return _direct(target) if type(target) is torch._ops.OpOverload else target


@functools.cache
def _direct(op: torch._ops.OpOverload) -> Callable:
    call = functools.partial(op._op)
    call.__name__, call.__module__ = str(op).replace(".", "_"), "fastt_direct"
    return call


def _timed_code(gm: torch.fx.GraphModule, clock: Callable = time.perf_counter) -> tuple[Callable, list[str]]:
    """The step's generated code with a clock read after every aten call: fn(*flat inputs) -> clock readings
    (one before the first call, then one per name in the returned list). It runs the same code as the runtime,
    so the per-call Python overhead is what the runtime pays. On a GPU the clock records a CUDA event on the
    current stream: an op's time is then its kernels' time, or the launch gap when the GPU waits for
    Python."""
    g = torch.fx.Graph()
    values: dict[str, torch.fx.Node] = {}
    ticks, names = [], []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        values[n.name] = g.node_copy(n, lambda a: values[a.name])
        if n.op == "call_function":
            values[n.name].target = direct(n.target)
            if not ticks:
                ticks.append(g.call_function(clock))
                values[n.name].prepend(ticks[0])
            ticks.append(g.call_function(clock))
            names.append(n.name)
    g.output(tuple(ticks))
    return torch.fx.GraphModule(gm, g).forward, names


def measure(graph: OpGraph, real_inputs: Sequence, *, kind: str = "cpu", threads: int = 1, runs: int = 5,
            progress: bool = True, concurrent: int = 1) -> MeasuredCosts:
    """Time every op of `graph` on this CPU with `threads` threads, or on the GPU its inputs are on (kind
    "cuda"): the mean over `runs` whole-step runs (a sum of per-op medians misses the occasional slow call
    that every real run pays), leaving out a run over twice the median run (the machine stalled in it).

    `real_inputs` are the step's graph inputs with real tensors (params, buffers, states, *batch); they are
    cloned, so the caller's model and optimizer are not changed. `concurrent` copies of the step run at once
    in as many threads (the op times then include what sharing the machine's caches and memory bandwidth
    costs, as when `concurrent` worker devices are busy).
    """
    return _measure([graph], [real_inputs], kind=kind, threads=threads, runs=runs, progress=progress,
                    concurrent=concurrent)


def _measure(graphs: Sequence[OpGraph], inputs: Sequence[Sequence], *, kind: str, threads: int, runs: int,
             progress: bool, concurrent: int) -> MeasuredCosts:
    """`measure` of several steps (the same step at several batch sizes), their runs taken in turn: run r of
    every step before run r + 1 of any. This machine's speed drifts by tens of percent over seconds, and a
    planner compares the steps' op times (the whole batch on one device against data parallelism's half): a
    drift while one table alone was measured decided the plan (alexnet on cpu:2, 2026-12-07: the fastt
    planner kept a plan simulated at 47 ms, its DP at b/2 having been measured slow, where DP measured 36.5
    and was simulated at 33.8 from a table of its own). An op signature in several steps (the update, whose
    shapes do not change with the batch) pools their runs."""
    codes = []
    for graph, real_inputs in zip(graphs, inputs):
        step = graph.fx
        if step is None:
            raise FasttError("this graph was not captured from a model: nothing to measure")
        if step.derived:
            raise FasttError("this graph was derived for planning (fastt.rebatch): measure the step captured "
                             "at its batch (rebatch(graph, b, traced=True))")
        fn, names = _timed_code(step.gm, _cuda_tick if kind == "cuda" else time.perf_counter)
        codes.append((fn, names, torch.utils._pytree.tree_leaves(list(real_inputs))))
    readings: list[list[list[float]]] = [[] for _ in graphs]

    def worker(d: int = 0) -> None:
        torch.set_num_threads(threads)
        if concurrent > 1:  # on device d's cores, as the runtime's worker threads run
            use_cores(d, threads, concurrent)
        with torch.no_grad():
            for r in range(runs + 1):
                for (fn, _, flat), got in zip(codes, readings):
                    ticks = fn(*[x.clone() if isinstance(x, torch.Tensor) else x for x in flat])
                    if r:  # the first run warms up the allocator and lazy init
                        got.append(_elapsed(ticks))

    if concurrent == 1:  # on this thread, as the local runtime runs a one-device plan (`local.run_step`)
        old = torch.get_num_threads()
        try:
            worker()
        finally:
            torch.set_num_threads(old)
    else:
        workers = [threading.Thread(target=worker, args=(d,)) for d in range(concurrent)]
        name = "+".join(dict.fromkeys(g.name for g in graphs))
        for w in tqdm(workers, desc=f"measuring {name} on {kind}x{threads}", disable=not progress):
            w.start()
        for w in workers:
            w.join()
    samples: dict[str, list[float]] = {}
    for graph, (_, names, _), got in zip(graphs, codes, readings):
        if len(got) < concurrent * runs:
            raise FasttError(f"measuring {graph.name} failed: a run of the step raised (see the traceback "
                             "above)")
        # A run the machine stalled in (one of 10 at 5x the others: resnet50's DP step simulated at 275 ms
        # against 57 measured, 2026-12-07) is no occasional slow call: runs over twice the median run are
        # left out.
        totals = [sum(seconds) for seconds in got]
        usual = 2 * statistics.median(totals)
        for seconds in (r for r, total in zip(got, totals) if total <= usual):
            elapsed = dict(zip(names, seconds))
            for op in graph.ops:
                if op.signature:
                    samples.setdefault(op.signature, []).append(sum(elapsed.get(n, 0.0) for n in op.nodes))
    return MeasuredCosts(kind=kind, threads=threads,
                         seconds={s: statistics.mean(v) for s, v in samples.items()})


def _real_inputs(graph: OpGraph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 example_inputs: Sequence[torch.Tensor]) -> tuple[str, list]:
    """(the device kind, the step's graph inputs) of `graph` on `example_inputs`' first `graph.batch` rows,
    read from the model and optimizer."""
    inputs = tuple(example_inputs)
    if graph.batch != inputs[0].shape[0]:  # a replica's step (every input has the batch's rows first)
        inputs = tuple(x[:graph.batch] for x in inputs)
    want = [dtype for _, dtype in graph.fx.structure.get("the batch's shapes and dtypes", ())]
    if want and [x.dtype for x in inputs] != want:  # else a worker's KeyError or a kernel's dtype complaint
        raise FasttError(f"measure: example_inputs are {len(inputs)} tensors of "
                         f"{[str(x.dtype) for x in inputs]}, the captured step takes {len(want)} of "
                         f"{[str(d) for d in want]}: pass inputs like those it was captured with")
    params, buffers, states, inputs, hypers = graph.fx.arguments(model, optimizer, inputs, create=False)
    kind = "cuda" if params and params[0].is_cuda else "cpu"
    return kind, [params, buffers, states, *inputs, hypers, 1.0]


def measure_model(graph: OpGraph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  example_inputs: Sequence[torch.Tensor], threads: int = 1, runs: int = 5,
                  progress: bool = True, concurrent: int = 1) -> MeasuredCosts:
    """Measured op times of `graph` (captured from this model) on this CPU with `threads` threads, or on the
    GPU the model is on.

    The step runs on copies of the real parameters, buffers and optimizer state: the model is not changed.
    Data parallelism places the step at batch/N: measure `rebatch(graph, b, traced=True)` with the inputs
    sliced to b.
    `concurrent` copies run at once (see `measure`): op times as when that many worker devices are busy.
    """
    kind, inputs = _real_inputs(graph, model, optimizer, example_inputs)
    return measure(graph, inputs, kind=kind, threads=threads, runs=runs, progress=progress,
                   concurrent=concurrent)


def measure_step(graph: OpGraph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 example_inputs: Sequence[torch.Tensor], batches: Sequence[int], threads: int,
                 concurrent: int) -> MeasuredCosts:
    """Measured op times of the step at each batch size in `batches` (one table: op signatures differ by
    shape), with `concurrent` copies running at once, on the device the model is on; the sizes' runs taken
    in turn (`_measure`)."""
    graphs = [rebatch(graph, b, traced=True) for b in dict.fromkeys(batches)]
    read = [_real_inputs(g, model, optimizer, example_inputs) for g in graphs]
    return _measure(graphs, [inputs for _, inputs in read], kind=read[0][0], threads=threads, runs=5,
                    progress=False, concurrent=concurrent)


def fit_transfers(sizes: Sequence[float], seconds: Sequence[float],
                  relative: bool = False) -> tuple[float, float]:
    """Least-squares fit of time = a + b·bytes; returns (latency a ≥ 0, bandwidth 1/b).

    `relative`: fit relative errors. Sizes span decades, and in plain least squares the noise of the largest
    transfer (a few percent of milliseconds) outweighs the smallest ones, which are what the latency is. Not
    for copies in memory, whose small sizes run from cache at a bandwidth large ones never see."""
    a_mat = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=float)], axis=1)
    secs = np.asarray(seconds, dtype=float)
    w = 1.0 / np.maximum(np.abs(secs), 1e-12) if relative else np.ones(len(secs))
    (a, b), *_ = np.linalg.lstsq(a_mat * w[:, None], secs * w, rcond=None)
    # Flat data fits a slope of rounding noise (~1e-26), which is no bandwidth: the line must rise measurably.
    span = float(np.ptp(a_mat[:, 1])) if len(sizes) else 0.0
    if not b * span > 1e-9 * np.abs(secs).max(initial=0.0):
        raise FasttError("transfer times did not grow with size: measure with larger sizes")
    return max(float(a), 0.0), 1.0 / float(b)


def measure_copies(sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22, 2**24), repeats: int = 5,
                   threads: int = 1) -> tuple[list[int], list[float]]:
    """Seconds to copy buffers of each size between two CPU worker devices (a memcpy here), the fastest of
    `repeats`: noise only adds time, and one preempted copy in a median of few made a small size look slower
    than a large one on a loaded machine (the fit then refused to find a bandwidth)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for n in sizes:
            src = torch.empty(n // 4, dtype=torch.float32).uniform_()
            dst = torch.empty_like(src)
            dst.copy_(src)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                ts.append(time.perf_counter() - t0)
            times.append(min(ts))
    finally:
        torch.set_num_threads(old)
    return list(sizes), times


def fit_gather(points: Sequence[tuple[int, int]], seconds: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of time = a + b·bytes + c·tensors: (a, b, c), each ≥ 0. Absolute errors: the megabytes
    that gradients come in are what matter, and the cost per byte of small exchanges (from cache) is lower.
    Where the points include one tensor alone, the smallest such pins the fixed cost (the plane passes
    through it): from large exchanges alone, whose times vary by more than a collective's fixed cost, the
    intercept came out anywhere from 0 to 0.46 ms on the same two ranks."""
    secs = np.asarray(seconds, dtype=float)
    a_mat = np.array([(1.0, b, k) for b, k in points], dtype=float)
    alone = [i for i, (_, k) in enumerate(points) if k == 1]
    if alone and len(points) > 2:
        pin = min(alone, key=lambda i: points[i][0])
        rest = [i for i in range(len(points)) if i != pin]
        # b and c from the other points' differences to the pinned one; then a through the pinned point
        (b, c), *_ = np.linalg.lstsq(a_mat[rest, 1:] - a_mat[pin, 1:], secs[rest] - secs[pin], rcond=None)
        b, c = max(float(b), 0.0), max(float(c), 0.0)
        return max(float(secs[pin] - b * a_mat[pin, 1] - c), 0.0), b, c
    coef, *_ = np.linalg.lstsq(a_mat, secs, rcond=None)
    a, b, c = (max(float(x), 0.0) for x in coef)
    return a, b, c


def replica_mean(grads: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The mean of the replicas' tensors (`grads[k]`: replica k's), summed in replica order as eager DP
    does: how the local runtime averages gradients (`runtime.local`), kept here for `measure_means` to
    time."""
    if len(grads) == 1:
        return list(grads[0])
    total = torch._foreach_add(grads[0], grads[1])
    for other in grads[2:]:  # in place: one running sum besides the replicas' own (the simulator's memory)
        torch._foreach_add_(total, other)
    torch._foreach_div_(total, float(len(grads)))
    return list(total)


MEAN_SHAPES = ((1, 2**10), (16, 2**10), (1, 2**16), (16, 2**14), (1, 2**20), (16, 2**16), (4, 2**20))


def measure_means(threads: int = 1, shapes: Sequence[tuple[int, int]] = MEAN_SHAPES, repeats: int = 5,
                  devices: int = 1) -> tuple[list[tuple[int, int]], list[float]]:
    """Seconds the local runtime takes to average two replicas' `k` tensors of `f` floats each (`shapes`:
    (k, f)), with its own mean (`replica_mean`), the fastest of `repeats` (noise only adds time): ([(bytes,
    tensors)], seconds). With `devices` > 1 it runs on device 0's cores while the other devices' cores copy
    memory (`beside_copies`), as a step's means run beside the other devices' backward: op times are measured
    with every device busy too. Alone, alexnet's means (15.5 MB a step under DP on cpu:2) were costed at 1.3
    ms where the step spent 2.4 (the average's memory traffic shares the machine's bandwidth)."""
    points: list[tuple[int, int]] = []
    times: list[float] = []

    def measure() -> None:
        torch.set_num_threads(threads)
        for k, f in shapes:
            grads = [[torch.rand(f) for _ in range(k)] for _ in range(2)]
            replica_mean(grads)
            times.append(min(_timed(lambda: replica_mean(grads)) for _ in range(repeats)))  # noqa: B023
            points.append((4 * k * f, k))
    beside_copies(measure, devices, threads)
    return points, times


def beside_copies(fn: Callable[[], None], devices: int, threads: int, floats: int = 2**22) -> None:
    """Run `fn` on a thread pinned to CPU worker device 0's cores (`use_cores`), while a thread on each other
    device's cores copies `floats` floats over and over (a memory-bound neighbour, as a device's backward
    is); on this thread where `devices` is 1."""
    if devices < 2:
        old = torch.get_num_threads()
        try:
            fn()
        finally:
            torch.set_num_threads(old)
        return
    stop, errors = threading.Event(), []

    def copying(d: int) -> None:
        use_cores(d, threads, devices)
        torch.set_num_threads(threads)
        x = torch.rand(floats)
        y = torch.empty_like(x)
        while not stop.is_set():
            y.copy_(x)

    def first() -> None:
        use_cores(0, threads, devices)
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            errors.append(e)
        stop.set()
    others = [threading.Thread(target=copying, args=(d,), name=f"fastt-copying-{d}", daemon=True)
              for d in range(1, devices)]
    for t in others:
        t.start()
    main = threading.Thread(target=first)
    main.start()
    main.join()
    for t in others:
        t.join()
    if errors:
        raise errors[0]


@functools.cache  # a property of the machine: measured once per process
def measure_handoffs(rounds: int = 300, ops: int = 20, repeats: int = 5) -> tuple[float, float]:
    """(latency, wake) of a hand-off between two CPU worker devices, threads of this process that wait on a
    lock as the local runtime's devices do (`local.Latch`), medians of `repeats`:
    - `latency`: seconds from one thread releasing the lock the other waits on until the other runs (a
      ping-pong of `rounds` hand-offs each way, each side running a small op when woken);
    - `wake`: seconds a running thread loses each time it wakes a waiting one that then runs a small op
      (`rounds` wakes, one after every `ops` small ops, against the same ops waking no one): Python's
      interpreter lock passes to the woken thread and back, each pass a wake-up of a sleeping thread.
    On this machine's 2-core VM each is 36-75 µs, drifting with the host over hours, and a plan that hands a
    value over every few ops is bound by them (issue 17: gnmt's split plan ran 336 ms where 160 were simulated
    without them)."""
    x = torch.ones(4)

    def locks() -> list[threading.Lock]:
        out = [threading.Lock() for _ in range(rounds)]
        for lk in out:
            lk.acquire()
        return out

    def both(a: Callable[[], None], b: Callable[[], None]) -> float:
        """Seconds thread a runs, with b on a second thread, each on its device's core as the runtime's."""
        spent = []

        def pinned(d: int, f: Callable[[], None]) -> Callable[[], None]:
            return lambda: (use_cores(d, 1, 2), f())
        threads = [threading.Thread(target=pinned(0, lambda: spent.append(_timed(a)))),
                   threading.Thread(target=pinned(1, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return spent[0]

    def ping_pong() -> float:
        there, back = locks(), locks()

        def a() -> None:
            for i in range(rounds):
                there[i].release()
                back[i].acquire()
                x + 1

        def b() -> None:
            for i in range(rounds):
                there[i].acquire()
                x + 1
                back[i].release()
        return both(a, b) / (2 * rounds)

    def woken(wake: bool) -> float:
        gates = locks()

        def a() -> None:
            for gate in gates:
                for _ in range(ops):
                    x + 1
                gate.release()

        def b() -> None:
            for gate in gates:
                if wake:
                    gate.acquire()
                    x + 1
        return both(a, b)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        latency = statistics.median(ping_pong() for _ in range(repeats))
        wake = statistics.median((woken(True) - woken(False)) / rounds for _ in range(repeats))
    finally:
        torch.set_num_threads(old)
    return latency, max(wake, 0.0)


def calibrate_cpu(cluster: Cluster) -> Cluster:
    """The cluster with its CPU devices' speeds and copy links measured on this machine.

    FLOP/s from a 1024² matmul, memory bandwidth and link `latency + bytes/bandwidth` from copies fitted by
    least squares, op overhead from a tiny op, the allreduce's `gather` (fixed, per byte, per tensor) from the
    runtime's own two-replica mean, each with the device's share of the cores. With several devices a link's
    latency is the hand-off between their threads, and each device's `wake_s` what waking it costs
    (`measure_handoffs`): the local runtime hands a CPU value over without copying it, by waking the thread
    that waits for it. A cluster that is not all CPU worker devices is returned unchanged: its links are not
    copies in this process.
    """
    if any(d.kind != "cpu" for d in cluster.devices):
        return cluster
    n = len(cluster.devices)
    threads = max(1, torch.get_num_threads() // n)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(1024, 1024)
        a @ a
        t = min(_timed(lambda: a @ a) for _ in range(3))
        flops = 2 * 1024**3 / t
        tiny = torch.ones(4)
        overhead = statistics.median(_timed(lambda: tiny + 1) for _ in range(50))
    finally:
        torch.set_num_threads(old)
    sizes, secs = measure_copies(threads=threads)
    # A larger copy is never faster than a smaller one: a dip is noise. On a loaded machine a copy large
    # enough to run on several threads waits for a scheduler slice at its barrier (8 ms for 1 MB, then 5 ms
    # for 16 MB, measured here with two other jobs running), which a line fitted through the dip would read as
    # no bandwidth.
    latency, bandwidth = fit_transfers(sizes, np.maximum.accumulate(secs))
    wake = 0.0
    if n > 1:
        latency, wake = measure_handoffs()
    # A copy of n bytes reads n and writes n: memory moves twice the copied bytes.
    devices = tuple(replace(d, flops=flops, mem_bandwidth=2 * bandwidth, op_overhead_s=overhead, wake_s=wake)
                    for d in cluster.devices)
    links = tuple(Link(lk.name, bandwidth, latency) for lk in cluster.links)
    # The local runtime averages gradients in a device's thread (`replica_mean`: foreach adds, then a
    # divide), which reads both replicas' and writes the mean, and pays per tensor: costed as fitted on it,
    # beside the other devices' work, not as a copy over a link (0.2 ms simulated where resnet50's DP step at
    # test size spent 3.8 ms).
    gather = fit_gather(*measure_means(threads, devices=n)) if n > 1 else None
    return replace(cluster, devices=devices, links=links, gather=gather)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
