"""The baseline planners (HEFT, Baechi's m-TOPO, m-ETF, m-SCT): hand-computed schedules on tiny graphs, then
invariants on random training steps (hypothesis) and a captured zoo model."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastt
from fastt import zoo
from fastt.cluster import Cluster, Device, Link
from fastt.graph import (
    BUFFER,
    COMPUTE,
    INPUT,
    PARAM,
    RESIDENT,
    STATE,
    UPDATE,
    Op,
    OpGraph,
    replicate,
    without_unplaced_updates,
)
from fastt.plan import baechi
from fastt.plan.baechi import favorite_children, m_etf, m_sct, m_topo
from fastt.plan.common import PlanCosts, memory_of, plan_costs
from fastt.plan.heft import heft, heft_schedule
from fastt.plan.schedule import Slots
from fastt.simulate import simulate
from fastt.strategy import Strategy

Planner = Callable[..., Strategy]
PLANNERS: dict[str, Planner] = {"heft": heft, "m-topo": m_topo, "m-etf": m_etf, "m-sct": m_sct}


def mesh(n: int, mem: int = 1 << 40, bw: float = 1.0, lat: float = 0.0) -> Cluster:
    """n devices with one dedicated link per ordered pair (bw bytes/s: with 1.0 a transfer of b bytes takes b s)."""
    devices = tuple(Device(f"d{i}", "test", mem, 1e12, 1e11) for i in range(n))
    pairs = [(s, d) for s in range(n) for d in range(n) if s != d]
    links = tuple(Link(f"{s}->{d}", bw, lat) for s, d in pairs)
    return Cluster("mesh", devices, links, {p: (k,) for k, p in enumerate(pairs)})


def dag(spec: dict[str, dict[str, int]], out: int = 0) -> OpGraph:
    """Compute ops by name in topological order: `{"b": {"a": 4}}` reads 4 bytes of a."""
    index: dict[str, int] = {}
    ops = []
    for name, ins in spec.items():
        index[name] = len(ops)
        ops.append(Op(name=name, kind=COMPUTE, target="t", inputs=tuple(index[j] for j in ins),
                      in_bytes=tuple(ins.values()), out_bytes=out))
    return OpGraph(ops=tuple(ops))


def costs_of(g: OpGraph, cl: Cluster, seconds: dict[str, list[float]]) -> PlanCosts:
    return PlanCosts(times=np.array([seconds[op.name] for op in g.ops], dtype=float), cluster=cl)


# ---------------------------------------------------------------------------------------------------- HEFT by hand

# The example of Topcuoglu, Hariri & Wu (2002), Fig. 2: ten tasks on three processors, transfer times on the edges.
CLASSIC_W = {"n1": [14, 16, 9], "n2": [13, 19, 18], "n3": [11, 13, 19], "n4": [13, 8, 17], "n5": [12, 13, 10],
             "n6": [13, 16, 9], "n7": [7, 15, 11], "n8": [5, 11, 14], "n9": [18, 12, 20], "n10": [21, 7, 16]}
CLASSIC = dag({"n1": {}, "n2": {"n1": 18}, "n3": {"n1": 12}, "n4": {"n1": 9}, "n5": {"n1": 11}, "n6": {"n1": 14},
               "n7": {"n3": 23}, "n8": {"n2": 19, "n4": 27, "n6": 15}, "n9": {"n2": 16, "n4": 23, "n5": 13},
               "n10": {"n7": 17, "n8": 11, "n9": 13}})


def test_heft_classic_example() -> None:
    """The paper's HEFT schedule (Fig. 4a): makespan 80; ranks order n1, n3, n4, n2, n5, n6, n9, n7, n8, n10."""
    cl = mesh(3)
    sched = heft_schedule(CLASSIC, cl, costs_of(CLASSIC, cl, CLASSIC_W))
    got = {op.name: (sched.dev[i], sched.start[i], sched.finish[i]) for i, op in enumerate(CLASSIC.ops)}
    assert got == {"n1": (2, 0, 9), "n3": (2, 9, 28), "n4": (1, 18, 26), "n2": (0, 27, 40), "n5": (2, 28, 38),
                   "n6": (1, 26, 42), "n9": (1, 56, 68), "n7": (2, 38, 49), "n8": (0, 57, 62), "n10": (1, 73, 80)}
    s = heft(CLASSIC, cl, costs_of(CLASSIC, cl, CLASSIC_W))
    assert s.planner == "heft"
    assert s.order == (("n2", "n8"), ("n4", "n6", "n9", "n10"), ("n1", "n3", "n5", "n7"))


