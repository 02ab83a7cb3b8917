"""The distributed runtime's messages and collectives (`runtime.distributed.wire`), checked without processes on
random plans: every value a rank reads from another arrives before the first segment that reads it, from the rank
that produced it, after the segment that produced it; every allreduce is one collective's, among every rank that
holds one of its gradients or reads it, started after the rank's gradients and before its mean is read; the
ranks run to the end in any interleaving; rank 0 gets every new parameter, state tensor and buffer it does not
compute, and every loss."""

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
from fastt.runtime.distributed import (
    GATHER_SHAPES,
    Wiring,
    _pack,
    _packed_size,
    _reads,
    _unpack,
    fit_gather,
    wire,
)
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
            for m in w.recv_before[d][i]:
                msg = w.messages[m]
                assert msg.dst == d and sent_after[m][0] == msg.src
                for v in msg.values:
                    assert where[v][0] == msg.src and where[v][1] <= sent_after[m][1]
                have.update(msg.values)
            for n in _reads(low, programs, seg):
                src = where.get((seg.replica, n))
                if src is not None and src[0] != d and n not in carried:
                    assert (seg.replica, n) in have, (d, i, n)
            for t in seg.tasks:  # what this rank produces it has
                have.update((t.replica, n) for n in t.nodes)
    to_0 = {v for m in w.messages if m.dst == 0 for v in m.values}  # in the step or at its end
    n = len(low.step.param_names)
    out = programs.outputs
    for k, value in w.keep[0].values():
        assert where.get((k, value), (0,))[0] == 0 or (k, value) in to_0
    assert len(w.keep[0]) >= n
    assert all(where[k, out[0]][0] == 0 or (k, out[0]) in to_0 for k in range(low.replicas))
    check_collectives(w, low, programs, where)
    for _ in range(5):
        run_in_any_order(w, programs, rng)


def check_collectives(w: Wiring, low, programs, where: dict) -> None:
    """Each allreduce is in one collective, among the ranks that hold its gradients or read it; a rank starts
    it after making its gradients of it and waits for it before the first segment that reads it, and ranks
    start the collectives they share in one order."""
    assert sorted(a for c in w.collectives for a in c.ops) == sorted(low.allreduces)
    started = {}  # (rank, collective) -> where it starts
    for d, bounds in enumerate(w.start_before):
        order = [c for cs in bounds for c in cs]
        assert order == sorted(order)  # every rank starts in the collectives' order
        started.update({(d, c): b for b, cs in enumerate(bounds) for c in cs})
    for c, col in enumerate(w.collectives):
        assert {d for d, c2 in started if c2 == c} == set(col.ranks)
        for name, src in zip(col.names, col.sources):
            for k, d in enumerate(src):
                assert where[k, name][0] == d and where[k, name][1] < started[d, c]
    for d, segs in enumerate(programs.devices):
        waited = {c for cs in w.reduce_before[d] for c in cs}
        for i, seg in enumerate(segs):
            for a in seg.waits:
                if a in low.allreduces:
                    c = next(c for c, col in enumerate(w.collectives) if a in col.ops)
                    first = min(j for j, cs in enumerate(w.reduce_before[d]) if c in cs)
                    assert c in waited and started[d, c] <= first <= i


def run_in_any_order(w: Wiring, programs, rng: random.Random) -> None:
    """Run the ranks' segments in a random interleaving, as processes may: a segment runs once its messages
    were sent and every rank of its collectives started them. Fails on a deadlock."""
    n = len(programs.devices)
    done, sent, started = [0] * n, set(), {}
    for d in range(n):
        for c in w.start_before[d][0]:
            started.setdefault(c, set()).add(d)
    while True:
        ready = [d for d in range(n) if done[d] < len(programs.devices[d])
                 and all(m in sent for m in w.recv_before[d][done[d]])
                 and all(started.get(c, set()) == set(w.collectives[c].ranks) for c in w.reduce_before[d][done[d]])]
        if not ready:
            break
        d = rng.choice(ready)
        sent.update(w.send_after[d][done[d]])
        done[d] += 1
        for c in w.start_before[d][done[d]]:
            started.setdefault(c, set()).add(d)
    assert done == [len(s) for s in programs.devices], f"deadlock: ranks stopped at segments {done}"


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
