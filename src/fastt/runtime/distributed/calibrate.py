"""Calibration: the process group's ranks as a `Cluster`, its links and gathers measured the way the runtime
sends and averages (`rank_cluster`)."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from ...cluster import Cluster, Device, Link, cpu_cluster, cuda_cluster
from ...cost import calibrate_cpu, fit_gather, fit_transfers
from .faults import alone_on_rank0
from .groups import Direction, directions, reducers
from .packing import Leaf, pack, packed_size, unpack

# (tensors, floats each); the first, one tiny tensor, pins the fixed cost (`fit_gather`)
GATHER_SHAPES = ((1, 16), (16, 16), (256, 16), (16, 2**16), (256, 2**12), (16, 2**18))


def rank_device() -> torch.device:
    """The device this rank runs on: its current GPU when the process group runs NCCL, else the CPU."""
    if "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_targets(device: torch.device) -> tuple[torch.device, ...]:
    """What a rank compiles a plan for: every device on its own (it only runs its own device's program)."""
    return (device,) * dist.get_world_size()


def synchronized(device: torch.device) -> float:
    """perf_counter once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _hop(x: torch.Tensor, other: int, sending: bool, groups: dict[Direction, dist.ProcessGroup]) -> None:
    """One message of x between this rank and `other`, the way the runtime sends one."""
    leaf = [Leaf.of(x)]
    rank = dist.get_rank()
    if sending:
        dist.isend(pack([(x, leaf[0])]), other, group=groups[rank, other]).wait()
    else:
        buf = torch.empty(packed_size(leaf), dtype=torch.uint8, device=x.device)
        dist.irecv(buf, other, group=groups[other, rank]).wait()
        unpack(buf, leaf)


def measure_p2p(peer: int, groups: dict[Direction, dist.ProcessGroup], device: torch.device,
                sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22, 2**24),
                repeats: int = 5) -> tuple[list[int], list[float]]:
    """Seconds a message of each size takes from rank 0 to `peer` the way the runtime sends one (packed into a
    buffer, `isend`, `irecv` into a fresh buffer, unpacked): half a ping-pong, median of repeats. Rank 0 and
    `peer` call it together (with `directions(device)`, which every rank makes), other ranks do not."""
    rank, times = dist.get_rank(), []
    other = peer if rank == 0 else 0
    for n in sizes:
        x = torch.rand(n // 4, device=device)
        ts = []
        for _ in range(repeats + 1):
            t0 = synchronized(device)
            _hop(x, other, rank == 0, groups)
            _hop(x, other, rank != 0, groups)
            ts.append((synchronized(device) - t0) / 2)
        times.append(statistics.median(ts[1:]))
    return list(sizes), times


def _average(xs: Sequence[torch.Tensor], leaves: Sequence[Leaf], group: dist.ProcessGroup,
             buf: torch.Tensor) -> None:
    """Two ranks average tensors the way the runtime's collectives do for two replicas (in a buffer kept from
    step to step): pack, `all_reduce`, divide, unpack."""
    pack(list(zip(xs, leaves)), buf)
    dist.all_reduce(buf.view(leaves[0].dtype), group=group)
    buf.view(leaves[0].dtype).div_(2.0)
    unpack(buf, leaves)


def measure_gather(group: dist.ProcessGroup, device: torch.device,
                   shapes: Sequence[tuple[int, int]] = GATHER_SHAPES,
                   repeats: int = 9) -> tuple[list[tuple[int, int]], list[float], list[float]]:
    """Seconds the two ranks of `group` take to average `k` tensors of `f` floats each (`shapes`: (k, f)), the
    way the runtime's collectives do (`_average`), median of repeats: ([(bytes, tensors)], seconds, this
    process's CPU seconds in them, gloo's threads included). The group's ranks call it together."""
    points, times, cpu = [], [], []
    for k, f in shapes:
        xs = [torch.rand(f, device=device) for _ in range(k)]
        leaves = [Leaf.of(x) for x in xs]
        buf = torch.empty(packed_size(leaves), dtype=torch.uint8, device=device)
        ts, cs = [], []
        for _ in range(repeats + 1):
            t0, c0 = synchronized(device), time.process_time()
            _average(xs, leaves, group, buf)
            ts.append(synchronized(device) - t0)
            cs.append(time.process_time() - c0)
        points.append((4 * k * f, k))
        times.append(statistics.median(ts[1:]))
        cpu.append(statistics.median(cs[1:]))
    return points, times, cpu


