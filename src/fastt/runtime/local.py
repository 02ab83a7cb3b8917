"""The local runtime: one thread per device (a CPU worker device or a CUDA stream), each running its program
strictly in order. The threads live as long as the process (`Workers`): device d runs on the same thread every
step.

The programs are `programs.compile_programs`' segments. A segment starts when every op it waits for has
finished (a thread waits on one event per op, never on the device order of others); torch releases the GIL
inside kernels, so devices compute in parallel. Gradients are averaged by the first device that needs them
(see `_Run.wait_all`). Worker devices share this process's memory: a transfer is a hand-off, and all holders
of a parameter hold the same tensor — so every replica reads the parameters as they were before the step, and
the new values are written back once the step has finished. Data parallelism keeps per-replica batch-norm
buffers (per-device statistics, as DDP); replica 0's are kept. An exception in any task stops every device and
is raised with the op's name.

On CUDA devices a thread launches its device's kernels on its own stream (a GPU's default stream, or a stream
of its own for a second device on the same GPU). A finished segment records a CUDA event, and a device that
reads its results makes its stream wait for that event, so the GPUs wait on each other only where the data
flows. A value on another GPU is copied once per step and device; parameters and the optimizer state live on
the model's GPU (the truth) and are copied to the other devices that read them. The step ends by synchronizing
every GPU.
"""

from __future__ import annotations

import contextlib
import linecache
import operator
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch.fx.node import map_arg

from ..cluster import use_cores
from ..cost import direct, replica_mean
from ..errors import FasttError
from ..lower import JOIN, PART, SHARD, Lowered, Task, part_args, part_names
from ..shard import CUTS
from ..split import join, rule, run_part, view_part
from .meter import StorageMeter
from .oom import Budget, oom_message, out_of_memory
from .programs import Programs, Segment, held_rows, on_device, rows, scattered


class StepError(RuntimeError):
    """An op raised while the step ran; the message names it and the device (out of memory: also the plan's
    simulated peak there beside the device's memory, `oom.oom_message`)."""


