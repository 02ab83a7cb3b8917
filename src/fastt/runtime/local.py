"""The local runtime: one thread per CPU worker device, each running its program strictly in order.

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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.node import map_arg

from ..api import simulate
from ..cluster import Cluster
from ..cost import MeasuredCosts
from ..errors import FasttError
from ..graph import OpGraph
from ..lower import JOIN, PART, RUN, Lowered, Task, lower
from ..split import join, rule, run_part
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


def _generate(low: Lowered, nodes: dict[str, fx.Node],
              tasks: Sequence[Task]) -> tuple[tuple[str, ...], tuple[str, ...], Callable]:
    """The code of a run of plain tasks: (names it reads, names read after it, function)."""
    names = [name for t in tasks for name in t.nodes]
    inside = set(names)
    inputs = tuple(dict.fromkeys(x.name for name in names for x in nodes[name].all_input_nodes
                                 if x.name not in inside))
    outputs = tuple(name for name in names if any(u.name not in inside for u in nodes[name].users))
    g = fx.Graph()
    values = {name: g.placeholder(name) for name in inputs}
    for name in names:
        values[name] = g.node_copy(nodes[name], lambda a: values[a.name])
    g.output(tuple(values[name] for name in outputs))
    return inputs, outputs, fx.GraphModule(low.step.gm, g).forward


@dataclass(frozen=True)
class Programs:
    """The compiled programs: `devices[d]` is device d's segments; `signals` the ops some device waits for;
    the step's nodes by name, its placeholders and its outputs (names), looked up once."""

    devices: tuple[tuple[Segment, ...], ...]
    signals: frozenset[int]
    nodes: dict[str, fx.Node]
    placeholders: tuple[str, ...]
    outputs: tuple[str, ...]


def compile_programs(low: Lowered) -> Programs:
    """Each device's program as segments (see the module docstring)."""
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
            code = _generate(low, nodes, tasks) if tasks[0].kind == RUN else ((), (), None)
            segments.append(Segment(tasks[0].replica, tuple(tasks), waits, *code))
        programs.append(tuple(segments))
    signals = handoffs | {j for a in low.allreduces for j in low.graph.ops[a].inputs} | set(low.allreduces)
    placeholders = tuple(name for name, n in nodes.items() if n.op == "placeholder")
    outputs = tuple(x.name for x in next(n for n in nodes.values() if n.op == "output").args[0])
    return Programs(tuple(programs), frozenset(signals), nodes, placeholders, outputs)


@dataclass(frozen=True)
class Placed:
    """A strategy ready to run: its per-device programs and its simulated iteration time (measured op costs)."""

    strategy: Strategy
    lowered: Lowered
    programs: Programs
    simulated_s: float


def place(graph: OpGraph, strategy: Strategy, cl: Cluster, costs: MeasuredCosts) -> Placed:
    """Lower and compile `strategy`; a strategy that does not fit in device memory is refused."""
    tl = simulate(graph, strategy, cl, costs)
    if not tl.fits:
        raise FasttError("the plan does not fit in device memory: " + "; ".join(tl.oom))
    low = lower(graph, strategy)
    return Placed(strategy, low, compile_programs(low), tl.iteration_s)


