"""Data per rank (`runtime.shards`), checked without processes: on random plans every input a rank reads is
held by it, the rows that travel rebuild each replica's share of the whole batch exactly, and each replica's
share is checked by a rank that holds all of it; data parallelism moves nothing, the one-device plan moves every
other shard to rank 0."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runtime import one_thread_per_device, pair, random_topological_rank  # noqa: F401 - fixture

import fastt
from fastt.cluster import Cluster, Link, cluster
from fastt.cost import MeasuredCosts
from fastt.errors import FasttError
from fastt.graph import data_parallel_graph
from fastt.plan.common import strategy_from
from fastt.runtime.distributed import reads
from fastt.runtime.programs import place
from fastt.runtime.reference import batch_like
from fastt.runtime.shards import Feed, input_roots, plan_feed, shard_of


@functools.cache
def captured(name: str) -> tuple[fastt.OpGraph, tuple[torch.Tensor, ...]]:
    _, w = pair(name)
    return fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs), w.example_inputs


def feed_of(g: fastt.OpGraph, s: fastt.Strategy, n_dev: int) -> tuple[Feed, object, object]:
    placed = place(g, s, cluster(f"cpu:{n_dev}"), MeasuredCosts("cpu", 1))
    low, programs = placed.lowered, placed.programs
    read = [[(seg.replica, name) for seg in segs for name in reads(low, programs, seg)] for segs in programs.devices]
    return plan_feed(low, programs, read), low, programs


def delivered(feed: Feed, whole: list[torch.Tensor]) -> list[list[list[torch.Tensor | None]]]:
    """Each rank's shares after the exchange, the messages simulated by slicing the senders' shards."""
    shards = [shard_of(whole, r, feed.world) for r in range(feed.world)]
    out = []
    for d in range(feed.world):
        assert feed.receives(d) == {src: feed.sends(src)[d] for src in range(feed.world) if d in feed.sends(src)}
        got = {p: feed.rows(p.src, shards[p.src][p.input], p.lo, p.hi) for ps in feed.receives(d).values() for p in ps}
        out.append(feed.shares(d, shards[d], got))
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), replicas=st.sampled_from([1, 2, 4]), n_dev=st.sampled_from([2, 4]),
       name=st.sampled_from(["mlp", "transformer"]))
def test_every_rank_holds_the_rows_it_reads(seed: int, replicas: int, n_dev: int, name: str) -> None:
    g, inputs = captured(name)
    dg = data_parallel_graph(g, replicas)
    rng = random.Random(seed)
    s = strategy_from(dg, "random", n_dev, [rng.randrange(n_dev) for _ in dg.ops],
                      start=random_topological_rank(dg, rng), replicas=replicas)
    feed, low, programs = feed_of(g, s, n_dev)
    roots = input_roots(low, programs)
    for d, segs in enumerate(programs.devices):
        for seg in segs:
            for name_ in reads(low, programs, seg):
                assert all((seg.replica, i) in feed.held[d] for i in roots.get(name_, ())), (d, name_)
    whole = list(batch_like(inputs, seed % 7))
    b = whole[0].shape[0] // replicas
    for d, shares in enumerate(delivered(feed, whole)):
        for k, share in enumerate(shares):
            for i, x in enumerate(share):
                assert (x is not None) == ((k, i) in feed.held[d])
                if x is not None:
                    assert torch.equal(x, whole[i][k * b:(k + 1) * b])
    for k, c in enumerate(feed.checker):
        assert all((k, i) in feed.held[c] for i in range(len(inputs)))


def test_data_parallelism_moves_no_rows_and_one_device_gathers_them() -> None:
    g, inputs = captured("mlp")
    dp, _, _ = feed_of(g, fastt.plan(g, "cpu:2", "dp"), 2)
    assert dp.pieces == () and dp.checker == (0, 1) and dp.shard == dp.share == 128
    single, _, _ = feed_of(g, fastt.plan(g, "cpu:2", "single"), 2)
    assert single.checker == (0,) and {(p.src, p.dst, p.lo, p.hi) for p in single.pieces} == {(1, 0, 128, 256)}
    assert len(single.pieces) == len(inputs)


def test_a_batch_that_does_not_split_into_the_ranks_shards_is_refused() -> None:
    g, _ = captured("mlp")  # 256 samples on 3 ranks
    with pytest.raises(FasttError, match="a batch of 256 does not split into 3 ranks' shards"):
        feed_of(g, fastt.plan(g, "cpu:3", "single"), 3)


def test_the_feed_is_simulated_on_the_ranks_shared_link() -> None:
    g, inputs = captured("mlp")
    cpu = cluster("cpu:2")
    link = Link("gloo-intra:n0", bandwidth=1e8, latency=50e-6)  # one link the ranks share, as on a node
    ranks = Cluster("gloo:2", cpu.devices, (link,), {(0, 1): (0,), (1, 0): (0,)})
    dp, _, _ = feed_of(g, fastt.plan(g, "cpu:2", "dp"), 2)
    assert dp.seconds(ranks) == 0.0
    single, _, _ = feed_of(g, fastt.plan(g, "cpu:2", "single"), 2)
    rows = sum(x[128:].nbytes for x in inputs)  # rank 1's shard, to rank 0 in one message
    assert single.seconds(ranks) == pytest.approx(link.latency + rows / link.bandwidth)