class _Run:
    """The state of one step: values per replica, an event per op some device waits for, the first error. On
    CUDA also: the CUDA event each waited-for op was recorded with, values copied to other GPUs, and tensors
    other streams read, kept alive until the step has synchronized."""

    signalled = True  # devices run in threads of this process and wait on each other's events

    def __init__(self, low: Lowered, programs: Programs, envs: list[dict], threads: int,
                 timings: list | None, meter: StorageMeter | None = None,
                 budgets: Sequence[Budget] = (), spans: list | None = None) -> None:
        self.low, self.programs, self.envs, self.threads, self.timings = low, programs, envs, threads, timings
        self.meter, self.budgets = meter, budgets
        # with `spans` (CPU): (segment or None: an allreduce mean, device, start, end), perf_counter seconds
        self.spans = spans
        # with `timings`: each device's seconds computing allreduce means (between its segments)
        self.reducing = [0.0] * len(programs.devices)
        self.nodes, self.cuda, self.streams = programs.nodes, programs.cuda, programs.streams
        # One event per op some device waits for: a waiter wakes only for its op (or an error: all are set).
        self.events = {op: Latch() for op in programs.signals} if self.signalled else {}
        self.lock = threading.Lock()
        self.claimed: set[int] = set()  # allreduces some device has started
        # gradient -> each replica's own, as the first allreduce of it found them
        self.raw: dict[str, list] = {}
        self.error: tuple[str, int, BaseException] | None = None
        # op -> (CUDA event, device that recorded it)
        self.recorded: dict[int, tuple[torch.cuda.Event, int]] = {}
        self.moved: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # -> (source, copy)
        self.held: list = []
        # What is still to read each value; at none it leaves the table (on CPU: on CUDA another stream may
        # still be reading it, so every value lives until the step has synchronized).
        self.left = None if self.cuda else dict(programs.readers)
        self.carriers = Counter(name for names in low.allreduces.values() for name in names)
        self.scattered: Counter[int] = Counter()  # reduce-scatter -> replicas that have their rows
        given = scattered(low)  # reduce-scatters whose replicas compute their own rows
        self.scatters = {a for a, names in low.allreduces.items() if names and set(names) <= given}
        # Per device, the allreduces whose gradients and readers are all on it (`Programs.accumulate`) still
        # to sum: each as soon as its last gradient is made, as gradient accumulation does, not held until an
        # update reads the mean (the simulator's order). A reduce-scatter is left out: its replicas compute
        # their own rows, so no device ever claims it.
        self.accumulate = [[a for a in ops if a not in self.scatters] for ops in programs.accumulate]
        if meter is not None:  # only a measured step pays for these
            # (replica, value, device) -> segments on the device still to read it
            self.local = Counter((seg.replica, name, d) for d, segs in enumerate(programs.devices)
                                 for seg in segs for name in seg.reads)
            self.readers: dict[tuple[int, str], set[int]] = {}  # (replica, value) -> devices that read it
            for k, name, d in self.local:
                self.readers.setdefault((k, name), set()).add(d)
            device_of = {t.op: d for d, program in enumerate(low.programs) for t in program}
            # gradient -> the devices its allreduce's readers run on
            self.group = {name: sorted({device_of[s] for s in low.graph.succs[a] if s in device_of})
                          for a, names in low.allreduces.items() for name in names}

    def release(self, k: int, read: Sequence[str], written: Sequence[str] = (), d: int = -1) -> None:
        """Replica k's segment on device d has read `read` and written `written`: drop the values nothing
        reads any more, as eager frees an activation after its last use. With a meter, what d wrote that other
        devices read is theirs from now on, as a GPU sends it when the segment ends (the simulator's
        `release`), and device d's copy of a value ends with d's last read of it."""
        if self.left is None:
            return
        env, left, kept = self.envs[k], self.left, self.programs.kept
        with self.lock:
            for name in read:
                left[k, name] -= 1
                if self.meter is not None and d >= 0:
                    self.local[k, name, d] -= 1
                    if not self.local[k, name, d] and isinstance(env.get(name), torch.Tensor):
                        self.meter.drop(d, env[name])
            for name in written if self.meter is not None and d >= 0 else ():
                others = self.readers.get((k, name), set()) - {d}
                if others and isinstance(env.get(name), torch.Tensor):
                    self.meter.hold(sorted(others), env[name])
                    if not self.local[k, name, d]:
                        self.meter.drop(d, env[name])
            for name in (*read, *written):
                if left.get((k, name), 0) <= 0 and name not in kept:
                    env.pop(name, None)

    def take(self, seg: Segment) -> list:
        """The inputs of generated segment `seg`, those it reads last taken out of the table, so that the
        code frees each after its last use there (the gradients a run of updates reads, one by one)."""
        env = self.envs[seg.replica]
        if self.left is None:
            return [env[name] for name in seg.inputs]
        kept, left, k = self.programs.kept, self.left, seg.replica
        with self.lock:
            last = {name for name in seg.inputs if left[k, name] == 1 and name not in kept}
            return [env.pop(name) if name in last else env[name] for name in seg.inputs]

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

    def wait_all(self, ops: Sequence[int], d: int, replica: int, chunk: int = 16) -> bool:
        """Wait for every op of `ops` (what replica `replica`'s segment on device d reads). Allreduces no
        device has started are claimed and computed here: the next one, with those of the following `chunk`
        whose gradients are all there already (one batch). A device never holds a claim on an allreduce while
        it waits for another one's gradients: no deadlock. Of a reduce-scatter, the replica computes its own
        rows (`scatter`)."""
        for k, a in enumerate(ops):
            if a not in self.low.allreduces:
                continue
            if a in self.scatters:
                if not self.scatter(a, replica, d):
                    return False
                continue
            with self.lock:
                if a in self.claimed:
                    continue
                ready = self._made(ops[k:k + chunk])
                batch = ready if a in ready else [a]
                self.claimed.update(batch)
            if not self.allreduce(batch, d):
                return False
        return all(self.wait(j, d) for j in ops if j not in self.scatters)

    def scatter(self, a: int, k: int, d: int) -> bool:
        """Replica k's rows of reduce-scatter `a`'s mean, on device d: every replica's rows of the gradient
        summed in replica order (as the whole mean sums them), so that each device makes, and holds, only
        its rows. The replicas' own gradients are kept aside until every replica has its rows."""
        if not all(self.wait(j, d) for j in self.low.graph.ops[a].inputs):
            return False
        t0 = time.perf_counter()
        names, r = self.low.allreduces[a], len(self.envs)
        with self.lock:
            for name in names:
                self.raw.setdefault(name, [env[name] for env in self.envs])
        grads = [[rows(self.get(j, name, d, self.raw[name][j]), r, k) for name in names] for j in range(r)]
        self.envs[k].update(zip(names, replica_mean(grads)))
        with self.lock:
            self.scattered[a] += 1
            done = self.scattered[a] == r
            for name in names if done else ():
                self.carriers[name] -= 1
                if not self.carriers[name]:
                    del self.raw[name]
        for j in range(r) if done else ():
            self.release(j, names)
        if self.cuda:
            self.held += grads
        if self.timings is not None:
            self.reduced(d, t0)
        return True

    def reduced(self, d: int, t0: float) -> None:
        """Device d computed an allreduce mean from `t0` until now."""
        now = time.perf_counter()
        self.reducing[d] += now - t0
        if self.spans is not None:
            self.spans.append((None, d, t0, now))

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

    def failure(self) -> str:
        """What the first error says: the op that raised and its device; out of memory, also the plan's
        simulated peak there."""
        name, d, e = self.error
        if out_of_memory(e):
            return oom_message(f"in op '{name}'", d, self.budgets, e)
        return f"op '{name}' on device {d} failed: {type(e).__name__}: {e}"

    def get(self, k: int, name: str, d: int, x: object = None):
        """Replica k's value `name` (or `x`, a value it had) on device d: on another GPU, copied once per
        step. The copy runs on a stream of the source GPU that first waits for device d's stream, which has
        waited for the value's producer."""
        x = self.envs[k][name] if x is None else x
        if (not self.cuda or not isinstance(x, torch.Tensor) or not x.is_cuda
                or x.device == self.programs.targets[d]):
            # CPU tensors in a GPU step (e.g. attention's random seed) stay where the kernel wants them
            return x
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
        t0 = time.perf_counter()
        names = [name for a in ops for name in self.low.allreduces[a]]
        # Two allreduces may carry one gradient (a clip's norm and its update both read it): each averages the
        # replicas' own gradients, kept aside by the first, never a mean another device has written meanwhile.
        with self.lock:
            for name in names:
                self.raw.setdefault(name, [env[name] for env in self.envs])
        grads = [[self.get(k, name, d, self.raw[name][k]) for name in names] for k in range(len(self.envs))]
        self.average(names, grads)
        if self.meter is not None:  # each replica's device would hold the mean as its own copy
            for name in names:
                self.meter.hold(self.group[name], self.envs[0][name])
        with self.lock:
            for name in names:
                self.carriers[name] -= 1
                if not self.carriers[name]:
                    del self.raw[name]
        for k in range(len(self.envs)):
            self.release(k, names)
        if self.cuda:  # the gradients were read on d's stream: other streams must not reuse their memory yet
            self.held += grads
        self.finished(ops, d)
        if self.timings is not None:
            self.reduced(d, t0)
        return True

    def average(self, names: Sequence[str], grads: Sequence[Sequence[torch.Tensor]]) -> None:
        """Every replica's `names` become the mean of `grads` (one list per replica), summed in replica
        order."""
        total = replica_mean(grads)
        for env in self.envs:
            env.update(zip(names, total))

    def call(self, name: str, env: dict) -> None:
        n = self.nodes[name]
        if n.op == "get_attr":  # a constant of the step (lowering puts them in the prelude)
            env[name] = operator.attrgetter(n.target)(self.low.step.gm)
            return
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a.name])
        env[name] = direct(n.target)(*args, **kwargs)

    def interpret(self, t: Task, d: int) -> None:
        """Run task `t` on device d node by node."""
        env, device = self.envs[t.replica], self.programs.targets[d]

        def args_of(n: fx.Node) -> tuple:
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: self.get(t.replica, a.name, d))
            return args, on_device(kwargs, device)

        if t.kind == PART:
            n = self.nodes[t.head]
            dim, k, parts = t.part
            if not t.given:
                env[f"{t.head}#{k}"] = run_part(n.target, *args_of(n), dim, k, parts)
            else:  # a chained part: its producers' parts, sliced as the whole op's shapes say
                args, kwargs = part_args(t, n)
                args, kwargs = map_arg((args, kwargs), lambda a: self.get(t.replica, a.name, d))
                args = [self.get(t.replica, a, d) if isinstance(a, str) else a for a in args]
                whole = map_arg(n.args, lambda a: a.meta.get("val"))
                env[f"{t.head}#{k}"] = run_part(n.target, args, on_device(kwargs, device), dim, k, parts,
                                                given=[pos for pos, _ in t.given], whole=whole)
            for name, cut in t.views:  # the views of the part that chained parts read
                v = self.nodes[name]
                env[f"{name}#{k}"] = view_part(v, env[f"{v.args[0].name}#{k}"], cut, parts)
            return
        if t.kind == SHARD:  # this replica's rows of the parameter, its mean gradient and its state
            cut, k, parts = t.part
            shape = self.nodes[t.head].meta["val"].shape
            renamed = dict(t.renamed)  # a chained update's part: its gradient's part

            def mine(a: fx.Node) -> object:
                if a.name in t.nodes:
                    return env[a.name + t.tag]
                x = self.get(t.replica, renamed.get(a.name, a.name), d)
                whole = isinstance(x, torch.Tensor) and x.shape == shape and a.name not in renamed
                return rows(x, parts, k, CUTS[cut]) if whole else x
            for name in t.nodes:
                n = self.nodes[name]
                args, kwargs = map_arg((n.args, n.kwargs), mine)
                env[name + t.tag] = direct(n.target)(*args, **on_device(kwargs, device))
            return
        if t.kind == JOIN:
            dim, _, parts = self.low.graph.ops[t.waits[0]].split
            env[t.head] = join(rule(self.nodes[t.head].target, dim),
                               [self.get(t.replica, f"{t.head}#{k}", d) for k in range(parts)],
                               self.nodes[t.head].meta.get("val"))
        for name in t.nodes:
            n = self.nodes[name]
            args, kwargs = args_of(n)
            env[name] = direct(n.target)(*args, **kwargs)

    def culprit(self, seg: Segment, d: int, e: BaseException) -> Task:
        """The task of a failed generated segment: the one whose node the code was running (read off the
        traceback's line of generated code), else the first that raises when its nodes run one by one."""
        tb, name = e.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith("<eval_with_key"):
                line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
                name = m.group(1) if (m := re.match(r"\s*(\w+) = ", line)) else name
            tb = tb.tb_next
        for t in seg.tasks:
            if name in t.nodes:
                return t
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
        if self.meter is not None:  # a GPU would hold what it receives, and a resident it reads, as its copy
            copies = self.meter.copies
            for name in seg.reads if seg.waits or copies else ():
                if isinstance(env.get(name), torch.Tensor):
                    self.meter.hold([d], env[name], given=(name, d) in copies)
        try:
            if seg.fn is None:
                for t in seg.tasks:
                    self.interpret(t, d)
            elif self.cuda:
                env.update(zip(seg.outputs, seg.fn([self.get(seg.replica, name, d) for name in seg.inputs])))
            else:
                env.update(zip(seg.outputs, seg.fn(self.take(seg))))
        except BaseException as e:  # noqa: BLE001 - reported with the op's name, other devices stop
            self.fail((self.culprit(seg, d, e) if seg.fn is not None else seg.tasks[-1]).name, d, e)
            return False
        if self.timings is not None:
            if start is not None:  # GPU time, read once the step has synchronized
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.streams[d])
                self.timings.append((seg, d, (start, end)))
            else:
                now = time.perf_counter()
                self.timings.append((seg, d, now - t0))
                if self.spans is not None:
                    self.spans.append((seg, d, t0, now))
        self.finished([t.op for t in seg.tasks], d)
        self.release(seg.replica, seg.reads, seg.outputs if seg.fn is not None else written(seg), d)
        return True

    def device(self, d: int) -> None:
        with self.meter.on(d) if self.meter is not None else contextlib.nullcontext():
            self.run_device(d)

    def run_device(self, d: int) -> None:
        # Grad mode, the intra-op thread count and the current CUDA stream (and GPU) are per thread.
        torch.set_grad_enabled(False)
        torch.set_num_threads(self.threads)
        if self.cuda:
            torch.cuda.set_stream(self.streams[d])
        elif len(self.programs.devices) > 1:  # a worker thread (one device runs on the caller's)
            use_cores(d, self.threads, len(self.programs.devices))
        for seg in self.programs.devices[d]:
            try:
                ready = self.wait_all(seg.waits, d, seg.replica)
            except BaseException as e:  # noqa: BLE001 - an allreduce this device computed: stop every device
                self.fail(f"allreduce before {seg.tasks[0].name}", d, e)
                return
            if not ready or not self.run_segment(seg, d):
                return
            if self.accumulate[d] and not self.accumulated(d):
                return

    def _made(self, candidates: Sequence[int]) -> list[int]:
        """Of `candidates`, the allreduces (not reduce-scatters) no device has claimed whose gradients are all
        made (under `lock`)."""
        ops = self.low.graph.ops
        return [a for a in candidates if a in self.low.allreduces and a not in self.claimed
                and a not in self.scatters and all(self.events[j].is_set() for j in ops[a].inputs)]

    def accumulated(self, d: int) -> bool:
        """Sum device d's own allreduces (`accumulate`) whose gradients are all made, in one batch."""
        with self.lock:
            ready = self._made(self.accumulate[d])
            self.claimed.update(ready)
            self.accumulate[d] = [a for a in self.accumulate[d] if a not in self.claimed]
        return not ready or self.allreduce(ready, d)


