"""The local runtime's training step: `parallelize` captures, measures, plans and returns a `ParallelStep`.

`PlacedStep` is what every runtime's step shares (the distributed runtime's `DistributedStep` too): the placed
plan and what the tuner reads and replaces of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .. import guards
from ..capture import stepped
from ..cluster import Cluster, cluster, torch_device
from ..coarsen import capture_graph
from ..cost import MeasuredCosts, calibrate_cpu, measure_step
from ..errors import FasttError
from ..graph import OpGraph
from ..lower import Lowered
from ..plan.basic import data_parallel, single_device
from ..precision import check_scaler
from ..simulate import Timeline, simulate_plan
from ..strategy import Strategy
from .decide import decide, tuner_of
from .local import host_work, run_step
from .meter import StorageMeter
from .programs import Placed, place, release_points
from .reference import eager_step
from .trial import Trial, raced, trial_steps
from .tune import Tuner


class PlacedStep:
    """A training step that runs a placed plan (`placed`: an attribute, or a property whose setter rewires):
    the plan, its programs and its simulated time, and what a `Tuner` reads to replan and place another
    plan."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    graph: OpGraph
    cluster: Cluster
    costs: MeasuredCosts
    tuner: Tuner | None
    placed: Placed
    # what plans are compiled for (`place`); None: the cluster's
    targets: Sequence[torch.device] | None = None
    # fastt's plan raced against its rivals before training (`runtime.trial`)
    trial: Trial | None = None

    @property
    def strategy(self) -> Strategy:
        return self.placed.strategy

    @property
    def lowered(self) -> Lowered:
        return self.placed.lowered

    @property
    def simulated_s(self) -> float:
        return self.placed.simulated_s

    def sync(self) -> None:
        """Make the user's model and optimizer hold the newest state: the local runtime writes it there every
        step (nothing to do); under torchrun every rank calls it before rank 0's model is read
        (`DistributedStep.sync`)."""

    def timeline(self) -> Timeline:
        """The running plan simulated with the step's costs now (the tuner refits them)."""
        placed = self.placed
        return simulate_plan(self.graph, placed.strategy, self.cluster, self.costs,
                             release=release_points(placed.lowered, placed.programs))


