"""The distributed runtime's messages (`runtime.distributed.wire`), checked without processes on random plans:
every value a rank reads from another arrives before the first segment that reads it, from the rank that
produced it, after the segment that produced it; every allreduce's gradients reach each rank that reads it; rank 0
gets every new parameter, state tensor and buffer it does not compute, and every loss."""

from __future__ import annotations

import functools
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runtime import one_thread_per_device, pair, random_topological_rank  # noqa: F401 - fixture

import fastt
from fastt.cluster import cluster
from fastt.cost import MeasuredCosts
from fastt.graph import data_parallel_graph
from fastt.plan.common import strategy_from
from fastt.runtime.distributed import _reads, wire
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