class Latch:
    """A one-shot `threading.Event` (set, is_set, wait) on one bare lock, held until set: a step makes one per
    op some device waits for, and an Event (a Condition over a lock) cost 4 µs to make, 1.5 ms a step for
    resnet50 under DP at test size (377 of them). A lock may be released by any thread; a second `set`, or one
    while a waiter briefly holds the lock, finds it released and does nothing."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # set already
            self._lock.release()

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self) -> None:
        self._lock.acquire()
        self.set()


def written(seg: Segment) -> tuple[str, ...]:
    """The values an interpreted segment (a split part or a join) writes to its replica's table."""
    t = seg.tasks[0]
    if t.kind == SHARD:
        return tuple(n + t.tag for n in t.nodes)
    return part_names(t) if t.kind == PART else (t.head, *t.nodes)


def replica_envs(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
                 buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
                 batch: Sequence[torch.Tensor],
                 hypers: Sequence[float]) -> list[dict]:
    """Each replica's table of values, holding the step's inputs: the parameters, its own batch-norm buffers
    (replica 0's are the model's, the others' copies of those the step writes), optimizer state, its share of
    the batch, the hyperparameters and its loss weight (`fastt.loss`)."""
    r = low.replicas
    if batch[0].shape[0] % r:
        raise FasttError(f"batch {batch[0].shape[0]} does not split into {r} replicas")
    b = batch[0].shape[0] // r
    shares = [[x[k * b:(k + 1) * b] for x in batch] for k in range(r)] if r > 1 else [list(batch)]
    return replica_tables(low, programs, params, buffers, states, shares, hypers, low.weights.of(shares))


