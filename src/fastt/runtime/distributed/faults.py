"""Faults and heartbeats: how a rank that cannot go on says so, and how its peers learn which rank stopped.

A rank that fails records the job's first failure in the process group's store (`record_failure`) and raises
`RankError`; its peers then lose it in turn and report that first failure. Every wait has a timeout, and ranks
count heartbeats in the store (`start_heartbeat`), so a rank that loses a connection names the rank that
stopped (`silent_ranks`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 20.0
FAILED_KEY = "fastt/first_failure"
HEARTBEAT_S = 0.5


def _beat_key(rank: int) -> str:
    """The store key counting a rank's heartbeats (`start_heartbeat`)."""
    return f"fastt/heartbeat/{rank}"


def _said_key(rank: int) -> str:
    """The store key a failed rank sets once it has said what it saw (`said`, `await_reports`)."""
    return f"fastt/said/{rank}"


class RankError(RuntimeError):
    """This rank cannot go on: an op raised, or a peer is gone or silent. The message names the rank."""


class LostPeer(RankError):
    """A peer closed its connection or sent nothing in time."""


def lost(src: int, name: str, e: BaseException, timeout: timedelta) -> str:
    """Why a receive from rank `src` (of a message carrying `name` first) failed with `e`."""
    if "timed out" in str(e).lower() or "timeout" in str(e).lower():
        return (f"rank {src} sent nothing for {timeout.total_seconds():g} s (waiting for '{name}'): "
                f"rank {src} is stalled or dead")
    return f"lost rank {src} (waiting for '{name}': {type(e).__name__}: {str(e).splitlines()[0]})"


def wait_done(work, timeout: timedelta, device: torch.device, why: Callable[[BaseException], str]) -> None:
    """Wait for `work` at most `timeout` (on a GPU polled: its `wait` only makes the stream wait), raising
    LostPeer(why(the error)) when it fails."""
    try:
        if device.type == "cuda":
            deadline = time.monotonic() + timeout.total_seconds()
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
                time.sleep(2e-4)
        work.wait(timeout)
    except (RuntimeError, TimeoutError) as e:
        raise LostPeer(why(e)) from e


def record_failure(message: str, lost_peer: bool = False) -> str:
    """Record `message` as the job's first failure in the process group's store unless one is there; returns
    the message with the first failure appended when that was another. `lost_peer`: this rank lost a
    connection or timed out, which may be a rank further away that died: the ranks whose heartbeat stopped are
    named."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        if lost_peer and not store.check([FAILED_KEY]):
            dead = silent_ranks(store)
            if dead:
                message += f"; rank {', '.join(map(str, dead))} stopped (no heartbeat)"
        first = store.compare_set(FAILED_KEY, "", message).decode()
    except Exception:  # noqa: BLE001 - the store may be gone with the process that hosted it
        if lost_peer and dist.get_rank() != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            message += "; rank 0 stopped (the store it hosts is gone)"  # started without torchrun's agent
        return message
    return message if first == message else f"{message} (first failure in the job: {first})"


def failure_recorded() -> bool:
    """Whether a rank has recorded the job's first failure (False when the store cannot say)."""
    try:
        return dist.distributed_c10d._get_default_store().check([FAILED_KEY])
    except Exception:  # noqa: BLE001 - the store is gone with rank 0: a timeout or a lost connection follows
        return False


def said() -> None:
    """Tell the other ranks' `await_reports` that this failed rank has printed its line. Not at
    `record_failure`: a peer that read the mark there could exit, and torchrun's agent stop this rank,
    before its line was out (in a CI run: rank 1 ran out of memory, rank 0 printed and exited, rank 1 said
    nothing)."""
    with contextlib.suppress(Exception):  # the store is gone with rank 0: nobody is left to wait
        dist.distributed_c10d._get_default_store().set(_said_key(dist.get_rank()), "1")


