"""Costs: roofline estimates, fitted transfer links, measured op times and their cost files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastt
import fastt.cost
from fastt import zoo
from fastt.cluster import CPU_COPY_BANDWIDTH, Cluster, cluster, cpu_cluster, gpu_cluster
from fastt.cost import MeasuredCosts, calibrate_cpu, fit_transfers, op_times, roofline_time
from fastt.errors import FasttError
from fastt.graph import ALLREDUCE, BUFFER, COMPUTE, INPUT, PARAM, STATE, UPDATE, Op, OpGraph

V100 = gpu_cluster("v100", 1).devices[0]


def matmul(m: int, k: int, n: int) -> Op:
    """An (m, k) @ (k, n) fp32 matmul: 2mkn FLOPs, reads both operands and writes the result."""
    return Op("mm", COMPUTE, "aten.mm.default", flops=2.0 * m * k * n, io_bytes=4 * (m * k + k * n + m * n),
              signature="mm")


def test_a_gpu_kernel_runs_at_calculons_measured_fraction_of_peak() -> None:
    op = matmul(4096, 4096, 4096)  # 137 GFLOP, 201 MB: past Calculon's last points (128 GFLOP, 100 MB)
    flops, nbytes = 2 * 4096**3, 4 * 3 * 4096**2
    assert V100.flops == 15.7e12 and V100.mem_bandwidth == 900e9 and V100.op_overhead_s == 5e-6
    assert V100.kernel_efficiency
    # Compute at 95% of peak, then memory at 90% of bandwidth, one after the other.
    want = 5e-6 + flops / (0.95 * 15.7e12) + nbytes / (0.90 * 900e9)
    assert roofline_time(op, V100) == pytest.approx(want, rel=1e-12)


def test_gpu_efficiency_is_interpolated_between_the_points_in_log_size() -> None:
    assert fastt.cost.efficiency(16e9, fastt.cost.MATMUL_EFFICIENCY) == pytest.approx(0.90)
    assert fastt.cost.efficiency(4e9, fastt.cost.MATMUL_EFFICIENCY) == pytest.approx(0.75)  # halfway: 1e9 .. 16e9
    assert fastt.cost.efficiency(1e3, fastt.cost.MATMUL_EFFICIENCY) == pytest.approx(0.60)  # held below 1 GFLOP
    assert fastt.cost.efficiency(10**6.5, fastt.cost.MEMORY_EFFICIENCY) == pytest.approx(0.675)
    op = Op("add", COMPUTE, "aten.add.Tensor", io_bytes=10_000_000)
    assert roofline_time(op, V100) == pytest.approx(5e-6 + 1e7 / (0.75 * 900e9), rel=1e-12)


def test_a_device_without_kernel_efficiency_keeps_the_plain_roofline() -> None:
    dev = replace(V100, kernel_efficiency=False)
    op = matmul(4096, 4096, 4096)
    flops, nbytes = 2 * 4096**3, 4 * 3 * 4096**2
    assert flops / 15.7e12 > nbytes / 900e9
    assert roofline_time(op, dev) == pytest.approx(5e-6 + flops / 15.7e12, rel=1e-12)
    skinny = matmul(65536, 4, 4)  # a skinny matmul streams far more bytes than it computes
    flops, nbytes = 2 * 65536 * 4 * 4, 4 * (65536 * 4 + 16 + 65536 * 4)
    assert nbytes / 900e9 > flops / 15.7e12
    assert roofline_time(skinny, dev) == pytest.approx(5e-6 + nbytes / 900e9, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e3, 1e13), st.floats(1e2, 1e10), st.integers(2, 16))
def test_on_a_gpu_a_larger_op_never_costs_less_and_parts_never_less_than_the_whole(
        flops: float, nbytes: float, parts: int) -> None:
    """What `simulate.lower_bound` relies on: an op's parts together cost at least the op."""
    def t(f: float, b: float) -> float:
        return roofline_time(Op("mm", COMPUTE, "aten.mm.default", flops=f, io_bytes=round(b)), V100)
    assert t(flops * 1.5, nbytes) >= t(flops, nbytes) and t(flops, nbytes * 1.5) >= t(flops, nbytes)
    assert parts * t(flops / parts, nbytes / parts) >= t(flops, nbytes) * (1 - 1e-12)


