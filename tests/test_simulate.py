"""Simulator tests: hand-computed timelines on tiny graphs, then invariants on random DAGs (hypothesis)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastt.cluster import Cluster, Device, Link
from fastt.errors import FasttError
from fastt.graph import ALLREDUCE, COMPUTE, INPUT, PARAM, RESIDENT, UPDATE, Op, OpGraph, replicate
from fastt.plan.common import memory_of
from fastt.report import chrome_trace, write_gantt, write_trace
from fastt.simulate import Timeline, inter_node_bytes, simulate
from fastt.strategy import Strategy


class Builder:
    """Ops by name: `add("b", inputs={"a": 100})` reads 100 bytes of a."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.index: dict[str, int] = {}

    def add(self, name: str, kind: str = COMPUTE, inputs: dict[str, int] | None = None, out: int = 0,
            updates: tuple[str, ...] = (), out_parts: tuple[int, ...] = (),
            keeps: dict[str, tuple[int, ...]] | None = None) -> str:
        """`out_parts`: the storages of its results (their bytes); `keeps[n]`: the parts of input n it keeps
        alive (all if not named)."""
        inputs, keeps = inputs or {}, keeps or {}
        self.index[name] = len(self.ops)
        in_parts = tuple(keeps.get(n, ()) for n in inputs)
        self.ops.append(Op(name=name, kind=kind, target=kind, inputs=tuple(self.index[n] for n in inputs),
                           in_bytes=tuple(inputs.values()), out_bytes=sum(out_parts) if out_parts else out,
                           updates=tuple(self.index[n] for n in updates), out_parts=out_parts,
                           in_parts=in_parts if any(in_parts) else ()))
        return name

    def graph(self) -> OpGraph:
        return OpGraph(ops=tuple(self.ops))


def mesh(n: int, bw: float = 1000.0, lat: float = 0.0, mem: int = 1 << 40, shared: bool = False) -> Cluster:
    """n devices; one link per ordered pair, or (shared) one link for every transfer."""
    devices = tuple(Device(f"d{i}", "test", mem, 1e12, 1e11) for i in range(n))
    pairs = [(s, d) for s in range(n) for d in range(n) if s != d]
    if shared:
        return Cluster("shared", devices, (Link("bus", bw, lat),), {p: (0,) for p in pairs})
    links = tuple(Link(f"{s}->{d}", bw, lat) for s, d in pairs)
    return Cluster("mesh", devices, links, {p: (k,) for k, p in enumerate(pairs)})


def plan(g: OpGraph, n: int, placement: dict[str, int], holders: dict[str, tuple[int, ...]] | None = None,
         order: list[list[str]] | None = None) -> Strategy:
    """A strategy with each device's order = the graph's order filtered to that device."""
    if order is None:
        order = [[op.name for op in g.ops if placement.get(op.name) == d] for d in range(n)]
    holders = holders or {g.ops[i].name: (0,) for i in g.residents}
    return Strategy("test", n, placement, tuple(tuple(o) for o in order), holders, replicas=g.replicas)


def every_device(cl: Cluster, **fields: float) -> Cluster:
    """`cl` with `fields` (a measured cost, e.g. wake_s) set on every device."""
    return replace(cl, devices=tuple(replace(d, **fields) for d in cl.devices))


def diamond(nbytes: int) -> Builder:
    """a, read by b and c, both read by d: each edge `nbytes`."""
    b = Builder()
    b.add("a")
    b.add("b", inputs={"a": nbytes})
    b.add("c", inputs={"a": nbytes})
    b.add("d", inputs={"b": nbytes, "c": nbytes})
    return b


def seconds(g: OpGraph, n: int, per_op: dict[str, float]) -> np.ndarray:
    return np.array([[per_op.get(op.name, 0.0)] * n for op in g.ops])


def at(tl: Timeline, g: OpGraph, name: str) -> tuple[float, float]:
    i = g.index[name]
    return float(tl.start[i]), float(tl.end[i])


