"""The distributed runtime's messages (`runtime.distributed.wire`), checked without processes on random plans:
every value a rank reads from another arrives before the first segment that reads it, from the rank that
produced it, after the segment that produced it; every allreduce's gradients reach each rank that reads it; rank 0
gets every new parameter, state tensor and buffer it does not compute, and every loss."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runtime import one_thread_per_device, pair, random_topological_rank  # noqa: F401 - fixture

import fastt
from fastt.cluster import cluster
from fastt.cost import MeasuredCosts
from fastt.graph import data_parallel_graph
from fastt.plan.common import strategy_from
from fastt.runtime.distributed import GATHER_SHAPES, _pack, _packed_size, _reads, _unpack, fit_gather, wire
from fastt.runtime.local import place


@functools.cache
def captured(name: str) -> fastt.OpGraph:
    _, w = pair(name)
    return fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), replicas=st.sampled_from([1, 2]), name=st.sampled_from(["mlp", "transformer"]))
def test_every_read_is_delivered_in_time(seed: int, replicas: int, name: str) -> None:
    g = captured(name)
    dg = data_parallel_graph(g, replicas)
    rng = random.Random(seed)
    rank = random_topological_rank(dg, rng)
    s = strategy_from(dg, "random", 2, [rng.randrange(2) for _ in dg.ops], start=rank, replicas=replicas)
    placed = place(g, s, cluster("cpu:2"), MeasuredCosts("cpu", 1))
    low, programs = placed.lowered, placed.programs
    w = wire(low, programs)
    where = {}
    for d, segs in enumerate(programs.devices):
        for i, seg in enumerate(segs):
            for t in seg.tasks:
                for n in (f"{t.head}#{t.part[1]}",) if t.part else (t.head, *t.nodes) if t.kind == "join" else t.nodes:
                    where[t.replica, n] = (d, i)
    carried = {n for names in low.allreduces.values() for n in names}
    sent_after = {m: (d, i) for d, segs in enumerate(w.send_after) for i, ms in enumerate(segs) for m in ms}
    for d, segs in enumerate(programs.devices):
        have: set = set()
        for i, seg in enumerate(segs):
            for m in w.recv_before[d][i] + w.reduce_before[d][i][1]:
                msg = w.messages[m]
                assert msg.dst == d and sent_after[m][0] == msg.src
                for v in msg.values:
                    assert where[v][0] == msg.src and where[v][1] <= sent_after[m][1]
                have.update(msg.values)
            for n in _reads(low, programs, seg):
                src = where.get((seg.replica, n))
                if src is not None and src[0] != d and n not in carried:
                    assert (seg.replica, n) in have, (d, i, n)
            for a in w.reduce_before[d][i][0]:
                for k in range(low.replicas):
                    for n in low.allreduces[a]:
                        assert where[k, n][0] == d or (k, n) in have
            for t in seg.tasks:  # what this rank produces it has
                have.update((t.replica, n) for n in t.nodes)
    to_0 = {v for m in w.messages if m.dst == 0 for v in m.values}  # in the step or at its end
    n = len(low.step.param_names)
    out = programs.outputs
    for k, value in w.keep[0].values():
        assert where.get((k, value), (0,))[0] == 0 or (k, value) in to_0
    assert len(w.keep[0]) >= n
    assert all(where[k, out[0]][0] == 0 or (k, out[0]) in to_0 for k in range(low.replicas))


def test_a_one_device_plan_sends_nothing() -> None:
    g = captured("mlp")
    placed = place(g, fastt.plan(g, "cpu:2", "single"), cluster("cpu:2"), MeasuredCosts("cpu", 1))
    w = wire(placed.lowered, placed.programs)
    assert not w.messages and not w.final


def test_pack_and_unpack_keep_values_and_captured_strides() -> None:
    """A message buffer round-trips tensors of several dtypes and layouts; dense ones come back as views of it
    with the captured strides (a transposed one stays transposed), others contiguous in their captured shape."""
    torch.manual_seed(0)
    xs = [torch.randn(3, 5), torch.randn(4, 6).t(), torch.randn(2, 3, 4).permute(2, 0, 1), torch.randn(4, 6)[:, :3],
          None, torch.empty(0), torch.tensor([1, 2, 3]), torch.tensor([True, False, True]), torch.randn(7).double()]
    leaves = [None if x is None else (x.shape, x.stride(), x.dtype) for x in xs]
    leaves[3] = (xs[3].shape, (3, 1), xs[3].dtype)  # captured contiguous, arrives as a slice: re-laid out
    buf = _pack(list(zip(xs, leaves)))
    assert buf.dtype == torch.uint8 and buf.numel() == _packed_size(leaves)
    out = _unpack(buf, leaves)
    for x, y, leaf in zip(xs, out, leaves):
        if x is None:
            assert y is None
            continue
        assert torch.equal(x, y) and y.dtype == x.dtype and y.stride() == tuple(leaf[1])
        if x.numel():
            assert y.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_fit_gather_recovers_the_plane() -> None:
    points = [(4 * k * f, k) for k, f in GATHER_SHAPES]
    a, b, c = fit_gather(points, [2e-4 + 2e-9 * nbytes + 8e-6 * k for nbytes, k in points])
    assert (a, b, c) == (pytest.approx(2e-4), pytest.approx(2e-9), pytest.approx(8e-6))
