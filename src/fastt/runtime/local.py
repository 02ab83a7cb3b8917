"""The local runtime: one thread per device (a CPU worker device or a CUDA stream), each running its program
strictly in order.

`compile_programs` cuts each device's program into segments: runs of consecutive tasks that need nothing from
another device once started (a segment ends where another device waits for its last op, and starts where it
waits for another device or an allreduce). A segment of plain tasks becomes one generated Python function (torch.fx
codegen), so its values stay local and only the ones read elsewhere go through the replica's shared table; split
parts and joins are interpreted. A segment starts when every op it waits for has finished (a thread waits on one
event per op, never on the device order of others); torch releases the GIL inside kernels, so devices compute in
parallel. Gradients are averaged by the first device that needs them (see `_Run.wait_all`). Worker devices share this process's memory: a transfer is a hand-off, and all holders of a parameter hold
the same tensor — so every replica reads the parameters as they were before the step, and the new values are
written back once the step has finished. Data parallelism keeps per-replica batch-norm buffers (per-device
statistics, as DDP); replica 0's are kept. An exception in any task stops every device and is raised with the op's
name.

On CUDA devices a thread launches its device's kernels on its own stream (a GPU's default stream, or a stream of
its own for a second device on the same GPU). A finished segment records a CUDA event, and a device that reads its
results makes its stream wait for that event, so the GPUs wait on each other only where the data flows. A value on
another GPU is copied once per step and device; parameters and the optimizer state live on the model's GPU (the
truth) and are copied to the other devices that read them. The step ends by synchronizing every GPU.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.node import map_arg

from ..cluster import Cluster, torch_device
from ..cost import MeasuredCosts
from ..errors import FasttError
from ..graph import OpGraph
from ..lower import JOIN, PART, RUN, Lowered, Task, lower
from ..simulate import simulate_plan
from ..split import join, rule, run_part, slice_dims
from ..strategy import Strategy


class StepError(RuntimeError):
    """An op raised while the step ran; the message names it and the device."""


@dataclass(frozen=True)
class Segment:
    """Consecutive tasks of one device and replica that run without waiting once `waits` (ops of other devices,
    allreduces) have finished. `fn(*inputs) -> outputs` is their generated code (None for a split part or join)."""

    replica: int
    tasks: tuple[Task, ...]
    waits: tuple[int, ...]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    fn: Callable | None = None


def _on(kwargs: dict, device: torch.device) -> dict:
    """An op's kwargs with a factory op's `device` (the device the step was captured on) set to `device`."""
    dev = kwargs.get("device")
    return {**kwargs, "device": device} if isinstance(dev, torch.device) and dev != device else kwargs


def _generate(low: Lowered, nodes: dict[str, fx.Node], tasks: Sequence[Task],
              device: torch.device) -> tuple[tuple[str, ...], tuple[str, ...], Callable]:
    """The code of a run of plain tasks on `device`: (names it reads, names read after it, function)."""
    names = [name for t in tasks for name in t.nodes]
    inside = set(names)
    inputs = tuple(dict.fromkeys(x.name for name in names for x in nodes[name].all_input_nodes
                                 if x.name not in inside))
    outputs = tuple(name for name in names if any(u.name not in inside for u in nodes[name].users))
    g = fx.Graph()
    values = {name: g.placeholder(name) for name in inputs}
    for name in names:
        values[name] = g.node_copy(nodes[name], lambda a: values[a.name])
        values[name].kwargs = _on(values[name].kwargs, device)
    g.output(tuple(values[name] for name in outputs))
    return inputs, outputs, fx.GraphModule(low.step.gm, g).forward


def written_placeholders(n: fx.Node) -> list[str]:
    """The placeholders node n writes in place: a buffer `copy_`'d into, batch norm's running statistics (which
    `native_batch_norm` updates in training although its schema does not say so)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    values = [*n.args, *(n.kwargs.get(a.name) for a in schema.arguments[len(n.args):])]
    written = [v for a, v in zip(schema.arguments, values) if a.alias_info is not None and a.alias_info.is_write]
    if n.target is torch.ops.aten.native_batch_norm.default and values[5]:
        written += values[3:5]
    return [v.name for v in written if isinstance(v, fx.Node) and v.op == "placeholder"]


