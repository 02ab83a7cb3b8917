"""Transfers and collectives on a cluster's links, as the simulator times them.

A transfer holds every link of its route from its start to its end, and a link carries one thing at a time,
granted in request order (FIFO): a request starts when it is made and every link of its route is free. An
allreduce holds the links of its group the same way, for the time `Cluster.allreduce_cost` gives it. `Links`
is that occupancy for one simulated step, with the records it makes (`Transfer`, `Collective`), which the
Timeline reports.
"""

from __future__ import annotations

from typing import NamedTuple

from fastt.cluster import Cluster
from fastt.errors import FasttError
from fastt.graph import Op
from fastt.shard import ALL_GATHER, REDUCE_SCATTER


class Transfer(NamedTuple):
    """Op `op`'s output moved from device `src` to `dst` over `links`, between `start` and `end` seconds."""

    op: int
    src: int
    dst: int
    nbytes: int
    start: float
    end: float
    links: tuple[int, ...]


class Collective(NamedTuple):
    """Allreduce ops `ops` (fused: their `nbytes` in one) over `group`, occupying `links` from `start` to
    `end`."""

    ops: tuple[int, ...]
    group: tuple[int, ...]
    nbytes: int
    start: float
    end: float
    links: tuple[int, ...]


class Routes(NamedTuple):
    """Per ordered device pair (`routes[s][d]`): the route's links, its total latency and its bottleneck
    bandwidth (no links, 0.0 and 1.0 on the diagonal)."""

    links: list[list[tuple[int, ...]]]
    latency: list[list[float]]
    bandwidth: list[list[float]]


def route_tables(cluster: Cluster) -> Routes:
    """The cluster's routes as the lists the event loop reads; a missing route is refused."""
    nd = len(cluster.devices)
    routes: list[list[tuple[int, ...]]] = [[()] * nd for _ in range(nd)]
    lat = [[0.0] * nd for _ in range(nd)]
    bw = [[1.0] * nd for _ in range(nd)]
    for s in range(nd):
        for d in range(nd):
            if s == d:
                continue
            if (s, d) not in cluster.routes or not cluster.routes[s, d]:
                raise FasttError(f"cluster {cluster.name} has no route from device {s} to device {d}")
            links = [cluster.links[k] for k in cluster.routes[s, d]]
            routes[s][d] = tuple(cluster.routes[s, d])
            lat[s][d] = sum(lk.latency for lk in links)  # same sum as Cluster.transfer_time, bit for bit
            bw[s][d] = min(lk.bandwidth for lk in links)
    return Routes(routes, lat, bw)


def half(op: Op) -> bool:
    """Whether a collective op is half a ring allreduce (a reduce-scatter or an all-gather)."""
    return op.target in (REDUCE_SCATTER, ALL_GATHER)


def allreduce_bytes(op: Op) -> int:
    """Bytes an allreduce aggregates: its output, or the largest input if the output is written in place. A
    reduce-scatter or an all-gather (`fastt.shard`) is half a ring allreduce: it counts as an allreduce of
    half the whole tensor's bytes (and half its latency: `Links.collective`)."""
    if op.target == REDUCE_SCATTER:
        return max(op.in_bytes, default=0) // 2
    if op.target == ALL_GATHER:
        return op.out_bytes // 2
    return max(op.out_bytes, *op.in_bytes, 0)


class Links:
    """When each link is next free, and the transfers and collectives granted so far, in request order.

    `costs[group]` is (links, seconds, seconds per byte, seconds per tensor) of an allreduce over `group`, as
    `Cluster.allreduce_cost` gives it.
    """

    def __init__(self, routes: Routes, costs: dict[tuple[int, ...], tuple]) -> None:
        self.routes, self.costs = routes, costs
        self.free = [0.0] * (1 + max((lk for r in routes.links for rt in r for lk in rt), default=0))
        self.transfers: list[Transfer] = []
        self.collectives: list[Collective] = []

    def transfer(self, op: int, src: int, dst: int, nbytes: int, t: float) -> float:
        """Move `nbytes` of op's output from src to dst, requested at t; returns when it has arrived."""
        route, s, free = self.routes.links[src][dst], t, self.free
        for lk in route:
            s = max(s, free[lk])
        e = s + self.routes.latency[src][dst] + nbytes / self.routes.bandwidth[src][dst]
        for lk in route:
            free[lk] = e
        self.transfers.append(Transfer(op, src, dst, nbytes, s, e, route))
        return e

    def collective(self, ops: list[int], group: tuple[int, ...], nbytes: int,
                   t: float, halves: bool = False) -> tuple[float, float]:
        """Run the allreduces `ops` over `group` as one, `nbytes` in all, from t or once their links are free:
        returns (start, end). `halves`: they are all reduce-scatters or all-gathers, whose ring takes n-1
        steps, not an allreduce's 2(n-1), so half the latency."""
        links, latency, per_byte, per_tensor = self.costs[group]
        s = max([t, *(self.free[lk] for lk in links)])
        e = s + latency / (2 if halves else 1) + nbytes * per_byte + len(ops) * per_tensor
        for lk in links:
            self.free[lk] = e
        self.collectives.append(Collective(tuple(ops), group, nbytes, s, e, links))
        return s, e
