"""The JSON file form of a Cluster, read back (`Cluster.to_dict` and `save` write it): every field checked, so
that a bad file is one FasttError naming the device or link and the field, never a planner's failure later."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .cluster import MAX_VALUE, SPEC_FORMS, Cluster, Device, Link, check_count
from .errors import FasttError


def from_json_file(path: str | os.PathLike[str]) -> Cluster:
    """The Cluster a JSON file describes (the form `Cluster.save` writes; see `from_dict`)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FasttError(f"cluster file {str(path)!r} not found; expected {SPEC_FORMS}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise FasttError(f"cluster file {str(path)!r} is not readable JSON: {e}") from None
    return from_dict(data, where=str(path))


def from_dict(data: Mapping[str, Any], where: str = "cluster JSON") -> Cluster:
    """A Cluster from its JSON form: {"name", "devices": [...], "links": [{..., "pairs"}], "routes"?}.

    Devices are {"name", "kind", "memory_bytes", "flops", "mem_bandwidth", "node"?, "op_overhead_s"?,
    "fp16_flops"?, "bf16_flops"?, "tf32_flops"?, "kernel_efficiency"? (true/false, see Device), "wake_s"?,
    "comm_s_per_byte"?}.
    Each link's "pairs" lists ordered device pairs [src, dst] (indices or names) whose route is that link
    alone; the optional top-level "routes" maps "src,dst" to a list of link names for multi-link routes. Every
    ordered pair of distinct devices must get exactly one route. The optional "gather" is [latency s, s per
    byte, s per tensor] (see Cluster). Every number must be finite and at most `MAX_VALUE`; anything else is a
    FasttError naming the field.
    """
    def fail(msg: str) -> FasttError:
        return FasttError(f"{where}: {msg}")

    if not isinstance(data, Mapping):
        raise fail(f"expected an object with devices and links, got {type(data).__name__}")
    devices = tuple(_device(d, i, fail) for i, d in enumerate(_items(data, "devices", fail)))
    links = tuple(_link(lk, k, fail) for k, lk in enumerate(_items(data, "links", fail)))
    if not devices:
        raise fail("no devices")
    check_count(len(devices), "device")
    if len({d.name for d in devices}) != len(devices) or len({lk.name for lk in links}) != len(links):
        raise fail("device names and link names must be unique")
    routes = _routes(data, devices, links, fail)
    return Cluster(str(data.get("name", where)), devices, links, routes, _gather(data.get("gather"), fail))


def _items(data: Mapping[str, Any], key: str, fail: Callable[[str], FasttError]) -> list[Mapping[str, Any]]:
    """data[key]: a list of objects (devices or links)."""
    items = data.get(key)
    if not isinstance(items, list) or not all(isinstance(x, Mapping) for x in items):
        raise fail(f"{key!r} must be a list of objects; see fastt.cluster_file.from_dict for the format")
    return items


def _number(obj: Mapping[str, Any], key: str, what: str, fail: Callable[[str], FasttError], *,
            default: float | None = None, positive: bool = True, integer: bool = False) -> Any:
    """obj[key] as a finite number (an int if `integer`), positive or non-negative, at most MAX_VALUE."""
    x = obj.get(key, default)
    if x is None:
        raise fail(f"{what}: missing field {key!r}")
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= MAX_VALUE
    if not ok or positive and x == 0 or integer and x != int(x):
        kind = "a whole number" if integer else "a number"
        raise fail(f"{what}: {key} must be {kind} {'>' if positive else '≥'} 0 and at most {MAX_VALUE:g}, "
                   f"got {x!r}")
    return int(x) if integer else float(x)


def _device(d: Mapping[str, Any], i: int, fail: Callable[[str], FasttError]) -> Device:
    what = f"device {i}"
    for key in ("name", "kind"):
        if key not in d:
            raise fail(f"{what}: missing field {key!r}")
    efficiency = d.get("kernel_efficiency", False)
    if not isinstance(efficiency, bool):
        raise fail(f"{what}: kernel_efficiency must be true or false, got {efficiency!r}")
    return Device(str(d["name"]), str(d["kind"]), _number(d, "memory_bytes", what, fail, integer=True),
                  _number(d, "flops", what, fail), _number(d, "mem_bandwidth", what, fail),
                  _number(d, "node", what, fail, default=0, positive=False, integer=True),
                  _number(d, "op_overhead_s", what, fail, default=0.0, positive=False),
                  *(_number(d, f"{t}_flops", what, fail, default=0.0, positive=False)
                    for t in ("fp16", "bf16", "tf32")), kernel_efficiency=efficiency,
                  wake_s=_number(d, "wake_s", what, fail, default=0.0, positive=False),
                  comm_s_per_byte=_number(d, "comm_s_per_byte", what, fail, default=0.0, positive=False))


def _link(lk: Mapping[str, Any], k: int, fail: Callable[[str], FasttError]) -> Link:
    if "name" not in lk:
        raise fail(f"link {k}: missing field 'name'")
    what = f"link {lk['name']!s}"
    return Link(str(lk["name"]), _number(lk, "bandwidth", what, fail),
                _number(lk, "latency", what, fail, positive=False))


def _routes(data: Mapping[str, Any], devices: Sequence[Device], links: Sequence[Link],
            fail: Callable[[str], FasttError]) -> dict[tuple[int, int], tuple[int, ...]]:
    """Every ordered pair of distinct devices' route: the links whose "pairs" name it,
    or the "routes" entry."""
    dev_index = {d.name: i for i, d in enumerate(devices)}
    link_index = {lk.name: k for k, lk in enumerate(links)}

    def dev(ref: Any) -> int:
        if isinstance(ref, str) and ref.strip() in dev_index:
            return dev_index[ref.strip()]
        if isinstance(ref, bool) or not isinstance(ref, (int, str)) or not str(ref).strip().isdigit():
            raise fail(f"unknown device {ref!r}")
        i = int(ref)
        if not 0 <= i < len(devices):
            raise fail(f"device index {i} out of range 0..{len(devices) - 1}")
        return i

    routes: dict[tuple[int, int], tuple[int, ...]] = {}

    def add(src: Any, dst: Any, route: tuple[int, ...]) -> None:
        key = dev(src), dev(dst)
        if key[0] == key[1] or key in routes:
            raise fail(f"route {key} is from a device to itself or given twice")
        routes[key] = route

    for k, lk in enumerate(data["links"]):
        pairs = lk.get("pairs", [])
        if not isinstance(pairs, list):
            raise fail(f"link {links[k].name!r}: pairs must be a list of [src, dst], got {pairs!r}")
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2:
                raise fail(f"link {links[k].name!r}: a pair is [src, dst], got {pair!r}")
            add(pair[0], pair[1], (k,))
    multi = data.get("routes", {})
    if not isinstance(multi, Mapping):
        raise fail(f"routes must map \"src,dst\" to lists of link names, got {type(multi).__name__}")
    for key, names in multi.items():
        if (str(key).count(",") != 1 or not isinstance(names, list) or not names
                or any(not isinstance(n, str) or n not in link_index for n in names)):
            raise fail(f"route {key!r}: expected \"src,dst\": [known link names], got {names!r}")
        add(*str(key).split(","), tuple(link_index[n] for n in names))
    missing = [p for p in itertools.permutations(range(len(devices)), 2) if p not in routes]
    if missing:
        raise fail(f"no route for device pairs {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return routes


def _gather(gather: Any, fail: Callable[[str], FasttError]) -> tuple[float, float, float] | None:
    """The optional "gather": [latency s, s per byte, s per tensor], each finite and ≥ 0."""
    if gather is None:
        return None
    what = "gather is [latency s, s per byte, s per tensor]"
    if not isinstance(gather, list) or len(gather) != 3:
        raise fail(f"{what}, all ≥ 0; got {gather!r}")
    fields = dict(zip(("latency", "per_byte", "per_tensor"), gather))
    return tuple(_number(fields, k, what, fail, positive=False) for k in fields)  # type: ignore[return-value]