def test_chain_on_one_device() -> None:
    b = Builder()
    b.add("a")
    b.add("b", inputs={"a": 8})
    b.add("c", inputs={"b": 8})
    g = b.graph()
    tl = simulate(g, plan(g, 1, {"a": 0, "b": 0, "c": 0}), mesh(1), seconds(g, 1, {"a": 1, "b": 2, "c": 3}))
    assert [at(tl, g, n) for n in "abc"] == [(0, 1), (1, 3), (3, 6)]
    assert tl.iteration_s == 6 and tl.busy_s == (6,) and tl.transfers == ()
    assert tl.critical_path == ("a", "b", "c")


def test_chain_across_two_devices_pays_latency_plus_bytes_over_bandwidth() -> None:
    b = Builder()
    b.add("a")
    b.add("b", inputs={"a": 1000})
    g = b.graph()
    tl = simulate(g, plan(g, 2, {"a": 0, "b": 1}), mesh(2, bw=1000, lat=0.5), seconds(g, 2, {"a": 1, "b": 2}))
    assert at(tl, g, "b") == (2.5, 4.5)  # a ends at 1, then 0.5 s latency + 1000 B / 1000 B/s
    (t,) = tl.transfers
    assert (t.op, t.src, t.dst, t.nbytes, t.start, t.end) == (0, 0, 1, 1000, 1.0, 2.5)
    assert tl.link_busy_s[0] == 1.5 and tl.critical_path == ("a", "b")


def test_a_device_woken_while_another_runs_pays_the_wake() -> None:
    """`Device.wake_s` is paid by an op whose device sat idle until another device's value came while some
    other device was running (b: device 0 runs c), not by one woken while the others wait (d: device 1 is
    done), nor one that waited for its own device (e)."""
    b = diamond(1000)
    b.add("e", inputs={"d": 1000})
    g = b.graph()
    two = mesh(2, bw=1000, lat=0.5)
    woken = every_device(two, wake_s=0.25)
    st = plan(g, 2, {"a": 0, "b": 1, "c": 0, "d": 0, "e": 0})
    per_op = seconds(g, 2, {"a": 1, "b": 2, "c": 3, "d": 1, "e": 1})
    tl = simulate(g, st, woken, per_op)
    # a's value reaches device 1 at 2.5, while device 0 runs c (1..4): b runs 2.5..4.75 with the wake; b's
    # value reaches device 0 at 6.25, device 1 then idle: d 6.25..7.25, then e.
    assert [at(tl, g, n) for n in "abcde"] == [(0, 1), (2.5, 4.75), (1, 4), (6.25, 7.25), (7.25, 8.25)]
    assert tl.busy_s == (6, 2.25)
    assert simulate(g, st, two, per_op).iteration_s == 8.0  # without it: b ends at 4.5, d starts at 6


def test_a_rank_whose_cores_copy_pays_for_what_it_sends_and_receives() -> None:
    """`Device.comm_s_per_byte` (a distributed CPU rank, whose cores run gloo's copies) keeps the sender and
    the receiver busy for that long per byte from the moment a transfer is requested: b waits for device 1 to
    have received a's value, and d for device 0 to have sent a's and received b's."""
    g = diamond(1000).graph()
    two = mesh(2, bw=1000, lat=0.5)
    copying = every_device(two, comm_s_per_byte=0.002)
    st = plan(g, 2, {"a": 0, "b": 1, "c": 0, "d": 0})
    per_op = seconds(g, 2, {"a": 1, "b": 2, "c": 3, "d": 1})
    # At 1 a's value leaves (1..2.5): device 0 runs c (1..4) then sends for 2 s (to 6), device 1 receives
    # from 1 to 3; b 3..5; its value leaves at 5 (5..6.5): device 0 receives 6..8, so d runs 8..9.
    tl = simulate(g, st, copying, per_op)
    assert [at(tl, g, n) for n in "abcd"] == [(0, 1), (3, 5), (1, 4), (8, 9)]
    assert tl.busy_s == (5, 2)  # the ops' own time
    plain = simulate(g, st, two, per_op)
    assert [at(plain, g, n) for n in "abcd"] == [(0, 1), (2.5, 4.5), (1, 4), (6, 7)]


