"""The local runtime: one thread per CPU worker device, each running its program strictly in order.

A task starts when every op it reads has finished (threads wait on events, never on the device order of others);
torch releases the GIL inside kernels, so devices compute in parallel. Worker devices share this process's
memory: a transfer is a hand-off, and all holders of a parameter hold the same tensor — so every replica reads
the parameters as they were before the step, and the new values are written back once the step has finished.
Data parallelism keeps per-replica batch-norm buffers (per-device statistics, as DDP); replica 0's are kept.
An exception in any task stops every device and is raised with the op's name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch.fx.node import map_arg

from ..errors import FasttError
from ..lower import JOIN, PART, Lowered, Task
from ..split import join, rule, run_part


class StepError(RuntimeError):
    """An op raised while the step ran; the message names it and the device."""


class _Run:
    """The state of one step: values per replica, the ops finished so far, the first error."""

    def __init__(self, low: Lowered, envs: list[dict]) -> None:
        self.low, self.envs = low, envs
        self.nodes = {n.name: n for n in low.step.gm.graph.nodes}
        self.done: set[int] = set()  # ops whose results are in the envs (allreduces included)
        self.claimed: set[int] = set()  # allreduces some task has started
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

    def finished(self, op: int) -> None:
        with self.cv:
            self.done.add(op)
            self.cv.notify_all()

    def allreduce(self, a: int) -> bool:
        """Average the gradients of allreduce `a` across replicas (once: the first task that needs it)."""
        for j in self.low.graph.ops[a].inputs:
            if not self.wait(j):
                return False
        for name in self.low.allreduces[a]:
            values = [env[name] for env in self.envs]
            total = values[0]
            for v in values[1:]:
                total = total + v
            mean = total / len(values)
            for env in self.envs:
                env[name] = mean
        self.finished(a)
        return True

    def call(self, name: str, env: dict) -> None:
        n = self.nodes[name]
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a.name])
        env[name] = n.target(*args, **kwargs)

    def run_task(self, t: Task) -> None:
        env = self.envs[t.replica]
        if t.kind == PART:
            n = self.nodes[t.head]
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: env[a.name])
            dim, k, parts = t.part
            env[f"{t.head}#{k}"] = run_part(n.target, args, kwargs, dim, k, parts)
        elif t.kind == JOIN:
            dim, _, parts = self.low.graph.ops[t.waits[0]].split
            env[t.head] = join(rule(self.nodes[t.head].target, dim), [env[f"{t.head}#{k}"] for k in range(parts)])
            for name in t.nodes:
                self.call(name, env)
        else:
            for name in t.nodes:
                self.call(name, env)

    def device(self, d: int) -> None:
        for t in self.low.programs[d]:
            try:
                if not all(self.wait(j) for j in t.waits):
                    return
                self.run_task(t)
            except BaseException as e:  # noqa: BLE001 - reported with the op's name, other devices stop
                with self.cv:
                    if self.error is None:
                        self.error = (t.name, d, e)
                    self.cv.notify_all()
                return
            self.finished(t.op)


def run_step(low: Lowered, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
             states: Sequence[Sequence[torch.Tensor]], batch: Sequence[torch.Tensor],
             threads_per_device: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run one step of `low` on real tensors: (loss, new parameters, new optimizer state tensors)."""
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
    run = _Run(low, envs)
    for env in envs:
        for name in low.prelude:
            run.call(name, env)
    old = torch.get_num_threads()
    torch.set_num_threads(threads_per_device)
    try:
        workers = [threading.Thread(target=run.device, args=(d,), daemon=True) for d in range(len(low.programs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(old)
    if run.error is not None:
        name, d, e = run.error
        raise StepError(f"op '{name}' on device {d} failed: {type(e).__name__}: {e}") from e
    out = list(low.step.gm.graph.nodes)[-1].args[0]
    n = len(low.step.param_names)
    loss = sum(env[out[0].name] for env in envs) / r
    new_params = [envs[0][x.name] for x in out[1 + n:1 + 2 * n]]
    new_states = [envs[0][x.name] for x in out[1 + 2 * n:]]
    return loss, new_params, new_states