@pytest.mark.parametrize("kind", [PARAM, STATE, BUFFER, INPUT, ALLREDUCE])
def test_roofline_free_kinds(kind: str) -> None:
    op = Op("r", kind, kind, out_bytes=1 << 30, flops=1e12, io_bytes=1 << 30)
    assert roofline_time(op, V100) == 0.0


def test_roofline_empty_op_costs_the_launch() -> None:
    assert roofline_time(Op("v", COMPUTE, "view"), V100) == V100.op_overhead_s


# -------------------------------------------------------------------------------------------- transfer fitting


@pytest.mark.parametrize(("a", "bandwidth"), [(5e-6, 12e9), (0.0, 25e9), (2e-3, 1e6)])
def test_fit_transfers_recovers_the_line(a: float, bandwidth: float) -> None:
    sizes = [2**12, 2**16, 2**20, 2**22, 2**24]
    secs = [a + s / bandwidth for s in sizes]
    for relative in (False, True):
        lat, bw = fit_transfers(sizes, secs, relative)
        assert lat == pytest.approx(a, rel=1e-6, abs=1e-12)
        assert bw == pytest.approx(bandwidth, rel=1e-9)


def test_fit_transfers_latency_is_not_swamped_by_the_largest_transfer() -> None:
    """Measured gloo times: the 16 MiB hop is 20% off the line; the latency still comes from the small ones."""
    sizes = [2**12, 2**16, 2**20, 2**22, 2**24]
    secs = [80e-6 + s / 4e9 for s in sizes]
    secs[-1] *= 1.2
    lat, _ = fit_transfers(sizes, secs, relative=True)
    assert lat == pytest.approx(80e-6, rel=0.1)


def test_fit_transfers_clamps_negative_latency() -> None:
    lat, bw = fit_transfers([1e3, 1e6], [1e-9, 1e-3 + 1e-9 - 2e-6])
    assert lat == 0.0 and bw > 0


@pytest.mark.parametrize(("sizes", "secs"), [
    ([1e3, 1e5, 1e7], [1e-3, 1e-3, 1e-3]),  # flat: lstsq finds a slope of ~1e-26, not a bandwidth of 1e25 B/s
    ([1e3, 1e5, 1e7], [3e-3, 2e-3, 1e-3]),
    ([1e6, 1e6], [1e-3, 2e-3]),  # one size: no slope to fit
    ([], []),
])
def test_fit_transfers_rejects_non_increasing(sizes: list[float], secs: list[float]) -> None:
    with pytest.raises(FasttError, match="did not grow with size"):
        fit_transfers(sizes, secs)


# ------------------------------------------------------------------------------------------------ measured costs


@pytest.fixture(scope="module")
def mlp() -> tuple[zoo.Workload, OpGraph, MeasuredCosts, dict[str, torch.Tensor]]:
    w = zoo.get("mlp", "test", dropout=False)
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="mlp")
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    costs = fastt.measure(g, w.model, w.optimizer, w.example_inputs, threads=1, runs=3, progress=False)
    return w, g, costs, before


def test_measure_times_every_op(mlp) -> None:
    w, g, costs, before = mlp
    assert costs.kind == "cpu" and costs.threads == 1
    timed = [op for op in g.ops if op.kind in (COMPUTE, UPDATE)]
    assert timed and any(op.kind == UPDATE for op in timed)
    for op in timed:
        assert op.signature, op.name
        assert costs.seconds[op.signature] > 0, op.name
    assert set(costs.seconds) <= {op.signature for op in g.ops}
    after = w.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model was not trained by measuring


def test_measure_with_busy_neighbours_times_the_same_ops(mlp) -> None:
    """Two copies of the step at once (both worker devices busy): every op is still timed, on copies."""
    w, g, alone, before = mlp
    busy = fastt.measure(g, w.model, w.optimizer, w.example_inputs, threads=1, runs=3, progress=False,
                         concurrent=2)
    assert set(busy.seconds) == set(alone.seconds)
    assert all(v > 0 for v in busy.seconds.values())
    assert all(torch.equal(before[k], v) for k, v in w.model.state_dict().items())


