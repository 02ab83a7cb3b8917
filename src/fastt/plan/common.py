"""What every planner shares: the costs it plans with, static memory per op, and building the Strategy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..cluster import Cluster
from ..cost import MeasuredCosts, op_times
from ..graph import ALLREDUCE, RESIDENT, UPDATE, OpGraph, duplicate_updates, kept_parts, parts
from ..strategy import Strategy

_PROBE = float(2**30)  # bytes of the transfer the per-byte slope is read off


@dataclass(frozen=True)
class PlanCosts:
    """Op times per device (`times[i, d]`), and for each edge the largest transfer time over device pairs."""

    times: np.ndarray
    cluster: Cluster

    def transfer(self, src: int, dst: int, nbytes: float) -> float:
        return self.cluster.transfer_time(src, dst, nbytes)

    @cached_property
    def latency(self) -> np.ndarray:
        """latency[s, d]: fixed seconds of a transfer from s to d (0 on the diagonal)."""
        n = len(self.cluster.devices)
        return np.array([[self.transfer(s, d, 0.0) for d in range(n)] for s in range(n)])

    @cached_property
    def inv_bandwidth(self) -> np.ndarray:
        """inv_bandwidth[s, d]: seconds per byte from s to d, so transfer = latency + bytes · inv_bandwidth.

        Read off a transfer of _PROBE bytes: the latency is some 10^5 times one byte's time, so the difference
        of a one-byte transfer and an empty one would lose about five of the slope's digits."""
        n = len(self.cluster.devices)
        lat = self.latency
        return np.array([[(self.transfer(s, d, _PROBE) - lat[s, d]) / _PROBE for d in range(n)]
                         for s in range(n)])

    def mean_transfer(self) -> tuple[float, float]:
        """(latency, seconds per byte) of a transfer averaged over ordered pairs of distinct devices."""
        n = len(self.cluster.devices)
        if n < 2:
            return 0.0, 0.0
        return float(self.latency.sum()) / (n * (n - 1)), float(self.inv_bandwidth.sum()) / (n * (n - 1))

    def max_transfer(self, nbytes: float) -> float:
        """The slowest transfer of nbytes between two distinct devices (0 on one device)."""
        if len(self.cluster.devices) < 2:
            return 0.0
        t = self.latency + nbytes * self.inv_bandwidth
        np.fill_diagonal(t, 0.0)
        return float(t.max())


def plan_costs(g: OpGraph, cluster: Cluster, measured: MeasuredCosts | None = None) -> PlanCosts:
    return PlanCosts(times=op_times(g, cluster, measured), cluster=cluster)


def memory_of(g: OpGraph) -> list[int]:
    """Bytes each op is charged on its device when planning: those of its results (each part, `Op.out_parts`,
    on its own) that are live at the peak of a run in graph order. Residents (params, state, buffers) are
    charged by the planners where they live.

    Charging every output for the whole step (Baechi's static model) counts each backward temporary as if it
    lived forever and overstates a training step's memory several times over; charging the outputs live at the
    single-device peak reproduces that peak when the plan is one device, and is an estimate otherwise (the
    simulator measures the real peak of every plan).
    """
    n = len(g.ops)
    sizes = [parts(op) for op in g.ops]
    last = [[i] * len(x) for i, x in enumerate(sizes)]  # per op and part, its last reader
    for i, op in enumerate(g.ops):
        for j in dict.fromkeys(op.inputs):
            for p in kept_parts(g, i, j):
                last[j][p] = max(last[j][p], i)
        if op.kind == UPDATE:  # its results, the new parameter and state, are the step's
            last[i] = [n - 1]
        for p in op.returned:  # the loss
            last[i][p] = n - 1
    frees: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for i in range(n):
        for p, at in enumerate(last[i]):
            frees[at].append((i, p))
    live, peak, at = 0, -1, 0
    for i, op in enumerate(g.ops):
        if op.kind not in RESIDENT:
            live += op.out_bytes
        if live > peak:
            peak, at = live, i
        live -= sum(sizes[j][p] for j, p in frees[i] if g.ops[j].kind not in RESIDENT)
    return [sum(b for b, end in zip(sizes[i], last[i]) if i <= at <= end) if op.kind not in RESIDENT else 0
            for i, op in enumerate(g.ops)]


def strategy_from(g: OpGraph, planner: str, n_devices: int, device_of: Sequence[int],
                  start: Sequence[float] | None = None, replicas: int = 1,
                  holders: dict[str, tuple[int, ...]] | None = None) -> Strategy:
    """A Strategy running each placed op of `g` on `device_of[i]`, each device's ops sorted by `start[i]`
    (by default the graph's topological order).

    By default a resident is held on the devices of the ops that update it (so each holder applies the
    update); one nobody updates is held where it is read. A device applies each update once, however many
    replicas it runs (`duplicate_updates` are left out).
    """
    order: list[list[int]] = [[] for _ in range(n_devices)]
    placement: dict[str, int] = {}
    readers: dict[int, set[int]] = {}
    writers: dict[int, set[int]] = {}
    skip = duplicate_updates(g, device_of)
    for i, op in enumerate(g.ops):
        if op.kind in RESIDENT or op.kind == ALLREDUCE or i in skip:
            continue
        d = int(device_of[i])
        placement[op.name] = d
        order[d].append(i)
        for j in op.inputs:
            if g.ops[j].kind in RESIDENT:
                readers.setdefault(j, set()).add(d)
        for j in op.updates:
            writers.setdefault(j, set()).add(d)
    if start is not None:
        for o in order:
            o.sort(key=lambda i: (start[i], i))
    if holders is None:
        holders = {g.ops[j].name: tuple(sorted(writers.get(j) or readers.get(j) or {0})) for j in g.residents}
    return Strategy(planner=planner, n_devices=n_devices, placement=placement,
                    order=tuple(tuple(g.ops[i].name for i in o) for o in order), holders=holders,
                    replicas=replicas)