def _writes(t: Task, d: int, nodes: dict[str, fx.Node]) -> list[tuple[str, int, tuple[int, int, int] | None]]:
    """What task t on device d writes in place: (placeholder, d, None) for a whole tensor, (placeholder, d, (dim,
    k, parts)) for the slice that part k of a split op writes (batch norm split by channel)."""
    if t.kind != PART:
        return [(x, d, None) for name in t.nodes for x in written_placeholders(nodes[name])]
    n = nodes[t.head]
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]
    dims = slice_dims(rule(n.target, t.part[0]), vals)
    pos = {a.name: i for i, a in enumerate(n.args) if isinstance(a, fx.Node)}
    return [(x, d, None if dims[pos[x]] is None else (dims[pos[x]], t.part[1], t.part[2]))
            for x in written_placeholders(n)]


@dataclass(frozen=True)
class Programs:
    """The compiled programs: `devices[d]` is device d's segments; `signals` the ops some device waits for;
    the step's nodes by name, its placeholders and its outputs (names), looked up once. `targets[d]` is the torch
    device device d runs on, `streams[d]` its CUDA stream (CUDA only); `writeback` the placeholders (batch-norm
    buffers) that replica 0 updates in place: (name, device, region), the region being None for the whole tensor
    or (dim, k, parts) for the slice a split op's part k updates."""

    devices: tuple[tuple[Segment, ...], ...]
    signals: frozenset[int]
    nodes: dict[str, fx.Node]
    placeholders: tuple[str, ...]
    outputs: tuple[str, ...]
    targets: tuple[torch.device, ...]
    streams: tuple = ()
    writeback: tuple[tuple[str, int, tuple[int, int, int] | None], ...] = ()
    copy_streams: dict = field(default_factory=dict)  # (device, source GPU) -> stream copying to the device

    @property
    def cuda(self) -> bool:
        return self.targets[0].type == "cuda"


def _streams(targets: Sequence[torch.device]) -> tuple:
    """A CUDA stream per device: its GPU's default stream for the first device on a GPU, a new one after."""
    seen: set[torch.device] = set()
    out = []
    for dev in targets:
        out.append(torch.cuda.Stream(dev) if dev in seen else torch.cuda.default_stream(dev))
        seen.add(dev)
    return tuple(out)