def test_heft_fills_a_gap() -> None:
    """a -> b (4 bytes), c independent, d reads b and c. By hand, ranks: a 17.5, b 8, c 7.5, d 1.
    a: d0 [0, 1]. b: d0 would end at 11, d1 waits for a's transfer until 5 and ends at 7 -> d1 [5, 7].
    c: d0 is free from 1 (ends 11), d1 has the gap [0, 5] -> d1 [0, 1], inserted before b. d: d1 [7, 8]."""
    g = dag({"a": {}, "b": {"a": 4}, "c": {}, "d": {"b": 1, "c": 1}})
    cl = mesh(2)
    costs = costs_of(g, cl, {"a": [1, 10], "b": [10, 2], "c": [10, 1], "d": [1, 1]})
    sched = heft_schedule(g, cl, costs)
    assert [(sched.dev[i], sched.start[i], sched.finish[i]) for i in range(4)] == [
        (0, 0, 1), (1, 5, 7), (1, 0, 1), (1, 7, 8)]
    s = heft(g, cl, costs)
    assert s.order == (("a",), ("c", "b", "d"))
    assert simulate(g, s, cl, costs.times).iteration_s == 8


def test_slots_insertion() -> None:
    slots = Slots()
    slots.add(0, 2.0, 4.0)
    slots.add(1, 6.0, 9.0)
    assert slots.earliest(0.0, 2.0) == (0.0, 0)  # fits before the first interval
    assert slots.earliest(0.0, 2.5) == (9.0, 2)  # fits in no gap: after the last
    assert slots.earliest(3.0, 2.0) == (4.0, 1)  # the gap [4, 6], once ready
    assert slots.earliest(4.5, 2.0) == (9.0, 2)
    assert slots.earliest(1.0, 0.0) == (1.0, 0)
    slots.add(1, 4.0, 5.0)  # touches the first block: merged into it
    assert (slots.starts, slots.ends) == ([2.0, 6.0], [5.0, 9.0])
    slots.add(1, 5.0, 6.0)  # closes the gap: one block
    assert (slots.starts, slots.ends) == ([2.0], [9.0])
    assert slots.earliest(3.0, 1.0) == (9.0, 1)


# ------------------------------------------------------------------------------------------ m-ETF, m-SCT by hand


def test_m_etf_by_earliest_start() -> None:
    """ETF picks the earliest start, not the earliest finish: b starts on d0 at 1 (ends 11) rather than on d1
    at 5 (ends 7); c took d1 at 0 first. d then waits for b on d0: [11, 12]."""
    g = dag({"a": {}, "b": {"a": 4}, "c": {}, "d": {"b": 1, "c": 1}})
    cl = mesh(2)
    s = m_etf(g, cl, costs_of(g, cl, {"a": [1, 10], "b": [10, 2], "c": [10, 1], "d": [1, 1]}))
    assert s.planner == "m-etf"
    assert s.order == (("a", "b", "d"), ("c",))


def test_m_sct_favorite_child() -> None:
    """a feeds c (1 byte) and b (100 bytes): the LP makes b a's favorite child. ETF runs c right after a (equal
    starts, c comes first in the graph); SCT runs b there first."""
    g = dag({"a": {}, "c": {"a": 1}, "b": {"a": 100}})
    cl = mesh(2)
    costs = costs_of(g, cl, {"a": [1, 1], "b": [1, 1], "c": [1, 1]})
    assert favorite_children(g, costs) == [2, -1, -1]
    assert m_etf(g, cl, costs).order[0] == ("a", "c", "b")
    assert m_sct(g, cl, costs).order[0] == ("a", "b", "c")
    assert favorite_children(g, costs_of(g, mesh(1), {"a": [1], "b": [1], "c": [1]})) == [-1] * 3


def test_m_sct_greedy_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the LP: each op's heaviest-transfer child, each child claimed by one parent at most."""
    monkeypatch.setattr(baechi, "_sct_lp", lambda *args: None)
    g = dag({"a": {}, "b": {}, "c": {"a": 5, "b": 9}, "d": {"a": 7}})
    cl = mesh(2)
    costs = costs_of(g, cl, {op.name: [1, 1] for op in g.ops})
    assert favorite_children(g, costs) == [3, 2, -1, -1]


