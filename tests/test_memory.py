"""The simulator's peak memory against the peak a real step holds on each CPU worker device."""

from __future__ import annotations

import dataclasses
import statistics
import threading

import pytest
import torch

from fastt import zoo
from fastt.cluster import Cluster, cluster, gpu_cluster
from fastt.coarsen import capture_graph
from fastt.graph import UPDATE, kept_parts
from fastt.plan.dpos import dpos_strategy
from fastt.plan.named import plan
from fastt.runtime import parallelize
from fastt.runtime.memory import measured_peaks
from fastt.runtime.meter import StorageMeter
from fastt.runtime.programs import release_points
from fastt.simulate import simulate_plan
from fastt.split import split
from fastt.strategy import Split


def test_the_meter_counts_each_storage_once_on_the_thread_that_made_it() -> None:
    meter = StorageMeter(2)

    def work(d: int, n: int) -> None:
        with meter.on(d):
            a = torch.ones(n, 100)  # 400n bytes
            b = a * 2  # 400n more, the peak
            v = b.t()  # a view: nothing new
            del a
            b.add_(1)  # in place: nothing new
            c = v.sum()  # 4 bytes, while b (through v) lives
            del b, v, c

    threads = [threading.Thread(target=work, args=(d, 10 * (d + 1))) for d in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.peak == [8000, 16000]
    assert meter.live == [0, 0]


def test_a_resident_read_where_it_is_not_held_counts_there_as_a_copy_until_dropped() -> None:
    """A GPU would copy a parameter to a device that reads it without holding it: the meter counts it there
    from `hold(given=True)` to `drop`, and a view of it made meanwhile is nothing new."""
    weight = torch.ones(100, 10)  # made before the step: 4000 bytes
    meter = StorageMeter(2)
    meter.hold([1], weight, given=True)
    with meter.on(1):
        v = weight.t()  # a view of the copy
        y = weight * 2  # 4000 bytes more
    assert meter.live == [0, 8000]
    meter.drop(1, weight)
    assert meter.live == [0, 4000] and meter.peak == [0, 8000]
    del v, y
    assert meter.live == [0, 0]


def median_peaks(step, batch, steps: int = 3) -> list[int]:
    """Each device's median of `steps` measured peaks (`measured_peaks`): how far apart the devices run moves
    what a device holds where they exchange values, and varies from step to step under load."""
    return [int(statistics.median(x)) for x in zip(*(measured_peaks(step, batch) for _ in range(steps)))]


def _peaks(name: str, planner: str = "single",
           strategy_of=None) -> tuple[list[int], tuple[int, ...], int]:
    """(measured peak per device, simulated peak per device, the plan's replicas)."""
    w = zoo.get(name, "test")
    strategy = strategy_of(w) if strategy_of else None
    step = parallelize(w.model, w.loss_fn, w.optimizer, w.example_inputs, "cpu:2", planner=planner,
                       strategy=strategy, trial=False)
    # the median of 3 steps per device: how far apart the devices run, which moves what a device holds where
    # they exchange values, varies from step to step under load (mlp's split plan: 1.20 and, once, 1.49)
    measured = median_peaks(step, w.example_inputs)
    tl = simulate_plan(step.graph, step.strategy, step.cluster, step.costs,
                       release=release_points(step.lowered, step.placed.programs))
    return measured, tl.peak_memory_bytes, step.strategy.replicas


def _split_linears(w: zoo.Workload):
    """Every addmm split in 2 along its rows (the batch), the parts placed by DPOS."""
    g = dataclasses.replace(capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs), recapture=None)
    splits = tuple(Split(op.name, "rows", 2) for op in g.ops if op.target == "aten.addmm.default")
    g2 = g
    for sp in splits:
        g2 = split(g2, sp.op, sp.dim, sp.parts)
    return dataclasses.replace(dpos_strategy(g2, cluster("cpu:2")), splits=splits)


def _updates_apart(w: zoo.Workload):
    """The forward and backward on device 1, the updates on device 0, which holds every parameter and state:
    device 1 reads each parameter as a copy, device 0 each gradient from device 1."""
    g = capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    s = plan(g, cluster("cpu:2"), "single")
    kind = {op.name: op.kind for op in g.ops}
    placement = {n: 0 if kind[n] == UPDATE else 1 for n in s.placement}
    order = tuple(tuple(n for n in s.order[0] if placement[n] == d) for d in range(2))
    return dataclasses.replace(s, n_devices=2, placement=placement, order=order)