def replica_tables(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
                   buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
                   shares: Sequence[Sequence[torch.Tensor | None]], hypers: Sequence[float],
                   weights: Sequence[float]) -> list[dict]:
    """`replica_envs` from each replica's share and weight; an input that is None is left out of its table (a
    distributed rank holds only the inputs it reads). A sharded update's state goes in as replica k's rows
    of it, unless it is held as rows already (a rank's own, from its last step)."""
    written = {name for name, _, _ in programs.writeback}
    held = held_rows(low)
    envs = []
    for k in range(low.replicas):
        own = list(buffers) if k == 0 else [x.clone() if name in written else x
                                             for name, x in zip(programs.placeholders[len(params):], buffers)]
        flat = [*params, *own, *(s for ss in states for s in ss), *shares[k], *hypers, weights[k]]
        env = {name: x for name, x in zip(programs.placeholders, flat, strict=True) if x is not None}
        for name, parts in held.items():  # a sharded update's state: its rows (a rank may hold only those)
            if name in env and env[name].shape == programs.nodes[name].meta["val"].shape:
                env[name] = rows(env[name], parts, k)
        envs.append(env)
    return envs


def weighted_loss(envs: Sequence[dict], programs: Programs,
                  device: torch.device | None = None) -> torch.Tensor:
    """The whole batch's loss: the mean of the replicas' losses, each times its weight (`fastt.loss`)."""
    loss, weight = programs.outputs[0], programs.placeholders[-1]
    return sum(env[loss].to(device) * env[weight] for env in envs) / len(envs)