def test_diamond() -> None:
    g = diamond(100).graph()
    tl = simulate(g, plan(g, 2, {"a": 0, "b": 0, "c": 1, "d": 0}), mesh(2, bw=100),
                  seconds(g, 2, {"a": 1, "b": 2, "c": 3, "d": 1}))
    # c: a's output arrives at 2, runs 2..5; its output reaches device 0 at 6; b finished at 3.
    assert [at(tl, g, n) for n in "abcd"] == [(0, 1), (1, 3), (2, 5), (6, 7)]
    assert tl.critical_path == ("a", "c", "d")
    assert tl.busy_s == (4, 3)


@pytest.mark.parametrize("shared, ends", [(True, (2.0, 3.0)), (False, (2.0, 2.0))])
def test_fork_transfers_contend_only_on_a_shared_link(shared: bool, ends: tuple[float, float]) -> None:
    b = Builder()
    b.add("a")
    b.add("b", inputs={"a": 100})
    b.add("c", inputs={"a": 100})
    g = b.graph()
    tl = simulate(g, plan(g, 3, {"a": 0, "b": 1, "c": 2}), mesh(3, bw=100, shared=shared),
                  seconds(g, 3, {"a": 1}))
    assert tuple(t.end for t in tl.transfers) == ends  # on one link the second transfer waits for the first
    assert at(tl, g, "b")[0] == ends[0] and at(tl, g, "c")[0] == ends[1]


def replicated(b: Builder, n: int) -> tuple[OpGraph, Strategy]:
    """replicate() of the step `b` built: each replica on its device, every parameter held everywhere."""
    g = replicate(b.graph(), n)
    placement = {op.name: int(op.name[1:op.name.index("/")]) for op in g.ops
                 if op.kind not in RESIDENT and op.kind != ALLREDUCE}
    params = {op.name: tuple(range(n)) for op in b.ops if op.kind == PARAM}
    return g, plan(g, n, placement, holders=params)


def data_parallel_step(n: int, grad_bytes: int) -> tuple[OpGraph, Strategy]:
    """replicate() of a one-parameter step: each replica on its device, the parameter held everywhere."""
    b = Builder()
    b.add("w", PARAM, out=grad_bytes)
    b.add("x", INPUT, out=10)
    b.add("grad", inputs={"w": grad_bytes, "x": 10}, out=grad_bytes)
    b.add("update", UPDATE, inputs={"w": grad_bytes, "grad": grad_bytes}, updates=("w",))
    return replicated(b, n)


@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_takes_the_ring_time(n: int) -> None:
    g, strategy = data_parallel_step(n, grad_bytes=4000)
    times = seconds(g, n, {f"r{k}/grad": 1.0 for k in range(n)} | {f"r{k}/update": 0.5 for k in range(n)})
    tl = simulate(g, strategy, mesh(n, bw=1000, lat=0.1), times)
    ring = 2 * (n - 1) / n * 4000 / 1000 + 2 * (n - 1) * 0.1
    (c,) = tl.collectives
    assert c.group == tuple(range(n)) and (c.start, c.end) == (1.0, pytest.approx(1.0 + ring))
    assert len(c.links) == n  # the ring's n hops
    assert tl.iteration_s == pytest.approx(1.0 + ring + 0.5)
    kinds = [g.ops[g.index[name]].kind for name in tl.critical_path]
    assert kinds[-2:] == [ALLREDUCE, UPDATE]
    assert tl.transfers == ()  # every replica holds w, and reads the aggregate where it was reduced


def two_gradient_step(n: int) -> tuple[OpGraph, Strategy]:
    """Each replica computes gradients g1 then g2 (1 s each) of two parameters, then updates both (0.5 s each)."""
    b = Builder()
    b.add("w1", PARAM, out=3000)
    b.add("w2", PARAM, out=1000)
    b.add("x", INPUT, out=10)
    b.add("g1", inputs={"w1": 3000, "x": 10}, out=3000)
    b.add("g2", inputs={"w2": 1000, "g1": 3000}, out=1000)
    b.add("u1", UPDATE, inputs={"w1": 3000, "g1": 3000}, updates=("w1",))
    b.add("u2", UPDATE, inputs={"w2": 1000, "g2": 1000}, updates=("w2",))
    return replicated(b, n)