def test_a_max_pools_output_and_indices_are_two_storages_kept_by_their_own_readers() -> None:
    w = zoo.get("lenet", "test")
    g = capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    pool = g.index["max_pool2d_with_indices"]
    out, indices = g.ops[pool].out_parts
    assert indices == 2 * out and out + indices == g.ops[pool].out_bytes  # int64 indices, float32 values
    kept = {g.ops[i].target: kept_parts(g, i, pool) for i in g.succs[pool]}
    assert kept == {"aten.convolution.default": (0,), "aten.convolution_backward.default": (0,),
                    "aten.max_pool2d_with_indices_backward.default": (1,)}


BOUND = 1.25  # issue 17: the prediction errs on the safe side, by at most a quarter
# Under load (three test runs at once on 2 cores, or CI beside other tests) a replica's device held up to 12%
# more than simulated: mlp dp 59.3 MB against 52.96, dlrm dp 12.44 against 11.07, mlp zero 38.22 against
# 37.15, transformer zero 85.66 against 78.49; on a quiet machine never more. The simulator does not bound how
# far apart the devices run (docs/design.md, memory).
RACE = 1.15

CASES = [
    ("mlp", "single", None), ("transformer", "single", None), ("dlrm", "single", None),
    ("resnet50", "single", None),  # batch norm: its output dies before the statistics saved for its backward
    ("lenet", "single", None),  # max pool: its output dies before its indices
    ("gpt2", "dp", None), ("transformer", "dp", None), ("lenet", "dp", None),
    # A replica's mean gradient is held on each device until the segment that reads it there ends: the
    # simulated peak is the runtime's worst case, whichever device runs ahead.
    ("alexnet", "dp", None), ("mlp", "dp", None), ("dlrm", "dp", None),
    ("mlp", "split", _split_linears),
    # sharded updates: each device holds and makes only its rows of the state, keeps its rows of the mean
    ("mlp", "zero", None), ("transformer", "zero", None),
    # parameters read where they are not held (a GPU holds a copy there), gradients handed to the updates
    ("transformer", "apart", _updates_apart),
]


@pytest.mark.parametrize(("name", "planner", "strategy_of"), CASES)
def test_the_simulated_peak_is_at_least_the_real_one_and_close(name: str, planner: str, strategy_of) -> None:
    """Safe and close on every device (each device's median of 3 steps). Where every device runs one replica
    of the step (dp, zero), how long a device holds the replicas' gradients and means depends on how far apart
    the devices run, a race: the simulator takes them in step. Close then is judged
    on the device that held most (mlp under zero, 6 runs on a quiet machine: the device behind 28.7 MB, the one
    ahead 30.8-36.1, simulated 37.2), and safe within RACE."""
    measured, simulated, replicas = _peaks(name, "fastt" if strategy_of else planner, strategy_of)
    # The split plan races too: its devices trade the parts of every layer mid-step (mlp, device 1: 10.53 MB
    # in four runs here, 7.38 once in a CI run, simulated 12.59; device 0 44.67 against 48.92).
    raced = replicas == len(measured) or planner == "split"
    for d, (m, s) in enumerate(zip(measured, simulated)):
        assert m <= s * (RACE if raced else 1), f"device {d}: simulated {s / 1e6:.2f} MB, measured {m / 1e6:.2f} MB"
    for m, s in [(max(measured), max(simulated))] if raced else zip(measured, simulated):
        assert s <= BOUND * m, f"simulated {s / 1e6:.2f} MB, measured {m / 1e6:.2f} MB"


def test_a_plan_near_a_devices_memory_is_tight() -> None:
    """A fitting plan within 10% of a device's memory is reported as tight, one with room is not."""
    w = zoo.get("mlp", "test")
    g = capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    base = gpu_cluster("v100", 2)
    s = plan(g, base, "dp")
    peak = max(simulate_plan(g, s, base).peak_memory_bytes)

    def sized(nbytes: int) -> Cluster:
        return dataclasses.replace(base, devices=tuple(dataclasses.replace(d, memory_bytes=nbytes)
                                                       for d in base.devices))
    near, roomy, small = (simulate_plan(g, s, sized(int(peak * f))) for f in (1.05, 1.2, 0.95))
    assert near.fits and near.tight == (0, 1)
    assert roomy.fits and not roomy.tight
    assert not small.fits and not small.tight