def compile_programs(low: Lowered, targets: Sequence[str | torch.device] | None = None) -> Programs:
    """Each device's program as segments (see the module docstring); `targets[d]` is the torch device device d
    runs on (default: all on the CPU)."""
    targets = tuple(torch.device(t) for t in (targets or ["cpu"] * len(low.programs)))
    if len({t.type for t in targets}) > 1 or len(targets) != len(low.programs):
        raise FasttError(f"devices {[str(t) for t in targets]}: the runtime needs one kind of device per plan "
                         f"device ({len(low.programs)})")
    device_of = {t.op: d for d, program in enumerate(low.programs) for t in program}
    # What each task waits for from elsewhere: ops of other devices and allreduces.
    foreign = {t.op: tuple(j for j in t.waits if j in low.allreduces or device_of[j] != d)
               for d, program in enumerate(low.programs) for t in program}

    def gated(t: Task) -> bool:  # waits for an allreduce, and for nothing else on another device
        return bool(foreign[t.op]) and all(j in low.allreduces for j in foreign[t.op])

    handoffs = {j for waits in foreign.values() for j in waits if j not in low.allreduces}
    nodes = {n.name: n for n in low.step.gm.graph.nodes}
    programs = []
    for d, program in enumerate(low.programs):
        runs: list[list[Task]] = []
        for t in program:
            prev = runs[-1][-1] if runs else None
            # Gradients are not cut out of a segment for the allreduce: its readers, the updates, come at the
            # end of the backward. A run of updates waits for all its allreduces up front.
            joins = prev is not None and (not foreign[t.op] or gated(t) and gated(prev))
            if (not joins or t.kind != RUN or prev.kind != RUN or prev.op in handoffs
                    or prev.replica != t.replica):
                runs.append([])
            runs[-1].append(t)
        segments = []
        for tasks in runs:
            waits = list(dict.fromkeys(j for t in tasks for j in foreign[t.op]))
            # Devices take a run's allreduces from different starting points, so they compute them side by side.
            k = len(waits) * d // len(low.programs)
            waits = tuple(waits[k:] + waits[:k])
            code = _generate(low, nodes, tasks, targets[d]) if tasks[0].kind == RUN else ((), (), None)
            segments.append(Segment(tasks[0].replica, tuple(tasks), waits, *code))
        programs.append(tuple(segments))
    signals = handoffs | {j for a in low.allreduces for j in low.graph.ops[a].inputs} | set(low.allreduces)
    placeholders = tuple(name for name, n in nodes.items() if n.op == "placeholder")
    outputs = tuple(x.name for x in next(n for n in nodes.values() if n.op == "output").args[0])
    writeback = tuple(w for d, program in enumerate(low.programs) for t in program if t.replica == 0
                      for w in _writes(t, d, nodes))
    return Programs(tuple(programs), frozenset(signals), nodes, placeholders, outputs, targets,
                    _streams(targets) if targets[0].type == "cuda" else (), writeback)


@dataclass(frozen=True)
class Placed:
    """A strategy ready to run: its per-device programs and its simulated iteration time (measured op costs)."""

    strategy: Strategy
    lowered: Lowered
    programs: Programs
    simulated_s: float


def place(graph: OpGraph, strategy: Strategy, cl: Cluster, costs: MeasuredCosts,
          targets: Sequence[str | torch.device] | None = None) -> Placed:
    """Lower and compile `strategy` for `targets` (the torch device of each device; default: the cluster's); a
    strategy that does not fit in device memory is refused."""
    low = lower(graph, strategy)
    programs = compile_programs(low, targets or [torch_device(dev) for dev in cl.devices])
    tl = simulate_plan(graph, strategy, cl, costs, release=release_points(low, programs))
    if not tl.fits:
        raise FasttError("the plan does not fit in device memory: " + "; ".join(tl.oom))
    return Placed(strategy, low, programs, tl.iteration_s)


def release_points(low: Lowered, programs: Programs) -> dict[str, str]:
    """Op -> the last op of its segment: what an op hands to other devices (values, gradients for an allreduce)
    leaves when its segment ends. The simulator's `release`, so it simulates the step the runtimes run."""
    ops = low.graph.ops
    return {ops[t.op].name: ops[seg.tasks[-1].op].name
            for segs in programs.devices for seg in segs for t in seg.tasks[:-1]}