def test_the_batch_sizes_a_planner_compares_are_measured_in_turn(mlp, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole batch and data parallelism's half: run r of each before run r + 1 of either, so a drift of
    the machine's speed reaches both tables (the spread of DP's simulated step over one device's, alexnet on
    cpu:2, 8 measurements: stdev 0.054 one table after the other, 0.020 in turn). Every op of both is timed."""
    w, g, _, _ = mlp
    calls: list[int] = []  # which step each run was: the order their code was made in
    made: list[object] = []
    timed_code = fastt.cost._timed_code

    def logged(gm, clock):
        fn, names = timed_code(gm, clock)
        k = len(made)
        made.append(gm)
        return (lambda *a: calls.append(k) or fn(*a)), names

    monkeypatch.setattr(fastt.cost, "_timed_code", logged)
    costs = fastt.cost.measure_step(g, w.model, w.optimizer, w.example_inputs, [g.batch, g.batch // 2], 1, 1)
    assert calls == [0, 1] * 6  # a warm-up run, then 5 timed runs, each of both steps
    half = fastt.graph.rebatch(g, g.batch // 2, traced=True)
    assert {op.signature for op in (*g.ops, *half.ops) if op.kind in (COMPUTE, UPDATE)} <= set(costs.seconds)


def test_a_part_never_measured_costs_its_share_of_the_measured_whole(mlp) -> None:
    """A split op's parts are not in the measured table: each costs its launch plus its share of the whole
    op's measured time (not the roofline, whose level a CPU's convolutions miss twentyfold); uneven parts
    in proportion, and on a cluster the costs were not measured for, the roofline as before."""
    from fastt.split import split

    _, g, costs, _ = mlp
    cl = calibrate_cpu(cpu_cluster(2))
    i = next(i for i, op in enumerate(g.ops) if op.target.startswith("aten.addmm") and op.signature)
    nodes = {n.name: n for n in g.fx.gm.graph.nodes}
    n_cols = nodes[g.ops[i].head].meta["val"].shape[1]
    parts = 3 if n_cols % 3 else 5  # uneven parts
    gs = split(g, g.ops[i].name, "cols", parts)
    sub = [k for k, op in enumerate(gs.ops) if op.split and op.name.startswith(g.ops[i].name + "#")]
    t, oh = op_times(gs, cl, costs), cl.devices[0].op_overhead_s
    whole = costs.seconds[g.ops[i].signature]
    shares = [gs.ops[k].flops / g.ops[i].flops for k in sub]
    assert len(sub) == parts and len(set(shares)) == 2 and sum(shares) == pytest.approx(1.0)
    for k, share in zip(sub, shares):
        assert t[k, 0] == pytest.approx(oh + (whole - oh) * share, rel=1e-5)  # the share: 6 digits
    gpu = cluster("2xV100")
    assert np.allclose(op_times(gs, gpu, costs)[sub], op_times(gs, gpu)[sub])


def test_measure_needs_a_captured_graph() -> None:
    with pytest.raises(FasttError, match="not captured"):
        fastt.cost.measure(OpGraph(ops=()), [])


def test_measured_costs_round_trip(tmp_path: Path, mlp) -> None:
    costs = mlp[2]
    costs.save(tmp_path / "costs.json")
    assert json.loads((tmp_path / "costs.json").read_text())["format"] == "fastt.costs"
    assert MeasuredCosts.load(tmp_path / "costs.json") == costs


CORRUPT = ["{not json", '{"kind": "cpu", "threads": 1}', '{"kind": "cpu", "threads": 1, "seconds": {"mm": "x"}}', "[]"]


@pytest.mark.parametrize("text", CORRUPT)
def test_corrupt_cost_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "costs.json"
    path.write_text(text)
    with pytest.raises(FasttError, match="cannot read cost file .*costs.json.*measure again"):
        MeasuredCosts.load(path)


def test_missing_cost_file(tmp_path: Path) -> None:
    with pytest.raises(FasttError, match="cannot read cost file"):
        MeasuredCosts.load(tmp_path / "absent.json")


def test_op_times_measured_on_cpu_roofline_elsewhere(mlp) -> None:
    g, costs = mlp[1], mlp[2]
    cpu, gpu = cpu_cluster(1).devices[0], V100
    mixed = Cluster("mixed", (cpu, gpu))
    t = op_times(g, mixed, costs)
    assert t.shape == (len(g.ops), 2)
    for i, op in enumerate(g.ops):
        if op.signature in costs.seconds:
            assert t[i, 0] == costs.seconds[op.signature]
        else:
            assert t[i, 0] == roofline_time(op, cpu)
        assert t[i, 1] == roofline_time(op, gpu)
    assert np.array_equal(op_times(g, mixed), np.array([[roofline_time(op, d) for d in (cpu, gpu)] for op in g.ops]))
    other = MeasuredCosts("cuda", 1, costs.seconds)  # measured on another kind: not used for cpu
    assert np.array_equal(op_times(g, mixed, other), op_times(g, mixed))


def test_op_times_falls_back_for_unmeasured_shapes() -> None:
    op = matmul(64, 64, 64)
    g = OpGraph(ops=(op, Op("other", COMPUTE, "add", flops=1e6, io_bytes=1 << 20, signature="add")))
    cl = cpu_cluster(1)
    t = op_times(g, cl, MeasuredCosts("cpu", 1, {"mm": 0.25}))
    assert t[0, 0] == 0.25
    assert t[1, 0] == roofline_time(g.ops[1], cl.devices[0])


def test_calibrate_cpu() -> None:
    before = cluster("cpu:2")
    after = calibrate_cpu(before)
    assert len(after.devices) == 2 and after.routes == before.routes
    for d in after.devices:
        assert d.kind == "cpu"
        assert d.flops > 1e8 and d.mem_bandwidth > 1e7 and d.op_overhead_s > 0
        assert np.isfinite([d.flops, d.mem_bandwidth, d.op_overhead_s]).all()
    assert [lk.name for lk in after.links] == [lk.name for lk in before.links]
    assert all(lk.bandwidth > 0 and lk.latency >= 0 for lk in after.links)
    assert any(lk.bandwidth != CPU_COPY_BANDWIDTH for lk in after.links)  # refit, not the nominal value
    # the allreduce is the runtime's own mean of the replicas' gradients, fitted: it costs per byte
    latency, per_byte, per_tensor = after.gather
    assert latency >= 0 and per_tensor >= 0 and 1e-12 < per_byte < 1e-8
    assert calibrate_cpu(cluster("cpu:1")).gather is None


def test_the_means_are_timed_on_device_0_beside_the_others_copying() -> None:
    """`measure_means` on several devices runs on device 0's cores while the others' cores copy memory (what a
    device's backward does beside a mean); an error in the timed work reaches the caller, the copies stop."""
    import os
    import threading

    from fastt.cluster import CORES
    from fastt.cost import beside_copies

    seen: list = []

    def copying() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("fastt-copying")]

    def probe() -> None:
        seen.append((set(os.sched_getaffinity(0)), copying(), torch.get_num_threads()))
    beside_copies(probe, 2, 1)
    cores, neighbours, threads = seen[0]
    assert neighbours == ["fastt-copying-1"] and threads == 1
    if len(CORES) >= 2:
        assert cores == {CORES[0]}

    def fails() -> None:
        raise ValueError("inside")
    with pytest.raises(ValueError, match="inside"):
        beside_copies(fails, 2, 1)
    assert not copying()  # the neighbours stopped


