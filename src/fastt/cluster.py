"""Cluster: the devices a plan runs on and the links between them.

A transfer from device i to device j occupies every link on `routes[i, j]` for its whole duration
(`latency` of each link + bytes / the slowest bandwidth on the route); a link carries one transfer at a time,
which is how contention is modelled.

`cluster(spec)` builds one from a spec: `cpu:N` (N CPU worker devices on this machine), `cuda` / `cuda:0,1`
(local GPUs), `NxGPU[-nvlink|-pcie]` (a simulated node of data-sheet GPUs, e.g. `4xV100`, `8xA100-pcie`),
`MxNxGPU[-link]` (M such nodes joined by one NIC each: the preset's InfiniBand, or `MxNxGPU[-link]@RATE`, e.g.
`2x4xA100@25Gbps`, `4x1xV100@10Gbps` for Ethernet), or a JSON file (`Cluster.save` writes one).
Device `kind` names the cost profile a device uses: "cpu" and "cuda" are devices fastt can run on and measure;
a preset's name (e.g. "V100") marks a simulated GPU costed from its data sheet.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fastt.errors import FasttError


@dataclass(frozen=True)
class Device:
    """One compute device. `flops` is peak FP32 FLOP/s, `mem_bandwidth` bytes/s of its memory; the tensor
    cores' dense peaks for matmuls and convolutions in FP16, BF16 and TF32 (0: none, see `peak`).
    `kernel_efficiency`: its kernels reach only a size-dependent fraction of those peaks, as a GPU's do
    (`fastt.cost.roofline_time`); False for a device whose speeds were fitted on measured ops (a CPU).
    `wake_s`: what an op pays that starts when a value from another device reaches it (its device waited)
    while another device runs: on CPU worker devices, threads of one process, waking the device's thread
    costs the running ones that much (Python's interpreter lock passes to it and back; measured by
    `fastt.cost.measure_handoffs`). `comm_s_per_byte`: the seconds of its cores a byte it sends or receives
    takes (a distributed CPU rank: gloo's copies through the host's TCP stack, which share the cores its ops
    run on; measured by `fastt.runtime.distributed.calibrate.measure_gather`); 0 where moving data costs the
    device's compute nothing (a GPU's copy engines, the local runtime's shared memory)."""

    name: str
    kind: str
    memory_bytes: int
    flops: float
    mem_bandwidth: float
    node: int = 0
    op_overhead_s: float = 0.0  # fixed cost of launching one op (kernel launch, dispatch)
    fp16_flops: float = 0.0
    bf16_flops: float = 0.0
    tf32_flops: float = 0.0
    kernel_efficiency: bool = False
    wake_s: float = 0.0
    comm_s_per_byte: float = 0.0

    def peak(self, dtype: str, conv: bool) -> float:
        """Peak FLOP/s of a matmul or convolution (`conv`) computed in `dtype` ("float32", "bfloat16", ...).

        Half precision runs on the tensor cores where the device has them, else at the FP32 peak (a CPU).
        FP32 runs on TF32 tensor cores only for convolutions: PyTorch's default `cudnn.allow_tf32` is True,
        `cuda.matmul.allow_tf32` False."""
        tensor = {"float16": self.fp16_flops, "bfloat16": self.bf16_flops,
                  "float32": self.tf32_flops if conv else 0.0}.get(dtype, 0.0)
        return tensor or self.flops