def test_m_sct_favorites_are_one_to_one() -> None:
    cl = mesh(3)
    fav = favorite_children(CLASSIC, costs_of(CLASSIC, cl, CLASSIC_W))
    children = [c for c in fav if c >= 0]
    assert children and len(children) == len(set(children))
    for p, c in enumerate(fav):
        assert c < 0 or p in CLASSIC.ops[c].inputs


# ------------------------------------------------------------------------------------------------ memory by hand


def fan_in(n: int, out: int) -> OpGraph:
    """n independent ops of `out` bytes, all read by `sink`: every output is live at once, so planning charges
    each of them (common.memory_of)."""
    g = dag({**{f"o{k}": {} for k in range(n)}, "sink": {f"o{k}": out for k in range(n)}}, out=out)
    return OpGraph(ops=(*g.ops[:-1], replace(g.ops[-1], out_bytes=0)))


def test_m_topo_fills_devices_in_turn() -> None:
    """8 ops of 100 bytes on 4 devices: Baechi's capacity is 800 / 4 + the largest op's 100 = 300, so three ops
    per device, in Kahn's breadth-first order."""
    g = fan_in(8, 100)
    assert sum(memory_of(g)) == 800
    s = m_topo(g, mesh(4, mem=10_000))
    assert s.order == (("o0", "o1", "o2"), ("o3", "o4", "o5"), ("o6", "o7", "sink"), ())
    # The capacity never exceeds a device's memory: with 150 bytes each device takes one op; the rest overflow.
    s = m_topo(g, mesh(4, mem=150))
    assert [s.placement[f"o{k}"] for k in range(4)] == [0, 1, 2, 3]


def test_m_topo_colocates_updates_with_their_parameters() -> None:
    """vgg19 on 4 devices: every update runs where its parameter's first reader (its forward op) went, so no
    parameter or optimizer state travels, and the updates are not all left to the last device (m-TOPO's plans
    before Baechi's rule)."""
    from fastt import zoo
    from fastt.api import capture

    w = zoo.get("vgg19")
    g = capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    s = m_topo(g, mesh(4, mem=1 << 40))
    for i in g.of_kind(UPDATE):
        params = [p for p in g.ops[i].updates if g.ops[p].kind == PARAM]
        first = min(s.placement[g.ops[r].name] for p in params for r in g.succs[p] if g.ops[r].kind != UPDATE)
        assert s.placement[g.ops[i].name] == first and all(s.holders[g.ops[p].name] == (first,) for p in params)
    assert len({s.placement[g.ops[i].name] for i in g.of_kind(UPDATE)}) > 1


@pytest.mark.parametrize("name", PLANNERS)
def test_tight_memory_spreads_ops(name: str) -> None:
    """Ops cheapest on device 0 but room for two per device: every device ends up with exactly two."""
    g = fan_in(8, 100)
    cl = mesh(4, mem=250)
    costs = PlanCosts(times=np.tile([1.0, 2.0, 2.0, 2.0], (9, 1)), cluster=cl)
    s = PLANNERS[name](g, cl, costs)
    s.validate(g)
    assert [len([n for n in o if n != "sink"]) for o in s.order] == [2, 2, 2, 2]


@pytest.mark.parametrize("name", PLANNERS)
def test_no_room_anywhere_does_not_crash(name: str) -> None:
    g = fan_in(6, 100)
    cl = mesh(2, mem=150)
    s = PLANNERS[name](g, cl, costs_of(g, cl, {op.name: [1.0, 1.0] for op in g.ops}))
    s.validate(g)
    assert not simulate(g, s, cl, np.ones((7, 2))).fits


# ----------------------------------------------------------------------------------------- random training steps