class _Run:
    """The state of one step: values per replica, an event per op some device waits for, the first error.
    On CUDA also: the CUDA event each waited-for op was recorded with, values copied to other GPUs, and tensors
    other streams read, kept alive until the step has synchronized."""

    signalled = True  # devices run in threads of this process and wait on each other's events

    def __init__(self, low: Lowered, programs: Programs, envs: list[dict], threads: int,
                 timings: list | None) -> None:
        self.low, self.programs, self.envs, self.threads, self.timings = low, programs, envs, threads, timings
        self.nodes, self.cuda, self.streams = programs.nodes, programs.cuda, programs.streams
        # One event per op some device waits for: a waiter wakes only for its op (or an error: all are set).
        self.events = {op: threading.Event() for op in programs.signals} if self.signalled else {}
        self.lock = threading.Lock()
        self.claimed: set[int] = set()  # allreduces some device has started
        self.raw: dict[str, list] = {}  # gradient -> each replica's own, as the first allreduce of it found them
        self.error: tuple[str, int, BaseException] | None = None
        self.recorded: dict[int, tuple[torch.cuda.Event, int]] = {}  # op -> (CUDA event, device that recorded it)
        self.moved: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # -> (source, copy)
        self.held: list = []

    def wait(self, op: int, d: int) -> bool:
        """Wait for op's results on device d; False when another device failed (stop)."""
        self.events[op].wait()
        if self.error is not None:
            return False
        if self.cuda:
            event, src = self.recorded[op]
            if src != d:
                self.streams[d].wait_event(event)
        return True

    def wait_all(self, ops: Sequence[int], d: int, chunk: int = 16) -> bool:
        """Wait for every op of `ops`. Allreduces no device has started are claimed and computed here: the next
        one, with those of the following `chunk` whose gradients are all there already (one batch). A device
        never holds a claim on an allreduce while it waits for another one's gradients: no deadlock."""
        for k, a in enumerate(ops):
            if a not in self.low.allreduces:
                continue
            with self.lock:
                if a in self.claimed:
                    continue
                ready = [b for b in ops[k:k + chunk] if b in self.low.allreduces and b not in self.claimed
                         and all(self.events[j].is_set() for j in self.low.graph.ops[b].inputs)]
                batch = ready if a in ready else [a]
                self.claimed.update(batch)
            if not self.allreduce(batch, d):
                return False
        return all(self.wait(j, d) for j in ops)

    def finished(self, ops: Sequence[int], d: int) -> None:
        signals = [op for op in ops if op in self.events]
        if self.cuda and signals:
            event = torch.cuda.Event()
            event.record(self.streams[d])
            self.recorded.update(dict.fromkeys(signals, (event, d)))
        for op in signals:
            self.events[op].set()

    def fail(self, name: str, d: int, e: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = (name, d, e)
        for ev in self.events.values():
            ev.set()

    def get(self, k: int, name: str, d: int, x: object = None):
        """Replica k's value `name` (or `x`, a value it had) on device d: on another GPU, copied once per step. The
        copy runs on a stream of the source GPU that first waits for device d's stream, which has waited for the
        value's producer."""
        x = self.envs[k][name] if x is None else x
        if not self.cuda or not isinstance(x, torch.Tensor) or not x.is_cuda or x.device == self.programs.targets[d]:
            return x  # CPU tensors in a GPU step (e.g. attention's random seed) stay where the kernel wants them
        hit = self.moved.get((k, name, d))
        if hit is not None and hit[0] is x:
            return hit[1]
        copier = self.programs.copy_streams.get((d, x.device))
        if copier is None:
            copier = self.programs.copy_streams[d, x.device] = torch.cuda.Stream(x.device)
        copier.wait_stream(self.streams[d])
        with torch.cuda.stream(copier):
            y = x.to(self.programs.targets[d], non_blocking=True)
        self.moved[k, name, d] = (x, y)
        return y

    def allreduce(self, ops: Sequence[int], d: int) -> bool:
        """Average the gradients of allreduces `ops` across replicas on device d, summed in replica order."""
        if not all(self.wait(j, d) for a in ops for j in self.low.graph.ops[a].inputs):
            return False
        names = [name for a in ops for name in self.low.allreduces[a]]
        # Two allreduces may carry one gradient (a clip's norm and its update both read it): each averages the
        # replicas' own gradients, kept aside by the first, never a mean another device has written meanwhile.
        with self.lock:
            for name in names:
                self.raw.setdefault(name, [env[name] for env in self.envs])
        grads = [[self.get(k, name, d, self.raw[name][k]) for name in names] for k in range(len(self.envs))]
        self.average(names, grads)
        if self.cuda:  # the gradients were read on d's stream: other streams must not reuse their memory yet
            self.held += grads
        self.finished(ops, d)
        return True

    def average(self, names: Sequence[str], grads: Sequence[Sequence[torch.Tensor]]) -> None:
        """Every replica's `names` become the mean of `grads` (one list per replica), summed in replica order."""
        total = replica_mean(grads)
        for env in self.envs:
            env.update(zip(names, total))

    def call(self, name: str, env: dict) -> None:
        n = self.nodes[name]
        if n.op == "get_attr":  # a constant of the step (lowering puts them in the prelude)
            env[name] = operator.attrgetter(n.target)(self.low.step.gm)
            return
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a.name])
        env[name] = n.target(*args, **kwargs)

    def interpret(self, t: Task, d: int) -> None:
        """Run task `t` on device d node by node."""
        env, device = self.envs[t.replica], self.programs.targets[d]

        def args_of(n: fx.Node) -> tuple:
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: self.get(t.replica, a.name, d))
            return args, _on(kwargs, device)

        if t.kind == PART:
            n = self.nodes[t.head]
            dim, k, parts = t.part
            env[f"{t.head}#{k}"] = run_part(n.target, *args_of(n), dim, k, parts)
            return
        if t.kind == JOIN:
            dim, _, parts = self.low.graph.ops[t.waits[0]].split
            env[t.head] = join(rule(self.nodes[t.head].target, dim),
                               [self.get(t.replica, f"{t.head}#{k}", d) for k in range(parts)])
        for name in t.nodes:
            n = self.nodes[name]
            args, kwargs = args_of(n)
            env[name] = n.target(*args, **kwargs)

    def culprit(self, seg: Segment, d: int) -> Task:
        """The task of a failed generated segment that raises when its nodes run one by one."""
        for t in seg.tasks:
            try:
                self.interpret(t, d)
            except BaseException:  # noqa: BLE001 - the first task that raises is the one to name
                return t
        return seg.tasks[-1]

    def run_segment(self, seg: Segment, d: int) -> bool:
        env = self.envs[seg.replica]
        start = torch.cuda.Event(enable_timing=True) if self.timings is not None and self.cuda else None
        if start is not None:
            start.record(self.streams[d])
        t0 = time.perf_counter()
        try:
            if seg.fn is None:
                for t in seg.tasks:
                    self.interpret(t, d)
            elif self.cuda:
                env.update(zip(seg.outputs, seg.fn(*[self.get(seg.replica, name, d) for name in seg.inputs])))
            else:
                env.update(zip(seg.outputs, seg.fn(*[env[name] for name in seg.inputs])))
        except BaseException as e:  # noqa: BLE001 - reported with the op's name, other devices stop
            self.fail((self.culprit(seg, d) if seg.fn is not None else seg.tasks[-1]).name, d, e)
            return False
        if self.timings is not None:
            if start is not None:  # GPU time, read once the step has synchronized
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.streams[d])
                self.timings.append((seg, d, (start, end)))
            else:
                self.timings.append((seg, d, time.perf_counter() - t0))
        self.finished([t.op for t in seg.tasks], d)
        return True

    def device(self, d: int) -> None:
        # Grad mode, the intra-op thread count and the current CUDA stream (and GPU) are per thread.
        torch.set_grad_enabled(False)
        torch.set_num_threads(self.threads)
        if self.cuda:
            torch.cuda.set_stream(self.streams[d])
        for seg in self.programs.devices[d]:
            try:
                ready = self.wait_all(seg.waits, d)
            except BaseException as e:  # noqa: BLE001 - an allreduce this device computed: stop every device
                self.fail(f"allreduce before {seg.tasks[0].name}", d, e)
                return
            if not ready or not self.run_segment(seg, d):
                return


