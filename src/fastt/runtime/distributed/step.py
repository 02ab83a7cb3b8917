"""The training step of one rank (`DistributedStep`): its shard of the batch in, the plan's messages run, the
new state kept where it is read next; how rank 0's model becomes the truth (`truth_to_rank0`) and how every
rank takes rank 0's state (`sync_from_rank0`)."""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ... import guards
from ...capture import batch_mismatch, bind, stepped
from ...cluster import Cluster
from ...cost import MeasuredCosts
from ...errors import FasttError
from ...graph import OpGraph
from ...strategy import Strategy
from ..local import replica_envs, replica_tables, weighted_loss
from ..oom import oom_message, out_of_memory
from ..programs import Placed, place
from ..shards import Feed, Piece, plan_feed, shard_of
from ..step import EagerStep, PlacedStep
from ..tune import Tuner
from .executor import Buffers, RankRun
from .faults import DEFAULT_TIMEOUT_S, LostPeer, RankError, alone_on_rank0, lost, record_failure, wait_done
from .groups import directions, reducers
from .packing import Leaf, pack, packed_size, unpack
from .wiring import Wiring, reads, wire


class DistributedStep(PlacedStep):
    """One training step of this rank's share of a plan: `loss = step(*shard)`, every rank passing its shard
    of the batch: rank r's B/world samples, rows [r·B/world, (r+1)·B/world) of the whole batch of B the step
    was captured with (`fastt.runtime.shards`; in a data-parallel plan rank r's shard is replica r's share,
    what `DistributedSampler` and a DataLoader of batch B/world give rank r). The rows a plan reads on another
    rank travel there. Every rank may instead pass the same whole batch (nothing travels). The loss comes back
    on rank 0, None elsewhere.

    After a step each rank keeps what its devices read next step: of a sharded update's state (`fastt.shard`),
    only its rows (rank 0 all of them); of a tensor-parallel weight (chained updates), it and its state whole,
    its parts joined. A parameter or state that rank 0 does not read stays on the ranks that do: rank 0's
    model and optimizer are the truth after `sync()`, which every rank calls (before a checkpoint or an
    evaluation on rank 0). Until then rank 0 refuses its model's `state_dict()` and forward and its
    optimizer's `state_dict()`, naming the ranks that hold the newest values."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, placed: Placed,
                 wiring: Wiring, timeout_s: float = DEFAULT_TIMEOUT_S, graph: OpGraph | None = None,
                 cluster: Cluster | None = None, costs: MeasuredCosts | None = None,
                 tuner: Tuner | None = None, example: Sequence[torch.Tensor] | None = None,
                 agree_s: float = 0.0) -> None:
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = timedelta(seconds=timeout_s)
        # What `switch` and the tuner place plans with, as on a local ParallelStep (the tuner's log and
        # decisions are rank 0's).
        self.graph, self.cluster, self.costs, self.tuner = graph, cluster, costs, tuner
        # Later plans are compiled for what this one was (`rank_targets`: no rank touches another's GPU).
        self.targets = placed.programs.targets
        self._placed, self.wiring = placed, wiring
        self.buffers = Buffers(wiring, self.rank, placed.programs.targets[self.rank])
        self._feed: Feed | None = None
        self._layouts: dict[tuple[bool, int], tuple] = {}  # `_layout`'s, of this feed
        self.example = example  # a whole batch the step takes: `host_seconds` runs its dry run on it
        self.agree_s = agree_s  # the ranks' agreement on a batch's shards (`measure_agreement`)
        self._host: tuple = (None, 0.0)  # (the programs it was measured for, `host_seconds`)
        self._connect()
        if self.rank == 0:
            _guard(model, optimizer)

    def _connect(self) -> None:
        """Make the process groups of the plan's collectives, a collective of every rank: where every rank
        places the plan together, so that a rank's own `RankRun` (a step's, or `host_seconds`' dry run alone)
        only finds them."""
        w = self.wiring
        reducers([*(c.ranks for c in w.collectives), *(g.ranks for g in w.gathers)], self.buffers.device)

    @property
    def placed(self) -> Placed:
        return self._placed

    @placed.setter
    def placed(self, placed: Placed) -> None:
        """Run another plan from the next step on (the tuner's trial or roll-back): its messages are wired."""
        same = placed.programs is self._placed.programs
        self._placed = placed
        if not same:
            self.wiring = wire(placed.lowered, placed.programs)
            self.buffers = Buffers(self.wiring, self.rank, placed.programs.targets[self.rank])
            self._feed, self._layouts = None, {}

    @property
    def one_process(self) -> bool:
        """Whether the running plan is one process: the whole step on rank 0 (`EagerRankStep`). A loop may
        then pass every rank the whole batch, as one process reads it, and no rows travel; a rank that
        passes its shard sends its rows to rank 0."""
        return False

    @property
    def feed(self) -> Feed:
        """Which rows of the batch each rank holds, and those that travel (made when a shard first comes: a
        batch that does not split into the ranks' shards can still run whole)."""
        if self._feed is None:
            low, programs = self.placed.lowered, self.placed.programs
            read = [[(seg.replica, name) for seg in segs for name in reads(low, programs, seg)]
                    for segs in programs.devices]
            self._feed = plan_feed(low, programs, read)
        return self._feed

    def _layout(self, flagged: bool, rank: int | None = None) -> tuple[list, list]:
        """This rank's (or `rank`'s) messages of the batch's rows, alike every step of a plan: per sending
        rank, then per receiving rank, (the rank, its pieces, the leaves they travel as, the message's
        bytes). `flagged` (one process): every other rank's message to rank 0 ends with its refusal flag, if
        it has no rows. Made once: the leaves of dlrm's pieces took rank 0 about 0.2 ms a step."""
        rank = self.rank if rank is None else rank
        got = self._layouts.get((flagged, rank))
        if got is None:
            feed = self.feed
            receives, sends = feed.receives(rank), feed.sends(rank)
            if flagged and rank == 0:
                receives = {src: receives.get(src, []) for src in range(1, self.world)}
            elif flagged:
                sends = {**sends, 0: sends.get(0, [])}

            def messages(by: dict[int, list[Piece]], sending: bool) -> list[tuple]:
                out = []
                for peer, pieces in by.items():
                    leaves = [Leaf.contiguous(*feed.leaf(p)) for p in pieces]
                    to_rank0 = peer == 0 if sending else rank == 0
                    leaves += [_FLAG] if flagged and to_rank0 else []
                    out.append((peer, pieces, leaves, packed_size(leaves)))
                return out

            got = self._layouts[flagged, rank] = (messages(receives, False), messages(sends, True))
        return got

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor | None:
        self.whole_state()
        t0 = time.perf_counter()
        tuning = self.tuner is not None and self.tuner.active
        params, tensors, envs, run = self._begin(batch, [] if tuning else None)
        with torch.no_grad(), self._failing():
            run.run()
        self._keep(envs, params, tensors)
        self._left()
        loss = weighted_loss(envs, self.placed.programs) if self.rank == 0 else None
        stepped(self.optimizer)
        if tuning:
            self._tune(time.perf_counter() - t0, run.timings)
        return loss

    def _left(self) -> None:
        """Record where this plan's step left the newest state (`_HELD`)."""
        if self.wiring.everywhere:
            _HELD.pop(self.optimizer, None)
        else:  # some rank lacks some newest value: another plan's step, or a read of rank 0's, needs it first
            _HELD[self.optimizer] = _Held(self.placed.strategy, self.placed.lowered.step, self.wiring.truth,
                                          bool(self.wiring.gathers))

    def _begin(self, batch: Sequence[torch.Tensor], timings: list | None) -> tuple:
        """This rank's start of a step: (the parameters, every tensor of the model and optimizer the step
        reads, the replicas' tables, its run) from its shard, whose rows travel first, or from the whole
        batch; the prelude run."""
        low, programs = self.placed.lowered, self.placed.programs
        step = low.step
        whole = self.world == 1 or len(batch) > 0 and batch[0].shape[0] == step.batch * low.replicas
        if whole:
            step.check(self.model, self.optimizer, batch, low.replicas)
            guards.check(step.gm, batch, low.replicas)
        else:
            with torch.no_grad(), self._failing():
                shares, weights = self._fed(batch)
        params, buffers, states, _, hypers = step.arguments(self.model, self.optimizer, batch)
        envs = (replica_envs(low, programs, params, buffers, states, batch, hypers) if whole else
                replica_tables(low, programs, params, buffers, states, shares, hypers, weights))
        run = RankRun(low, programs, self.wiring, envs, self.rank, self.timeout, self.buffers, timings,
                      self.placed.budgets)
        with torch.no_grad():
            for env in envs:
                for name in low.prelude:  # a view of an input this rank does not hold is read nowhere here
                    if all(a.name in env for a in programs.nodes[name].all_input_nodes):
                        run.call(name, env)
        return params, [*params, *buffers, *(s for ss in states for s in ss)], envs, run

    @property
    def simulated_s(self) -> float:
        """The simulated step of this rank: the simulator's time for the plan's devices and messages, plus
        what the step does before and after them: the rows of the batch that travel between the ranks
        (`Feed.seconds`, on the cluster's links), the parts of tensor-parallel weights that travel at its end
        (`joins_s`), the ranks' agreement on the shards (`agreement_s`) and this rank's host work
        (`host_seconds`)."""
        try:
            feed = self.feed.seconds(self.cluster) if self.cluster is not None and self.world > 1 else 0.0
        except FasttError:  # a batch that does not split into the ranks' shards runs whole: nothing travels
            feed = 0.0
        return self.placed.simulated_s + feed + self.joins_s() + self.agreement_s() + self.host_seconds()

    def agreement_s(self) -> float:
        """Seconds a step spends on the ranks' agreement on its shards (`_agree`, measured: `agree_s`)."""
        return self.agree_s

    def joins_s(self) -> float:
        """Simulated seconds of the end-of-step messages that carry chained updates' parts (a tensor-parallel
        weight's and its state's) to the ranks that read the whole weight next step, on the cluster's links:
        the simulator keeps such a weight in its parts from step to step, the runtime joins it on every rank
        that reads it (bert-base under Megatron's plan on 2 ranks: 9.7 MB a step, 0.1 s at 1 Gbit/s)."""
        w, joined = self.wiring, self.placed.lowered.joined
        if self.cluster is None or self.world < 2 or not joined:
            return 0.0
        def nbytes(v: tuple[int, str]) -> int:  # of a chained update's part (`name#k`) in its buffer, else 0
            return packed_size(w.layouts[v].leaves) if v[1].rsplit("#", 1)[0] in joined else 0
        ends = [(m.src, m.dst, sum(map(nbytes, m.values))) for m in (w.messages[i] for i in w.final)]
        return self.cluster.messages_time(end for end in ends if end[2])

    def host_seconds(self, runs: int = 5) -> float:
        """Seconds a step of the running plan spends on this rank outside its device's work, its messages and
        the batch's rows: checking the batch, binding the model's and optimizer's tensors, the replicas'
        tables and the prelude, keeping the new state and the loss. The median of `runs` dry runs (once per
        plan) on the whole example batch, in which nothing travels and the state stands for the new state;
        the model and the optimizer are left as they were. Without an example batch: 0."""
        programs = self.placed.programs
        if self._host[0] is not programs:
            self._host = (programs, statistics.median(self._dry() for _ in range(runs))
                          if self.example is not None else 0.0)
        return self._host[1]

    def _dry(self) -> float:
        """Seconds of one dry run of this rank's host work (`host_seconds`)."""
        t0 = time.perf_counter()
        params, tensors, envs, _ = self._begin(self.example, None)
        begun = time.perf_counter() - t0
        programs, named = self.placed.programs, dict(zip(self.placed.programs.placeholders, tensors))
        for c in self.wiring.merge[self.rank]:  # what the other ranks' slices would be: the same, copied
            envs[0][c.name] = torch.tensor_split(named[c.buffer], c.parts, c.dim)[c.index].clone()
        for x, (k, value) in self.wiring.keep[self.rank].items():
            t = named[x]
            envs[k][value] = t.detach() if isinstance(t, torch.nn.Parameter) else t.clone()
        if self.rank == 0:
            for env in envs:
                env[programs.outputs[0]] = torch.zeros(())
        t0 = time.perf_counter()
        with torch.no_grad():
            self._keep(envs, params, tensors)
        if self.rank == 0:
            weighted_loss(envs, programs)
        return begun + time.perf_counter() - t0

    def _keep(self, envs: list[dict], params: Sequence[torch.Tensor],
              tensors: Sequence[torch.Tensor]) -> None:
        """The step's new state into the model and optimizer (`tensors`: every one the step reads, in its
        placeholders' order): the slices other ranks wrote into this rank's buffers, and the values this rank
        keeps (a sharded update's rows of its state in place of the whole, or back to the whole)."""
        programs, step = self.placed.programs, self.placed.lowered.step
        named = dict(zip(programs.placeholders, tensors))
        slots = dict(zip(programs.placeholders[len(tensors) - sum(map(len, step.state_keys)):],
                         [(p, k) for p, keys in zip(params, step.state_keys) for k in keys]))
        for c in self.wiring.merge[self.rank]:
            torch.tensor_split(named[c.buffer], c.parts, c.dim)[c.index].copy_(envs[0][c.name])
        for x, (k, value) in self.wiring.keep[self.rank].items():
            new = envs[k][value]
            target = named[x]
            if isinstance(target, torch.nn.Parameter):
                target.data = new
            elif new.shape != target.shape:
                p, key = slots[x]
                self.optimizer.state[p][key] = new
            elif new is not target:
                target.copy_(new)

    def whole_state(self) -> None:
        """`whole_state` before a step of this plan: `__call__` calls it, and the trial before timing one."""
        whole_state(self.model, self.optimizer, self.placed.strategy)

    def sync(self) -> None:
        """Rank 0's model and optimizer become the truth: the ranks that keep values rank 0 does not read send
        them to it (`truth_to_rank0`). Every rank calls it, as a collective; nothing travels where rank 0
        already has everything."""
        truth_to_rank0(self.model, self.optimizer, self.timeout)

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """A failure of this rank (not a refused batch) is recorded as the job's and raised as a RankError
        (out of memory between ops, in a message's or collective's buffer, naming the plan's peak too)."""
        try:
            yield
        except FasttError:
            raise
        except Exception as e:
            why = (str(e) if isinstance(e, RankError) else
                   oom_message("outside an op (a message or collective)", self.rank, self.placed.budgets, e)
                   if out_of_memory(e) else f"{type(e).__name__}: {e}")
            lost_peer = isinstance(e, LostPeer)
            raise RankError(record_failure(f"rank {self.rank}: {why}", lost_peer=lost_peer)) from e

    def _fed(self, shard: Sequence[torch.Tensor], traced: bool = True
             ) -> tuple[list[list[torch.Tensor | None]], list[float]]:
        """Per replica, the inputs this rank holds (None where it holds none) from its shard and the rows the
        others send (`Feed`), and every replica's loss weight. A shard one rank refuses (its shape, a change
        of the model or optimizer, a guard of a share it checks) is refused by every rank, nothing trained.
        `traced` False: the shares feed the user's own eager step, not the traced one, so only their shapes
        are checked (the captured step's model, optimizer and guards do not bind it)."""
        low, feed, r = self.placed.lowered, self.feed, self.placed.lowered.replicas
        why = _bad_shard(feed, shard)
        if why:  # zeros of the right shape keep the exchange in step; every rank refuses below
            shard = [torch.zeros((feed.shard, *sample), dtype=dtype, device=self.buffers.device)
                     for sample, dtype in feed.leaves]
        elif traced:
            try:  # the shard's shape is right: only the model and optimizer are left to check
                probe = [x[:1].expand(feed.share, *x.shape[1:]) for x in shard]
                low.step.check(self.model, self.optimizer, probe)
            except FasttError as e:
                why = str(e)
        # one process: another rank's receive of rank 0's answer is posted before its rows go, so that rank 0
        # hands the answer over at once (0.16 ms a step where it was posted after the rows had gone)
        answer = self._answer() if not traced and self.rank else None
        received, flags = self._exchange(feed, shard, None if traced else float(bool(why)))
        shares = feed.shares(self.rank, shard, received)
        counts = [0.0] * r
        for k in [k for k, c in enumerate(feed.checker) if c == self.rank and not why and traced]:
            try:
                guards.check(low.step.gm, shares[k])
            except FasttError as e:
                why = f"replica {k}'s share: {e}" if r > 1 else str(e)
                break
            if low.weights.counts and r > 1:
                counts[k] = float(low.weights.count(*shares[k]))
        agreed = self._agree(why, counts) if traced else self._told_rank0(why, counts, flags, answer)
        return shares, low.weights.weighed(agreed)

    def _exchange(self, feed: Feed, shard: Sequence[torch.Tensor], flag: float | None = None
                  ) -> tuple[dict[Piece, torch.Tensor], dict[int, float]]:
        """The rows of other ranks' shards this rank needs, received while it sends the rows others need from
        its own: one message per direction, before any of the step's own (each direction keeps its order).
        With `flag` (one process: every rank's rows go to rank 0), each other rank's message to rank 0 ends
        with its flag, and rank 0 gets them: (the rows, {rank: its flag})."""
        groups, device = directions(self.buffers.device), self.buffers.device
        receives, sends = self._layout(flag is not None)
        ahead = flag is not None and device.type == "cpu"  # one process on gloo: rank 0's receives go ahead
        posted = []
        for src, pieces, leaves, nbytes in receives:
            group = groups[src, self.rank]
            if ahead:
                buf, work, other = _AHEAD.posted(group, src, nbytes)
            else:
                buf, other = self.buffers.get(("feed", "in", src), nbytes), None
                work = dist.irecv(buf, src, group=group)
            posted.append((src, pieces, leaves, buf, work, other))
        sent = []
        for dst, pieces, leaves, nbytes in sends:
            pairs = [(feed.rows(self.rank, shard[p.input], p.lo, p.hi), leaf)
                     for p, leaf in zip(pieces, leaves)]
            if len(leaves) > len(pieces):  # its flag
                pairs.append((torch.tensor([flag], dtype=torch.float64, device=device), _FLAG))
            buf = pack(pairs, self.buffers.get(("feed", "out", dst), nbytes))
            tag = _Ahead.tag(nbytes) if ahead else 0
            sent.append((dst, dist.isend(buf, dst, group=groups[self.rank, dst], tag=tag)))
        received, flags = {}, {}
        for src, pieces, leaves, buf, work, other in posted:
            wait_done(work, self.timeout, device,
                      lambda e, src=src: lost(src, "rows of the batch", e, self.timeout))
            if ahead:
                _AHEAD.post_next(groups[src, self.rank], src, other, buf)
            values = unpack(buf, leaves)
            if len(leaves) > len(pieces):
                flags[src] = float(values.pop())
            received.update(zip(pieces, values))
        for dst, work in sent:
            wait_done(work, self.timeout, device,
                      lambda e, dst=dst: f"a send to rank {dst} failed ({type(e).__name__}: {e})")
        return received, flags

    def _agree(self, why: str, counts: list[float]) -> list[float]:
        """Every replica's count, from the rank that checks it (one all_gather); if any rank refused its shard
        (`why`), every rank raises its reason."""
        mine = torch.tensor([1.0 if why else 0.0, *counts], dtype=torch.float64, device=self.buffers.device)
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.float64, device=mine.device)
        work = dist.all_gather_single(everyone, mine, async_op=True)
        wait_done(work, self.timeout, mine.device,
                  lambda e: f"a rank did not join the check of the batch's shards ({type(e).__name__}: {e})")
        table = everyone.view(self.world, -1).tolist()
        refused = [rank for rank, row in enumerate(table) if row[0]]
        if refused:
            whys: list = [None] * self.world
            dist.all_gather_object(whys, why)
            raise FasttError(f"rank {refused[0]} refused the batch: {whys[refused[0]]}")
        return [table[c][1 + k] for k, c in enumerate(self.feed.checker)]

    def _answer(self) -> tuple[torch.Tensor, dist.Work]:
        """Another rank's receive of rank 0's answer in `_told_rank0`, posted (rank 0 sends it nothing else in
        one process's step: it holds every row)."""
        verdict = torch.empty(1, dtype=torch.float64, device=self.buffers.device)
        return verdict, dist.irecv(verdict, 0, group=directions(self.buffers.device)[0, self.rank])

    def _told_rank0(self, why: str, counts: list[float], flags: dict[int, float],
                    answer: tuple[torch.Tensor, dist.Work] | None) -> list[float]:
        """`_agree` for one process's eager step, which runs on rank 0 and counts nothing: each other rank's
        rows to rank 0 end with whether it refused its shard (`flags`, `_exchange`), and rank 0 answers each
        with the first rank that refused (-1: none). Rank 0 waits for nothing but the rows: the all_gather
        took 0.2-0.33 ms of dlrm's 4-5 ms step at 1gbit. If any rank refused, every rank raises its reason.
        `answer`: another rank's receive of the answer, posted (`_answer`); None on rank 0."""
        device, groups = self.buffers.device, directions(self.buffers.device)
        if answer is None:  # rank 0
            refused = [k for k in range(self.world) if (why if k == 0 else flags[k])]
            verdict = torch.full((1,), refused[0] if refused else -1, dtype=torch.float64, device=device)
            for dst in range(1, self.world):
                wait_done(dist.isend(verdict, dst, group=groups[0, dst]), self.timeout, device,
                          lambda e, dst=dst: f"a send to rank {dst} failed ({type(e).__name__}: {e})")
        else:
            verdict, work = answer
            wait_done(work, self.timeout, device,
                      lambda e: lost(0, "the check of the batch's shards", e, self.timeout))
            refused = [int(verdict.item())] if verdict.item() >= 0 else []
        if refused:
            whys: list = [None] * self.world
            dist.all_gather_object(whys, why)
            raise FasttError(f"rank {refused[0]} refused the batch: {whys[refused[0]]}")
        return counts

    def _tune(self, seconds: float, timings: list) -> None:
        """FastT's loop across the ranks: rank 0's tuner observes every rank's segment times and this step's
        time (its own); when it switches plans (a trial or a roll-back), every rank places the same plan and
        takes rank 0's model and optimizer state first, since the others only keep what their devices read."""
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, timings)

        def observe() -> tuple:  # may replan, which takes rank 0 a while
            before, segs = self.placed, self.placed.programs.devices
            times = [(segs[d][i], d, s) for d, ts in enumerate(everyone) for i, s in ts]
            self.tuner.observe(self, seconds, times)
            changed = self.placed.strategy != before.strategy
            return self.placed.strategy.to_json() if changed else None, self.tuner.active

        box = [alone_on_rank0(observe)]
        dist.broadcast_object_list(box, src=0)
        switch, self.tuner.active = box[0]
        if switch is not None:
            self.switch(Strategy.from_json(switch), self.placed if self.rank == 0 else None)

    def switch(self, strategy: Strategy, placed: Placed | None = None) -> None:
        """Run `strategy` from the next step on. Every rank calls it with the same strategy (`placed`: this
        rank's placement of it, if made already): it is placed and wired, and every rank takes rank 0's model
        and optimizer state, since the others only kept what their devices read."""
        if placed is None:
            placed = place(self.graph, strategy, self.cluster, self.costs, self.targets)
        truth_to_rank0(self.model, self.optimizer, self.timeout)
        self.placed = placed
        check_same(self.wiring)
        self._connect()
        sync_from_rank0(self.model, self.optimizer, placed.lowered.step)