@st.composite
def steps(draw: st.DrawFn) -> OpGraph:
    """A random training step: params with momentum state, an input, a DAG of compute ops, one update per param,
    and maybe a buffer that a single op reads (so every resident has one op that pins it)."""
    ops: list[Op] = []

    def add(**kw) -> int:
        ops.append(Op(target=kw["kind"], **kw))
        return len(ops) - 1

    size = st.integers(0, 1 << 20)
    params = [add(name=f"p{k}", kind=PARAM, out_bytes=draw(size)) for k in range(draw(st.integers(1, 4)))]
    states = [add(name=f"s{k}", kind=STATE, out_bytes=ops[p].out_bytes) for k, p in enumerate(params)]
    buffers = [add(name="buf", kind=BUFFER, out_bytes=draw(size))] if draw(st.booleans()) else []
    computed = [add(name="x", kind=INPUT, out_bytes=draw(size), batch=True)]
    for k in range(draw(st.integers(1, 14))):
        pool = computed + params + (buffers if k == 0 else [])
        srcs = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        if k == 0:
            srcs = list(dict.fromkeys([*srcs, *buffers]))
        computed.append(add(name=f"c{k}", kind=COMPUTE, inputs=tuple(srcs), in_bytes=tuple(draw(size) for _ in srcs),
                            out_bytes=draw(size), flops=float(draw(st.integers(0, 10**10))), io_bytes=draw(size),
                            batch=draw(st.booleans())))
    for p, s in zip(params, states):
        grad = draw(st.sampled_from(computed[1:]))
        add(name=f"update/{ops[p].name}", kind=UPDATE, inputs=(p, s, grad),
            in_bytes=(ops[p].out_bytes, ops[s].out_bytes, draw(size)), flops=float(draw(st.integers(0, 10**8))),
            io_bytes=draw(size), updates=(p, s))
    return OpGraph(ops=tuple(ops), name="random", batch=4)


def clusters(n: int, mem: int, bw: float) -> Cluster:
    return mesh(n, mem=mem, bw=bw, lat=1e-6)


def static_use(g: OpGraph, s: Strategy) -> list[int]:
    """Bytes each device holds under the static model: its ops' charges and the residents its ops pin (each
    resident in `steps` has exactly one op that pins it: its update, or the one reader of the buffer)."""
    use = [0] * s.n_devices
    mem = memory_of(g)
    updated = {r for op in g.ops for r in op.updates}
    for i, op in enumerate(g.ops):
        if op.kind in RESIDENT:
            continue
        d = s.placement[op.name]
        use[d] += mem[i] + sum(g.ops[r].out_bytes for r in op.updates)
        use[d] += sum(g.ops[r].out_bytes for r in op.inputs if g.ops[r].kind in RESIDENT and r not in updated)
    return use


@settings(max_examples=250, deadline=None)
@given(g=steps(), n=st.integers(1, 8), bw=st.sampled_from([1e6, 1e9, 1e12]), name=st.sampled_from(list(PLANNERS)))
def test_random_steps_with_ample_memory(g: OpGraph, n: int, bw: float, name: str) -> None:
    cl = clusters(n, 1 << 40, bw)
    s = PLANNERS[name](g, cl)
    assert s.planner == name and s.n_devices == n
    s.validate(g)
    times = plan_costs(g, cl).times
    tl = simulate(g, s, cl, times)
    assert tl.fits
    # a device runs its ops one at a time: the step lasts at least as long as any device's share of the work
    for d in range(n):
        work = sum(times[i, d] for i in range(len(g.ops)) if tl.device[i] == d)
        assert work <= tl.iteration_s * (1 + 1e-9), (d, work, tl.iteration_s)