@dataclass(frozen=True)
class Link:
    """A channel that carries one transfer at a time. `bandwidth` in bytes/s, `latency` in seconds."""

    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """Devices, links, and for every ordered pair of distinct devices the links a transfer uses.

    Gradients are averaged by a ring allreduce (NCCL's: the links move 2(n-1)/n of the bytes and reduce on the
    way) unless `gather` is set: fastt's distributed runtime, whose ranks average by collectives that sum in
    replica order. `gather` = (latency s, s per byte, s per gradient tensor) of one average between two
    devices, fitted on measured ones; n devices take (n-1)·latency + 2(n-1)/n·bytes·(s per byte)
    + tensors·(s per tensor), as the runtime's sharded sum goes (`allreduce_cost`)."""

    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    routes: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    gather: tuple[float, float, float] | None = None

    def __len__(self) -> int:
        return len(self.devices)

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """Indices of the links a transfer from src to dst occupies (empty when src == dst)."""
        return () if src == dst else self.routes[src, dst]

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to move nbytes from device src to device dst over an idle route."""
        if src == dst:
            return 0.0
        links = [self.links[k] for k in self.routes[src, dst]]
        return sum(lk.latency for lk in links) + nbytes / min(lk.bandwidth for lk in links)

    def messages_time(self, messages: Iterable[tuple[int, int, float]]) -> float:
        """Seconds the messages (src, dst, bytes), all sent at once, take on idle links that carry one at a
        time: the busiest link's total."""
        busy = [0.0] * len(self.links)
        for src, dst, nbytes in messages:
            for k in self.route(src, dst):
                busy[k] += self.transfer_time(src, dst, nbytes)
        return max(busy, default=0.0)

    def allreduce_cost(self, group: Sequence[int]) -> tuple[tuple[int, ...], float, float, float]:
        """Links, fixed seconds, seconds per byte and per tensor of an allreduce over `group` (in ring order).

        Ring: each of the 2(n-1) steps moves bytes/n between neighbours: 2(n-1)/n · bytes / slowest bandwidth,
        plus one route latency per step (the largest, since all neighbours step together).
        Fitted (`gather`, fastt's distributed runtime): the two-device average scaled to n as its sharded
        sum goes (an all_to_all, then an all_gather): 2(n-1)/n of the bytes, n-1 latencies, the per-tensor
        work once; it occupies the links between all of them.
        """
        n = len(group)
        if n == 1:
            return (), 0.0, 0.0, 0.0
        if self.gather is not None:
            hops = [self.route(a, b) for a in group for b in group if a != b]
            latency, per_byte, per_tensor = self.gather
            links = tuple(sorted({lk for h in hops for lk in h}))
            return links, (n - 1) * latency, 2 * (n - 1) / n * per_byte, per_tensor
        hops = [self.route(group[k], group[(k + 1) % n]) for k in range(n)]
        links = tuple(sorted({lk for h in hops for lk in h}))
        slowest = min(self.links[lk].bandwidth for lk in links)
        latency = max(sum(self.links[lk].latency for lk in h) for h in hops)
        return links, 2 * (n - 1) * latency, 2 * (n - 1) / n / slowest, 0.0


    def to_dict(self) -> dict[str, Any]:
        """The JSON file form of this cluster (what `cluster(path)` reads back into an equal Cluster)."""
        links: list[dict[str, Any]] = [
            {"name": lk.name, "bandwidth": lk.bandwidth, "latency": lk.latency, "pairs": []}
            for lk in self.links
        ]
        multi: dict[str, list[str]] = {}
        for (src, dst), route in self.routes.items():
            if len(route) == 1:
                links[route[0]]["pairs"].append([src, dst])
            else:
                multi[f"{src},{dst}"] = [self.links[k].name for k in route]
        out: dict[str, Any] = {"name": self.name, "devices": [asdict(d) for d in self.devices],
                               "links": links}
        if multi:
            out["routes"] = multi
        if self.gather is not None:
            out["gather"] = list(self.gather)
        return out

    def to_json(self) -> str:
        """The JSON file form of this cluster as text (see `to_dict`)."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON file form of this cluster to path."""
        Path(path).write_text(self.to_json() + "\n")


def with_links(cluster: Cluster, links: Sequence[Link]) -> Cluster:
    """A copy of cluster with its links replaced one for one (e.g. refit by regression); routes are kept."""
    links = tuple(links)
    if len(links) != len(cluster.links):
        raise FasttError(f"with_links: cluster {cluster.name!r} has {len(cluster.links)} links, "
                         f"got {len(links)}")
    return replace(cluster, links=links)


# ------------------------------------------------------------------------------------------------------------
# Spec parsing

