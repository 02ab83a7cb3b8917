"""Strategy: what a planner decides — op splits, the device of each op, each device's order, parameter
holders.

A Strategy names ops, not indices, so that it survives re-capturing the graph and reads well as JSON. It
applies to the graph it was planned on: with `replicas > 1` that is `replicate(step at batch/replicas,
replicas)`. `validate(graph)` checks everything the simulator and the runtime rely on, in O(ops + edges), and
says what is wrong in one line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from fastt.errors import FasttError
from fastt.graph import ALLREDUCE, RESIDENT, OpGraph

FORMAT, VERSION = "fastt.strategy", 3
READS = (1, 2, 3)  # version 1 had no sharded updates, 2 no split chains


@dataclass(frozen=True)
class Split:
    """Op `op` split into `parts` sub-ops along the named dimension `dim` of its split rule (OS-DPOS)."""

    op: str
    dim: str
    parts: int


@dataclass(frozen=True)
class Strategy:
    """A plan for one training step on `n_devices` devices.

    `placement` maps every op that is neither RESIDENT nor ALLREDUCE to its device; `order[d]` lists exactly
    the ops placed on device d in the order it runs them; `holders` maps every RESIDENT op (parameter,
    optimizer state, buffer) to the devices that keep a copy across iterations. Allreduces are not placed:
    they run on the devices of their inputs.
    """

    planner: str
    n_devices: int
    placement: Mapping[str, int]
    order: tuple[tuple[str, ...], ...]
    holders: Mapping[str, tuple[int, ...]]
    replicas: int = 1
    splits: tuple[Split, ...] = field(default=())
    sharded: tuple[str, ...] = field(default=())  # updates sharded over the replicas (`fastt.shard`)
    chained: tuple[str, ...] = field(default=())  # split ops whose parts read their producers' parts

    def __post_init__(self) -> None:
        # Normalise containers so that strategies built from lists, or read from JSON, compare equal.
        object.__setattr__(self, "placement", dict(self.placement))
        object.__setattr__(self, "order", tuple(tuple(o) for o in self.order))
        object.__setattr__(self, "holders", {k: tuple(v) for k, v in self.holders.items()})
        object.__setattr__(self, "splits", tuple(self.splits))
        object.__setattr__(self, "sharded", tuple(self.sharded))
        object.__setattr__(self, "chained", tuple(self.chained))

    def to_json(self) -> str:
        """The versioned JSON text of this strategy."""
        return json.dumps({
            "format": FORMAT, "version": VERSION, "planner": self.planner, "n_devices": self.n_devices,
            "replicas": self.replicas,
            "splits": [{"op": s.op, "dim": s.dim, "parts": s.parts} for s in self.splits],
            "sharded": list(self.sharded), "chained": list(self.chained),
            "placement": dict(self.placement), "order": [list(o) for o in self.order],
            "holders": {k: list(v) for k, v in self.holders.items()},
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Strategy:
        """Parse `to_json` output; FasttError says which field is malformed."""
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise FasttError(f"strategy is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise FasttError(f"not a strategy file: expected an object with \"format\": \"{FORMAT}\"")
        if obj.get("version") not in READS:
            raise FasttError(f"strategy version {obj.get('version')!r} is not supported (this fastt reads "
                             f"versions {', '.join(map(str, READS))}); re-plan to write a current one")
        splits = [Split(op=_get(s, "op", str, "splits[]"), dim=_get(s, "dim", str, "splits[]"),
                        parts=_get(s, "parts", int, "splits[]")) for s in _get(obj, "splits", list)]
        placement = _get(obj, "placement", dict)
        order = _get(obj, "order", list)
        holders = _get(obj, "holders", dict)
        _expect(all(isinstance(k, str) and _is_int(v) for k, v in placement.items()),
                "placement must map op names to device indices")
        _expect(all(isinstance(o, list) and all(isinstance(n, str) for n in o) for o in order),
                "order must be a list (one per device) of lists of op names")
        _expect(all(isinstance(v, list) and all(_is_int(d) for d in v) for v in holders.values()),
                "holders must map op names to lists of device indices")
        sharded = _get(obj, "sharded", list) if obj["version"] >= 2 else []
        _expect(all(isinstance(n, str) for n in sharded), "sharded must be a list of update names")
        chained = _get(obj, "chained", list) if obj["version"] >= 3 else []
        _expect(all(isinstance(n, str) for n in chained), "chained must be a list of split op names")
        n_devices, replicas = _get(obj, "n_devices", int), _get(obj, "replicas", int)
        _expect(n_devices >= 1 and replicas >= 1 and all(s.parts >= 1 for s in splits),
                "n_devices, replicas and every split's parts must be at least 1")
        return cls(planner=_get(obj, "planner", str), n_devices=n_devices,
                   placement=placement, order=tuple(tuple(o) for o in order),
                   holders={k: tuple(v) for k, v in holders.items()}, replicas=replicas, splits=tuple(splits),
                   sharded=tuple(sharded), chained=tuple(chained))

    def save(self, path: str | Path) -> None:
        """Write the strategy as JSON to `path`."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Strategy:
        """Read a strategy written by `save`."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise FasttError(f"cannot read strategy {path}: {e.strerror}") from None
        return cls.from_json(text)

    def validate(self, g: OpGraph, acyclic: bool = True) -> None:
        """Raise FasttError naming the first problem that keeps this strategy from running `g` (the graph with
        the strategy's replication and splits applied: see fastt.split.graph_for). `acyclic=False` leaves out
        the check that its orders and the data edges make no cycle (the simulator, where a cycle stalls,
        checks it only then)."""
        if g.replicas != self.replicas:
            raise FasttError(f"strategy is for {self.replicas} replica(s) but the graph has {g.replicas}; "
                             f"apply it to replicate(graph at batch/{self.replicas}, {self.replicas})")
        dev = self._devices(g)
        holders = self._holders(g)
        pos = self._positions(g, dev)
        _check_updates(g, dev, holders)
        if acyclic:
            _check_acyclic(g, dev, pos, self.order)

    def _devices(self, g: OpGraph) -> list[int]:
        """Device of each op (-1 for residents and allreduces), checking placement covers exactly the placed
        ops."""
        ops, index, valid = g.ops, g.index, range(self.n_devices)
        dev = [-1] * len(ops)
        for name, d in self.placement.items():
            i = index.get(name)
            if i is None or ops[i].kind in RESIDENT or ops[i].kind == ALLREDUCE or type(d) is not int \
                    or d not in valid:
                self._bad_placement(g, name, d)
            dev[i] = d
        for i, op in enumerate(ops):
            if dev[i] < 0 and op.kind not in RESIDENT and op.kind != ALLREDUCE:
                raise FasttError(f"op '{op.name}' is missing from placement; every non-resident op needs a "
                                 "device")
            if op.kind == ALLREDUCE:
                for j in op.inputs:
                    if dev[j] < 0:
                        raise FasttError(f"allreduce '{op.name}' reads '{g.ops[j].name}', which is not "
                                         "placed on a device; an allreduce aggregates placed ops")
        return dev

    def _bad_placement(self, g: OpGraph, name: str, d: object) -> None:
        """Raise what is wrong with placing op `name` on device `d`."""
        kind = g.ops[_lookup(g, name, "placement")].kind
        if kind in RESIDENT or kind == ALLREDUCE:
            what = "residents go in holders" if kind in RESIDENT else "allreduces are not placed"
            raise FasttError(f"placement lists '{name}', a {kind} op: {what}")
        self._in_range(d, f"placement of '{name}'")

    def _holders(self, g: OpGraph) -> dict[int, tuple[int, ...]]:
        """Holder devices of each resident op, checking every resident has at least one."""
        out: dict[int, tuple[int, ...]] = {}
        for name, devs in self.holders.items():
            i = _lookup(g, name, "holders")
            if g.ops[i].kind not in RESIDENT:
                raise FasttError(f"holders lists '{name}', a {g.ops[i].kind} op; only params, state and "
                                 "buffers have holders")
            for d in devs:
                self._in_range(d, f"holder of '{name}'")
            out[i] = tuple(sorted(set(devs)))
        for i in g.residents:
            if not out.get(i):
                raise FasttError(f"resident '{g.ops[i].name}' is missing from holders; give it at least one "
                                 "device")
        return out

    def _positions(self, g: OpGraph, dev: list[int]) -> list[int]:
        """Index of each placed op in its device's order, checking order[d] is exactly the ops placed on d."""
        if len(self.order) != self.n_devices:
            raise FasttError(f"order has {len(self.order)} device lists but the strategy has "
                             f"{self.n_devices} devices; give one list per device")
        pos, index = [-1] * len(g.ops), g.index
        for d, names in enumerate(self.order):
            for k, name in enumerate(names):
                i = index.get(name)
                if i is None or dev[i] != d or pos[i] >= 0:
                    i = _lookup(g, name, f"order on device {d}")
                    if dev[i] != d:
                        where = (f"placed on device {dev[i]}" if dev[i] >= 0
                                 else f"a {g.ops[i].kind} op, not placed")
                        raise FasttError(f"order on device {d} lists '{name}', which is {where}")
                    raise FasttError(f"order on device {d} lists '{name}' twice")
                pos[i] = k
        for i, d in enumerate(dev):
            if d >= 0 and pos[i] < 0:
                raise FasttError(f"op '{g.ops[i].name}' is placed on device {d} but missing from order on "
                                 f"device {d}")
        return pos

    def _in_range(self, d: object, what: str) -> None:
        if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d < self.n_devices):
            raise FasttError(f"{what} is device {d!r}, out of range for {self.n_devices} devices")


