"""The per-rank executor: one step of this rank's segments, with the wiring's messages and collectives instead
of the local runtime's shared memory (`RankRun`), and the buffers it keeps from step to step (`Buffers`).

    run() +-- _run() +-- post_receives()              every receive of the step, up front
                     +-- per segment: start() -> receive() -> reduce() -> run_segment() -> send()
                     +-- _end()                       end-of-step messages, the collectives left,
                                                      sharded updates' all-gathers and joins (`_rows_end`)
          +-- finish()                                every send (on a GPU every receive, and the GPU)
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_unflatten

from ...cost import replica_mean
from ...lower import Lowered
from ..local import _Run
from ..oom import Budget
from ..programs import Programs, rows
from .collectives import ReduceCall, RowGather, Shards
from .faults import HEARTBEAT_S, LostPeer, RankError, failure_recorded, lost
from .groups import directions, reducers
from .packing import Leaf, pack, packed_size, unpack
from .wiring import Wiring


class Buffers:
    """Buffers of messages and collectives kept from step to step: a fresh buffer of megabytes costs its page
    faults every step. Not for messages or collectives that carry a value this rank keeps after the step (a
    new parameter, or a mean, is a view of the buffer): those get a fresh one each time. A message's key is
    its index; a collective's, (its index, a dtype) for a sum, (its index, a dtype, a role) for the sharded
    form."""

    def __init__(self, wiring: Wiring, rank: int, device: torch.device) -> None:
        kept = set(wiring.keep[rank].values())
        names = {name for _, name in kept}
        self.fresh = frozenset([  # a view the rank makes of a message's value is of its buffer too
            *(i for i, m in enumerate(wiring.messages)
              if m.dst == rank and kept & {*m.values, *(v for v, _, _ in wiring.derived[i])}),
            *(c for c, col in enumerate(wiring.collectives) if names & set(col.names))])
        self.kept: dict[int | tuple, torch.Tensor] = {}
        self.device = device

    def get(self, key: int | tuple, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The buffer of `key` (its sends have completed, its values of the last step are gone), viewed as
        `dtype` (`nbytes` a multiple of its size)."""
        if (key if isinstance(key, int) else key[0]) in self.fresh:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device).view(dtype)
        buf = self.kept.get(key)
        if buf is None or buf.numel() != nbytes:  # a key's size may change (one process's rows end in a flag)
            buf = self.kept[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf.view(dtype)


class _Serial:
    """A thread that runs functions one at a time, in the order they come (`submit`): a rank's collectives of
    more than two replicas, whose second half (an `all_gather`) can only start once the first has arrived and
    been summed, and which every rank must start on a process group in one order."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="fastt-collectives").start()

    def submit(self, fn: Callable[[], list]) -> Future:
        future: Future = Future()
        self.queue.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            fn, future = self.queue.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the rank that waits for it
                future.set_exception(e)
            # Nothing of a done job stays in this daemon thread's frame: its closure holds works and process
            # groups, which outlived destroy_process_group there and aborted one run in ten at exit
            # ("terminate called without an active exception", rank 1 of tests/distributed_shards.py).
            del fn, future


@functools.cache
def _serial() -> _Serial:
    """The process's one `_Serial` thread (a rank is a process), started when first needed."""
    return _Serial()


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a GPU's sharded collectives are queued on, made once per GPU."""
    return torch.cuda.Stream(device)


class _Then:
    """The `all_gather`s of a sharded collective, issued by the `_Serial` thread (`future`) or already (a
    GPU), into `outs` (one per dtype; a reduce-scatter's: its parts of the mean, once done): what a rank
    waits for. Raises what the thread raised."""

    def __init__(self, future: Future, outs: list[torch.Tensor] | dict) -> None:
        self.future, self.outs = future, outs

    def is_completed(self) -> bool:
        return self.future.done() and all(w.is_completed() for w in self.future.result())

    def wait(self) -> None:
        for w in self.future.result():
            w.wait()


class _Posted(NamedTuple):
    """A receive posted into `buf` (None: an empty message, nothing posted)."""

    buf: torch.Tensor
    work: dist.Work | None


class _Sent(NamedTuple):
    """Message `message`'s send, from `buf`."""

    message: int
    buf: torch.Tensor
    work: dist.Work


class _SumPart(NamedTuple):
    """One dtype of a two-replica collective: the `all_reduce` of `buf`, which holds tensors of `leaves`."""

    leaves: list[Leaf]
    buf: torch.Tensor
    work: dist.Work


class _ShardJob(NamedTuple):
    """One dtype of the sharded form: what this rank sends, receives, sums (its shard) and gathers."""

    shards: Shards
    send: torch.Tensor
    recv: torch.Tensor
    mine: torch.Tensor
    out: torch.Tensor


class _Watch(NamedTuple):
    """What a rank says when a wait fails: at its deadline (`stalled`), and what it waited for (`what`)."""

    stalled: Callable[[], str]
    what: Callable[[], str]


class _Pending(NamedTuple):
    """Work a GPU's stream waits for, which the rank polls at the end of the step."""

    work: object
    watch: _Watch


class RankRun(_Run):
    """One step on this rank: its device's segments, with the wiring's messages instead of shared memory.
    On a GPU the rank only queues work: a receive makes the rank's stream wait for it, and the step ends by
    waiting (at most the timeout) for every message and the GPU."""

    signalled = False

    def __init__(self, low: Lowered, programs: Programs, wiring: Wiring, envs: list[dict], rank: int,
                 timeout: timedelta, buffers: Buffers, timings: list | None = None,
                 budgets: Sequence[Budget] = ()) -> None:
        super().__init__(low, programs, envs, torch.get_num_threads(), timings, budgets=budgets)
        self.wiring, self.rank, self.timeout, self.buffers = wiring, rank, timeout, buffers
        self.groups = directions(buffers.device)
        # On a GPU, its default stream: never a pooled stream, which a direction's NCCL ops may run on.
        if self.cuda:
            self.streams = (torch.cuda.default_stream(buffers.device),) * len(programs.devices)
        self.sends: list[_Sent] = []
        self.posted: dict[int, _Posted] = {}  # by message
        self.reducers = reducers([*(c.ranks for c in wiring.collectives), *(g.ranks for g in wiring.gathers)],
                                 buffers.device)
        # Collectives started and not yet waited for: with two replicas, their sums (per dtype); with more,
        # the sharded form's all_gathers. A rank on its own in a collective starts nothing.
        self.sums: dict[int, list[_SumPart]] = {}
        self.gathers: dict[int, _Then] = {}
        self.pending: list[_Pending] = []  # on a GPU, what to wait for at the end

    def run(self) -> None:
        d = self.rank
        if self.cuda:  # after what the caller queued (the batch)
            self.streams[d].wait_stream(torch.cuda.current_stream(self.programs.targets[d]))
            with torch.cuda.stream(self.streams[d]):
                self._run(d)
        else:
            self._run(d)
        self.finish()

    def _run(self, d: int) -> None:
        self.post_receives()
        for i, seg in enumerate(self.programs.devices[d]):
            self.start(self.wiring.start_before[d][i])
            self.receive(self.wiring.recv_before[d][i])
            self.reduce(self.wiring.reduce_before[d][i])
            if not self.run_segment(seg, d):
                raise RankError(self.failure()) from self.error[2]
            self.send(self.wiring.send_after[d][i])
        self.start(self.wiring.start_before[d][-1])
        self._end(d)

    def _end(self, d: int) -> None:
        """After the last segment: name the slices of buffers this rank's split ops wrote, exchange the
        end-of-step messages, and wait for the collectives this rank only contributed to."""
        for c in self.wiring.chunks[d]:
            self.envs[0][c.name] = torch.tensor_split(self.envs[0][c.buffer], c.parts, c.dim)[c.index]
        messages = self.wiring.messages
        self.send([i for i in self.wiring.final if messages[i].src == d])
        self.receive([i for i in self.wiring.final if messages[i].dst == d])
        if self.posted:  # a receive left posted would take the next step's message
            raise RankError(f"messages {sorted(self.posted)[:5]} were posted but never read (a wiring bug)")
        for c, parts in self.sums.items():
            for part in parts:
                self._wait_collective(self.wiring.collectives[c], part.work)
        for c, then in self.gathers.items():
            self._wait_collective(self.wiring.collectives[c], then)
        self.sums.clear()
        self.gathers.clear()
        self._rows_end(d)

    def _rows_end(self, d: int) -> None:
        """Sharded updates' results, after every other collective of the step: each new parameter gathered
        whole (one `all_gather` per dtype, every rank's parts padded to the most a rank has), and the state
        whose parts this rank received joined; both as replica 0's value, which the rank keeps. Chained
        updates' results: their parts joined, in the replica's table whose parts the rank has."""
        for g in self.wiring.gathers:
            if d in g.ranks:
                self._gather(g)
        for value, parts in self.wiring.joins[d]:
            self.envs[0][value] = torch.cat([self.envs[k][value] for k in range(parts)])
        for r, value, dim, parts in self.wiring.chained[d]:  # a tensor-parallel weight's or its state's parts
            made = [self.envs[r][f"{value}#{k}"] for k in range(parts if dim >= 0 else 1)]
            self.envs[r][value] = torch.cat(made, dim) if dim >= 0 else made[0]

    def _gather(self, g: RowGather) -> None:
        made = {}
        for dtype in dict.fromkeys(leaf.dtype for leaf in g.leaves):
            if len(g.ranks) == 1:  # a rank on its own: it has every part
                made.update({(i, p): self.envs[p][g.names[i]] for i, p in g.pieces(g.ranks[0], dtype)})
                continue
            send = g.pack(self.envs, self.rank, dtype, self.buffers.device)
            out = torch.empty(len(g.ranks) * send.numel(), dtype=dtype, device=self.buffers.device)
            try:
                work = dist.all_gather_single(out, send, group=self.reducers[g.ranks], async_op=True)
            except RuntimeError as e:
                raise LostPeer(self._failed(g, e)) from e
            self._wait_collective(g, work)
            made.update(g.parts(out, dtype))
        self.envs[0].update(g.wholes(made))

    def post_receives(self) -> None:
        """Post every receive of the step up front, each into its buffer, in the order the senders send them:
        a message then finds its buffer waiting (receives posted late make an exchange slower)."""
        for i in self.wiring.inbox[self.rank]:
            m = self.wiring.messages[i]
            buf = self.buffers.get(i, packed_size(self.wiring.leaves[i]))
            try:
                self.posted[i] = _Posted(buf, dist.irecv(buf, m.src, group=self.groups[m.src, m.dst])
                                         if buf.numel() else None)
            except RuntimeError as e:
                raise LostPeer(lost(m.src, m.values[0][1], e, self.timeout)) from e

    def receive(self, ms: Sequence[int]) -> None:
        for i in ms:
            m, leaves = self.wiring.messages[i], self.wiring.leaves[i]
            posted = self.posted.pop(i)
            self._wait_message(i, posted.work, m.src, m.values[0][1])
            tensors = iter(unpack(posted.buf, leaves))
            for v in m.values:
                layout = self.wiring.layouts[v]
                self.envs[v[0]][v[1]] = tree_unflatten([next(tensors) for _ in layout.leaves], layout.spec)
            for v, base, path in self.wiring.derived[i]:  # views of a value it carried, made from it here
                x = self.envs[base[0]][base[1]]
                for name in path:
                    node = self.programs.nodes[name]
                    x = node.target(x, *node.args[1:], **node.kwargs)
                self.envs[v[0]][v[1]] = x

    def send(self, ms: Sequence[int]) -> None:
        for i in ms:
            m = self.wiring.messages[i]
            pairs = [pair for v in m.values
                     for pair in zip(tree_leaves(self.envs[v[0]][v[1]]), self.wiring.layouts[v].leaves)]
            buf = pack(pairs, self.buffers.get(i, packed_size(self.wiring.leaves[i])))
            if buf.numel():
                self.sends.append(_Sent(i, buf, dist.isend(buf, m.dst, group=self.groups[m.src, m.dst])))

    def start(self, cs: Sequence[int]) -> None:
        """Start collectives `cs`, not waited for. Two replicas: this rank's part of their sum (both gradients
        added in replica order, one, or zeros) and an `all_reduce` per dtype: a + b is b + a, bit for bit.
        More: the sharded form (`ReduceCall`, `_start_shards`)."""
        for c in cs:
            col = self.wiring.collectives[c]
            if len(col.ranks) == 1:
                continue  # a rank on its own: `reduce` takes the mean itself
            if col.rows:
                self.gathers[c] = self._start_rows(c, col)
            elif self.low.replicas == 2:
                self.sums[c] = self._start_sum(c, col)
            else:
                self.gathers[c] = self._start_shards(c, col)

    def _start_sum(self, c: int, col: ReduceCall) -> list[_SumPart]:
        pairs = []
        for name, src, leaf in zip(col.names, col.sources, col.leaves):
            mine = [self.envs[k][name] for k, r in enumerate(src) if r == self.rank]
            pairs.append((mine[0] + mine[1] if len(mine) == 2 else mine[0] if mine else
                          torch.zeros(leaf.shape, dtype=leaf.dtype, device=self.buffers.device), leaf))
        started = []
        for dtype in dict.fromkeys(leaf.dtype for leaf in col.leaves):
            these = [(x, leaf) for x, leaf in pairs if leaf.dtype == dtype]
            buf = pack(these, self.buffers.get((c, dtype), packed_size([leaf for _, leaf in these])))
            try:
                work = dist.all_reduce(buf.view(dtype), group=self.reducers[col.ranks], async_op=True)
            except RuntimeError as e:
                raise LostPeer(self._failed(col, e)) from e
            started.append(_SumPart([leaf for _, leaf in these], buf, work))
        return started

    def _start_shards(self, c: int, col: ReduceCall) -> _Then:
        """The sharded form: this rank's slices of the gradients it holds go to the shards' owners by an
        `all_to_all`; this rank sums its shard's replicas in replica order and divides (as `replica_mean`),
        and an `all_gather` of the shards follows (`_exchange`). On the CPU the exchange and the sum run on
        the `_Serial` thread, which starts a rank's collectives in the order they come; on a GPU all of it is
        queued at once, on a side stream."""
        jobs = self._shard_jobs(c, col)
        return self._submit(col, functools.partial(self._exchange, jobs, self.reducers[col.ranks]),
                            [job.out for job in jobs])

    def _start_rows(self, c: int, col: ReduceCall) -> _Then:
        """A reduce-scatter: per dtype, this rank's row parts of the gradients it holds go to the parts'
        owners by an `all_to_all`, and this rank sums the parts it owns in replica order and divides
        (`RowShards`); on the `_Serial` thread, as the sharded form. Its outs: (gradient, part) -> that part
        of the mean. On a GPU all of it is queued on the rank's stream."""
        jobs, means = [], {}
        for sh in col.row_shards(self.rank):
            def buf(role: str, numel: int, sh=sh) -> torch.Tensor:
                return self.buffers.get((c, sh.dtype, role), numel * sh.dtype.itemsize, sh.dtype)
            jobs.append((sh, sh.pack(self.envs, col, buf("send", sum(sh.send_counts))),
                         buf("recv", sum(sh.recv_counts))))
        group = self.reducers[col.ranks]

        def exchange() -> list:
            for sh, send, recv in jobs:
                work = dist.all_to_all_single(recv, send, list(sh.recv_counts), list(sh.send_counts),
                                              group=group, async_op=True)
                work.wait() if self.cuda else work.wait(self.timeout)
                means.update(sh.means(recv, col))
            return []
        if self.cuda:  # no side stream: the rank's stream then reads the parts in order
            done: Future = Future()
            try:
                done.set_result(exchange())
            except RuntimeError as e:
                raise LostPeer(self._failed(col, e)) from e
            return _Then(done, means)
        return self._submit(col, exchange, means)

    def _submit(self, col: ReduceCall, exchange: Callable[[], list], outs) -> _Then:
        """Run a collective's `exchange` on the `_Serial` thread (CPU) or queue it on a side stream (GPU)."""
        try:
            if not self.cuda:
                return _Then(_serial().submit(exchange), outs)
            side = _side_stream(self.buffers.device)
            side.wait_stream(torch.cuda.current_stream(self.buffers.device))
            done: Future = Future()
            with torch.cuda.stream(side):
                done.set_result(exchange())
            return _Then(done, outs)
        except RuntimeError as e:
            raise LostPeer(self._failed(col, e)) from e

    def _shard_jobs(self, c: int, col: ReduceCall) -> list[_ShardJob]:
        """Per dtype, what this rank sends (packed now, from its replicas' gradients), and its buffers."""
        n, jobs = len(col.ranks), []
        for sh in col.shards(self.rank):
            def buf(role: str, numel: int, sh: Shards = sh) -> torch.Tensor:
                return self.buffers.get((c, sh.dtype, role), numel * sh.dtype.itemsize, sh.dtype)
            jobs.append(_ShardJob(sh, sh.pack(self.envs, col, buf("send", sum(sh.send_counts))),
                                  buf("recv", sum(sh.recv_counts)), buf("mine", sh.size),
                                  buf("out", n * sh.size)))
        return jobs

    def _exchange(self, jobs: Sequence[_ShardJob], group: dist.ProcessGroup) -> list:
        """Per dtype: the `all_to_all`, waited for; this rank's shard of the mean; its `all_gather`."""
        gathers = []
        for sh, send, recv, mine, out in jobs:
            work = dist.all_to_all_single(recv, send, list(sh.recv_counts), list(sh.send_counts), group=group,
                                          async_op=True)
            if self.cuda:
                work.wait()  # the side stream waits
            else:
                work.wait(self.timeout)
            sh.mean(recv, mine)
            gathers.append(dist.all_gather_single(out, mine, group=group, async_op=True))
        return gathers

    def reduce(self, cs: Sequence[int]) -> None:
        """Wait for collectives `cs` (on a GPU: the stream waits); every replica's gradients become their
        mean, as `replica_mean` computes it (the sum in replica order, then divided)."""
        for c in cs:
            col = self.wiring.collectives[c]
            if col.rows:
                self._scattered(col, self.gathers.pop(c, None))
                continue
            if len(col.ranks) == 1:  # a rank on its own
                means = dict(zip(col.names, replica_mean([[env[x] for x in col.names] for env in self.envs])))
            elif self.low.replicas == 2:
                means = self._summed(col, self.sums.pop(c))
            else:
                means = self._gathered(col, self.gathers.pop(c))
            for env in self.envs:
                env.update(means)

    def _scattered(self, col: ReduceCall, then: _Then | None) -> None:
        """A reduce-scatter's parts of the mean into the tables of the replicas that update them (a rank on
        its own in it, `then` None: every part, from its replicas' gradients)."""
        if then is not None:
            self._wait_collective(col, then)
            means = then.outs
        else:
            n = len(col.rows)
            means = {(j, p): x for p in range(n) for j, x in enumerate(replica_mean(
                [[rows(env[name], n, p) for name in col.names] for env in self.envs]))}
        for (j, p), x in means.items():
            self.envs[p][col.names[j]] = x

    def _summed(self, col: ReduceCall, parts: Sequence[_SumPart]) -> dict[str, torch.Tensor]:
        """The means of a two-replica collective: its sums, divided."""
        means = {}
        for part in parts:
            self._wait_collective(col, part.work)
            dtype = part.leaves[0].dtype
            part.buf.view(dtype).div_(float(self.low.replicas))
            means.update(zip([x for x, leaf in zip(col.names, col.leaves) if leaf.dtype == dtype],
                             unpack(part.buf, part.leaves)))
        return means

    def _gathered(self, col: ReduceCall, then: _Then) -> dict[str, torch.Tensor]:
        """The means of a sharded collective: views of its gathered shards."""
        self._wait_collective(col, then)
        means = {}
        for sh, out in zip(col.shards(self.rank), then.outs):
            means.update(sh.means(out, col))
        return means

    def _wait_message(self, i: int, work: dist.Work | None, src: int, name: str) -> None:
        """Wait for message i's receive (from `src`, carrying `name` first): on a GPU the stream waits (see
        `finish`), on the CPU the rank, at most the timeout."""
        if work is None:
            return
        try:
            if self.cuda:
                work.wait()
                self.pending.append(_Pending(work, self._message_watch(i)))
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise LostPeer(lost(src, name, e, self.timeout)) from e

    def _wait_collective(self, col: ReduceCall, work: dist.Work | _Then) -> None:
        """Wait for a collective: on a GPU the stream waits (see `finish`), on the CPU the rank, at most the
        timeout, polling (`_poll`): when one of its ranks dies, the others may only learn it from the
        connection of a survivor next to it."""
        try:
            if self.cuda:
                work.wait()
                self.pending.append(_Pending(work, self._collective_watch(col)))
            else:
                self._poll(work, time.monotonic() + self.timeout.total_seconds(), self._collective_watch(col))
                work.wait()
        except LostPeer:
            raise
        except RuntimeError as e:
            raise LostPeer(self._failed(col, e)) from e

    def _message_watch(self, i: int) -> _Watch:
        m = self.wiring.messages[i]
        peer = m.src if m.dst == self.rank else m.dst
        return _Watch(lambda: (f"rank {peer} exchanged nothing for {self.timeout.total_seconds():g} s "
                               f"(message with '{m.values[0][1]}'): rank {peer} is stalled or dead"),
                      lambda: f"the message with '{m.values[0][1]}'")

    def _collective_watch(self, col: ReduceCall) -> _Watch:
        return _Watch(lambda: self._failed(col, TimeoutError("timed out")),
                      lambda: f"the allreduce of '{col.names[0]}'")

    def _poll(self, work: dist.Work | _Then, deadline: float, watch: _Watch) -> None:
        """Wait until `work` is done, raising `LostPeer` at the deadline or once another rank has recorded a
        failure (looked up every heartbeat period), which names the dead rank."""
        look = 0.0
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise LostPeer(watch.stalled())
            if now > look:
                look = now + HEARTBEAT_S
                if failure_recorded():
                    raise LostPeer(f"stopped waiting for {watch.what()}: another rank failed")
            time.sleep(2e-4)

    def _failed(self, col: ReduceCall, e: BaseException) -> str:
        """Why an allreduce failed: the peer, when it had one other rank; else the ranks (and the heartbeats
        of the store name the one that stopped, see `record_failure`)."""
        others = [r for r in col.ranks if r != self.rank]
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            return (f"{who} did not join the allreduce of '{col.names[0]}' for "
                    f"{self.timeout.total_seconds():g} s: {who} is stalled or dead")
        if len(others) == 1:
            return lost(others[0], col.names[0], e, self.timeout)
        return (f"lost {who} (in the allreduce of '{col.names[0]}': "
                f"{type(e).__name__}: {str(e).splitlines()[0]})")

    def finish(self) -> None:
        """Wait for every send (and on a GPU every receive, then the GPU) within the timeout; segment timings
        become (segment index, seconds)."""
        if self.cuda:
            deadline = time.monotonic() + self.timeout.total_seconds()
            sends = [_Pending(s.work, self._message_watch(s.message)) for s in self.sends]
            for p in [*self.pending, *sends]:
                self._poll(p.work, deadline, p.watch)
            torch.cuda.synchronize(self.programs.targets[self.rank])
        else:
            for s in self.sends:
                try:
                    s.work.wait(self.timeout)
                except RuntimeError as e:
                    raise LostPeer(f"a send to rank {self.wiring.messages[s.message].dst} failed "
                                   f"({type(e).__name__}: {e})") from e
        if self.timings is not None:
            self.timings[:] = [(k, t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3)
                               for k, (_, _, t) in enumerate(self.timings)]