class EagerRankStep(DistributedStep):
    """One process: the whole step on rank 0's device (a one-device plan there), run as the user's own eager
    step (`reference.eager_step`: forward, loss, backward, clip, `optimizer.step()`, `.grad` left as it was),
    not through the runtime op by op. The other ranks send rank 0 their shards' rows, as the plan's
    `DistributedStep` does, and take no step of their own: rank 0 keeps the newest state, the others' goes
    stale (as under the runtime's one-device plan; a switch to another plan hands them rank 0's). The
    simulated step is the plan's, its rows' and rank 0's Python around the rows (`_dry`)."""

    eager = EagerStep.eager  # the user's eager step, `.grad` put back as it was

    def __init__(self, *args: object, loss_fn: Callable, clip_grad_norm: float | None,
                 autocast: torch.dtype | None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.loss_fn, self.clip_grad_norm, self.autocast = loss_fn, clip_grad_norm, autocast
        self._alone: tuple = (None, False)  # (a placed plan, whether it runs on rank 0 alone)
        self.whole = False  # whether the last step was passed the whole batch (`one_process`): no rows travel

    def _on_rank0(self) -> bool:
        """Whether the running plan is one device, rank 0's (not after a `switch` to another)."""
        placed = self.placed
        if self._alone[0] is not placed:
            self._alone = (placed, set(placed.strategy.placement.values()) == {0})
        return self._alone[1]

    @property
    def one_process(self) -> bool:
        return self.world > 1 and self._on_rank0()

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor | None:
        if not self._on_rank0():  # `switch`ed to another plan: the runtime runs it
            return super().__call__(*batch)
        self.whole_state()
        self._left()  # before the forward: rank 0's guard reads it (inside a trial, another plan's rows)
        low = self.placed.lowered
        self.whole = bool(batch) and batch[0].shape[0] == low.step.batch * low.replicas
        if self.world > 1 and not self.whole:
            with torch.no_grad(), self._failing():
                batch = self._fed(batch, traced=False)[0][0]  # rank 0 holds every input of the replica
        if self.rank != 0:
            stepped(self.optimizer)
            return None
        with self._failing():
            return self.eager(batch)

    @property
    def simulated_s(self) -> float:
        """As `DistributedStep`'s; where the last step was passed the whole batch, rank 0's step alone: no
        rows travel and rank 0 takes none."""
        if self.whole and self._on_rank0():
            return self.placed.simulated_s
        return super().simulated_s

    def agreement_s(self) -> float:
        """None for rank 0's eager step: the other ranks' flags come with their rows (`_told_rank0`); another
        plan's, switched to, as `DistributedStep`'s."""
        return 0.0 if self._on_rank0() else super().agreement_s()

    def _dry(self) -> float:
        """One dry run of rank 0's Python around its eager step (`host_seconds`, the median of a few once per
        plan): taking the other ranks' rows of the example batch (`_fed`: checking its shard, the others
        packing their rows and flags, timed here since rank 0 waits for them, unpacking them and building the
        batch), nothing travelling. In the runtime, rank 0 spent 0.44 ms a step taking dlrm's rows at 1gbit
        (2026-12-07), where the rows on the link were simulated at 0.11. Nothing on one rank; another plan's,
        switched to, as `DistributedStep`'s."""
        if not self._on_rank0():
            return super()._dry()
        if self.world < 2:
            return 0.0
        feed, example = self.feed, self.example
        t0 = time.perf_counter()
        shard = shard_of(example, 0, self.world)
        _bad_shard(feed, shard)
        received: dict[Piece, torch.Tensor] = {}
        for _, pieces, leaves, nbytes in self._layout(True, 0)[0]:  # rank 0's, on every rank
            pairs = [(example[p.input][p.lo:p.hi], leaf) for p, leaf in zip(pieces, leaves)]
            pairs.append((torch.zeros(1, dtype=torch.float64), _FLAG))
            values = unpack(pack(pairs, torch.empty(nbytes, dtype=torch.uint8)), leaves)
            float(values.pop())
            received.update(zip(pieces, values))
        feed.shares(0, shard, received)
        return time.perf_counter() - t0


_FLAG = Leaf((1,), (1,), torch.float64)  # a rank's refusal of its shard, at the end of its rows to rank 0


class _Ahead:
    """Rank 0's receives of the other ranks' rows for one process's step on gloo, each posted a step ahead.
    Gloo sends nothing until the receiver has posted its receive (one posted after the send waited 0.22-0.24
    ms on loopback). Rank 0 posts the receive of the next step's rows as soon as this step's have come, so
    they travel while it computes this step. In a loop without barriers, rank 0's time to take the rows went
    from 0.65 to 0.43 and 0.55 ms a step in two runs (dlrm at 1gbit), resnet50's from 3.4 and 3.3 to 0.9 ms,
    but the whole step's change was inside the runs' noise (dlrm 7.50 -> 6.34 and 6.85 -> 7.04 ms; resnet50
    69.28 -> 68.71 and 66.94 -> 68.47). Timed from a barrier before each step, rank 0 still waits while the
    other ranks pack and send them (`benchmarks/rows_ahead.py`, 2026-12-07). Two buffers per direction take
    turns: this step's batch is views of one. A receive whose rows never come (training ends, another plan
    runs) stays posted and harms nothing: torchrun runs that exit with one posted ended cleanly (with or
    without destroy_process_group, and with the peer gone first). Its tag is its size, so no other message in
    the direction lands in it, and a step with rows of that size takes it up again, from any step object.
    NCCL ignores tags, so GPUs post at the step's start."""

    def __init__(self) -> None:
        # per direction, per size: (the buffer, its posted receive, the other buffer)
        self._posted: weakref.WeakKeyDictionary[dist.ProcessGroup, dict] = weakref.WeakKeyDictionary()

    @staticmethod
    def tag(nbytes: int) -> int:
        """The tag of one process's rows of `nbytes` (not gloo's default tag, 0, of every other message)."""
        return 1 + nbytes % (2 ** 31 - 2)

    def posted(self, group: dist.ProcessGroup, src: int, nbytes: int
               ) -> tuple[torch.Tensor, dist.Work, torch.Tensor]:
        """The receive of rank `src`'s rows of `nbytes` in `group` (the one posted a step ahead, else one
        posted now): its buffer, its work and the other buffer, for `post_next`."""
        if nbytes not in self._posted.get(group, {}):
            self.post_next(group, src, *(torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)))
        return self._posted[group].pop(nbytes)

    def post_next(self, group: dist.ProcessGroup, src: int, buf: torch.Tensor, now: torch.Tensor) -> None:
        """Post the receive of `src`'s next rows into `buf`, once this step's have come into `now`."""
        work = dist.irecv(buf, src, group=group, tag=self.tag(buf.numel()))
        self._posted.setdefault(group, {})[buf.numel()] = (buf, work, now)