def replica_mean(grads: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The mean of the replicas' tensors (`grads[k]`: replica k's), summed in replica order as eager DP does."""
    total = grads[0]
    for other in grads[1:]:
        total = torch._foreach_add(total, other)
    torch._foreach_div_(total, float(len(grads)))
    return list(total)


def replica_envs(low: Lowered, programs: Programs, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                 states: Sequence[Sequence[torch.Tensor]], batch: Sequence[torch.Tensor],
                 hypers: Sequence[float]) -> list[dict]:
    """Each replica's table of values, holding the step's inputs: the parameters, its own batch-norm buffers
    (replica 0's are the model's, the others' copies of those the step writes), optimizer state, its share of the
    batch, the hyperparameters and its loss weight (`fastt.loss`)."""
    r = low.replicas
    if batch[0].shape[0] % r:
        raise FasttError(f"batch {batch[0].shape[0]} does not split into {r} replicas")
    b = batch[0].shape[0] // r
    shares = [[x[k * b:(k + 1) * b] for x in batch] for k in range(r)]
    return replica_tables(low, programs, params, buffers, states, shares, hypers, low.weights.of(shares))


def replica_tables(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
                   buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
                   shares: Sequence[Sequence[torch.Tensor | None]], hypers: Sequence[float],
                   weights: Sequence[float]) -> list[dict]:
    """`replica_envs` from each replica's share and weight; an input that is None is left out of its table (a
    distributed rank holds only the inputs it reads)."""
    written = {name for name, _, _ in programs.writeback}
    envs = []
    for k in range(low.replicas):
        own = list(buffers) if k == 0 else [x.clone() if name in written else x
                                             for name, x in zip(programs.placeholders[len(params):], buffers)]
        flat = [*params, *own, *(s for ss in states for s in ss), *shares[k], *hypers, weights[k]]
        envs.append({name: x for name, x in zip(programs.placeholders, flat, strict=True) if x is not None})
    return envs


def weighted_loss(envs: Sequence[dict], programs: Programs, device: torch.device | None = None) -> torch.Tensor:
    """The whole batch's loss: the mean of the replicas' losses, each times its weight (`fastt.loss`)."""
    loss, weight = programs.outputs[0], programs.placeholders[-1]
    return sum(env[loss].to(device) * env[weight] for env in envs) / len(envs)


def run_step(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]], batch: Sequence[torch.Tensor],
             hypers: Sequence[float], threads_per_device: int = 1,
             timings: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run one step of `low` (its `compile_programs`) on real tensors: (loss, new parameters, new optimizer
    state tensors), on the device the parameters are on. `timings` collects (segment, device, seconds) of every
    segment run (on CUDA the segment's GPU time)."""
    envs = replica_envs(low, programs, params, buffers, states, batch, hypers)
    run = _Run(low, programs, envs, threads_per_device, timings)
    with torch.no_grad():
        for env in envs:
            for name in low.prelude:
                run.call(name, env)
    gpus = list(dict.fromkeys(programs.targets)) if programs.cuda else []
    for stream, dev in zip(programs.streams, programs.targets):  # after what the caller queued (the batch)
        stream.wait_stream(torch.cuda.current_stream(dev))
    workers = [threading.Thread(target=run.device, args=(d,), daemon=True) for d in range(len(programs.devices))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    try:
        for dev in gpus:
            torch.cuda.synchronize(dev)
    except RuntimeError as e:  # an asynchronous kernel error surfaces here, not in the op that caused it
        if run.error is None:
            run.error = ("(asynchronous CUDA error: rerun with CUDA_LAUNCH_BLOCKING=1 to name the op)", -1, e)
    run.held.clear()
    if run.error is not None:
        name, d, e = run.error
        raise StepError(f"op '{name}' on device {d} failed: {type(e).__name__}: {e}") from e
    if timings is not None and gpus:
        timings[:] = [(seg, d, t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3)
                      for seg, d, t in timings]
    home = params[0].device if params else programs.targets[0]
    for name, d, region in programs.writeback:  # a buffer replica 0 updated on another GPU
        if (0, name, d) in run.moved:
            whole, written = envs[0][name], run.moved[0, name, d][1]
            if region is not None:
                dim, k, parts = region
                whole, written = (torch.tensor_split(x, parts, dim)[k] for x in (whole, written))
            whole.copy_(written)
    out, n = programs.outputs, len(low.step.param_names)
    loss = weighted_loss(envs, programs, home)
    new_params = [envs[0][x].to(home) for x in out[1 + n:1 + 2 * n]]
    new_states = [envs[0][x].to(home) for x in out[1 + 2 * n:]]
    return loss, new_params, new_states
