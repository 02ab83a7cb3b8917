"""The distributed runtime: one process per device over torch.distributed (gloo on CPU, NCCL on GPU), launched
by torchrun.

Every rank builds the same model, captures the same step and compiles the same programs as the local runtime
(`programs.compile_programs`); rank d runs device d's segments. What the local runtime hands over in memory
goes by point-to-point messages, all known before the first step (`wire`):

- a value one device reads from another: sent (`isend`, non-blocking) right after the segment that produced
  it, received right before the first segment that reads it. Sends never block and a rank only waits for
  values that come earlier in a valid plan, so no order of ranks can deadlock (the local runtime's argument).
- an allreduce: a collective of the ranks that hold one of its gradients or read its mean, after which all of
  them hold the same mean, bit for bit the local runtime's and eager data parallelism's (the sum in replica
  order): an `all_reduce` for two replicas (a + b is b + a), else each rank sums its shard of the mean in
  order (an `all_to_all` brings it the replicas' parts) and an `all_gather` of the shards follows
  (`ReduceCall`). Ranks start the collectives they share in one order, which cannot deadlock
  (`order_collectives`); allreduces that become ready together go in one.
- at the end of the step: the new parameters, optimizer state and batch-norm buffers go to the ranks that read
  them next step; the replicas' losses to rank 0. Rank 0's model becomes the truth when every rank calls
  `DistributedStep.sync()` (before a checkpoint or an evaluation on rank 0; rank 0 refuses a `state_dict()`
  or a forward of its model until then), which brings it the values it does not read from the ranks that
  keep them (`truth_to_rank0`).
- sharded updates (`fastt.shard`): the gradient's reduce-scatter is that `all_to_all` alone, cut at the row
  parts (`RowShards`); at the end the new parameter's rows are all-gathered (`RowGather`), and of the state
  each rank keeps its rows, rank 0 the whole (the others' rows sent to it).
- chained updates (tensor-parallel weights, `split.chain_update`): part k of a new weight and of its state is
  made on the rank of its gradient's part k; at the end the parts go to every rank that reads the weight
  next step, which join them (`Wiring.chained`). Where the gradient parts are averaged across
  replicas (megatron on several nodes), part k's allreduce is a collective of the ranks holding part k.

Messages carry no tags: each direction between two ranks has a process group of its own (`directions`), whose
messages are received in the order they are sent (`Wiring.inbox`), which is how NCCL matches them; gloo runs
the same way. On a GPU a rank only queues work (a receive makes its stream wait) and waits at the end of the
step.

A rank that fails records the job's first failure in the process group's store and raises `RankError` (the
launcher exits non-zero); its peers then lose it in turn and report that first failure. Every wait has a
timeout, and ranks count heartbeats in the store, so a rank that loses a connection names the rank that
stopped. A rank waiting for a collective (which does not say which rank is gone) also stops once another rank
has recorded a failure.

The modules, in the order the data goes through them (each imports only those above it):

- `packing`: the wire format, tensors in one byte buffer as the captured step laid them out (`Leaf`).
- `collectives`: the allreduces as collectives of ranks (`ReduceCall`, `Shards`) and their one order.
- `wiring`: every message and collective of a step (`wire`, `Wiring`, `Message`).
- `groups`: the process groups per direction and per set of reducing ranks.
- `faults`: failures, timeouts and heartbeats (`RankError`, `LostPeer`, `record_failure`, `alone_on_rank0`).
- `executor`: one step of this rank's segments (`RankRun`).
- `calibrate`: the ranks as a `Cluster`, measured (`rank_cluster`).
- `step`: this rank's training step (`DistributedStep`).
- `parallelize`: capture, plan and place over the process group (`parallelize_distributed`).
"""

from .calibrate import (
    GATHER_SHAPES,
    fit_gather,
    measure_gather,
    measure_p2p,
    rank_cluster,
    rank_device,
    rank_targets,
)
from .collectives import ReduceCall, Shards
from .faults import (
    DEFAULT_TIMEOUT_S,
    FAILED_KEY,
    HEARTBEAT_S,
    LostPeer,
    RankError,
    alone_on_rank0,
    await_reports,
    failure_recorded,
    record_failure,
    said,
    silent_ranks,
    start_heartbeat,
)
from .groups import directions, reducers
from .packing import ALIGN, Leaf, pack, packed_size, unpack
from .parallelize import parallelize_distributed, whole_batch
from .step import DistributedStep, sync_from_rank0
from .wiring import Message, Wiring, reads, wire

__all__ = [
    "ALIGN",
    "DEFAULT_TIMEOUT_S",
    "FAILED_KEY",
    "GATHER_SHAPES",
    "HEARTBEAT_S",
    "DistributedStep",
    "Leaf",
    "LostPeer",
    "Message",
    "RankError",
    "ReduceCall",
    "Shards",
    "Wiring",
    "alone_on_rank0",
    "await_reports",
    "directions",
    "failure_recorded",
    "fit_gather",
    "measure_gather",
    "measure_p2p",
    "pack",
    "packed_size",
    "parallelize_distributed",
    "rank_cluster",
    "rank_device",
    "rank_targets",
    "reads",
    "record_failure",
    "reducers",
    "said",
    "silent_ranks",
    "start_heartbeat",
    "sync_from_rank0",
    "unpack",
    "whole_batch",
    "wire",
]
