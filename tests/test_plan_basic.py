"""The reference planners (single device, data parallelism) and the lower bound on any strategy's iteration time."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fastt
from fastt import zoo
from fastt.api import lower_bound
from fastt.cluster import cluster
from fastt.cost import op_times
from fastt.errors import FasttError
from fastt.graph import (
    ALLREDUCE,
    BUFFER,
    COMPUTE,
    INPUT,
    PARAM,
    RESIDENT,
    UPDATE,
    Op,
    OpGraph,
    replicate,
    without_unplaced_updates,
)
from fastt.plan import PLANNERS, get_planner, graph_for
from fastt.plan.common import strategy_from
from fastt.simulate import simulate as simulate_graph


def captured(name: str) -> OpGraph:
    w = zoo.get(name, "test", dropout=False)
    return fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=name)


@pytest.fixture(scope="module")
def mlp() -> OpGraph:
    return captured("mlp")


@pytest.fixture(scope="module")
def bn_net() -> OpGraph:
    """A small net with batch norm: buffers (running stats) written in place, Adam state as residents."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return fastt.capture(model, nn.functional.cross_entropy, opt, (torch.randn(8, 12), torch.randint(0, 3, (8,))),
                         name="bn_net")


def test_registry() -> None:
    assert set(PLANNERS) >= {"single", "dp"}
    assert get_planner("dp") is PLANNERS["dp"]
    with pytest.raises(FasttError, match="unknown planner 'nope'.*single"):
        get_planner("nope")


# ------------------------------------------------------------------------------------------------- single device


@pytest.mark.parametrize("graph", ["mlp", "bn_net"])
def test_single_device(graph: str, request: pytest.FixtureRequest) -> None:
    g: OpGraph = request.getfixturevalue(graph)
    cl = cluster("4xV100")
    s = fastt.plan(g, cl, "single")
    assert s.planner == "single" and s.n_devices == 4 and s.replicas == 1
    placed = [op.name for op in g.ops if op.kind not in RESIDENT]
    assert s.placement == dict.fromkeys(placed, 0)
    assert s.order == (tuple(placed), (), (), ())  # the captured order
    assert s.holders == {g.ops[i].name: (0,) for i in g.residents}
    s.validate(g)
    assert graph_for(g, s) is g

    tl = fastt.simulate(g, s, cl)
    times = op_times(g, cl)
    total = float(sum(times[i, 0] for i, op in enumerate(g.ops) if op.kind not in RESIDENT))
    assert tl.busy_s[0] == pytest.approx(total, rel=1e-9)
    assert tl.busy_s[1:] == (0.0, 0.0, 0.0)
    assert tl.transfers == () and tl.collectives == ()
    assert tl.iteration_s == pytest.approx(total, rel=1e-9)  # one device, nothing to wait for: no idle time
    assert tl.peak_memory_bytes[1:] == (0, 0, 0)
    assert tl.resident_bytes[0] == g.resident_bytes()
    assert tl.iteration_s >= tl.lower_bound_s > 0


