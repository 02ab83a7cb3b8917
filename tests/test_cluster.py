"""Tests for fastt.cluster: every spec form, route shapes, transfer times, JSON round trip, bad specs."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastt.cluster import (
    Cluster,
    Device,
    GiB,
    Link,
    cluster,
    cpu_threads,
    preset_for,
    torch_device,
    with_links,
)
from fastt.cluster_file import from_dict
from fastt.errors import FasttError


def all_pairs_routed(c: Cluster) -> bool:
    """Every ordered pair of distinct devices has a route of valid link indices."""
    pairs = set(itertools.permutations(range(len(c)), 2))
    return set(c.routes) == pairs and all(0 <= k < len(c.links) for r in c.routes.values() for k in r)


def test_cpu_devices_share_cores_and_memory() -> None:
    c = cluster("cpu:2")
    assert c.name == "cpu:2" and len(c) == 2 and {d.kind for d in c.devices} == {"cpu"}
    assert all_pairs_routed(c) and len(c.links) == 2 and c.route(0, 1) != c.route(1, 0)
    assert c.devices[0].flops == cpu_threads(2) * 32 * 2.5e9
    assert c.devices[0].memory_bytes == cluster("cpu:1").devices[0].memory_bytes // 2
    # one copy link: 5 us + 1e6 B / 5e9 B/s
    assert c.transfer_time(0, 1, 1e6) == pytest.approx(5e-6 + 1e6 / 5e9)
    assert cluster("cpu") == cluster("CPU:1") and cluster("cpu").routes == {}
    assert cpu_threads(1000) == 1


def test_v100_nvlink_is_point_to_point() -> None:
    c = cluster("4xV100")
    assert c.name == "4xV100-nvlink" and len(c) == 4 and len(c.links) == 12 and all_pairs_routed(c)
    assert all(len(r) == 1 for r in c.routes.values())
    assert len({c.route(i, j) for i, j in c.routes}) == 12  # dedicated per ordered pair
    d = c.devices[0]
    assert (d.kind, d.memory_bytes, d.flops, d.mem_bandwidth) == ("V100", 16 * 2**30, 15.7e12, 900e9)
    assert c.transfer_time(0, 3, 1e8) == pytest.approx(5e-6 + 1e8 / 25e9)
    assert cluster("4xv100-NVLINK") == c


def test_nvswitch_routes_egress_then_ingress() -> None:
    c = cluster("8xA100")
    assert len(c.links) == 16 and all_pairs_routed(c)
    out, inn = c.route(2, 5)
    assert c.links[out].name == "nvlink-out:2" and c.links[inn].name == "nvlink-in:5"
    assert c.route(2, 6)[0] == out and c.route(1, 5)[1] == inn  # shared: contention at the endpoints
    assert c.transfer_time(2, 5, 3e9) == pytest.approx(5e-6 + 3e9 / 300e9)
    h = cluster("8xH100")
    assert h.devices[0].flops == 67e12 and h.transfer_time(0, 1, 450e6) == pytest.approx(5e-6 + 1e-3)


def test_pcie_routes_up_then_down() -> None:
    c = cluster("4xV100-pcie")
    assert c.name == "4xV100-pcie" and len(c.links) == 8 and all_pairs_routed(c)
    up, down = c.route(0, 3)
    assert c.links[up].name == "pcie-up:0" and c.links[down].name == "pcie-down:3"
    assert c.transfer_time(0, 3, 12e6) == pytest.approx(1e-5 + 12e6 / 12e9)
    assert cluster("8xA100-pcie").transfer_time(1, 2, 24e6) == pytest.approx(1e-5 + 1e-3)


@pytest.mark.parametrize("spec,kind,mem,bw", [
    ("2xA100-80GB", "A100-80GB", 80 * GiB, 2039e9), ("4xV100-32GB", "V100-32GB", 32 * GiB, 900e9),
    ("2xA100-40GB", "A100", 40 * GiB, 1555e9), ("1xH100-80GB", "H100", 80 * GiB, 3.35e12),
])
def test_memory_variants(spec: str, kind: str, mem: int, bw: float) -> None:
    d = cluster(spec).devices[0]
    assert (d.kind, d.memory_bytes, d.mem_bandwidth) == (kind, mem, bw)


def test_multi_node_routes_through_nics() -> None:
    c = cluster("2x4xV100")
    assert c.name == "2x4xV100-nvlink" and len(c) == 8 and all_pairs_routed(c)
    assert [d.node for d in c.devices] == [0] * 4 + [1] * 4
    assert len(c.links) == 2 * 12 + 4  # NVLink pairs per node, plus NIC out and in per node
    out, inn = c.route(1, 6)
    assert c.links[out].name == "n0/nic-out" and c.links[inn].name == "n1/nic-in"
    assert c.route(3, 4)[0] == out and c.route(6, 1) != (out, inn)
    assert len(c.route(1, 2)) == 1 and c.links[c.route(1, 2)[0]].bandwidth == 25e9  # stays inside node 0
    # 100 Gb/s EDR = 12.5e9 B/s, 3 us over the two NICs
    assert c.transfer_time(1, 6, 12.5e6) == pytest.approx(3e-6 + 1e-3)
    a = cluster("3x2xA100-pcie")
    assert len(a) == 6 and all_pairs_routed(a) and a.transfer_time(0, 5, 25e6) == pytest.approx(3e-6 + 1e-3)
    assert cluster("2x8xH100").transfer_time(0, 15, 50e6) == pytest.approx(3e-6 + 1e-3)


@pytest.mark.parametrize("spec, name, bytes_per_s", [("2x4xA100@25Gbps", "2x4xA100-nvlink@25Gbps", 25e9 / 8),
                                                     ("4x1xV100@10gbit", "4x1xV100-nvlink@10Gbps", 10e9 / 8),
                                                     ("2x2xV100-pcie@400Mbps", "2x2xV100-pcie@0.4Gbps", 50e6),
                                                     ("2x2xH100@12.5GB/s", "2x2xH100-nvlink@100Gbps", 12.5e9)])
def test_network_between_nodes(spec: str, name: str, bytes_per_s: float) -> None:
    """`@RATE` replaces the NIC between nodes (Ethernet); the links inside a node stay the preset's."""
    c, preset = cluster(spec), cluster(spec.partition("@")[0])
    assert c.name == name and len(c.links) == len(preset.links)
    last = len(c) - 1
    assert c.transfer_time(0, last, 1e6) == pytest.approx(3e-6 + 1e6 / bytes_per_s)
    if c.devices[1].node == 0:
        assert c.transfer_time(0, 1, 1e6) == preset.transfer_time(0, 1, 1e6)
    assert cluster(c.name) == c  # the name is a spec that builds the same cluster