def await_reports(wait_s: float = 25.0) -> None:
    """Before a failed rank exits: wait (at most `wait_s`) until every other rank has said what it saw
    (`said`) or stopped beating. Started without torchrun, rank 0 hosts the store, where the others read the
    job's first failure and the heartbeats that name a dead rank (a collective does not say which of its
    ranks is gone, and a rank may only learn of it when a survivor next to it exits); under torchrun the agent
    stops every rank once one has exited, so a rank that exited at once could have a peer stopped before it
    said what it saw (rank 0, losing rank 1 in an allreduce on a loaded machine, was killed before it
    printed)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        deadline = time.monotonic() + wait_s
        others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
        while time.monotonic() < deadline:
            missing = [r for r in others if not store.check([_said_key(r)])]
            if set(missing) <= set(silent_ranks(store, missing)):
                return
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read it
        return


def start_heartbeat() -> Callable[[], None]:
    """Count this rank's heartbeats in the store, from a thread: a rank that dies stops counting. Returns the
    function that stops it (call it before the process group is destroyed)."""
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(_beat_key(rank), 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            stop.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, daemon=True, name="fastt-heartbeat")
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join()

    return halt


# Per store, how many times `alone_on_rank0` ran: every rank counts the same, which names the key it waits on.
_ALONE: weakref.WeakKeyDictionary[dist.Store, itertools.count] = weakref.WeakKeyDictionary()


def alone_on_rank0(fn: Callable[[], object]) -> object:
    """`fn()` on rank 0 while the others wait for it, however long it takes (planning, calibrating, the eager
    check: a barrier or broadcast would time out): each waits for a key in the store as long as rank 0's
    heartbeat goes on, and names rank 0 when it stops. Every rank calls it at the same point, like a
    collective. Returns fn's result on rank 0, None elsewhere."""
    store = dist.distributed_c10d._get_default_store()
    key = f"fastt/alone/{next(_ALONE.setdefault(store, itertools.count()))}"
    if dist.get_rank() == 0:
        out = fn()
        store.set(key, "1")
        return out
    _await_rank0(store, key)
    return None


def _await_rank0(store: dist.Store, key: str) -> None:
    """Wait until rank 0 sets `key`, as long as its heartbeat goes on and no rank has recorded a failure."""
    me, nap, beats, moved, look = dist.get_rank(), 1e-4, 0, time.monotonic(), 0.0
    while True:
        try:
            if store.check([key]):
                return
            now = time.monotonic()
            if now > look:  # rank 0's heartbeat, every heartbeat period
                look = now + HEARTBEAT_S
                count = store.add(_beat_key(0), 0)
                if count != beats:
                    beats, moved = count, now
                elif beats and now - moved > 4 * HEARTBEAT_S:
                    raise LostPeer(record_failure(f"rank {me}: rank 0 stopped (no heartbeat) while the "
                                                  "others waited for it"))
                if failure_recorded():
                    raise LostPeer(record_failure(f"rank {me}: stopped waiting for rank 0: a rank failed"))
        except LostPeer:
            raise
        except Exception as e:  # the store is gone with rank 0 (started without torchrun)
            why = f"rank {me}: lost rank 0 while it worked alone ({type(e).__name__}: {e})"
            raise LostPeer(record_failure(why, lost_peer=True)) from e
        time.sleep(nap)
        nap = min(2 * nap, 0.01)


def silent_ranks(store: dist.Store, ranks: Sequence[int] | None = None,
                 wait_s: float = 4 * HEARTBEAT_S) -> list[int]:
    """The other ranks (of `ranks`, default all) whose heartbeat count did not move in `wait_s` (ranks that
    never beat are left out)."""
    me = dist.get_rank()
    ranks = [r for r in (range(dist.get_world_size()) if ranks is None else ranks) if r != me]
    if not ranks:
        return []
    keys = [_beat_key(r) for r in ranks]
    before = [store.add(k, 0) for k in keys]
    time.sleep(wait_s)
    return [r for r, k, b in zip(ranks, keys, before) if b and store.add(k, 0) == b]