def measure_agreement(device: torch.device, repeats: int = 15) -> float:
    """Seconds the ranks take to agree on a batch's shards (`DistributedStep._agree`: an all_gather of a few
    numbers a rank), from a barrier, median of repeats. Every rank calls it; each gets its own."""
    world = dist.get_world_size()
    mine = torch.zeros(1 + world, dtype=torch.float64, device=device)
    everyone = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = synchronized(device)
        dist.all_gather_single(everyone, mine)
        everyone.tolist()
        times.append(synchronized(device) - t0)
    return statistics.median(times[1:])


def rank_cluster(device: torch.device | None = None) -> Cluster:
    """The process group's ranks as a Cluster, one device per rank: its share of a node's cores, calibrated
    (gloo), or its GPU (NCCL: `rank:R@cuda:I`, costed from the GPU's name, as `cuda_cluster` does). Nodes come
    from torchrun's LOCAL_WORLD_SIZE; one link per (ordered) pair of nodes, whose latency and bandwidth are
    fitted (least squares) on messages measured for each link class: within a node (rank 0 to rank 1) and
    between nodes (rank 0 to the first rank of node 1). Gradients are averaged by the runtime's collectives (a
    gather: `Cluster.gather`), whose cost between two ranks is fitted on measured ones (`measure_gather`),
    across nodes when there are several. Every rank calls it; all get rank 0's numbers (and on GPUs their own
    GPU)."""
    device = device or rank_device()
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = [r // per_node for r in range(world)]
    fitted, gather, comm = _measured_links(device, per_node, node)
    cpu = device.type == "cpu"
    speed = alone_on_rank0(lambda: calibrate_cpu(cpu_cluster(1)).devices[0] if cpu else None)
    box = [(fitted, speed, gather, comm) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    fitted, dev, gather, comm = box[0]
    if cpu:
        share = dev.memory_bytes // per_node
        devices = tuple(replace(dev, name=f"rank:{r}", memory_bytes=share, node=node[r], comm_s_per_byte=comm)
                        for r in range(world))
    else:  # every rank's GPU is taken to be of this rank's kind; each is named after its place on its node
        gpu = cuda_cluster([device.index]).devices[0]
        devices = tuple(replace(gpu, name=f"rank:{r}@cuda:{r % per_node}", node=node[r])
                        for r in range(world))
    return _cluster_of(devices, node, fitted, gather, "gloo" if cpu else "nccl")


def _measured_links(device: torch.device, per_node: int,
                    node: Sequence[int]) -> tuple[dict[str, tuple[float, float]], tuple | None, float]:
    """On rank 0, the fitted (latency, bandwidth) per link class ('intra', 'inter': within a node, between
    nodes), the gather's fit, and the CPU seconds per byte a rank sends or receives (`Device.comm_s_per_byte`:
    the gather's CPU time per byte averaged, halved, since each of the two ranks sends and receives every
    byte), measured with the first rank of each class; empty elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = {"intra": 1 if world > 1 and node[1] == 0 else None,
             "inter": per_node if per_node < world else None}
    fitted: dict[str, tuple[float, float]] = {}
    gather, comm, groups = None, 0.0, directions(device)
    pairs = reducers([(0, peer) for peer in peers.values() if peer is not None], device)
    for cls, peer in peers.items():  # the gather across nodes (measured last) is the slower one
        if peer is None:
            continue
        if rank in (0, peer):
            sizes, secs = measure_p2p(peer, groups, device)
            points, times, cpu = measure_gather(pairs[0, peer], device)
            if rank == 0:
                fitted[cls] = fit_transfers(sizes, secs, relative=True)
                gather = fit_gather(points, times)
                comm = fit_gather(points, cpu)[1] / 2
        dist.barrier()
    return fitted, gather, comm


def _cluster_of(devices: tuple[Device, ...], node: Sequence[int], fitted: dict[str, tuple[float, float]],
                gather: tuple | None, backend: str) -> Cluster:
    """The cluster of `devices` with one link per (ordered) pair of nodes, shared by all their ranks: on a
    node, messages go through the host's TCP stack on the cores that compute (two ranks exchanging take twice
    as long as one sending); between nodes, through one connection."""
    world = len(devices)
    links, index, routes = [], {}, {}
    for i, j in itertools.permutations(range(world), 2):
        pair = (node[i], node[j])
        if pair not in index:
            cls = "intra" if node[i] == node[j] else "inter"
            index[pair] = len(links)
            name = f"n{node[i]}" if cls == "intra" else f"n{node[i]}->n{node[j]}"
            links.append(Link(f"{backend}-{cls}:{name}", fitted[cls][1], fitted[cls][0]))
        routes[i, j] = (index[pair],)
    return Cluster(f"{backend}:{world}", devices, tuple(links), routes, gather)