class _Run:
    """The state of one step: values per replica, an event per op some device waits for, the first error."""

    def __init__(self, low: Lowered, programs: Programs, envs: list[dict], threads: int,
                 timings: list | None) -> None:
        self.low, self.programs, self.envs, self.threads, self.timings = low, programs, envs, threads, timings
        self.nodes = programs.nodes
        # One event per op some device waits for: a waiter wakes only for its op (or an error: all are set).
        self.events = {op: threading.Event() for op in programs.signals}
        self.lock = threading.Lock()
        self.claimed: set[int] = set()  # allreduces some device has started
        self.error: tuple[str, int, BaseException] | None = None

    def wait(self, op: int) -> bool:
        """Wait for op's results; False when another device failed (stop)."""
        self.events[op].wait()
        return self.error is None

    def wait_all(self, ops: Sequence[int], chunk: int = 16) -> bool:
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
            if not self.allreduce(batch):
                return False
        return all(self.wait(j) for j in ops)

    def finished(self, ops: Sequence[int]) -> None:
        for op in ops:
            if op in self.events:
                self.events[op].set()

    def fail(self, name: str, d: int, e: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = (name, d, e)
        for ev in self.events.values():
            ev.set()

    def allreduce(self, ops: Sequence[int]) -> bool:
        """Average the gradients of allreduces `ops` across replicas, summed in replica order."""
        if not all(self.wait(j) for a in ops for j in self.low.graph.ops[a].inputs):
            return False
        names = [name for a in ops for name in self.low.allreduces[a]]
        total = [self.envs[0][name] for name in names]
        for env in self.envs[1:]:
            total = torch._foreach_add(total, [env[name] for name in names])
        torch._foreach_div_(total, float(len(self.envs)))
        for env in self.envs:
            env.update(zip(names, total))
        self.finished(ops)
        return True

    def call(self, name: str, env: dict) -> None:
        n = self.nodes[name]
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a.name])
        env[name] = n.target(*args, **kwargs)

    def interpret(self, t: Task, env: dict) -> None:
        """Run task `t` node by node."""
        if t.kind == PART:
            n = self.nodes[t.head]
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a.name])
            dim, k, parts = t.part
            env[f"{t.head}#{k}"] = run_part(n.target, args, kwargs, dim, k, parts)
            return
        if t.kind == JOIN:
            dim, _, parts = self.low.graph.ops[t.waits[0]].split
            env[t.head] = join(rule(self.nodes[t.head].target, dim), [env[f"{t.head}#{k}"] for k in range(parts)])
        for name in t.nodes:
            self.call(name, env)

    def culprit(self, seg: Segment, env: dict) -> Task:
        """The task of a failed generated segment that raises when its nodes run one by one."""
        for t in seg.tasks:
            try:
                self.interpret(t, env)
            except BaseException:  # noqa: BLE001 - the first task that raises is the one to name
                return t
        return seg.tasks[-1]

    def run_segment(self, seg: Segment, d: int) -> bool:
        env = self.envs[seg.replica]
        t0 = time.perf_counter()
        try:
            if seg.fn is None:
                for t in seg.tasks:
                    self.interpret(t, env)
            else:
                env.update(zip(seg.outputs, seg.fn(*[env[name] for name in seg.inputs])))
        except BaseException as e:  # noqa: BLE001 - reported with the op's name, other devices stop
            self.fail((self.culprit(seg, env) if seg.fn is not None else seg.tasks[-1]).name, d, e)
            return False
        if self.timings is not None:
            self.timings.append((seg, d, time.perf_counter() - t0))
        self.finished([t.op for t in seg.tasks])
        return True

    def device(self, d: int) -> None:
        # Grad mode and the intra-op thread count are per thread.
        torch.set_grad_enabled(False)
        torch.set_num_threads(self.threads)
        for seg in self.programs.devices[d]:
            try:
                ready = self.wait_all(seg.waits)
            except BaseException as e:  # noqa: BLE001 - an allreduce this device computed: stop every device
                self.fail(f"allreduce before {seg.tasks[0].name}", d, e)
                return
            if not ready or not self.run_segment(seg, d):
                return


def run_step(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]], batch: Sequence[torch.Tensor],
             threads_per_device: int = 1,
             timings: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run one step of `low` (its `compile_programs`) on real tensors: (loss, new parameters, new optimizer
    state tensors). `timings` collects (segment, device, seconds) of every segment run."""
    r = low.replicas
    if batch[0].shape[0] % r:
        raise FasttError(f"batch {batch[0].shape[0]} does not split into {r} replicas")
    b = batch[0].shape[0] // r
    envs = []
    for k in range(r):
        own = list(buffers) if k == 0 else [x.clone() for x in buffers]
        flat = [*params, *own, *(s for ss in states for s in ss), *(x[k * b:(k + 1) * b] for x in batch)]
        envs.append(dict(zip(programs.placeholders, flat)))
    run = _Run(low, programs, envs, threads_per_device, timings)
    with torch.no_grad():
        for env in envs:
            for name in low.prelude:
                run.call(name, env)
    workers = [threading.Thread(target=run.device, args=(d,), daemon=True) for d in range(len(programs.devices))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if run.error is not None:
        name, d, e = run.error
        raise StepError(f"op '{name}' on device {d} failed: {type(e).__name__}: {e}") from e
    out, n = programs.outputs, len(low.step.param_names)
    loss = sum(env[out[0]] for env in envs) / r
    new_params = [envs[0][x] for x in out[1 + n:1 + 2 * n]]
    new_states = [envs[0][x] for x in out[1 + 2 * n:]]
    return loss, new_params, new_states