def _check_updates(g: OpGraph, dev: list[int], holders: dict[int, tuple[int, ...]]) -> None:
    """Every update runs on a holder of what it updates, and every holder of an updated resident updates
    it."""
    updated_on: dict[int, set[int]] = {}
    for i, op in enumerate(g.ops):
        for u in op.updates:
            if u not in holders:
                continue
            if dev[i] not in holders[u]:
                raise FasttError(f"update '{op.name}' on device {dev[i]} writes '{g.ops[u].name}', but "
                                 f"device {dev[i]} does not hold it (holders: {list(holders[u])}); place the "
                                 "update on a holder")
            updated_on.setdefault(u, set()).add(dev[i])
    for u, devs in updated_on.items():
        for h in holders[u]:
            if h not in devs:
                raise FasttError(f"device {h} holds '{g.ops[u].name}' but runs no update of it, so its copy "
                                 f"would go stale; place an update of it on device {h} or drop {h} from its "
                                 "holders")


def _check_acyclic(g: OpGraph, dev: list[int], pos: list[int], order: tuple[tuple[str, ...], ...]) -> None:
    """Data edges plus per-device order edges must form a DAG, or some device would wait forever."""
    ops, index = g.ops, g.index
    for i, op in enumerate(ops):
        for j in op.inputs:
            if dev[i] >= 0 and dev[j] == dev[i] and pos[j] > pos[i]:
                raise FasttError(f"order on device {dev[i]} runs '{op.name}' before '{ops[j].name}' but "
                                 f"'{op.name}' depends on '{ops[j].name}'")
    nxt = [-1] * len(ops)  # next op on the same device
    prv = [-1] * len(ops)
    for names in order:
        idx = [index[n] for n in names]
        for a, b in pairwise(idx):
            nxt[a], prv[b] = b, a
    live = [op.kind not in RESIDENT for op in ops]
    preds = [[j for j in dict.fromkeys(op.inputs) if live[j]] for op in ops]
    indeg = [len(p) + (prv[i] >= 0) for i, p in enumerate(preds)]
    stack = [i for i in range(len(ops)) if live[i] and indeg[i] == 0]
    done = 0
    while stack:
        i = stack.pop()
        done += 1
        for s in g.succs[i] + ((nxt[i],) if nxt[i] >= 0 else ()):
            indeg[s] -= 1
            if indeg[s] == 0:
                stack.append(s)
    if done < sum(live):
        raise FasttError(_cycle_message(g, dev, preds, prv, indeg))


