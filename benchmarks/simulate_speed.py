"""Benchmark: seconds to simulate a random 50,000-op DAG on 8 devices with a random placement.

Run: `.venv/bin/python benchmarks/simulate_speed.py [--ops N] [--devices D]`; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from fastt.cluster import Cluster, Device, Link
from fastt.graph import COMPUTE, INPUT, PARAM, Op, OpGraph
from fastt.simulate import simulate
from fastt.strategy import Strategy


def random_case(n_ops: int, n_dev: int, seed: int = 0) -> tuple[OpGraph, Strategy, Cluster, np.ndarray]:
    """A random DAG (about 2 inputs per op, mostly recent producers), a fully connected cluster, a random plan."""
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    n_params = n_ops // 20
    for i in range(n_ops):
        if i < n_params:
            ops.append(Op(name=f"p{i}", kind=PARAM, target="param", out_bytes=4096))
        elif i < n_params + 8:
            ops.append(Op(name=f"x{i}", kind=INPUT, target="input", out_bytes=1 << 16))
        else:
            k = int(rng.integers(1, 4))
            lo = max(n_params, i - 200)  # local structure, as in real step graphs
            ins = sorted({int(j) for j in rng.integers(lo, i, size=k)})
            if rng.random() < 0.3:
                ins.append(int(rng.integers(0, n_params)))
            ops.append(Op(name=f"op{i}", kind=COMPUTE, target="f", inputs=tuple(ins),
                          in_bytes=tuple(int(rng.integers(1, 1 << 20)) for _ in ins), out_bytes=1 << 18))
    g = OpGraph(ops=tuple(ops))
    devices = tuple(Device(f"gpu{d}", "V100", 16 << 30, 14e12, 9e11) for d in range(n_dev))
    links = tuple(Link(f"l{s}-{d}", 25e9, 5e-6) for s in range(n_dev) for d in range(n_dev) if s != d)
    routes, k = {}, 0
    for s in range(n_dev):
        for d in range(n_dev):
            if s != d:
                routes[s, d] = (k,)
                k += 1
    cluster = Cluster("bench", devices, links, routes)
    place = rng.integers(0, n_dev, size=n_ops)
    placement = {op.name: int(place[i]) for i, op in enumerate(ops) if i >= n_params}
    order = tuple(tuple(op.name for i, op in enumerate(ops) if i >= n_params and place[i] == d) for d in range(n_dev))
    holders = {ops[i].name: (int(place[i]),) for i in range(n_params)}
    strategy = Strategy("random", n_dev, placement, order, holders)
    times = rng.uniform(1e-5, 1e-3, size=(n_ops, n_dev))
    return g, strategy, cluster, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=50_000)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
    g, strategy, cluster, times = random_case(args.ops, args.devices)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        simulate(g, strategy, cluster, times)
        runs.append(time.perf_counter() - t0)
    print(json.dumps({"ops": args.ops, "devices": args.devices, "seconds": round(statistics.median(runs), 3)}))


if __name__ == "__main__":
    main()