@pytest.mark.parametrize("spec", ["cpu:3", "4xV100", "8xA100-pcie", "2x4xA100", "2x2xV100-pcie"])
def test_json_round_trip(spec: str, tmp_path: Path) -> None:
    c = cluster(spec)
    path = tmp_path / "c.json"
    c.save(path)
    assert cluster(str(path)) == c and cluster(path) == c
    assert from_dict(json.loads(c.to_json())) == c
    devices = tuple(dataclasses.replace(d, wake_s=5e-5, comm_s_per_byte=4e-10) for d in c.devices)
    measured = dataclasses.replace(c, devices=devices)
    assert from_dict(json.loads(measured.to_json())) == measured  # what calibration measured, kept


def test_json_by_hand_with_names_and_multi_link_route(tmp_path: Path) -> None:
    dev = {"kind": "x", "memory_bytes": 2**30, "flops": 1e12, "mem_bandwidth": 1e11}
    data = {"name": "hand", "devices": [{"name": "a", **dev}, {"name": "b", **dev, "node": 1}],
            "links": [{"name": "ab", "bandwidth": 1e9, "latency": 1e-6, "pairs": [["a", "b"]]},
                      {"name": "up", "bandwidth": 2e9, "latency": 1e-6},
                      {"name": "down", "bandwidth": 4e9, "latency": 2e-6}],
            "routes": {"1,0": ["up", "down"]}}
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(data))
    c = cluster(str(path))
    assert c.name == "hand" and c.devices[1].node == 1 and c.routes == {(0, 1): (0,), (1, 0): (1, 2)}
    assert c.transfer_time(0, 1, 1e9) == pytest.approx(1 + 1e-6)
    assert c.transfer_time(1, 0, 2e9) == pytest.approx(3e-6 + 1)  # slowest link on the route bounds it
    assert from_dict(c.to_dict()) == c
    data["gather"] = [1e-4, 2e-9, 5e-6]
    assert from_dict(data).gather == (1e-4, 2e-9, 5e-6) and from_dict(from_dict(data).to_dict()) == from_dict(data)
    for bad in ([1e-4, 2e-9], [1e-4, -1.0, 0.0], "fast"):
        with pytest.raises(FasttError, match="gather is"):
            from_dict(data | {"gather": bad})
    del data["routes"]
    with pytest.raises(FasttError, match="no route"):
        from_dict(data)


def test_with_links_replaces_parameters() -> None:
    c = cluster("cpu:2")
    refit = with_links(c, [Link(lk.name, 1e9, 1e-4) for lk in c.links])
    assert refit.routes == c.routes and refit.transfer_time(0, 1, 1e9) == pytest.approx(1 + 1e-4)
    with pytest.raises(FasttError):
        with_links(c, [])