def test_released_gradients_are_reduced_together_after_their_segment() -> None:
    """Without `release` g1's allreduce overlaps g2; released with g2 (one segment), both go as one, after it."""
    n, lat = 2, 0.1
    g, strategy = two_gradient_step(n)
    per = {f"r{k}/{x}": t for k in range(n) for x, t in (("g1", 1.0), ("g2", 1.0), ("u1", 0.5), ("u2", 0.5))}
    times, cl = seconds(g, n, per), mesh(n, bw=1000, lat=lat)
    ring = [2 * (n - 1) / n * b / 1000 + 2 * (n - 1) * lat for b in (3000, 1000, 4000)]
    apart = simulate(g, strategy, cl, times)
    assert [(c.start, c.end) for c in apart.collectives] == [(1.0, pytest.approx(1 + ring[0])),
                                                             (pytest.approx(1 + ring[0]),
                                                              pytest.approx(1 + ring[0] + ring[1]))]
    release = {f"r{k}/g1": f"r{k}/g2" for k in range(n)}
    together = simulate(g, strategy, cl, times, release=release)
    (c,) = together.collectives
    assert sorted(g.ops[a].name for a in c.ops) == ["allreduce/g1->u1", "allreduce/g2->u2"]
    assert (c.start, c.end, c.nbytes) == (2.0, pytest.approx(2 + ring[2]), 4000)  # one latency for both
    assert together.iteration_s == pytest.approx(2 + ring[2] + 1.0)
    # A local reader does not wait for the release: g2 reads g1 at its end.
    assert at(together, g, "r0/g2") == (1.0, 2.0)


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_of_an_allreduce_pays_for_what_it_sends_and_receives(n: int) -> None:
    """With `comm_s_per_byte` every device of an allreduce is busy for what it sends and receives (2(n-1)/n of
    the bytes each way) from the moment the allreduce is requested: g1's and g2's (4000 bytes in all) delay the
    updates past the ring's end."""
    g, strategy = two_gradient_step(n)
    per = {f"r{k}/{x}": t for k in range(n) for x, t in (("g1", 1.0), ("g2", 1.0), ("u1", 0.5), ("u2", 0.5))}
    cl, c = mesh(n, bw=1000, lat=0.1), 1e-3
    copying = every_device(cl, comm_s_per_byte=c)
    charged = 2.0 + 2 * 2 * (n - 1) / n * 4000 * c + 1.0  # g1 and g2, the copies, then u1 and u2
    assert simulate(g, strategy, cl, seconds(g, n, per)).iteration_s < charged - 5  # the ring alone
    assert simulate(g, strategy, copying, seconds(g, n, per)).iteration_s == pytest.approx(charged)


def test_release_sends_a_transfer_at_the_end_of_its_segment() -> None:
    b = Builder()
    b.add("a")
    b.add("b", inputs={"a": 100})
    b.add("c", inputs={"a": 100})
    g = b.graph()
    s = plan(g, 2, {"a": 0, "b": 0, "c": 1})
    tl = simulate(g, s, mesh(2, bw=100), seconds(g, 2, {"a": 1, "b": 2, "c": 1}), release={"a": "b"})
    assert at(tl, g, "c") == (4.0, 5.0)  # a's output leaves with b's end (3), then 1 s on the link
    with pytest.raises(FasttError, match="not placed on its device"):
        simulate(g, s, mesh(2, bw=100), seconds(g, 2, {}), release={"a": "c"})


