"""Strategy tests: JSON round trip, malformed files, and every validation error naming the op or device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastt.errors import FasttError
from fastt.graph import COMPUTE, PARAM, UPDATE, Op, OpGraph
from fastt.strategy import Split, Strategy


def graph() -> OpGraph:
    """w (param) → a → b, c → d, and an update of w reading d."""
    ops = [Op("w", PARAM, "p", out_bytes=8),
           Op("a", COMPUTE, "f", inputs=(0,), in_bytes=(8,)),
           Op("b", COMPUTE, "f", inputs=(1,), in_bytes=(4,)),
           Op("c", COMPUTE, "f"),
           Op("d", COMPUTE, "f", inputs=(3,), in_bytes=(4,)),
           Op("u", UPDATE, "f", inputs=(0, 2, 4), in_bytes=(8, 4, 4), updates=(0,))]
    return OpGraph(ops=tuple(ops))


def good(**changes: object) -> Strategy:
    fields: dict = {"planner": "test", "n_devices": 2, "placement": {"a": 0, "b": 0, "c": 1, "d": 1, "u": 0},
                    "order": (("a", "b", "u"), ("c", "d")), "holders": {"w": (0,)}}
    return Strategy(**(fields | changes))


def test_json_round_trip(tmp_path: Path) -> None:
    s = good(replicas=1, splits=(Split("a", "batch", 2),))
    assert Strategy.from_json(s.to_json()) == s
    s.save(tmp_path / "s.json")
    assert Strategy.load(tmp_path / "s.json") == s
    assert json.loads(s.to_json())["format"] == "fastt.strategy"


def test_valid_strategy_passes() -> None:
    good().validate(graph())


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a strategy file"),
    (json.dumps({"format": "other"}), "not a strategy file"),
    (json.dumps({"format": "fastt.strategy", "version": 99}), "version 99 is not supported"),
])
def test_malformed_files(text: str, message: str) -> None:
    with pytest.raises(FasttError, match=message):
        Strategy.from_json(text)


@pytest.mark.parametrize("field, value, message", [
    ("placement", None, 'no field "placement"'),
    ("n_devices", "2", 'field "n_devices" of strategy should be int, not str'),
    ("n_devices", True, 'field "n_devices" of strategy should be int, not bool'),
    ("placement", {"a": "0"}, "placement must map op names to device indices"),
    ("order", [["a"], "c"], "order must be a list"),
    ("holders", {"w": 0}, "holders must map op names to lists"),
    ("splits", [{"op": "a", "dim": "batch"}], 'splits\\[\\] has no field "parts"'),
])
def test_missing_or_mistyped_fields(field: str, value: object, message: str) -> None:
    obj = json.loads(good().to_json())
    if value is None:
        del obj[field]
    else:
        obj[field] = value
    with pytest.raises(FasttError, match=message):
        Strategy.from_json(json.dumps(obj))


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(FasttError, match="cannot read strategy"):
        Strategy.load(tmp_path / "missing.json")


@pytest.mark.parametrize("changes, message", [
    ({"placement": {"a": 0, "b": 0, "c": 1, "d": 1, "u": 0, "zz": 1}}, "placement names unknown op 'zz'"),
    ({"placement": {"a": 0, "b": 0, "c": 1, "u": 0}}, "op 'd' is missing from placement"),
    ({"placement": {"a": 0, "b": 0, "c": 1, "d": 5, "u": 0}}, "placement of 'd' is device 5, out of range"),
    ({"placement": {"w": 0, "a": 0, "b": 0, "c": 1, "d": 1, "u": 0}}, "placement lists 'w', a param op"),
    ({"holders": {}}, "resident 'w' is missing from holders"),
    ({"holders": {"w": (0, 2)}}, "holder of 'w' is device 2, out of range"),
    ({"holders": {"w": (0,), "a": (0,)}}, "holders lists 'a', a compute op"),
    ({"order": (("a", "b", "u"),)}, "order has 1 device lists but the strategy has 2"),
    ({"order": (("a", "b", "u", "c"), ("d",))}, "order on device 0 lists 'c', which is placed on device 1"),
    ({"order": (("a", "b", "u"), ("c", "d", "c"))}, "order on device 1 lists 'c' twice"),
    ({"order": (("a", "b", "u"), ("c",))}, "'d' is placed on device 1 but missing from order on device 1"),
    ({"order": (("a", "b", "u", "w"), ("c", "d"))}, "order on device 0 lists 'w', which is a param op"),
    ({"order": (("a", "b", "u"), ("d", "c"))}, "order on device 1 runs 'd' before 'c' but 'd' depends on 'c'"),
    ({"replicas": 2}, "strategy is for 2 replica"),
    ({"placement": {"a": 1, "b": 1, "c": 1, "d": 1, "u": 1}, "order": ((), ("a", "b", "c", "d", "u"))},
     "update 'u' on device 1 writes 'w', but device 1 does not hold it"),
    ({"holders": {"w": (0, 1)}}, "device 1 holds 'w' but runs no update of it"),
])
def test_validation_errors_name_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(FasttError, match=message.replace("(", "\\(")):
        good(**changes).validate(graph())


def test_cross_device_cycle_is_named() -> None:
    # a (dev 0) feeds b (dev 1); c (dev 1) feeds d (dev 0). Device 0 runs d first, device 1 runs b first: each
    # device waits for the other.
    ops = [Op("a", COMPUTE, "f"), Op("b", COMPUTE, "f", inputs=(0,), in_bytes=(4,)),
           Op("c", COMPUTE, "f"), Op("d", COMPUTE, "f", inputs=(2,), in_bytes=(4,))]
    s = Strategy("t", 2, {"a": 0, "b": 1, "c": 1, "d": 0}, (("d", "a"), ("b", "c")), {})
    with pytest.raises(FasttError, match="contradict the dependencies") as err:
        s.validate(OpGraph(ops=tuple(ops)))
    msg = str(err.value)
    assert all(f"'{n}'" in msg for n in "abcd")
    assert "-(order on device 0)->" in msg and "-(data)->" in msg


def test_validation_is_linear_on_a_long_chain() -> None:
    n = 100_000
    ops = [Op(f"o{i}", COMPUTE, "f", inputs=(i - 1,) if i else (), in_bytes=(4,) if i else ()) for i in range(n)]
    names = [op.name for op in ops]
    s = Strategy("t", 2, {nm: i % 2 for i, nm in enumerate(names)}, (tuple(names[0::2]), tuple(names[1::2])), {})
    s.validate(OpGraph(ops=tuple(ops)))  # a quadratic check would take minutes here


def test_a_device_runs_each_update_once() -> None:
    """Gradient accumulation runs 2 replicas a device: each device applies each update once (the same mean
    gradient on the same parameter), which saves the other copies' time; replica 0's copy always runs, and a
    plan that leaves out every copy of an update, or replica 0's, is still refused."""
    from fastt import zoo
    from fastt.api import capture, simulate
    from fastt.cluster import cluster
    from fastt.graph import data_parallel_graph, replica_of
    from fastt.plan import graph_for
    from fastt.plan.basic import data_parallel

    w = zoo.get("mlp")
    g = capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    cl = cluster("4xV100")
    s = data_parallel(g, cl, accumulate=2)
    placed = graph_for(g, s)
    updates = [op for op in placed.ops if op.kind == UPDATE]
    assert len(updates) == 4 * len(g.of_kind(UPDATE))  # one per device
    assert {replica_of(op.name) for op in updates} == {0, 2, 4, 6}  # each device's first replica
    s.validate(placed)
    every = data_parallel_graph(g, 8)  # every copy placed, as before: valid, and slower by the copies' time
    device = {op.name: replica_of(op.name) // 2 for op in every.ops if op.kind not in ("param", "state", "buffer",
                                                                                       "allreduce")}
    order = [[n for n in device if device[n] == d] for d in range(4)]
    full = Strategy("all", 4, device, order, s.holders, replicas=8)
    assert simulate(g, full, cl).iteration_s > simulate(g, s, cl).iteration_s
    first = next(op.name for op in every.ops if op.kind == UPDATE and replica_of(op.name) == 0)
    for gone in ([first], [op.name for op in every.ops if op.kind == UPDATE and op.name.endswith(first[3:])]):
        bad = Strategy("bad", 4, {k: v for k, v in device.items() if k not in gone},
                       [[n for n in o if n not in gone] for o in order], s.holders, replicas=8)
        with pytest.raises(FasttError, match="missing from placement"):
            bad.validate(graph_for(g, bad))