def test_cuda_without_gpu_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:0,1"):
        with pytest.raises(FasttError, match="no CUDA device visible"):
            cluster(spec)


def test_cuda_with_faked_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {0: ("Tesla V100-SXM2-32GB", 34_089_730_048), 1: ("Tesla V100-SXM2-32GB", 34_089_730_048),
             2: ("Some Future GPU", 8 * GiB)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name=names[i][0], total_memory=names[i][1]))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    c = cluster("cuda:0,1")
    assert c.name == "cuda:0,1" and [d.name for d in c.devices] == ["cuda:0", "cuda:1"]
    assert c.devices[0].kind == "cuda" and c.devices[0].memory_bytes == 34_089_730_048
    assert c.devices[0].flops == 15.7e12 and c.transfer_time(0, 1, 25e6) == pytest.approx(5e-6 + 1e-3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    c = cluster("cuda")
    assert len(c) == 3 and all_pairs_routed(c) and c.devices[2].flops < 15.7e12
    assert "pcie-up:0" in {lk.name for lk in c.links}
    with pytest.raises(FasttError, match="bad CUDA device ids"):
        cluster("cuda:5")
    # A GPU named twice: two devices (streams) sharing its memory, hand-offs within it, copies to the others.
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    c = cluster("cuda:0,0,1")
    assert [d.name for d in c.devices] == ["cuda:0", "cuda:0/1", "cuda:1"] and all_pairs_routed(c)
    assert c.devices[0].memory_bytes == c.devices[1].memory_bytes == 34_089_730_048 // 2
    assert [torch_device(d) for d in c.devices] == ["cuda:0", "cuda:0", "cuda:1"]
    ranks = [dataclasses.replace(d, name=f"rank:{r}@cuda:{r % 2}") for r, d in enumerate(c.devices)]  # NCCL ranks
    assert [torch_device(d) for d in ranks] == ["cuda:0", "cuda:1", "cuda:0"]
    with pytest.raises(FasttError, match="simulated"):
        torch_device(dataclasses.replace(c.devices[0], name="rank:0"))
    assert c.links[c.route(0, 1)[0]].name == "stream:0->1" and c.route(1, 2) == c.route(0, 2)
    assert c.transfer_time(0, 1, 450e6) == pytest.approx(5e-6 + 1e-3)  # half of 900 GB/s


def test_preset_matching() -> None:
    assert preset_for("NVIDIA A100-SXM4-80GB", 85_100_000_000).name == "A100-80GB"  # type: ignore[union-attr]
    assert preset_for("NVIDIA A100-SXM4-40GB", 42_300_000_000).name == "A100"  # type: ignore[union-attr]
    assert preset_for("NVIDIA H100 80GB HBM3", 85_000_000_000).name == "H100"  # type: ignore[union-attr]
    assert preset_for("NVIDIA H200", 150_000_000_000).name == "H200"  # type: ignore[union-attr]
    assert preset_for("Tesla V100-SXM2-16GB", 16_900_000_000).name == "V100"  # type: ignore[union-attr]
    assert preset_for("NVIDIA GeForce RTX 4090", 24 * GiB) is None


@pytest.mark.parametrize("spec", ["foo", "4xK80", "4x", "xV100", "cpu:", "cpu:x", "4xV100-ethernet", "cuda:a",
                                  "0xV100", "2x0xA100", "cpu:0", "", "missing.json", 3, "4xV100@10Gbps",
                                  "2x4xV100@", "2x4xV100@fast", "2x4xV100@0Gbps", "2x4xV100@-1Gbps",
                                  "2x4xV100@10Gbpm"])
def test_bad_specs_raise_one_line(spec: object) -> None:
    with pytest.raises(FasttError) as err:
        cluster(spec)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "\n" not in msg and msg


def test_bad_spec_message_lists_forms() -> None:
    with pytest.raises(FasttError, match=r"bad cluster spec 'foo': expected cpu:N, cuda.*MxNxGPU.*JSON"):
        cluster("foo")


def test_bad_json_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FasttError, match="not readable JSON"):
        cluster(str(bad))
    bad.write_text(json.dumps({"devices": [{"name": "a"}], "links": []}))
    with pytest.raises(FasttError, match="device 0: missing field .kind."):
        cluster(str(bad))
    d = Device("a", "x", 1, 1.0, 1.0)
    good = Cluster("two", (d, Device("b", "x", 1, 1.0, 1.0)), (Link("l", 1.0, 0.0),), {(0, 1): (0,), (1, 0): (0,)})
    data = good.to_dict()
    data["links"][0]["pairs"].append([0, 1])
    with pytest.raises(FasttError, match="given twice"):
        from_dict(data)