_AHEAD = _Ahead()


def _bad_shard(feed: Feed, shard: Sequence[torch.Tensor]) -> str:
    """Why `shard` is not a shard of the step's batch ('' if it is)."""
    why = batch_mismatch(shard, [((feed.shard, *sample), dtype) for sample, dtype in feed.leaves])
    return why and (f"{why} (its shard: its rows of the batch of {feed.shard * feed.world} over {feed.world} "
                    "ranks; or pass the whole batch on every rank)")


def check_same(wiring: Wiring) -> None:
    """Every rank compiled the same messages (a digest of them, compared across ranks)."""
    digests: list = [None] * dist.get_world_size()
    digest = hashlib.sha1(repr((wiring.messages, wiring.collectives)).encode()).hexdigest()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise FasttError("the ranks compiled different programs: "
                         "do all ranks build the same model and inputs?")


def whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                strategy: Strategy | None = None) -> None:
    """Every rank takes the newest state of everything if a step of another plan than `strategy` left some
    rank without it (a value its devices did not read; only its rows of a sharded update's state): rank 0
    gets what it lacks (`truth_to_rank0`), then every rank rank 0's (`sync_from_rank0`). Before a trial's
    rival, a step or a capture of another plan on this optimizer. Every rank calls it alike: every rank ran
    the same steps."""
    held = _HELD.get(optimizer)
    if held is None or _RACING and not held.rows:  # a trial's step only needs the state's shapes right
        return
    # by value, which every rank has alike (rank 0's tuner may have rewired its own step meanwhile)
    if held.strategy is not strategy and held.strategy != strategy:
        truth_to_rank0(model, optimizer)
        sync_from_rank0(model, optimizer, held.step)