@settings(max_examples=250, deadline=None)
@given(g=steps(), n=st.integers(1, 8), slack=st.sampled_from([0.0, 0.5, 1.0]), name=st.sampled_from(list(PLANNERS)))
def test_random_steps_with_tight_memory(g: OpGraph, n: int, slack: float, name: str) -> None:
    """Devices hold total/n plus `slack` of the largest op: every placement stays within memory when there is
    room for the largest op on top of an even share (a device with room always exists), and never crashes."""
    mem = memory_of(g)
    need = [0 if op.kind in RESIDENT else mem[i] + sum(g.ops[r].out_bytes for r in op.updates)
            + sum(g.ops[r].out_bytes for r in op.inputs if g.ops[r].kind == BUFFER) for i, op in enumerate(g.ops)]
    limit = max(1, -(-sum(need) // n) + int(slack * max(need)))
    cl = clusters(n, limit, 1e9)
    s = PLANNERS[name](g, cl)
    s.validate(g)
    simulate(g, s, cl, plan_costs(g, cl).times)
    # Baechi's m-TOPO caps each device at its own capacity (total/devices + the largest op) and then puts a
    # parameter's update, with its state, where the parameter went, which can overflow that device: hypothesis
    # found 8 bytes against 7 on 3 devices. Its own guarantee is test_m_topo_respects_the_cap's.
    if slack == 1.0 and name != "m-topo":
        assert max(static_use(g, s)) <= limit


@settings(max_examples=150, deadline=None)
@given(g=steps(), n=st.integers(2, 8))
def test_m_topo_respects_the_cap(g: OpGraph, n: int) -> None:
    """Devices are filled in a topological order (each device runs its ops in it), every device before the last
    stays within its capacity but for the updates colocated with their parameters, and a parameter and its state
    live where their update runs (where the first op that read or updated the parameter went)."""
    limit = 1 << 30
    cl = clusters(n, limit, 1e9)
    s = m_topo(g, cl)
    mem = memory_of(g)
    size = [op.out_bytes if op.kind in RESIDENT else mem[i] for i, op in enumerate(g.ops)]
    cap = min(limit, sum(size) / n + max(size))
    use = [0] * n
    for i, op in enumerate(g.ops):
        if op.kind not in RESIDENT and op.kind != UPDATE:
            use[s.placement[op.name]] += size[i]
    assert all(u <= cap for u in use[:-1])
    pos = {name: k for names in s.order for k, name in enumerate(names)}
    for op in g.ops:  # each device's order is topological
        for j in op.inputs:
            if op.name in pos and g.ops[j].name in pos and s.placement[op.name] == s.placement[g.ops[j].name]:
                assert pos[g.ops[j].name] < pos[op.name]
    for i in g.of_kind(UPDATE):  # a parameter and its state live where their update runs
        assert all(s.holders[g.ops[r].name] == (s.placement[g.ops[i].name],) for r in g.ops[i].updates)


@pytest.mark.parametrize("name", PLANNERS)
def test_data_parallel_graph(name: str) -> None:
    """A replicated graph (allreduces, residents updated on two devices) still gets a valid plan (one update a
    device: a second replica's update on the same device is left out, `graph.duplicate_updates`)."""
    g = replicate(_small_step(), 2)
    cl = clusters(2, 1 << 40, 1e9)
    s = PLANNERS[name](g, cl)
    assert s.replicas == 2
    placed = without_unplaced_updates(g, s.placement)
    s.validate(placed)
    assert simulate(placed, s, cl, plan_costs(placed, cl).times).fits


def _small_step() -> OpGraph:
    ops = [Op(name="p", kind=PARAM, target="p", out_bytes=1000), Op(name="x", kind=INPUT, target="x", out_bytes=100),
           Op(name="y", kind=COMPUTE, target="mm", inputs=(0, 1), in_bytes=(1000, 100), out_bytes=100, flops=1e6),
           Op(name="g", kind=COMPUTE, target="mm", inputs=(2, 1), in_bytes=(100, 100), out_bytes=1000, flops=1e6),
           Op(name="u", kind=UPDATE, target="u", inputs=(0, 3), in_bytes=(1000, 1000), updates=(0,))]
    return OpGraph(ops=tuple(ops), name="small", batch=2)


# ------------------------------------------------------------------------------------------------- a zoo model


@pytest.fixture(scope="module")
def mlp() -> OpGraph:
    w = zoo.get("mlp", "test")
    return fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="mlp")


@pytest.mark.parametrize("name", PLANNERS)
def test_zoo_mlp(mlp: OpGraph, name: str) -> None:
    cl = fastt.cluster("4xV100")
    s = PLANNERS[name](mlp, cl)
    s.validate(mlp)
    tl = fastt.simulate(mlp, s, cl)
    single = fastt.simulate(mlp, fastt.plan(mlp, cl, "single"), cl)
    assert tl.fits
    assert tl.iteration_s <= 3 * single.iteration_s


def test_paper_bert_large_plans_in_seconds() -> None:
    """~2900 ops on 8 V100s: every baseline (m-SCT's LP included) plans in a few seconds and fits."""
    w = zoo.get("bert-large", "paper")
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name="bert-large")
    cl = fastt.cluster("8xV100")
    costs = plan_costs(g, cl)
    for name, planner in PLANNERS.items():
        t0 = time.perf_counter()
        s = planner(g, cl, costs)
        assert time.perf_counter() - t0 < 5, name
        s.validate(g)
        assert fastt.simulate(g, s, cl).fits, name