class ParallelStep(PlacedStep):
    """One training step of a model under a plan: `loss = step(*batch)`. The model's parameters and the
    optimizer's state are the truth: they are updated in place after every step (read them at any time).
    With a `tuner`, the first steps of training also tune the plan (see `fastt.runtime.tune`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, graph: OpGraph, cl: Cluster,
                 costs: MeasuredCosts, placed: Placed, threads_per_device: int,
                 example: Sequence[torch.Tensor], tuner: Tuner | None = None) -> None:
        self.model, self.optimizer, self.graph, self.cluster = model, optimizer, graph, cl
        self.costs, self.placed, self.threads_per_device = costs, placed, threads_per_device
        self.tuner = tuner
        self.meter: StorageMeter | None = None  # set while `memory.measured_peaks` measures a step
        self.example = example  # a batch the step takes: `host_seconds` runs its dry run on it
        self._host: tuple = (None, 0.0)  # (the programs it was measured for, `host_seconds`)

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        tuning = self.tuner is not None and self.tuner.active
        return self._step(batch, [] if tuning else None, tuning)

    def profiled(self, *batch: torch.Tensor,
                 spans: list | None = None) -> tuple[torch.Tensor, list[float], list[float]]:
        """One training step, as `step(*batch)` takes it, and each device's busy seconds in it: (loss, the
        wall time of the segments it ran, the time it spent computing allreduce means between them). Waits
        for other devices' values are in neither. The simulator's `Timeline.busy_s` is the first's sum over
        its ops; it runs allreduces on links, beside the devices. `spans` (CPU devices) collects when each
        segment and mean ran (`run_step`), for a measured trace (`report.measured_trace`)."""
        timings: list = []
        loss = self._step(batch, timings, False, spans)
        busy, reducing = [0.0] * len(self.cluster.devices), [0.0] * len(self.cluster.devices)
        for seg, d, seconds in timings:
            (busy if seg is not None else reducing)[d] += seconds
        return loss, busy, reducing

    def _step(self, batch: Sequence[torch.Tensor], timings: list | None, tuning: bool,
              spans: list | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        params, buffers, states, batch, hypers = self._arguments(batch)
        loss, new_params, new_states = run_step(self.lowered, self.placed.programs, params, buffers, states,
                                                batch, hypers, self.threads_per_device, timings, self.meter,
                                                self.placed.budgets, spans)
        self._written(params, new_params, new_states)
        stepped(self.optimizer)
        if tuning:
            self.tuner.observe(self, time.perf_counter() - t0, timings)
        return loss

    def _arguments(self, batch: Sequence[torch.Tensor]) -> tuple:
        """The step's inputs, read from the model, the optimizer and the batch once they are checked to be
        what the step was captured for."""
        step = self.lowered.step
        step.check(self.model, self.optimizer, batch, self.lowered.replicas)
        guards.check(step.gm, batch, self.lowered.replicas)
        return step.arguments(self.model, self.optimizer, batch)

    def _written(self, params: Sequence[torch.Tensor], new_params: Sequence[torch.Tensor],
                 new_states: Sequence[torch.Tensor]) -> None:
        # The step's results are fresh tensors: hand them over instead of copying (the Parameter objects,
        # which the optimizer and the user hold, stay the same).
        for p, new in zip(params, new_params):
            p.data = new
        fresh = iter(new_states)
        for p, keys in zip(params, self.lowered.step.state_keys):
            for k in keys:
                self.optimizer.state[p][k] = next(fresh)

    @property
    def simulated_s(self) -> float:
        """The simulated step: the simulator's time for the devices' work, plus what the step does on the host
        before and after it (`host_seconds`, measured once per plan)."""
        return self.placed.simulated_s + self.host_seconds()

    def host_seconds(self, runs: int = 5) -> float:
        """Seconds a step of the running plan spends on the host, outside its devices' segments: checking and
        reading its inputs, the replicas' tables, starting and joining the devices' threads, gathering and
        handing over the results (`local.host_work`: the segments left out), on the example batch. The median
        of `runs`, once per plan. The model and the optimizer are left as they were. Each run starts with
        the caches cold (64 MB written), as a real step's host work runs after its devices' work: with them
        warm, alexnet's DP step on cpu:2 was costed 0.44-0.66 ms on the host where the real step spent 1.2
        (the old parameters it frees are still not freed here)."""
        programs = self.placed.programs
        if self._host[0] is not programs:
            # more than a server CPU's last-level cache share: writing it evicts what the caches held
            evict = torch.empty(64 * 2**20 // 4)

            def once() -> float:
                evict.fill_(1.0)
                t0 = time.perf_counter()
                params, buffers, states, b, hypers = self._arguments(self.example)
                host_work(self.lowered, programs, params, buffers, states, b, hypers, self.threads_per_device)
                self._written(params, [p.data for p in params], [x for xs in states for x in xs])
                return time.perf_counter() - t0
            self._host = (programs, statistics.median(once() for _ in range(runs)))
        return self._host[1]


def busy_devices(strategy: Strategy) -> int:
    """How many worker devices a plan keeps busy at once, for measuring its ops: worker devices share the
    machine's caches and memory bandwidth, so ops are timed with every device busy unless the plan uses
    one."""
    return 1 if len(set(strategy.placement.values())) == 1 else strategy.n_devices


def parallelize(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                example_inputs: Sequence[torch.Tensor], devices: str = "cpu:2", planner: str = "fastt",
                strategy: Strategy | None = None, tune: bool | Tuner = False,
                clip_grad_norm: float | None = None, accumulate: int = 1,
                trial: bool | int = True, autocast: torch.dtype | None = None,
                grad_scaler: torch.amp.GradScaler | None = None) -> ParallelStep:
    """Capture the step, plan it for `devices` (or use `strategy`), refuse a plan that does not fit, and
    return the step callable. Devices are CPU worker devices (`cpu:N`) or local GPUs (`cuda`, `cuda:0,1`;
    `cuda:0,0` runs two devices as two streams of one GPU); on GPUs the model must be on one of them (its
    parameters and the optimizer's state stay there, the truth).

    Op times are measured on a device (a worker device: its share of the cores) before planning; the `fastt`
    planner plans with them, and keeps its plan only if it measures faster than data parallelism and, on CPU
    worker devices, than one device with every core (FastT's rule; that device is what plain eager PyTorch
    uses): they run a few steps on the example batch first (`trial=True`: 3 after a warm-up; a number: that
    many; False: the plan unmeasured), the model, optimizer and random generators put back after; `step.trial`
    has the medians and which plan was kept (`fastt.runtime.trial`). The rival with every core, and a
    one-device `strategy` on CPU (that rival kept, saved), run as the plain eager step (`EagerStep`).
    `tune=True` (or a configured `Tuner`) instead starts from data parallelism when it fits and runs FastT's
    tuning loop during the first steps; on CPU worker devices, without a `strategy`, that start is first
    raced against one device with every core (`trial` steps), and where that rival measures faster it is
    kept and nothing is tuned.
    `clip_grad_norm` clips the gradients to that global norm before every update, as
    `torch.nn.utils.clip_grad_norm_` would between backward and `optimizer.step()`. `accumulate=k` takes each
    step's batch as k micro-batches per device, one after the other, and updates once with the whole batch's
    gradient (gradient accumulation: a device holds one micro-batch's activations): the plan is data
    parallelism over the micro-batches (`plan.basic.data_parallel`). `autocast` (torch.bfloat16 or
    torch.float16) runs the forward under `torch.autocast` on the model's device, as an eager loop's `with
    torch.autocast(...)` around the forward and the loss does (`fastt.precision`). `grad_scaler`: loss
    scaling is not captured, so an enabled `torch.amp.GradScaler` is refused (a disabled one is a no-op);
    never call a scaler's `scale(loss).backward()` or `step(optimizer)` on fastt's step, which has already
    run the backward and the update.
    """
    check_scaler(grad_scaler)
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise FasttError("accumulate must be a whole number of micro-batches a step (1 or more), got "
                         f"{accumulate!r}")
    if accumulate > 1 and (tune or strategy is not None or planner not in ("fastt", "dp")):
        raise FasttError("accumulate runs data parallelism over the micro-batches: use it with planner dp "
                         "(or the default), without tune or a strategy of your own")
    cl = cluster(devices)
    every_core = strategy is not None and strategy.n_devices == 1 and {d.kind for d in cl.devices} == {"cpu"}
    if every_core:  # a one-device plan (the trial's rival, `all_cores`) runs with every core: eager PyTorch
        cl = cluster("cpu:1")
    _check_home(model, example_inputs, cl)
    cl = calibrate_cpu(cl)
    n = len(cl.devices)
    cuda = cl.devices[0].kind == "cuda"
    threads = torch.get_num_threads() if cuda else max(1, torch.get_num_threads() // n)
    graph = capture_graph(model, loss_fn, optimizer, example_inputs, name=type(model).__name__,
                          clip_grad_norm=clip_grad_norm, autocast=autocast)
    tuner = tuner_of(tune)
    if accumulate > 1:
        strategy = data_parallel(graph, cl, accumulate)

    def measure(batches: Sequence[int], planned: Strategy | None) -> MeasuredCosts:
        # Worker devices share the cores' caches and memory bandwidth: measure with as many busy. GPUs share
        # nothing.
        busy = 1 if cuda else busy_devices(planned) if planned is not None else n
        return measure_step(graph, model, optimizer, example_inputs, batches, threads, busy)

    chosen = decide(graph, cl, n_devices=n, planner=planner, strategy=strategy, tuner=tuner, measure=measure)

    def placed(s: Strategy, tuning: Tuner | None = None) -> ParallelStep:
        return ParallelStep(model, optimizer, graph, cl, chosen.costs, place(graph, s, cl, chosen.costs),
                            threads, example_inputs, tuning)

    if every_core and tuner is None:
        one = place(graph, chosen.strategy, cl, chosen.costs)
        step: ParallelStep = EagerStep(model, optimizer, graph, cl, chosen.costs, one, threads,
                                       example_inputs, loss_fn=loss_fn, clip_grad_norm=clip_grad_norm,
                                       autocast=autocast)
    else:
        step = placed(chosen.strategy, tuner)
    alone = None if cuda or n < 2 else lambda: all_cores(model, loss_fn, optimizer, graph, example_inputs,
                                                                 clip_grad_norm, autocast)
    if chosen.planned and tuner is None:  # the tuner measures and rolls back itself
        step = raced(step, placed, example_inputs, trial_steps(trial), alone=alone)
    elif tuner is not None and strategy is None and alone is not None:
        step = _raced_before_tuning(step, placed, example_inputs, trial_steps(trial), alone, tuner)
    return step


def _raced_before_tuning(step: ParallelStep, place_dp: Callable[[Strategy], ParallelStep],
                         batch: Sequence[torch.Tensor], steps: int, alone: Callable[[], ParallelStep],
                         tuner: Tuner) -> ParallelStep:
    """The plan the tuner starts from (data parallelism where it fits), raced (`raced`) against one device
    with every core before tuning, the tuner idle during the race: the tuner replans over the cluster's worker
    devices, so it never reaches that rival itself. Where the rival is kept, there is nothing to tune."""
    step.tuner = None
    kept = raced(step, place_dp, batch, steps, alone=alone)
    if kept is step:
        step.tuner = tuner
    else:
        t = kept.trial
        tuner.skip(f"one device with every core measured {t.one_device_s * 1e3:.1f} ms a step, "
                   f"{step.strategy.planner}'s plan {t.fastt_plan_s * 1e3:.1f} ms")
    return kept


def all_cores(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, graph: OpGraph,
              example_inputs: Sequence[torch.Tensor], clip_grad_norm: float | None = None,
              autocast: torch.dtype | None = None) -> EagerStep:
    """The step on one CPU worker device with every core: what plain eager PyTorch uses, its intra-op threads
    splitting each op, and on a small machine often faster than any plan over worker devices of a core each.
    It runs as the user's own eager step (`EagerStep`). Its op times are measured at that thread count, so its
    simulated time is its own."""
    threads = torch.get_num_threads()
    one = calibrate_cpu(cluster("cpu:1"))
    costs = measure_step(graph, model, optimizer, example_inputs, [graph.batch], threads, 1)
    return EagerStep(model, optimizer, graph, one, costs, place(graph, single_device(graph, one), one, costs),
                     threads, example_inputs, loss_fn=loss_fn, clip_grad_norm=clip_grad_norm,
                     autocast=autocast)


class EagerStep(ParallelStep):
    """One device with every core, run as plain PyTorch: the user's forward, loss and backward, the clip and
    `optimizer.step()` (`reference.eager_step`), where `ParallelStep` would run the same one-device plan
    through its runtime, op by op, at a cost (measured with one thread: dlrm at test size 4.9 ms a step
    eager, 5.6-5.7 ms through the runtime). It keeps what every plan keeps: the model's parameters and the
    optimizer's state are updated (in place, as PyTorch's optimizers do: the runtime's plans hand over fresh
    tensors, so a `state_dict()` kept unsaved and uncopied changes with the next step here), `.grad` is left
    as it was, and the loss is returned detached. The simulated step is the plan's, with no host work outside
    its ops. While `memory.measured_peaks` counts storage (`meter`), the step runs through the runtime, whose
    devices' threads the meter watches: the peak it measures is the runtime's, not eager's."""

    def __init__(self, *args: object, loss_fn: Callable, clip_grad_norm: float | None,
                 autocast: torch.dtype | None) -> None:
        super().__init__(*args)
        self.loss_fn, self.clip_grad_norm, self.autocast = loss_fn, clip_grad_norm, autocast

    def _step(self, batch: Sequence[torch.Tensor], timings: list | None, tuning: bool,
              spans: list | None = None) -> torch.Tensor:
        if self.meter is not None:
            return super()._step(batch, timings, tuning, spans)
        t0 = time.perf_counter()
        loss = self.eager(batch)
        seconds = time.perf_counter() - t0
        if timings is not None:  # `profiled`: the one device was busy for the whole step
            timings.append((EAGER, 0, seconds))
        if spans is not None:
            spans.append((EAGER, 0, t0, t0 + seconds))
        return loss

    def eager(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """The user's eager step on `batch` (`reference.eager_step`), `.grad` put back as it was."""
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        try:
            return eager_step(self.model, self.loss_fn, self.optimizer, batch, self.clip_grad_norm,
                              self.autocast)
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    def host_seconds(self, runs: int = 5) -> float:
        """Nothing: the eager step has no work outside its device (the host is that device)."""
        return 0.0


EAGER = "eager step (plain PyTorch)"  # how an `EagerStep`'s step is named in timings and measured traces


def _check_home(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], cl: Cluster) -> None:
    """Refuse devices the runtime cannot run, and a model or batch not on a device of the cluster."""
    kinds = {d.kind for d in cl.devices}
    if not kinds <= {"cpu"} and kinds != {"cuda"}:
        raise FasttError(f"cannot run on {cl.name}: the local runtime runs cpu:N or local cuda devices "
                         "(simulated GPUs such as 4xV100 are for fastt plan/simulate/compare)")
    targets = {torch.device(torch_device(d)) for d in cl.devices}
    home = {t.device for t in [*model.parameters(), *example_inputs]}
    if len(home) != 1 or not home <= targets:
        where = ", ".join(sorted(map(str, home)))
        raise FasttError(f"the model and its inputs are on {where}, not on one device of {cl.name}: move "
                         f"them there first (e.g. model.to('{min(map(str, targets))}'))")