def _bound(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step) -> tuple[list, list, list[Leaf]]:
    """The step's parameters, buffers and optimizer states as this rank's tensors, each state's (parameter,
    key), and each one's whole `Leaf` (from the captured step: alike on every rank)."""
    params, buffers, states = bind(model, optimizer, step.param_names, step.state_keys, create=True)
    tensors = [*params, *buffers, *(s for ss in states for s in ss)]
    slots = [None] * (len(params) + len(buffers)) + [(p, k) for p, keys in zip(params, step.state_keys)
                                                      for k in keys]
    vals = [n.meta["val"] for n in step.gm.graph.nodes if n.op == "placeholder"][:len(tensors)]
    leaves = [Leaf.contiguous(v.shape, t.dtype) for t, v in zip(tensors, vals)]
    return tensors, slots, leaves


def _put(optimizer: torch.optim.Optimizer, t: torch.Tensor, new: torch.Tensor, slot) -> None:
    """`new` becomes the value of this rank's tensor `t`: a parameter's data, a state this rank held in rows
    replaced whole, else copied in place."""
    if isinstance(t, torch.nn.Parameter):
        t.data = new
    elif t.shape != new.shape:
        optimizer.state[slot[0]][slot[1]] = new
    else:
        t.copy_(new)


def truth_to_rank0(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)) -> None:
    """Rank 0's model and optimizer become the truth: each rank that keeps newest values rank 0 did not read
    in the last step (`Wiring.truth`) sends them to it in one buffer. Every rank calls it alike."""
    held = _HELD.get(optimizer)
    if held is None or not held.truth:
        return
    _HELD[optimizer] = held._replace(truth=())
    rank = dist.get_rank()
    tensors, slots, leaves = _bound(model, optimizer, held.step)
    names = [n.name for n in held.step.gm.graph.nodes if n.op == "placeholder"]  # as the step's tensors are
    index = {x: i for i, x in enumerate(names)}
    device = tensors[0].device
    groups = directions(device)
    for src in sorted({r for _, r in held.truth}):
        if rank not in (0, src):
            continue
        which = [index[x] for x, r in held.truth if r == src]
        mine = [leaves[i] for i in which]
        if rank == src:
            work = dist.isend(pack([(tensors[i], leaves[i]) for i in which]), 0, group=groups[src, 0])
        else:
            buf = torch.empty(packed_size(mine), dtype=torch.uint8, device=device)
            work = dist.irecv(buf, src, group=groups[src, 0])
        peer = src if rank == 0 else 0
        wait_done(work, timeout, device,
                  lambda e, peer=peer: lost(peer, "the newest state for rank 0", e, timeout))
        if rank == 0:
            with torch.no_grad():
                for i, new in zip(which, unpack(buf, mine)):
                    _put(optimizer, tensors[i], new, slots[i])