def _cycle_message(g: OpGraph, dev: list[int], preds: list[list[int]], prv: list[int],
                   indeg: list[int]) -> str:
    """Describe one cycle among the ops Kahn's algorithm could not release (each has a stuck predecessor)."""
    start = next(i for i, k in enumerate(indeg) if k > 0)
    seen: dict[int, int] = {}
    path: list[int] = []
    i = start
    while i not in seen:
        seen[i] = len(path)
        path.append(i)
        i = next(j for j in [*preds[i], prv[i]] if j >= 0 and indeg[j] > 0)
    cycle = path[seen[i]:][::-1]  # walked backwards along predecessors; report it forwards
    cycle.append(cycle[0])
    steps = []
    for a, b in pairwise(cycle):
        how = f"order on device {dev[a]}" if a == prv[b] else "data"
        steps.append(f"'{g.ops[a].name}' -({how})-> ")
    return ("the per-device orders contradict the dependencies, so the devices would wait on each other "
            "forever: " + "".join(steps)
            + f"'{g.ops[cycle[0]].name}'; reorder so that every op runs after its inputs")


def _lookup(g: OpGraph, name: str, where: str) -> int:
    i = g.index.get(name)
    if i is None:
        raise FasttError(f"{where} names unknown op '{name}'; was the strategy planned for another graph?")
    return i


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise FasttError(f"malformed strategy: {what}")


def _get(obj: Any, key: str, typ: type, where: str = "strategy") -> Any:
    """obj[key], checked to be of type typ (ints exclude bools)."""
    if not isinstance(obj, dict) or key not in obj:
        raise FasttError(f"malformed strategy: {where} has no field \"{key}\"")
    val = obj[key]
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise FasttError(f"malformed strategy: field \"{key}\" of {where} should be {typ.__name__}, "
                         f"not {type(val).__name__}")
    return val
