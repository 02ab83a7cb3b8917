"""The local runtime: one thread per CPU worker device, each running its program strictly in order.

`compile_programs` cuts each device's program into segments: runs of consecutive tasks that need nothing from
another device once started (a segment ends where another device waits for its last op, and starts where it
waits for another device or an allreduce). A segment of plain tasks becomes one generated Python function (torch.fx
codegen), so its values stay local and only the ones read elsewhere go through the replica's shared table; split
parts and joins are interpreted. A segment starts when every op it waits for has finished (threads wait on a
condition, never on the device order of others); torch releases the GIL inside kernels, so devices compute in
parallel. Worker devices share this process's memory: a transfer is a hand-off, and all holders of a parameter hold
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

from ..errors import FasttError
from ..lower import JOIN, PART, RUN, Lowered, Task
from ..split import join, rule, run_part


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


def _generate(low: Lowered, tasks: Sequence[Task]) -> tuple[tuple[str, ...], tuple[str, ...], Callable]:
    """The code of a run of plain tasks: (names it reads, names read after it, function)."""
    nodes = {n.name: n for n in low.step.gm.graph.nodes}
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


def compile_programs(low: Lowered) -> tuple[tuple[Segment, ...], ...]:
    """Each device's program as segments (see the module docstring)."""
    device_of = {t.op: d for d, program in enumerate(low.programs) for t in program}

    def foreign(t: Task, d: int) -> tuple[int, ...]:
        return tuple(j for j in t.waits if j in low.allreduces or device_of[j] != d)

    signals = {j for d, program in enumerate(low.programs) for t in program for j in foreign(t, d)}
    signals |= {j for a in low.allreduces for j in low.graph.ops[a].inputs}
    programs = []
    for d, program in enumerate(low.programs):
        runs: list[list[Task]] = []
        for t in program:
            prev = runs[-1][-1] if runs else None
            if (prev is None or foreign(t, d) or t.kind != RUN or prev.kind != RUN or prev.op in signals
                    or prev.replica != t.replica):
                runs.append([])
            runs[-1].append(t)
        segments = []
        for tasks in runs:
            waits = tuple(dict.fromkeys(j for t in tasks for j in foreign(t, d)))
            code = _generate(low, tasks) if tasks[0].kind == RUN else ((), (), None)
            segments.append(Segment(tasks[0].replica, tuple(tasks), waits, *code))
        programs.append(tuple(segments))
    return tuple(programs)


class _Run:
    """The state of one step: values per replica, the ops finished so far, the first error."""

    def __init__(self, low: Lowered, programs: tuple[tuple[Segment, ...], ...], envs: list[dict],
                 threads: int, timings: list | None) -> None:
        self.low, self.programs, self.envs, self.threads, self.timings = low, programs, envs, threads, timings
        self.nodes = {n.name: n for n in low.step.gm.graph.nodes}
        self.done: set[int] = set()  # ops whose results are in the envs (allreduces included)
        self.claimed: set[int] = set()  # allreduces some device has started
        self.cv = threading.Condition()
        self.error: tuple[str, int, BaseException] | None = None

    def wait(self, op: int) -> bool:
        """Wait for op's results; False when another device failed (stop)."""
        if op in self.low.allreduces:
            with self.cv:
                first = op not in self.claimed
                self.claimed.add(op)
            if first:
                return self.allreduce(op)
        with self.cv:
            while op not in self.done and self.error is None:
                self.cv.wait()
            return op in self.done

    def finished(self, ops: Sequence[int]) -> None:
        with self.cv:
            self.done.update(ops)
            self.cv.notify_all()

    def allreduce(self, a: int) -> bool:
        """Average the gradients of allreduce `a` across replicas (once: the first device that needs it)."""
        if not all(self.wait(j) for j in self.low.graph.ops[a].inputs):
            return False
        for name in self.low.allreduces[a]:
            values = [env[name] for env in self.envs]
            total = values[0]
            for v in values[1:]:
                total = total + v
            mean = total / len(values)
            for env in self.envs:
                env[name] = mean
        self.finished((a,))
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
            t = self.culprit(seg, env) if seg.fn is not None else seg.tasks[-1]
            with self.cv:
                if self.error is None:
                    self.error = (t.name, d, e)
                self.cv.notify_all()
            return False
        if self.timings is not None:
            self.timings.append((seg, d, time.perf_counter() - t0))
        self.finished([t.op for t in seg.tasks])
        return True

    def device(self, d: int) -> None:
        # Grad mode and the intra-op thread count are per thread.
        torch.set_grad_enabled(False)
        torch.set_num_threads(self.threads)
        for seg in self.programs[d]:
            if not all(self.wait(j) for j in seg.waits) or not self.run_segment(seg, d):
                return


def run_step(low: Lowered, programs: tuple[tuple[Segment, ...], ...], params: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]], batch: Sequence[torch.Tensor],
             threads_per_device: int = 1,
             timings: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run one step of `low` (its `compile_programs`) on real tensors: (loss, new parameters, new optimizer
    state tensors). `timings` collects (segment, device, seconds) of every segment run."""
    r = low.replicas
    if batch[0].shape[0] % r:
        raise FasttError(f"batch {batch[0].shape[0]} does not split into {r} replicas")
    b = batch[0].shape[0] // r
    placeholders = [n.name for n in low.step.gm.graph.nodes if n.op == "placeholder"]
    envs = []
    for k in range(r):
        own = list(buffers) if k == 0 else [x.clone() for x in buffers]
        flat = [*params, *own, *(s for ss in states for s in ss), *(x[k * b:(k + 1) * b] for x in batch)]
        envs.append(dict(zip(placeholders, flat)))
    run = _Run(low, programs, envs, threads_per_device, timings)
    with torch.no_grad():
        for env in envs:
            for name in low.prelude:
                run.call(name, env)
    workers = [threading.Thread(target=run.device, args=(d,), daemon=True) for d in range(len(programs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if run.error is not None:
        name, d, e = run.error
        raise StepError(f"op '{name}' on device {d} failed: {type(e).__name__}: {e}") from e
    out = list(low.step.gm.graph.nodes)[-1].args[0]
    n = len(low.step.param_names)
    loss = sum(env[out[0].name] for env in envs) / r
    new_params = [envs[0][x.name] for x in out[1 + n:1 + 2 * n]]
    new_states = [envs[0][x.name] for x in out[1 + 2 * n:]]
    return loss, new_params, new_states