def run_step(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
             batch: Sequence[torch.Tensor], hypers: Sequence[float], threads_per_device: int = 1,
             timings: list | None = None, meter: StorageMeter | None = None,
             budgets: Sequence[Budget] = (),
             spans: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run one step of `low` (its `compile_programs`) on real tensors: (loss, new parameters, new optimizer
    state tensors), on the device the parameters are on. `timings` collects (segment, device, seconds) of
    every segment run (on CUDA the segment's GPU time), and on CPU (None, device, seconds) of the allreduce
    means each device computed between its segments; `meter` counts what each device's thread allocates;
    `budgets` (the placed plan's) are what a device that runs out of memory is said to have needed. `spans`
    (on CPU, with `timings`) collects (segment or None, device, start, end) of the same, in `perf_counter`
    seconds."""
    run = _begin(low, programs, params, buffers, states, batch, hypers, threads_per_device, timings, meter,
                 budgets, spans)
    _on_devices(run, run.device)
    return _results(run, params)


def host_work(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
              buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
              batch: Sequence[torch.Tensor], hypers: Sequence[float], threads_per_device: int = 1) -> None:
    """What `run_step` does on the host around its devices' segments, the segments left out: the replicas'
    tables, the prelude, the devices' threads started and joined, the results gathered, with the step's
    inputs standing for its results (the new parameters and state are the old). Timed by
    `ParallelStep.host_seconds`: the simulator times the devices' work, not this."""
    run = _begin(low, programs, params, buffers, states, batch, hypers, threads_per_device, None)
    _on_devices(run, lambda d: None)
    out, n = programs.outputs, len(low.step.param_names)
    given = dict(zip(out[1 + n:], [*params, *(s for ss in states for s in ss)]))
    given[out[0]] = torch.zeros(())
    for env in run.envs:
        for name, x in given.items():
            if name in low.joined:  # a chained update's parts
                dim, parts = low.joined[name]
                env.update({f"{name}#{k}": y for k, y in enumerate(
                    [x] if dim < 0 else torch.tensor_split(x, parts, dim))})
            else:
                env[name] = x
    _results(run, params)


def _begin(low: Lowered, programs: Programs, params: Sequence[torch.Tensor],
           buffers: Sequence[torch.Tensor], states: Sequence[Sequence[torch.Tensor]],
           batch: Sequence[torch.Tensor], hypers: Sequence[float], threads_per_device: int,
           timings: list | None, meter: StorageMeter | None = None, budgets: Sequence[Budget] = (),
           spans: list | None = None) -> _Run:
    """A step's state, its replicas' tables made and the prelude run, its streams after the caller's."""
    envs = replica_envs(low, programs, params, buffers, states, batch, hypers)
    run = _Run(low, programs, envs, threads_per_device, timings, meter, budgets, spans)
    with torch.no_grad():
        for env in envs:
            for name in low.prelude:
                run.call(name, env)
    for stream, dev in zip(programs.streams, programs.targets):  # after what the caller queued (the batch)
        stream.wait_stream(torch.cuda.current_stream(dev))
    return run


def _on_devices(run: _Run, device: Callable[[int], None]) -> None:
    """`device(d)` for every device: one CPU device on this thread, else each on its worker thread."""
    programs = run.programs
    if len(programs.devices) == 1 and not programs.cuda:
        # One CPU device (a one-device plan with every core, as plain eager PyTorch runs): on this thread,
        # whose OpenMP pool stays warm between steps, as eager's does.
        grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
        try:
            device(0)
        finally:
            torch.set_grad_enabled(grad)
            torch.set_num_threads(threads)
    else:
        WORKERS.run(device, len(programs.devices))


class Workers:
    """The devices' threads, kept from step to step: device d's work runs on thread d every step, so what a
    thread keeps stays warm, and no thread is started per step. PyTorch keeps cuDNN's convolution plans per
    thread (`thread_local` in ATen's Conv_v8.cpp): on a fresh thread every step, every convolution's plan was
    made again every step. On the CPU a thread keeps its OpenMP pool (a fresh thread a step ran a one-device
    transformer step 1.6 times as slowly: 201.7 against 126.2 ms). One step at a time runs on them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inboxes: list[queue.SimpleQueue] = []

    def run(self, device: Callable[[int], None], n: int) -> None:
        """`device(d)` on thread d for d < n, returning once all have; the first exception one raised is
        raised here."""
        with self.lock:
            while len(self.inboxes) < n:
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(inbox,), name=f"fastt-device-{len(self.inboxes)}",
                                 daemon=True).start()
                self.inboxes.append(inbox)
            done, errors = [Latch() for _ in range(n)], []
            for d in range(n):
                self.inboxes[d].put((device, d, done[d], errors))
            for latch in done:
                latch.wait()
        if errors:
            raise errors[0]

    def forget(self) -> None:
        """After a fork: the child has none of the parent's threads."""
        self.lock, self.inboxes = threading.Lock(), []


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        device, d, done, errors = inbox.get()
        try:
            device(d)
        except BaseException as e:  # noqa: BLE001 - raised on the thread that ran the step
            errors.append(e)
        # The step's state (`device` is a bound method of its `_Run`: on CUDA its tables hold every value of
        # the step) goes with the step, before the caller wakes, not when the next step's work arrives.
        del device, errors
        done.set()


WORKERS = Workers()
os.register_at_fork(after_in_child=WORKERS.forget)


def _results(run: _Run, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                  list[torch.Tensor]]:
    """Once every device has run: the GPUs synchronized, the first error raised, the timings read, and the
    step's (loss, new parameters, new optimizer state tensors) on the parameters' device."""
    low, programs, envs, timings = run.low, run.programs, run.envs, run.timings
    gpus = list(dict.fromkeys(programs.targets)) if programs.cuda else []
    try:
        for dev in gpus:
            torch.cuda.synchronize(dev)
    except RuntimeError as e:  # an asynchronous kernel error surfaces here, not in the op that caused it
        if run.error is None:
            run.error = ("(asynchronous CUDA error: rerun with CUDA_LAUNCH_BLOCKING=1 to name the op)", -1, e)
    run.held.clear()
    if run.error is not None:
        raise StepError(run.failure()) from run.error[2]
    if timings is not None and gpus:
        timings[:] = [(seg, d, t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3)
                      for seg, d, t in timings]
    elif timings is not None:
        timings += [(None, d, s) for d, s in enumerate(run.reducing) if s]
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
    new_params = [result(envs, programs, x, home, low.joined) for x in out[1 + n:1 + 2 * n]]
    new_states = [result(envs, programs, x, home, low.joined) for x in out[1 + 2 * n:]]
    return loss, new_params, new_states


def result(envs: Sequence[dict], programs: Programs, name: str, home: torch.device,
           joined: dict[str, tuple[int, int]] | None = None) -> torch.Tensor:
    """The step's result `name` on `home`: replica 0's, or, made by a sharded update, every replica's rows
    joined (the all-gather), or, made by a chained update (`joined`: its dim and parts), its parts joined."""
    if joined and name in joined:
        dim, parts = joined[name]
        if dim < 0:  # every part computes it alike (Adam's step count)
            return envs[0][f"{name}#0"].to(home)
        return torch.cat([envs[0][f"{name}#{k}"].to(home) for k in range(parts)], dim)
    x, whole = envs[0][name], programs.nodes[name].meta.get("val")
    if isinstance(whole, torch.Tensor) and x.shape != whole.shape:
        return torch.cat([env[name].to(home) for env in envs])
    return x.to(home)
