"""Benchmark: capture + group + roofline cost of a zoo model at paper size (time and peak resident memory).

Usage: python benchmarks/capture_cost.py [--model bert-large] [--size paper] [--out out/capture_cost.json]
Target (issue 2): bert-large at paper size in under 60 s and under 4 GiB resident.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import fastt
from fastt import zoo
from fastt.cost import op_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-large")
    ap.add_argument("--size", default="paper")
    ap.add_argument("--cluster", default="8xV100")
    ap.add_argument("--out", default="out/capture_cost.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    w = zoo.get(a.model, a.size)
    t1 = time.perf_counter()
    g = fastt.capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=a.model)
    t2 = time.perf_counter()
    times = op_times(g, fastt.cluster(a.cluster))
    t3 = time.perf_counter()
    result = {"model": a.model, "size": a.size, "batch": g.batch, "fx_nodes": g.fx_nodes, "ops": len(g.ops),
              "build_s": t1 - t0, "capture_and_group_s": t2 - t1, "roofline_s": t3 - t2, "total_s": t3 - t0,
              "single_device_roofline_s": float(times[:, 0].sum()),
              "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