SPEC_FORMS = ("cpu:N, cuda, cuda:0,1, NxGPU[-nvlink|-pcie] (GPU: V100, V100-32GB, A100, A100-80GB, H100, "
              "H200), MxNxGPU[-link][@RATE] (RATE: the network between nodes, e.g. 25Gbps, 400Mbps, "
              "12.5GB/s), or a JSON file path")
_RATE_UNITS = {"gbps": 1e9 / 8, "gbit": 1e9 / 8, "mbps": 1e6 / 8, "mbit": 1e6 / 8, "gb/s": 1e9, "mb/s": 1e6}


def rate(text: str) -> float:
    """Bytes/s of a rate such as `25Gbps`, `1gbit`, `400Mbps` or `12.5GB/s`
    (bits for bps/bit, bytes for B/s)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z/]+)", text.strip().lower())
    if not m or m[2] not in _RATE_UNITS or float(m[1]) <= 0:
        raise FasttError(f"bad rate {text!r}: expected a positive number and a unit, e.g. 25Gbps, 400Mbps, "
                         "12.5GB/s")
    return float(m[1]) * _RATE_UNITS[m[2]]


def cluster(spec: str | os.PathLike[str] | Cluster) -> Cluster:
    """The Cluster a spec names: cpu:N, cuda[:i,j], NxGPU[-link], MxNxGPU[-link][@RATE], or a JSON file (see
    module doc)."""
    if isinstance(spec, Cluster):
        return spec
    from .cluster_file import from_json_file  # the file form reads Devices and Links: it imports this module

    if isinstance(spec, os.PathLike):
        return from_json_file(spec)
    if not isinstance(spec, str):
        raise FasttError(f"bad cluster spec {spec!r}: expected {SPEC_FORMS}")
    s = spec.strip().lower()
    if m := re.fullmatch(r"cpu(?::(\d+))?", s):
        return cpu_cluster(int(m[1] or 1))
    if m := re.fullmatch(r"cuda(?::(\d+(?:,\d+)*))?", s):
        return cuda_cluster(None if m[1] is None else [int(i) for i in m[1].split(",")])
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x([a-z0-9-]+?)(?:-(nvlink|pcie))?(?:@(.+))?", s)
    if m and m[3] in GPU_PRESETS:
        if m[5] is not None and not m[1]:
            raise FasttError(f"bad cluster spec {spec!r}: @RATE is the network between nodes, so it needs "
                             "nodes (MxNxGPU@RATE, e.g. 2x4xA100@25Gbps)")
        nic = None if m[5] is None else rate(m[5])
        return gpu_cluster(m[3], int(m[2]), nodes=int(m[1] or 1), link=m[4] or "nvlink", nic=nic)
    if s.endswith(".json") or os.path.exists(spec):
        return from_json_file(spec)
    raise FasttError(f"bad cluster spec {spec!r}: expected {SPEC_FORMS}")


# The most devices a cluster may have. Routes are per ordered pair (n² of them) and the simulator and planners
# keep per-device state: at this size a data-parallel plan of resnet50 is planned and simulated in seconds
# (docs/design.md), beyond it building the routes alone takes minutes and gigabytes.
MAX_DEVICES = 1024
# The largest number a cluster file may give (bytes, FLOP/s, bytes/s, seconds): beyond any real device, and
# small enough that sums over a plan stay finite and integers fit in 64 bits.
MAX_VALUE = 1e18


def check_count(n: int, what: str, total: int | None = None) -> None:
    """Raise FasttError unless a spec's count n is at least one and the cluster's `total` devices (n when
    not given) at most MAX_DEVICES."""
    if n < 1:
        raise FasttError(f"cluster spec needs at least one {what}, got {n}")
    if (total or n) > MAX_DEVICES:
        raise FasttError(f"a cluster of {total or n} devices is more than fastt plans and simulates "
                         f"(at most {MAX_DEVICES}); plan fewer devices")


# ------------------------------------------------------------------------------------------------------------
# Local CPU worker devices

CPU_FLOPS_PER_CORE = 32 * 2.5e9  # AVX2 FP32: 2 FMA units x 8 lanes x 2 FLOP per cycle at ~2.5 GHz
CPU_MEM_BW_PER_CORE = 10e9  # bytes/s one core's share of DRAM bandwidth can stream
CPU_COPY_BANDWIDTH = 5e9  # bytes/s a memory copy between worker threads sustains
CPU_COPY_LATENCY = 5e-6  # seconds to hand a tensor to another worker thread
CPU_OP_OVERHEAD = 10e-6  # seconds of Python/ATen dispatch per op


try:  # the cores this process may use, read before any thread is pinned to its device's (`use_cores`)
    CORES: tuple[int, ...] = tuple(sorted(os.sched_getaffinity(0)))
except AttributeError:  # not on Linux
    CORES = ()
_PINNED = threading.local()


def cpu_threads(n_devices: int) -> int:
    """Threads each of n_devices CPU worker devices gets: this process's cores shared out, at least one."""
    return max(1, (len(CORES) or os.cpu_count() or 1) // max(1, n_devices))


def use_cores(d: int, threads: int, n: int) -> None:
    """Run the calling thread, CPU worker device d of n with `threads` threads each, on its own cores: cores
    [d·threads, (d+1)·threads) of the process's, as the simulator has a device's cores to itself. Where the n
    devices need more cores than there are, or on a system without thread affinity, it runs anywhere.
    Unpinned, the scheduler moved threads that hand values back and forth onto one core, where a hand-off
    costs a quarter of what it costs between cores: a chain of small layers alternating devices ran 8 ms or
    21 ms a step by its history."""
    want = CORES[d * threads:(d + 1) * threads] if len(CORES) >= n * threads else CORES
    if want and getattr(_PINNED, "cores", None) != want:
        os.sched_setaffinity(0, want)  # 0: the calling thread
        _PINNED.cores = want


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30  # no sysconf (Windows): assume 8 GiB


def cpu_cluster(n: int) -> Cluster:
    """n CPU worker devices on this machine (kind "cpu"), each with cpu_threads(n) cores and 1/n of the RAM.

    The FLOP/s and bandwidth here are nominal (AVX2 peak per core share); fastt.cost calibrates them by
    measurement, and the copy links are refit by regression on measured copies (see `with_links`).
    """
    check_count(n, "CPU device")
    threads = cpu_threads(n)
    dev = [Device(f"cpu:{i}", "cpu", _physical_memory() // n, threads * CPU_FLOPS_PER_CORE,
                  threads * CPU_MEM_BW_PER_CORE, 0, CPU_OP_OVERHEAD) for i in range(n)]
    links: list[Link] = []
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for i, j in itertools.permutations(range(n), 2):
        routes[i, j] = (len(links),)
        links.append(Link(f"copy:{i}->{j}", CPU_COPY_BANDWIDTH, CPU_COPY_LATENCY))
    return Cluster(f"cpu:{n}", tuple(dev), tuple(links), routes)


# ------------------------------------------------------------------------------------------------------------
# GPU presets. Memory is in GiB (2**30 bytes): the HBM stacks are binary-sized, and what torch reports as
# total_memory is a little under it. Bandwidths are bytes/s per direction.


@dataclass(frozen=True)
class GpuPreset:
    """One GPU model's data-sheet numbers and the interconnects of the systems it ships in."""

    name: str
    flops: float  # peak FP32 FLOP/s without tensor cores (PyTorch leaves TF32 matmul off by default)
    fp16_flops: float  # dense tensor-core peaks (data sheets quote twice these "with sparsity")
    bf16_flops: float  # 0: no BF16 tensor cores
    tf32_flops: float  # 0: no TF32 tensor cores
    mem_bandwidth: float  # HBM bytes/s
    memory_bytes: int
    nvlink: float  # per-direction NVLink bytes/s: per GPU pair (no switch) or per GPU (NVSwitch)
    nvswitch: bool  # True: GPUs reach each other through an NVSwitch (route = egress_i, ingress_j)
    pcie: float  # usable per-direction PCIe bytes/s (about 3/4 of the raw x16 rate)
    nic: float  # per-node NIC bytes/s per direction


GiB = 2**30
# NVIDIA Tesla V100 GPU Accelerator data sheet (2018), SXM2: 15.7 TFLOP/s FP32, 900 GB/s HBM2, 16/32 GB.
# NVLink2 as in "NVIDIA DGX-1 With Tesla V100 System Architecture" white paper (2017): 25 GB/s per direction
# per link; the hybrid cube-mesh is approximated as one dedicated link per GPU pair. PCIe Gen3 x16 15.75 GB/s
# raw, ~12 GB/s usable. NIC: 100 Gb/s EDR InfiniBand (DGX-1). Tensor cores: 125 TFLOP/s FP16 (mixed precision,
# FP32 accumulate), no BF16 or TF32 (Volta).
_V100 = GpuPreset("V100", 15.7e12, 125e12, 0.0, 0.0, 900e9, 16 * GiB, 25e9, False, 12e9, 12.5e9)
# NVIDIA A100 Tensor Core GPU data sheet (2021), SXM: 19.5 TFLOP/s FP32, 40GB HBM2 1,555 GB/s,
# 80GB HBM2e 2,039 GB/s, NVLink3 600 GB/s (300 per direction) via NVSwitch, PCIe Gen4 x16 31.5 GB/s raw
# (~24 usable). NIC: 200 Gb/s HDR InfiniBand (DGX A100). Tensor cores (dense): 312 TFLOP/s FP16 and BF16,
# 156 TF32.
_A100 = GpuPreset("A100", 19.5e12, 312e12, 312e12, 156e12, 1555e9, 40 * GiB, 300e9, True, 24e9, 25e9)
# NVIDIA H100 Tensor Core GPU data sheet (2023), SXM: 67 TFLOP/s FP32, 80GB HBM3 3.35 TB/s, NVLink4 900 GB/s
# (450 per direction) via NVSwitch, PCIe Gen5 x16 63 GB/s raw (~50 usable).
# NIC: 400 Gb/s NDR InfiniBand (DGX H100). Tensor cores: 1,979 TFLOP/s FP16 and BF16, 989 TF32, both "with
# sparsity": half that dense.
_H100 = GpuPreset("H100", 67e12, 989.5e12, 989.5e12, 494.5e12, 3.35e12, 80 * GiB, 450e9, True, 50e9, 50e9)
# NVIDIA H200 Tensor Core GPU data sheet (2024), SXM: the H100's compute (67 TFLOP/s FP32) with 141 GB HBM3e
# at 4.8 TB/s; NVLink4 900 GB/s via NVSwitch, PCIe Gen5, 400 Gb/s NDR InfiniBand and tensor cores as the
# H100.
_H200 = replace(_H100, name="H200", mem_bandwidth=4.8e12, memory_bytes=141 * 10**9)
GPU_PRESETS: dict[str, GpuPreset] = {
    "v100": _V100, "v100-16gb": _V100,
    "v100-32gb": replace(_V100, name="V100-32GB", memory_bytes=32 * GiB),
    "a100": _A100, "a100-40gb": _A100,
    "a100-80gb": replace(_A100, name="A100-80GB", mem_bandwidth=2039e9, memory_bytes=80 * GiB),
    "h100": _H100, "h100-80gb": _H100,
    "h200": _H200,
}
# Unknown GPUs (cuda specs only): a conservative guess, below every preset;
# fastt.cost measures real ops anyway.
# Its half precision at the FP32 guess: fastt measures a real GPU, and refuses no precision it may have.
_UNKNOWN_GPU = GpuPreset("GPU", 10e12, 10e12, 10e12, 0.0, 500e9, 8 * GiB, 25e9, False, 12e9, 12.5e9)
NVLINK_LATENCY = 5e-6  # per route; split over the two hops of an NVSwitch route
PCIE_LATENCY = 1e-5  # per route; split over the up- and down-link
NIC_LATENCY = 3e-6  # per inter-node route; split over the sending and receiving NIC
GPU_OP_OVERHEAD = 5e-6  # kernel launch
STREAM_LATENCY = 5e-6  # one CUDA stream waiting for another's event


def _tensor_peaks(p: GpuPreset) -> tuple[float, float, float]:
    """A preset's tensor-core peaks in Device's order (fp16, bf16, tf32)."""
    return p.fp16_flops, p.bf16_flops, p.tf32_flops


def _node_links(p: GpuPreset, gpus: Sequence[int], link: str, tag: str, links: list[Link],
                routes: dict[tuple[int, int], tuple[int, ...]]) -> None:
    """Append the links within one node of GPUs (global device indices gpus) and their routes."""
    def add(name: str, bandwidth: float, latency: float) -> int:
        links.append(Link(f"{tag}{name}", bandwidth, latency))
        return len(links) - 1

    if link == "nvlink" and not p.nvswitch:  # point-to-point: a dedicated link per ordered pair
        for i, j in itertools.permutations(gpus, 2):
            routes[i, j] = (add(f"nvlink:{i}->{j}", p.nvlink, NVLINK_LATENCY),)
        return
    bw, lat, out_name, in_name = ((p.nvlink, NVLINK_LATENCY, "nvlink-out", "nvlink-in") if link == "nvlink"
                                  else (p.pcie, PCIE_LATENCY, "pcie-up", "pcie-down"))
    outs = {i: add(f"{out_name}:{i}", bw, lat / 2) for i in gpus}
    ins = {i: add(f"{in_name}:{i}", bw, lat / 2) for i in gpus}
    for i, j in itertools.permutations(gpus, 2):
        routes[i, j] = (outs[i], ins[j])


def gpu_cluster(gpu: str, n: int, nodes: int = 1, link: str = "nvlink", nic: float | None = None) -> Cluster:
    """A simulated cluster of `nodes` nodes with n `gpu` preset GPUs each (kind = the preset's name).

    Within a node GPUs talk over NVLink (V100: a link per ordered pair; A100/H100: NVSwitch, route = the
    sender's egress link then the receiver's ingress link) or over PCIe (route = sender's up-link then
    receiver's down-link to the host switch). Between nodes the route is (NIC out of the sending node, NIC in
    of the receiving node); the PCIe hop to the NIC is left out because it is faster than the NIC and is
    assumed not to be the bottleneck. `nic` (bytes/s per direction) replaces the preset's InfiniBand NIC, e.g.
    for Ethernet between nodes (its latency stays the preset's).
    """
    p = GPU_PRESETS.get(gpu.lower())
    if p is None or link not in ("nvlink", "pcie"):
        raise FasttError(f"bad cluster spec '{nodes}x{n}x{gpu}-{link}': expected {SPEC_FORMS}")
    check_count(n, "GPU per node", n * nodes)
    check_count(nodes, "node", n * nodes)
    multi = nodes > 1
    devices = tuple(Device(f"{p.name}:{k}.{i}" if multi else f"{p.name}:{i}", p.name, p.memory_bytes, p.flops,
                           p.mem_bandwidth, k, GPU_OP_OVERHEAD, *_tensor_peaks(p), kernel_efficiency=True)
                    for k in range(nodes) for i in range(n))
    links: list[Link] = []
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for k in range(nodes):
        _node_links(p, range(k * n, (k + 1) * n), link, f"n{k}/" if multi else "", links, routes)
    if multi:
        nic_out = [len(links) + k for k in range(nodes)]
        bw = p.nic if nic is None else nic
        links += [Link(f"n{k}/nic-out", bw, NIC_LATENCY / 2) for k in range(nodes)]
        nic_in = [len(links) + k for k in range(nodes)]
        links += [Link(f"n{k}/nic-in", bw, NIC_LATENCY / 2) for k in range(nodes)]
        for i, j in itertools.permutations(range(len(devices)), 2):
            if i // n != j // n:
                routes[i, j] = (nic_out[i // n], nic_in[j // n])
    name = f"{nodes}x{n}x{p.name}-{link}" if multi else f"{n}x{p.name}-{link}"
    if multi and nic is not None:
        name += f"@{nic * 8 / 1e9:g}Gbps"
    return Cluster(name, devices, tuple(links), routes)


def preset_for(name: str, total_memory: int) -> GpuPreset | None:
    """The preset matching a CUDA device name (as torch reports it) and memory size, or None if unknown.

    PCIe cards of the same chip (e.g. "V100-PCIE") are matched to the SXM preset; fastt.cost measures them.
    """
    up = name.upper()
    if "H200" in up:
        return GPU_PRESETS["h200"]
    if "H100" in up:
        return GPU_PRESETS["h100"]
    if "A100" in up:
        return GPU_PRESETS["a100-80gb" if total_memory > 60 * GiB else "a100"]
    if "V100" in up:
        return GPU_PRESETS["v100-32gb" if total_memory > 24 * GiB else "v100"]
    return None


def cuda_cluster(ids: Sequence[int] | None = None) -> Cluster:
    """The local CUDA GPUs (all, or those in ids) as a Cluster of kind "cuda" devices.

    A GPU named more than once (`cuda:0,0`) becomes that many devices on one GPU, each its own CUDA stream
    (named `cuda:0`, `cuda:0/1`, ...), sharing its memory equally; a hand-off between them moves no data
    (a stream waits for an event), costed as a copy within the GPU's memory. It runs the multi-device
    runtime on one GPU.
    """
    import torch  # local: importing fastt.cluster stays cheap

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise FasttError("no CUDA device visible; use cpu:N or a simulated cluster such as 4xV100")
    count = torch.cuda.device_count()
    ids = list(range(count)) if ids is None else list(ids)
    check_count(len(ids), "CUDA device")
    if any(not 0 <= i < count for i in ids):
        raise FasttError(f"bad CUDA device ids {ids}: {count} visible (0..{count - 1})")
    gpus = list(dict.fromkeys(ids))
    props = {i: torch.cuda.get_device_properties(i) for i in gpus}
    presets = {i: preset_for(props[i].name, props[i].total_memory) or _UNKNOWN_GPU for i in gpus}
    names = [f"cuda:{i}" + (f"/{ids[:k].count(i)}" if ids[:k].count(i) else "") for k, i in enumerate(ids)]
    devices = tuple(Device(name, "cuda", int(props[i].total_memory) // ids.count(i), presets[i].flops,
                           presets[i].mem_bandwidth, 0, GPU_OP_OVERHEAD, *_tensor_peaks(presets[i]),
                           kernel_efficiency=True)
                    for name, i in zip(names, ids))
    peer = all(torch.cuda.can_device_access_peer(a, b) for a, b in itertools.permutations(gpus, 2))
    slowest = min(presets.values(), key=lambda p: (p.nvlink, p.pcie))
    links: list[Link] = []
    between: dict[tuple[int, int], tuple[int, ...]] = {}
    _node_links(slowest, range(len(gpus)), "nvlink" if peer else "pcie", "", links, between)
    routes: dict[tuple[int, int], tuple[int, ...]] = {}
    for a, b in itertools.permutations(range(len(ids)), 2):
        ga, gb = gpus.index(ids[a]), gpus.index(ids[b])
        if ga != gb:
            routes[a, b] = between[ga, gb]
        else:  # a stream hand-off; a copy within the GPU reads and writes, so half its memory bandwidth
            routes[a, b] = (len(links),)
            links.append(Link(f"stream:{a}->{b}", presets[ids[a]].mem_bandwidth / 2, STREAM_LATENCY))
    return Cluster("cuda:" + ",".join(map(str, ids)), devices, tuple(links), routes)


def torch_device(dev: Device) -> str:
    """The torch device a device of a local cluster runs on ("cpu", "cuda:0"): a GPU device is named after its
    GPU (`cuda:0`; streams of one GPU: `cuda:0/1`; a rank of the distributed runtime: `rank:2@cuda:0`)."""
    gpu = re.search(r"cuda:\d+", dev.name) if dev.kind == "cuda" else None
    if dev.kind != "cpu" and gpu is None:
        raise FasttError(f"device {dev.name} is simulated: the local runtime runs cpu:N or local cuda "
                         "devices (simulated GPUs such as 4xV100 are for fastt plan/simulate/compare)")
    return "cpu" if gpu is None else gpu[0]
