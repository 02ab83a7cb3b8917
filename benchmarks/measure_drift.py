"""How steadily measured op times compare two plans: the ratio of data parallelism's simulated step to one
device's on cpu:2, from op tables measured again and again in one process, both ways in turn: the whole batch's
table and DP's half-batch table one after the other (as `measure_step` did before 2026-12-07), and their runs
taken in turn (`measure_step` now). The planner decides on that ratio; its spread across measurements is how
much the machine's drift during a measurement moves a decision.

Usage:
  .venv/bin/python benchmarks/measure_drift.py --model alexnet --repeats 8    # about a minute
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fastt import zoo
from fastt.cluster import cluster
from fastt.coarsen import capture_graph
from fastt.cost import MeasuredCosts, calibrate_cpu, measure_model, measure_step
from fastt.graph import rebatch
from fastt.plan.named import plan
from fastt.simulate import simulate_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alexnet")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    w = zoo.get(args.model, "test", dropout=False)
    cl = calibrate_cpu(cluster("cpu:2"))
    g = capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=args.model)
    threads, batches = max(1, torch.get_num_threads() // 2), [g.batch, g.batch // 2]
    dp, single = plan(g, cl, "dp"), plan(g, cl, "single")

    def one_after_the_other() -> MeasuredCosts:
        tables = [measure_model(rebatch(g, b, traced=True), w.model, w.optimizer, w.example_inputs,
                                threads=threads, progress=False, concurrent=2) for b in batches]
        return MeasuredCosts("cpu", threads, {k: v for t in tables for k, v in t.seconds.items()})

    def in_turn() -> MeasuredCosts:
        return measure_step(g, w.model, w.optimizer, w.example_inputs, batches, threads, 2)

    ways = {"one table after the other": one_after_the_other, "in turn": in_turn}
    ratios: dict[str, list[float]] = {how: [] for how in ways}
    for _ in range(args.repeats):
        for how, measured in ways.items():
            costs = measured()
            ratios[how].append(simulate_plan(g, dp, cl, costs).iteration_s
                               / simulate_plan(g, single, cl, costs).iteration_s)
    print(f"{args.model} on cpu:2, DP's simulated step over one device's, {args.repeats} measurements each:")
    for how, got in ratios.items():
        print(f"  {how:26} mean {statistics.mean(got):.3f}  stdev {statistics.stdev(got):.3f}  "
              f"from {min(got):.3f} to {max(got):.3f}")


if __name__ == "__main__":
    main()