def sync_from_rank0(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step) -> None:
    """Every rank's parameters, buffers and optimizer state become rank 0's (one broadcast of one buffer); a
    rank that held only its rows of a state (a sharded update's) gets it whole. Rank 0's are the newest only
    after `truth_to_rank0`."""
    _HELD.pop(optimizer, None)
    tensors, slots, leaves = _bound(model, optimizer, step)
    buf = (pack(list(zip(tensors, leaves))) if dist.get_rank() == 0 else
           torch.empty(packed_size(leaves), dtype=torch.uint8, device=tensors[0].device))
    dist.broadcast(buf, src=0)
    if dist.get_rank() == 0:
        return
    with torch.no_grad():
        for t, new, slot in zip(tensors, unpack(buf, leaves), slots):
            _put(optimizer, t, new, slot)


@contextlib.contextmanager
def racing(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """A trial of plans on this optimizer (`trial.raced`, which puts every rank's own state back after): its
    steps only time the plans, so a step of one plan after another's takes rank 0's state only where the
    other left some rank its rows of a state (the shapes must be right), not to bring every value up to date
    (a broadcast of the whole state between timed steps); and what its steps left is forgotten after."""
    global _RACING
    _RACING = True
    try:
        yield
    finally:
        _RACING = False
        _HELD.pop(optimizer, None)


def _guard(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """On rank 0: its model's `state_dict()` and forward, and its optimizer's `state_dict()`, raise while
    rank 0 lacks newest values (no `truth_to_rank0` since the last step): a checkpoint or an evaluation
    would silently read an older state."""
    if optimizer in _GUARDED:  # per optimizer: a new one on the same model is watched too
        return
    _GUARDED.add(optimizer)

    def refuse(*_: object) -> None:
        held = _HELD.get(optimizer)
        if held is not None and held.truth:
            ranks = ", ".join(map(str, sorted({r for _, r in held.truth})))
            raise FasttError(f"rank 0's model and optimizer lack the newest values of {len(held.truth)} "
                             f"tensors, kept by rank {ranks} (rank 0 does not read them in this plan): call "
                             "step.sync() on every rank first")

    model.register_state_dict_pre_hook(refuse)
    model.register_forward_pre_hook(refuse)
    optimizer.register_state_dict_pre_hook(refuse)


class _Held(NamedTuple):
    """What the last step of a plan left where: its strategy and captured step, and the placeholders whose
    newest value rank 0 lacks, each with the rank that sends it (`Wiring.truth`)."""

    strategy: Strategy
    step: object
    truth: tuple[tuple[str, int], ...]
    rows: bool  # some rank keeps only its rows of a sharded update's state


# optimizer -> `_Held` of its last step, where that step left some rank without the newest state of everything
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GUARDED: weakref.WeakSet = weakref.WeakSet()  # the optimizers whose model `_guard` watches on rank 0
_RACING = False  # inside `racing`