# --------------------------------------------------------------------------------------------- data parallelism


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("graph", ["mlp", "bn_net"])
def test_data_parallel_structure(graph: str, n: int, request: pytest.FixtureRequest) -> None:
    g: OpGraph = request.getfixturevalue(graph)
    cl = cluster(f"{n}xV100")
    s = fastt.plan(g, cl, "dp")
    assert s.planner == "dp" and s.replicas == n and s.n_devices == n
    rg = graph_for(g, s)
    s.validate(rg)
    assert rg.replicas == n and rg.batch == g.batch
    sub = fastt.graph.rebatch(g, g.batch // n)
    assert sub.batch == g.batch // n

    # One allreduce per (gradient, update) pair, over the n replicas' copies of that gradient.
    pairs = [(sub.ops[j].name, op.name) for op in sub.ops if op.kind == UPDATE
             for j in op.inputs if sub.ops[j].kind not in RESIDENT]
    allreduces = [op for op in rg.ops if op.kind == ALLREDUCE]
    assert len(allreduces) == len(pairs) > 0
    assert sorted(op.name for op in allreduces) == sorted(f"allreduce/{a}->{b}" for a, b in pairs)
    for op in allreduces:
        grad = op.name.removeprefix("allreduce/").split("->")[0]
        assert [rg.ops[j].name for j in op.inputs] == [f"r{k}/{grad}" for k in range(n)]
        assert op.name not in s.placement

    # Every replica's update reads allreduces only (never its own replica's gradient) and runs on its device.
    updates = [op for op in rg.ops if op.kind == UPDATE]
    assert len(updates) == n * len(sub.of_kind(UPDATE))
    for op in updates:
        k = int(op.name[1:op.name.index("/")])
        assert s.placement[op.name] == k
        fed = [rg.ops[j] for j in op.inputs if rg.ops[j].kind not in RESIDENT]
        assert fed and all(x.kind == ALLREDUCE for x in fed)

    # Residents stay single ops, held on every device; everything else is copied once per replica.
    assert [rg.ops[i].name for i in rg.residents] == [sub.ops[i].name for i in sub.residents]
    assert s.holders == {rg.ops[i].name: tuple(range(n)) for i in rg.residents}
    for d in range(n):
        assert all(name.startswith(f"r{d}/") for name in s.order[d])
        assert len(s.order[d]) == len(sub.ops) - len(sub.residents)

    tl = fastt.simulate(g, s, cl)
    assert len(set(tl.peak_memory_bytes)) == 1  # replicas are alike
    assert len(set(tl.busy_s)) == 1
    assert sorted(a for c in tl.collectives for a in c.ops) == sorted(rg.index[op.name] for op in allreduces)
    assert tl.iteration_s >= tl.lower_bound_s > 0
    assert tl.fits


def test_data_parallel_of_buffers(bn_net: OpGraph) -> None:
    """Batch-norm running stats are buffers each replica updates in place on its own copy."""
    bufs = [i for i in bn_net.residents if bn_net.ops[i].kind == BUFFER and any(i in op.updates for op in bn_net.ops)]
    assert bufs
    s = fastt.plan(bn_net, "2xV100", "dp")
    rg = graph_for(bn_net, s)
    for i in bufs:
        name = bn_net.ops[i].name
        writers = [op for op in rg.ops if rg.index[name] in op.updates]
        assert sorted(s.placement[op.name] for op in writers) == [0, 1]


def test_data_parallel_work_per_device_shrinks(mlp: OpGraph) -> None:
    """DP's per-device work is below single's (roofline costs are monotone in the batch). At test size
    the iteration is not faster: launch overheads and allreduces dominate such small steps."""
    cl = cluster("4xV100")
    single = fastt.simulate(mlp, fastt.plan(mlp, cl, "single"), cl)
    dp = fastt.simulate(mlp, fastt.plan(mlp, cl, "dp"), cl)
    assert max(dp.busy_s) < single.busy_s[0]
    # DP steps the optimizer after the whole backward (as DDP does), so every gradient is alive at once.
    grads = sum(op.out_bytes for op in mlp.ops if op.kind == PARAM)
    assert max(dp.peak_memory_bytes) <= single.peak_memory_bytes[0] + grads
    assert dp.lower_bound_s == single.lower_bound_s  # a property of the graph and cluster, not the strategy


def test_data_parallel_indivisible_batch(mlp: OpGraph) -> None:
    assert mlp.batch % 3
    with pytest.raises(FasttError, match=rf"batch {mlp.batch} of 'mlp' does not split into 3"):
        fastt.plan(mlp, "3xV100", "dp")


def test_data_parallel_one_device_is_single(mlp: OpGraph) -> None:
    s = fastt.plan(mlp, "1xV100", "dp")
    assert graph_for(mlp, s) is mlp
    single = fastt.plan(mlp, "1xV100", "single")
    assert (s.placement, s.holders) == (single.placement, single.holders)
    assert sorted(s.order[0]) == sorted(single.order[0])  # DP runs the updates last


# ------------------------------------------------------------------------------------------------- lower bound


@st.composite
def step_graphs(draw: st.DrawFn) -> OpGraph:
    """A random training step: params, an input batch, compute ops (a DAG), one update per param."""
    ops: list[Op] = []

    def add(**kw) -> int:
        ops.append(Op(target=kw["kind"], **kw))
        return len(ops) - 1

    size = st.integers(1, 1 << 24)
    params = [add(name=f"p{k}", kind=PARAM, out_bytes=draw(size)) for k in range(draw(st.integers(1, 3)))]
    x = add(name="x", kind=INPUT, out_bytes=draw(size), batch=True)
    computed = [x]
    for k in range(draw(st.integers(1, 8))):
        srcs = draw(st.lists(st.sampled_from(computed + params), min_size=1, max_size=3, unique=True))
        computed.append(add(name=f"c{k}", kind=COMPUTE, inputs=tuple(srcs),
                            in_bytes=tuple(draw(size) for _ in srcs), out_bytes=draw(size),
                            flops=float(draw(st.integers(0, 10**11))), io_bytes=draw(size),
                            batch=draw(st.booleans())))
    for p in params:
        grad = draw(st.sampled_from(computed[1:]))
        add(name=f"update/{ops[p].name}", kind=UPDATE, inputs=(p, grad), in_bytes=(ops[p].out_bytes, draw(size)),
            flops=float(draw(st.integers(0, 10**9))), io_bytes=draw(size), updates=(p,))
    return OpGraph(ops=tuple(ops), name="random", batch=4)


def placed_strategy(g: OpGraph, n: int, device_of: list[int], replicas: int = 1) -> fastt.Strategy:
    """Placement as given; each resident held by the devices that update it (or device 0), as validate needs."""
    holders = {}
    for j in g.residents:
        devs = {device_of[i] for i, op in enumerate(g.ops) if j in op.updates}
        holders[g.ops[j].name] = tuple(sorted(devs or {0}))
    return strategy_from(g, "hand", n, device_of, replicas=replicas, holders=holders)


def split_batch(g: OpGraph, n: int) -> OpGraph:
    """The step at batch/n as the roofline sees it: batch ops do 1/n of the FLOPs and move ⌈1/n⌉ of the bytes."""
    def part(op: Op) -> Op:
        if not op.batch:
            return op
        return replace(op, flops=op.flops / n, io_bytes=math.ceil(op.io_bytes / n),
                       out_bytes=math.ceil(op.out_bytes / n), in_bytes=tuple(math.ceil(b / n) for b in op.in_bytes))
    return OpGraph(ops=tuple(part(op) for op in g.ops), name=g.name, batch=g.batch // n)


@settings(max_examples=100, deadline=None)
@given(g=step_graphs(), n=st.integers(1, 4), data=st.data())
def test_lower_bound_holds_for_any_placement(g: OpGraph, n: int, data: st.DataObject) -> None:
    cl = cluster(f"{n}xV100")
    times = op_times(g, cl)
    lb = lower_bound(g, times, n)
    assert lb > 0

    single = fastt.simulate(g, fastt.plan(g, cl, "single"), cl)
    assert single.lower_bound_s == pytest.approx(lb)
    assert single.iteration_s >= lb * (1 - 1e-9)

    device_of = data.draw(st.lists(st.integers(0, n - 1), min_size=len(g.ops), max_size=len(g.ops)))
    tl = fastt.simulate(g, placed_strategy(g, n, device_of), cl)
    assert tl.iteration_s >= lb * (1 - 1e-9)

    # Data-parallel replicas (placed anywhere): the bound on the whole step still holds.
    if n > 1:
        rg = replicate(split_batch(g, n), n)
        where = data.draw(st.lists(st.integers(0, n - 1), min_size=len(rg.ops), max_size=len(rg.ops)))
        s = placed_strategy(rg, n, where, replicas=n)
        placed = without_unplaced_updates(rg, s.placement)  # one update a device (`duplicate_updates`)
        rtl = simulate_graph(placed, s, cl, op_times(placed, cl))
        assert rtl.iteration_s >= lb * (1 - 1e-9)


def test_lower_bound_hand_computed() -> None:
    """LB = max(W / D, C): total fastest work over devices, or the longest chain of batch-independent ops."""
    ops = (
        Op("p", PARAM, "param", out_bytes=4),
        Op("x", INPUT, "input", out_bytes=4, batch=True),
        Op("a", COMPUTE, "mm", inputs=(1, 0), in_bytes=(4, 4), batch=True),
        Op("b", COMPUTE, "mm", inputs=(0,), in_bytes=(4,)),  # parameter-only
        Op("c", COMPUTE, "mm", inputs=(2, 3), in_bytes=(4, 4), batch=True),
        Op("u", UPDATE, "sgd", inputs=(0, 4), in_bytes=(4, 4), updates=(0,)),
    )
    g = OpGraph(ops=ops)
    t = np.array([[0, 0], [0, 0], [8, 9], [1, 3], [4, 2], [2, 2]], dtype=float)
    assert lower_bound(g, t, 2) == pytest.approx((8 + 1 + 2 + 2) / 2)
    assert lower_bound(g, t, 8) == pytest.approx(1 + 2)  # the chain b -> (c) -> u; c depends on the batch
    assert lower_bound(g, np.zeros((6, 2)), 2) == 0


def test_data_parallel_beats_single_on_paper_vgg19() -> None:
    """At paper size the step is compute-bound and DP on 4 V100s wins clearly (FakeTensor capture: no memory)."""
    w = zoo.get("vgg19", "paper", dropout=False)
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="vgg19")
    cl = cluster("4xV100")
    single = fastt.simulate(g, fastt.plan(g, cl, "single"), cl)
    dp = fastt.simulate(g, fastt.plan(g, cl, "dp"), cl)
    assert dp.iteration_s < 0.5 * single.iteration_s
    assert dp.iteration_s >= dp.lower_bound_s > single.iteration_s / 4 * 0.99
    assert single.fits and dp.fits