def test_the_local_allreduce_is_simulated_at_its_fitted_cost() -> None:
    from fastt.api import capture
    from fastt.plan.named import plan
    from fastt.simulate import simulate_plan

    w = zoo.get("mlp", "test")
    g = capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="mlp")
    cl = replace(calibrate_cpu(cluster("cpu:2")), gather=(1e-4, 1e-9, 1e-5))
    tl = simulate_plan(g, plan(g, cl, "dp"), cl)
    assert tl.collectives
    for c in tl.collectives:
        assert c.end - c.start == pytest.approx(1e-4 + 1e-9 * c.nbytes + 1e-5 * len(c.ops))


def test_calibrate_cpu_reads_a_dip_in_copy_times_as_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy times measured on a loaded machine (a 1 MB copy waiting out a scheduler slice at its threads'
    barrier, slower than the 16 MB one, as measured here with two other jobs running): calibration still finds a
    bandwidth, from the times made monotone, where a line through them has none."""
    loaded = [1e-6, 3e-6, 8e-3, 6e-3, 2e-3]
    monkeypatch.setattr(fastt.cost, "measure_copies", lambda threads: ([2**12, 2**16, 2**20, 2**22, 2**24], loaded))
    with pytest.raises(FasttError):
        fit_transfers([2**12, 2**16, 2**20, 2**22, 2**24], loaded)
    links = calibrate_cpu(cluster("cpu:2")).links
    assert all(0 < lk.bandwidth < 1e12 and lk.latency >= 0 for lk in links)


def test_calibrate_cpu_leaves_gpus_alone() -> None:
    gpus = gpu_cluster("v100", 2)
    assert calibrate_cpu(gpus).devices == gpus.devices