@pytest.mark.parametrize("n", [2, 4])
def test_gather_allreduce_costs_what_the_cluster_fitted(n: int) -> None:
    g, strategy = two_gradient_step(n)
    cl = mesh(n, bw=1000, lat=0.1)
    cl = Cluster(cl.name, cl.devices, cl.links, cl.routes, gather=(0.3, 1e-3, 0.25))
    per = {f"r{k}/{x}": 1.0 for k in range(n) for x in ("g1", "g2")}
    release = {f"r{k}/g1": f"r{k}/g2" for k in range(n)}
    tl = simulate(g, strategy, cl, seconds(g, n, per), release=release)
    (c,) = tl.collectives
    assert c.end - c.start == pytest.approx((n - 1) * 0.3 + 2 * (n - 1) / n * 4000 * 1e-3 + 2 * 0.25)
    assert len(c.links) == n * (n - 1)  # every device receives from every other
    halves = replace(cl, devices=tuple(replace(d, node=2 * k // n) for k, d in enumerate(cl.devices)))
    tl = simulate(g, strategy, halves, seconds(g, n, per), release=release)
    assert inter_node_bytes(tl, halves) == 2 * (n // 2) ** 2 * 2 / n * 4000  # a shard each way per pair


def test_a_reader_of_an_allreduce_takes_part_in_it() -> None:
    """Replica 1's update runs on device 2, which holds no gradient: it joins the allreduce (as the distributed
    runtime's collective) and receives no transfer of the mean."""
    g, strategy = data_parallel_step(2, grad_bytes=4000)
    placement = dict(strategy.placement) | {"r1/update": 2}
    order = [[x for x in o if placement[x] == d] for d, o in enumerate([*strategy.order, ["r1/update"]])]
    s = Strategy("test", 3, placement, tuple(map(tuple, order)), {"w": (0, 2)}, replicas=2)
    tl = simulate(g, s, mesh(3, bw=1000, lat=0.1), seconds(g, 3, {"r0/grad": 1.0, "r1/grad": 1.0}))
    (c,) = tl.collectives
    assert c.group == (0, 1, 2) and all(g.ops[t.op].kind != ALLREDUCE for t in tl.transfers)


def test_resident_read_by_a_non_holder_comes_from_the_fastest_holder() -> None:
    b = Builder()
    b.add("w", PARAM, out=500)
    b.add("a", inputs={"w": 500})
    g = b.graph()
    cluster = mesh(3, bw=100)
    fast = next(k for k, lk in enumerate(cluster.links) if lk.name == "2->1")
    links = tuple(Link(lk.name, 500 if k == fast else lk.bandwidth, 0.0) for k, lk in enumerate(cluster.links))
    cluster = Cluster("c", cluster.devices, links, cluster.routes)
    tl = simulate(g, plan(g, 3, {"a": 1}, holders={"w": (0, 2)}), cluster, seconds(g, 3, {"a": 1}))
    (t,) = tl.transfers
    assert (t.src, t.dst, t.start, t.end) == (2, 1, 0.0, 1.0) and at(tl, g, "a") == (1, 2)
    assert tl.resident_bytes == (500, 0, 500)
    assert tl.peak_memory_bytes == (500, 500, 500)  # the received copy, freed when a is done
    assert tl.memory_trace[1][1][-1] == 0


def small_memory_case(mem: int) -> tuple[OpGraph, Timeline]:
    b = Builder()
    b.add("w", PARAM, out=100)
    b.add("x", INPUT, out=10)
    b.add("a", inputs={"x": 10, "w": 100}, out=20)
    b.add("b", inputs={"a": 20}, out=30)
    b.add("c", inputs={"b": 30}, out=5)
    g = b.graph()
    tl = simulate(g, plan(g, 1, {"x": 0, "a": 0, "b": 0, "c": 0}), mesh(1, mem=mem),
                  seconds(g, 1, {"a": 1, "b": 1, "c": 1}))
    return g, tl


def test_exact_peak_memory() -> None:
    _, tl = small_memory_case(mem=1000)
    # t=0: w 100 + x 10 + a 20 = 130; t=1: b allocates 30 → 160 (the batch x lives to the step's end, as its
    # caller holds it); t=2: a (20) is freed before c allocates 5: c starts after b, a's last reader, ended.
    assert tl.peak_memory_bytes == (160,) and tl.fits and tl.oom == ()
    times, level = tl.memory_trace[0]
    assert list(level) == [100, 110, 130, 160, 140, 145, 135, 105, 100]
    assert list(times) == [0, 0, 0, 1, 2, 2, 3, 3, 3]


def test_each_part_of_a_result_is_freed_after_its_own_last_reader() -> None:
    """A batch norm's output (40 bytes) and its saved statistics (20): the output dies with its last reader y,
    the statistics live on to z (its backward)."""
    b = Builder()
    b.add("w", PARAM, out=100)
    b.add("x", INPUT, out=10)
    b.add("bn", inputs={"x": 10, "w": 100}, out_parts=(40, 20))
    b.add("y", inputs={"bn": 40}, out=30, keeps={"bn": (0,)})
    b.add("z", inputs={"y": 30, "bn": 20}, out=5, keeps={"bn": (1,)})
    g = b.graph()
    s = plan(g, 1, {"x": 0, "bn": 0, "y": 0, "z": 0})
    tl = simulate(g, s, mesh(1), seconds(g, 1, {"bn": 1, "y": 1, "z": 1}))
    # t=0: w 100 + x 10 + bn 60 = 170; t=1: y 30 → 200; t=2: bn's output (40) goes before z allocates 5.
    times, level = tl.memory_trace[0]
    assert list(level[:7]) == [100, 110, 150, 170, 200, 160, 165] and list(times[:7]) == [0, 0, 0, 0, 1, 2, 2]
    assert tl.peak_memory_bytes == (200,) and level[-1] == 100
    whole = OpGraph(ops=tuple(replace(op, out_parts=(), in_parts=()) for op in g.ops))
    assert simulate(whole, s, mesh(1), seconds(g, 1, {"bn": 1, "y": 1, "z": 1})).peak_memory_bytes == (205,)
    assert memory_of(g) == [0, 0, 60, 30, 0]  # at y, the peak of a run in order: bn's two parts and y


def test_over_the_limit_is_reported_with_device_and_bytes() -> None:
    _, tl = small_memory_case(mem=150)
    assert not tl.fits and tl.oom == ("device 0 (d0) needs 160 bytes, has 150 bytes",)


def test_oom_message_uses_readable_units() -> None:
    b = Builder()
    b.add("w", PARAM, out=17_300_000_000)
    g = b.graph()
    tl = simulate(g, plan(g, 1, {}), mesh(1, mem=16_000_000_000), seconds(g, 1, {}))
    assert tl.oom == ("device 0 (d0) needs 17.3 GB, has 16.0 GB",)


def test_strategy_for_another_cluster_is_refused() -> None:
    b = Builder()
    b.add("a")
    g = b.graph()
    with pytest.raises(FasttError, match="2 devices but cluster"):
        simulate(g, plan(g, 2, {"a": 0}), mesh(3), seconds(g, 3, {}))


# ---------------------------------------------------------------- random DAGs


def random_case(seed: int) -> tuple[OpGraph, Strategy, Cluster, np.ndarray]:
    """A random step: params with random holders, inputs, compute ops, and allreduce+update groups."""
    rng = np.random.default_rng(seed)
    n_dev = int(rng.integers(1, 9))
    b = Builder()
    placement: dict[str, int] = {}
    holders: dict[str, tuple[int, ...]] = {}
    readable: list[str] = []
    for k in range(int(rng.integers(0, 4))):
        holders[b.add(f"p{k}", PARAM, out=int(rng.integers(1, 1000)))] = tuple(
            sorted(set(rng.integers(0, n_dev, size=int(rng.integers(1, 4))).tolist())))
        readable.append(f"p{k}")
    for k in range(int(rng.integers(1, 3))):
        placement[b.add(f"x{k}", INPUT, out=int(rng.integers(0, 1000)))] = int(rng.integers(n_dev))
        readable.append(f"x{k}")

    def compute(name: str, dev: int) -> None:
        picks = rng.choice(len(readable), size=min(len(readable), int(rng.integers(1, 4))), replace=False)
        # Some ops make several storages; a reader keeps some of them alive.
        keeps = {readable[p]: tuple(sorted(set(rng.integers(0, 3, size=int(rng.integers(1, 3))).tolist())))
                 for p in picks if b.ops[b.index[readable[p]]].out_parts and rng.random() < 0.7}
        b.add(name, inputs={readable[p]: int(rng.integers(0, 2000)) for p in picks},
              out=int(rng.integers(0, 1000)) * int(rng.random() < 0.9), keeps=keeps,
              out_parts=tuple(int(x) for x in rng.integers(0, 500, size=3)) if rng.random() < 0.3 else ())
        placement[name] = dev
        readable.append(name)

    for k in range(int(rng.integers(1, 30))):
        if rng.random() < 0.1:  # a replicated parameter: gradients per holder, allreduce, one update per holder
            hs = tuple(sorted(set(rng.integers(0, n_dev, size=int(rng.integers(1, 5))).tolist())))
            w = b.add(f"w{k}", PARAM, out=int(rng.integers(1, 1000)))
            holders[w] = hs
            for h in hs:
                compute(f"g{k}_{h}", h)
            nbytes = int(rng.integers(1, 4000))
            red = b.add(f"ar{k}", ALLREDUCE, inputs={f"g{k}_{h}": nbytes for h in hs}, out=nbytes)
            for h in hs:
                placement[b.add(f"u{k}_{h}", UPDATE, inputs={red: nbytes, w: 8}, updates=(w,))] = h
            readable.append(red)
        else:
            compute(f"c{k}", int(rng.integers(n_dev)))
    g = b.graph()
    return g, plan(g, n_dev, placement, holders), random_cluster(rng, n_dev), rng.uniform(0, 1, (len(g), n_dev)) * (
        rng.random((len(g), n_dev)) < 0.9)


def random_cluster(rng: np.random.Generator, n_dev: int) -> Cluster:
    """Routes of 1-2 links drawn from a small pool, so transfers contend."""
    n_links = int(rng.integers(1, 2 * n_dev + 1))
    links = tuple(Link(f"l{k}", float(rng.uniform(100, 5000)), float(rng.uniform(0, 0.2))) for k in range(n_links))
    routes = {(s, d): tuple(sorted(set(rng.integers(0, n_links, size=int(rng.integers(1, 3))).tolist())))
              for s in range(n_dev) for d in range(n_dev) if s != d}
    devices = tuple(Device(f"d{i}", "test", 1 << 40, 1e12, 1e11) for i in range(n_dev))
    return Cluster("random", devices, links, routes)


def check_dependencies(g: OpGraph, s: Strategy, cl: Cluster, tl: Timeline) -> None:
    """Every op starts only once each input is on its device (locally, by transfer, or by allreduce)."""
    arrivals = {(t.op, t.dst): t for t in tl.transfers}
    assert len(arrivals) == len(tl.transfers)  # one transfer per (op, receiving device)
    groups = {a: c.group for c in tl.collectives for a in c.ops}
    holders = {g.index[k]: v for k, v in s.holders.items()}
    for t in tl.transfers:
        src_has = holders.get(t.op) or groups.get(t.op) or (int(tl.device[t.op]),)
        assert t.src in src_has and t.start >= tl.end[t.op]
        assert t.end - t.start == pytest.approx(cl.transfer_time(t.src, t.dst, t.nbytes))
    for i, op in enumerate(g.ops):
        d = int(tl.device[i])
        if op.kind == ALLREDUCE:
            readers = {int(tl.device[r]) for r, o in enumerate(g.ops) if i in o.inputs}
            assert groups[i] == tuple(sorted({int(tl.device[j]) for j in op.inputs} | readers))
            assert all(tl.start[i] >= tl.end[j] for j in op.inputs)
            continue
        for j in op.inputs:
            there = holders.get(j) or groups.get(j) or (int(tl.device[j]),)
            ready = tl.end[j] if d in there else arrivals[j, d].end
            assert tl.start[i] >= ready, (op.name, g.ops[j].name)


def check_exclusive(intervals: dict[int, list[tuple[float, float]]]) -> None:
    for spans in intervals.values():
        spans.sort()
        for (_, e0), (s1, _) in pairwise(spans):
            assert s1 >= e0


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_dags_respect_every_invariant(seed: int) -> None:
    g, s, cl, times = random_case(seed)
    tl = simulate(g, s, cl, times)
    placed = [i for i in range(len(g)) if tl.device[i] >= 0]
    # Every op runs exactly once, for its time, on its device.
    events = [e for e in chrome_trace(tl, g)["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert sorted(g.index[e["name"]] for e in events) == placed
    for i in placed:
        assert tl.end[i] - tl.start[i] == pytest.approx(times[i, tl.device[i]]) and tl.start[i] >= 0
    check_dependencies(g, s, cl, tl)
    # A device runs one op at a time, in its order; a link carries one thing at a time.
    for d, names in enumerate(s.order):
        idx = [g.index[n] for n in names]
        assert all(tl.device[i] == d for i in idx)
        assert all(tl.start[b] >= tl.end[a] for a, b in pairwise(idx))
    per_link: dict[int, list[tuple[float, float]]] = {}
    for rec in (*tl.transfers, *tl.collectives):
        for lk in rec.links:
            per_link.setdefault(lk, []).append((rec.start, rec.end))
    check_exclusive(per_link)
    # Memory never drops below the resident set and returns to it exactly.
    for d, (_, level) in enumerate(tl.memory_trace):
        base = sum(g.ops[r].out_bytes for r in g.residents if d in s.holders[g.ops[r].name])
        assert tl.resident_bytes[d] == base and level.min() >= base >= 0
        assert level[-1] == base and tl.peak_memory_bytes[d] == level.max()
    # A result's parts, each freed after its own last reader, never hold more than the result freed whole.
    whole = OpGraph(ops=tuple(replace(op, out_parts=(), in_parts=()) for op in g.ops))
    assert all(p <= q for p, q in zip(tl.peak_memory_bytes, simulate(whole, s, cl, times).peak_memory_bytes))
    assert tl.iteration_s == max(tl.end.max(initial=0.0), 0.0)
    assert all(tl.iteration_s >= e for e in tl.end)


# ---------------------------------------------------------------- exports


def test_chrome_trace_and_gantt(tmp_path: Path) -> None:
    g, strategy = data_parallel_step(2, grad_bytes=4000)
    tl = simulate(g, strategy, mesh(2, bw=1000, lat=0.1), seconds(g, 2, {"r0/grad": 1.0, "r1/grad": 1.5}))
    trace = chrome_trace(tl, g)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[0, 1] == "d1" and names[1, 0] == "0->1"
    ar = [e for e in trace["traceEvents"] if e.get("cat") == ALLREDUCE]
    assert len(ar) == 2 and ar[0]["ts"] == pytest.approx(1.5e6)  # on both ring links, in µs
    write_trace(tl, g, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(trace))
    write_gantt(tl, g, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_gantt_of_ten_thousand_ops(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from simulate_speed import random_case as big_case

    g, strategy, cluster, times = big_case(10_000, 4)
    tl = simulate(g, strategy, cluster, times)
    write_gantt(tl, g, tmp_path / "big.png")
    assert (tmp_path / "big.png").stat().st_size > 1000


def test_a_stalled_simulation_names_the_waiting_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Builder()
    b.add("a")
    b.add("b", inputs={"a": 4})
    b.add("c")
    b.add("d", inputs={"c": 4})
    g = b.graph()
    s = plan(g, 2, {"a": 0, "b": 1, "c": 1, "d": 0}, order=[["d", "a"], ["b", "c"]])
    # the simulator checks for such a cycle only when it stalls, and names it then
    with pytest.raises(FasttError, match="contradict the dependencies, so the devices would wait on each other"):
        simulate(g, s, mesh(2), seconds(g, 2, {}))
    monkeypatch.setattr(Strategy, "validate", lambda self, g, acyclic=True: None)  # it would refuse the order
    with pytest.raises(FasttError, match="stalled: device 0 waits to run 'd'; device 1 waits to run 'b'"):
        simulate(g, s, mesh(2), seconds(g, 2, {}))
