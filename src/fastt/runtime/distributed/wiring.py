"""Message compilation: every message and collective of a step, known before the first step (`wire`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch._guards import detect_fake_mode
from torch.utils._pytree import TreeSpec

from ...coarsen import ALIAS
from ...errors import FasttError
from ...lower import JOIN, PART, SHARD, Lowered, Task, part_names, part_reads
from ...split import run_part, view_part
from ..programs import Programs, Segment, row_counts, scattered
from .collectives import Bounds, ReduceCall, RowGather, frozen, order_collectives
from .packing import Leaf

Value = tuple[int, str]  # (replica, name): a value in one replica's table


@dataclass(frozen=True)
class Message:
    """Values going from rank `src` to rank `dst` in one buffer."""

    src: int
    dst: int
    values: tuple[Value, ...]


class Layout(NamedTuple):
    """How a value travels: its pytree spec and the `Leaf` of every tensor in it (None for a None)."""

    spec: TreeSpec
    leaves: tuple[Leaf | None, ...]


class Chunk(NamedTuple):
    """Slice `index` of `parts` along `dim` of buffer `buffer` (a split op's part updates it in place), named
    `name` while it travels."""

    buffer: str
    name: str
    dim: int
    index: int
    parts: int


@dataclass(frozen=True)
class Wiring:
    """Every message and collective of a step. Per rank and segment: the collectives it starts before it (one
    more entry: after the last segment), the messages it receives and the collectives it waits for before it,
    the messages it sends after it; then the end-of-step messages and, per rank, the values it keeps from its
    own replicas (placeholder name -> value)."""

    messages: tuple[Message, ...]
    recv_before: Bounds
    reduce_before: Bounds
    send_after: Bounds
    final: tuple[int, ...]
    keep: tuple[dict[str, Value], ...]
    layouts: dict[Value, Layout]  # how each value that travels is laid out
    # Per rank: chunks of buffers its split ops wrote, to name before the end, and chunks others wrote, to
    # copy into its buffer after the end.
    chunks: tuple[tuple[Chunk, ...], ...] = ()
    merge: tuple[tuple[Chunk, ...], ...] = ()
    leaves: tuple[tuple[Leaf | None, ...], ...] = ()  # per message, the leaf of every tensor in its buffer
    inbox: tuple[tuple[int, ...], ...] = ()  # per rank, the messages it receives, in the order they are sent
    collectives: tuple[ReduceCall, ...] = ()  # in the order every rank starts them
    start_before: Bounds = ()
    # Sharded updates: the all-gathers of their new parameters at the end, and per rank the values whose
    # rows it joins after the end-of-step messages (the state that rank 0 keeps whole), each with its parts.
    gathers: tuple[RowGather, ...] = ()
    joins: tuple[tuple[tuple[str, int], ...], ...] = ()
    # Chained updates (tensor-parallel weights): per rank, the new values whose parts it joins after the
    # end-of-step messages, each as (replica, value, dim, parts); dim < 0: every part made it whole.
    chained: tuple[tuple[tuple[int, str, int, int], ...], ...] = ()
    # The placeholders whose newest value rank 0 does not keep (it does not read them), each with the rank
    # that sends it when rank 0's model must be the truth (`truth_to_rank0`); and whether every rank keeps
    # the newest whole value of every placeholder (else another plan's step needs rank 0's state first).
    truth: tuple[tuple[str, int], ...] = ()
    everywhere: bool = True
    # Per message, the values its receiver makes from one it carries (`_Post.need`: a view of that value),
    # each as (value, the carried value, the view nodes from it).
    derived: tuple[tuple[tuple[Value, Value, tuple[str, ...]], ...], ...] = ()


class _Need(NamedTuple):
    """A value a rank needs from rank `src`, made by its segment `segment` (-1: before the step)."""

    src: int
    segment: int
    value: Value


class _Post:
    """Builds the messages: a value goes to a rank once per step, and the values that leave one segment (or
    the step's end) for one receiving point travel together in one buffer."""

    def __init__(self, where: dict[Value, int], segment_of: dict[Value, tuple[int, int]],
                 programs: Programs, rowed: dict[str, int]) -> None:
        self.where, self.segment_of, self.rowed = where, segment_of, rowed
        self.nodes, self.devices = programs.nodes, programs.devices
        self.messages: list[Message] = []
        self.sent: set[tuple[int, str, int]] = set()
        self.send_after: list[list[list[int]]] = [[[] for _ in segs] for segs in programs.devices]
        # (replica, carried value, rank) -> {a view of it that the rank needs: the view nodes from it}
        self.views: dict[tuple[int, str, int], dict[str, tuple[str, ...]]] = {}
        self.ending = False  # the end-of-step messages: their values travel as they are

    def need(self, k: int, name: str, d: int) -> _Need | None:
        """Where replica k's `name` comes from when d needs it from another rank, else None. A view of a value
        its rank made (a transpose, a reshape) travels as that value, which d makes the view of: a value and
        its views read by d travel once (bert-base's MLM head under Megatron's plan sent an 8 MB gradient
        twice, as itself and as its transpose, to two segments; the simulator charged it once). Not at the
        end of the step, when the value a view was made of may be gone from its rank's table."""
        src = self.where.get((k, name))
        if src is None or src == d:
            return None
        base, path = (name, ()) if self.ending else self._base(k, name, src)
        if path:
            self.views.setdefault((k, base, d), {})[name] = path
            name = base
        if (k, name, d) in self.sent:
            return None
        self.sent.add((k, name, d))
        return _Need(src, self.segment_of.get((k, name), (src, -1))[1], (k, name))

    def _base(self, k: int, name: str, src: int) -> tuple[str, tuple[str, ...]]:
        """The deepest value that `name` is a view of, through view nodes of one input that neither take
        part of it (its size at most `name`'s) nor start at an offset into its storage (`as_strided`), made on
        rank `src` and left in its table by the segment that made it; with the view nodes from it to `name`.
        (`name`, ()) where there is none."""
        node = self.nodes.get(name)
        val = node.meta.get("val") if node is not None else None
        best: tuple[str, tuple[str, ...]] = (name, ())
        if not isinstance(val, torch.Tensor) or name in self.rowed:
            return best
        path = []
        while (node.target in ALIAS and node.target is not torch.ops.aten.as_strided.default
               and len(node.all_input_nodes) == 1 and node.args and node.args[0] is node.all_input_nodes[0]):
            path.append(node.name)
            node = node.args[0]
            v = node.meta.get("val")
            if (not isinstance(v, torch.Tensor) or v.numel() > val.numel() or node.name in self.rowed
                    or self.where.get((k, node.name)) != src):
                break
            made = self.segment_of.get((k, node.name))
            if made is not None and node.name in self.devices[made[0]][made[1]].outputs:
                best = (node.name, tuple(reversed(path)))
        return best

    def derived(self, m: Message) -> tuple[tuple[Value, Value, tuple[str, ...]], ...]:
        """The values m's receiver makes from those m carries."""
        return tuple(((k, view), (k, name), path) for k, name in m.values
                     for view, path in self.views.get((k, name, m.dst), {}).items())

    def post(self, d: int, needs: Sequence[_Need], at_end: bool = False) -> tuple[int, ...]:
        """Messages to d carrying `needs`, one per source segment; sent after it or at the end."""
        groups: dict[tuple[int, int], list] = {}
        for src, seg, value in needs:
            if value is not None:
                groups.setdefault((src, -1 if at_end else seg), []).append(value)
        out = []
        for (src, seg), values in groups.items():
            out.append(len(self.messages))
            self.messages.append(Message(src, d, tuple(values)))
            if not at_end:
                self.send_after[src][seg].append(out[-1])
        return tuple(out)


def _produced(t: Task) -> tuple[str, ...]:
    """The values a task writes into its replica's table (a chained update's part: `name#k`)."""
    if t.kind == PART:
        return part_names(t)
    if t.kind == JOIN:
        return (t.head, *t.nodes)
    return tuple(name + t.tag for name in t.nodes)


def reads(low: Lowered, programs: Programs, seg: Segment) -> list[str]:
    """The values a segment reads from its replica's table."""
    if seg.fn is not None:
        return list(seg.inputs)
    names: list[str] = []
    for t in seg.tasks:
        if t.kind == PART:
            names += part_reads(t, programs.nodes[t.head])
        elif t.kind == JOIN:
            parts = low.graph.ops[t.waits[0]].split[2]
            names += [f"{t.head}#{k}" for k in range(parts)]
        renamed = dict(t.renamed)  # a chained update's part reads its gradient's part
        names += [renamed.get(x.name, x.name) for n in t.nodes for x in programs.nodes[n].all_input_nodes]
    return list(dict.fromkeys(names))


def _layouts(programs: Programs, names: Sequence[str], low: Lowered,
             chunks: dict[str, Chunk]) -> dict[str, Layout | None]:
    """Each value's `Layout`, from the captured graph's fake tensors (a split part: its head op on them)."""
    vals = {n.name: n.meta.get("val") for n in programs.nodes.values()}
    fake = detect_fake_mode([v for v in vals.values() if isinstance(v, torch.Tensor)])
    out = {}
    parts = {name: t for prog in low.programs for t in prog if t.kind == PART for name in part_names(t)}
    for name in names:
        if name in out:
            continue
        if name in chunks:
            c = chunks[name]
            v = torch.tensor_split(vals[c.buffer], c.parts, c.dim)[c.index]
        elif "#" in name and name.rsplit("#", 1)[0] in low.joined:  # a chained update's part of a new value
            base, k = name.rsplit("#", 1)
            dim, n_parts = low.joined[base]
            v = vals[base] if dim < 0 else torch.tensor_split(vals[base], n_parts, dim)[int(k)]
        elif name in parts:
            t = parts[name]
            n = programs.nodes[t.head]
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: vals[a.name])
            with fake:
                made = {t.head: run_part(n.target, args, kwargs, *t.part)}
                for view, cut in t.views:  # the views of the part its chained readers read
                    node = programs.nodes[view]
                    made[view] = view_part(node, made[node.args[0].name], cut, t.part[2])
            v = made[name.rsplit("#", 1)[0]]
        else:
            v = vals.get(name)
        flat, spec = torch.utils._pytree.tree_flatten(v)
        if not flat or not all(isinstance(x, torch.Tensor) or x is None for x in flat):
            out[name] = None  # not sendable: only an error if some rank needs it
        else:
            out[name] = Layout(spec, tuple(None if x is None else Leaf.of(x) for x in flat))
    return out


def _located(programs: Programs) -> tuple[dict[Value, int], dict[Value, tuple[int, int]]]:
    """Where each value is made: its rank, and its (rank, segment)."""
    where: dict[Value, int] = {}
    segment_of: dict[Value, tuple[int, int]] = {}
    for d, segs in enumerate(programs.devices):
        for i, seg in enumerate(segs):
            for t in seg.tasks:
                for name in _produced(t):
                    where[t.replica, name] = d
                    segment_of[t.replica, name] = (d, i)
    return where, segment_of


def wire(low: Lowered, programs: Programs) -> Wiring:
    """All messages of a step of `programs`, one rank per device (see the package docstring)."""
    where, segment_of = _located(programs)
    carried = {name for names in low.allreduces.values() for name in names}
    rowed = _rows_made(low, programs)
    post = _Post(where, segment_of, programs, rowed)
    recv_before, first_read = [], []
    for d, segs in enumerate(programs.devices):
        # What d reads from one segment of another rank travels in one message, before the first of d's
        # segments that reads any of it (each value is needed no later; that segment waits for the sender's
        # anyway): one message per (sender's segment, rank), as the simulator moves an op's output to a
        # device once (dlrm's table-wise plan sent each of 10 gradient columns to another segment of rank 0).
        first, at = {}, {}
        bins: list[list[_Need]] = [[] for _ in segs]
        for i, seg in enumerate(segs):
            for need in (post.need(seg.replica, name, d) for name in reads(low, programs, seg)
                         if name not in carried):
                if need is not None:
                    bins[at.setdefault(need[:2], i)].append(need)
            for a in seg.waits:
                if a in low.allreduces:
                    first.setdefault(a, i)
        recv_before.append(tuple(post.post(d, needs) for needs in bins))
        first_read.append(first)
    post.ending = True
    final, keep, chunks, merge, rowed_end, truth, everywhere = _final(low, programs, where, post)
    values = list(dict.fromkeys(v for m in post.messages for v in m.values))
    info = {c.name: c for cs in chunks for c in cs}
    grads = list(dict.fromkeys(name for names in low.allreduces.values() for name in names))
    layouts = _layouts(programs, [name for _, name in values] + grads, low, info)
    bad = [name for name in [*(name for _, name in values), *grads] if layouts.get(name) is None]
    if bad:
        raise FasttError(f"values {bad[:3]} cross devices but are not tensors: "
                         "this plan cannot run distributed")
    order = order_collectives(low, programs, post.send_after, segment_of, first_read, recv_before,
                              {name: layouts[name].leaves[0] for name in grads}, _owners(low, programs))
    travel = {(k, name): layouts[name] if name not in rowed else _rows_layout(layouts[name], rowed[name], k)
              for k, name in values}
    leaves = tuple(tuple(leaf for v in m.values for leaf in travel[v].leaves) for m in post.messages)
    # A rank sends segment by segment, then its end-of-step messages: the order each direction carries them.
    sent = [i for segs in post.send_after for ms in segs for i in ms] + final
    inbox = tuple(tuple(i for i in sent if post.messages[i].dst == d) for d in range(len(programs.devices)))
    return Wiring(tuple(post.messages), tuple(recv_before), order.reduce_before,
                  frozen(post.send_after), tuple(final), keep,
                  travel, chunks, merge, leaves, inbox, order.collectives, order.start_before,
                  *_gathers(rowed_end, programs), truth, everywhere, tuple(map(post.derived, post.messages)))


def _final(low: Lowered, programs: Programs, where: dict[Value, int], post: _Post) -> tuple:
    """End-of-step messages: the new state to the ranks that read it next step, the losses to rank 0. Returns
    (message indices, per rank {placeholder: value} it keeps from its own replicas, per rank the chunks it
    names, per rank the chunks it merges, `_RowsEnd`, `Wiring.truth`, `Wiring.everywhere`). A value no rank
    reads next step goes to rank 0. What a sharded update makes by rows: a new parameter is all-gathered to
    its readers; of its state a rank keeps its own rows, and rank 0 (or a rank of more parts or none) gets
    every part and joins them; a buffer written slice by slice is merged on its readers and rank 0. Rank 0
    gets nothing else it does not read: sending every value to rank 0 each step doubled the traffic of a plan
    that keeps layers off it (vgg19's pipeline over a 1 Gbit/s loopback: 12.2 MB a step, 96 of its 195 ms)."""
    n_dev = len(programs.devices)
    new, buffers, partial = _new_state(low, programs, where)
    readers = _readers(low, programs, [*new, *partial])
    rowed, params = _rows_made(low, programs), set(programs.placeholders[:len(low.step.param_names)])
    everywhere = all(r == set(range(n_dev)) for r in readers.values())
    rowed_or_sliced = set(partial) | {x for x, v in new.items() if v in rowed}
    for x in rowed_or_sliced:
        readers[x].add(0)
    needs: list[list] = [[] for _ in range(n_dev)]
    keep: list[dict[str, Value]] = [{} for _ in range(n_dev)]
    end = _RowsEnd({}, [[] for _ in range(n_dev)], [[] for _ in range(n_dev)])
    for x, value in new.items():
        if value in low.joined:  # a chained update's parts: to every rank that reads it next step, joined
            _chained_end(low, x, value, readers[x], post, needs, keep, end)
            continue
        parts = rowed.get(value)
        if parts:
            owners = tuple(where[k, value] for k in range(parts))
            if x in params:
                end.gathered[value] = (owners, tuple(sorted(readers[x] | set(owners))))
            for d in sorted(readers[x]):
                own = [k for k in range(parts) if owners[k] == d]
                if x not in params and d != 0 and len(own) == 1:
                    keep[d][x] = (own[0], value)
                    continue
                keep[d][x] = (0, value)
                if x not in params:
                    end.joins[d].append((value, parts))
                    needs[d] += [post.need(k, value, d) for k in range(parts)]
            continue
        for d in sorted(readers[x]):
            own = [k for k in range(low.replicas) if where.get((k, value)) == d]
            # Every replica applies the same update, so a rank's own replica's new parameter is the same.
            k = own[0] if own and x not in buffers else 0
            keep[d][x] = (k, value)
            needs[d].append(post.need(k, value, d))
    chunks: list[list[Chunk]] = [[] for _ in range(n_dev)]
    merge: list[list[Chunk]] = [[] for _ in range(n_dev)]
    for x, pieces in partial.items():  # each rank gets the slices the others wrote
        for d, dim, k, parts in pieces:
            piece = Chunk(x, f"{x}@{k}", dim, k, parts)
            chunks[d].append(piece)
            where[0, piece.name] = d
            for r in sorted(readers[x]):
                if r != d:
                    needs[r].append(post.need(0, piece.name, r))
                    merge[r].append(piece)
    needs[0] += [post.need(k, programs.outputs[0], 0) for k in range(low.replicas)]
    final = [m for d in range(n_dev) for m in post.post(d, [x for x in needs[d] if x], at_end=True)]
    truth = tuple((x, min(d for d in range(n_dev) if x in keep[d])) for x in new if x not in keep[0])
    everywhere = everywhere and not rowed_or_sliced
    return final, tuple(keep), tuple(map(tuple, chunks)), tuple(map(tuple, merge)), end, truth, everywhere


class _RowsEnd(NamedTuple):
    """What a step's end does with the results of sharded updates: new parameters gathered (value -> (the
    rank of each part, the ranks of the gather)), per rank the values whose parts it joins, and per rank the
    chained updates' results whose parts it joins (`Wiring.chained`)."""

    gathered: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    joins: list[list[tuple[str, int]]]
    chained: list[list[tuple[int, str, int, int]]]


def _chained_end(low: Lowered, x: str, value: str, readers: set[int], post: _Post, needs: list[list],
                 keep: list[dict[str, Value]], end: _RowsEnd) -> None:
    """The new value of placeholder `x` that chained updates make in parts (`value#k`, `Lowered.joined`):
    each rank that reads `x` next step gets the parts of one replica (one whose part it
    makes, else replica 0: every replica's parts are the same, their gradients averaged alike) and joins
    them after the end-of-step messages."""
    dim, parts = low.joined[value]
    names = [f"{value}#{k}" for k in range(parts if dim >= 0 else 1)]
    replicas = [k for k in range(low.replicas) if (k, names[0]) in post.where]
    for d in sorted(readers):
        r = next((k for k in replicas for name in names if post.where.get((k, name)) == d), 0)
        needs[d] += [post.need(r, name, d) for name in names]
        end.chained[d].append((r, value, dim, parts))
        keep[d][x] = (r, value)


def _gathers(end: _RowsEnd, programs: Programs) -> tuple[tuple[RowGather, ...], tuple, tuple]:
    """The all-gathers of the new parameters (one per set of ranks), each rank's joins and its chained
    updates' joins."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for value, (_, ranks) in end.gathered.items():
        groups.setdefault(ranks, []).append(value)
    leaf = {v: Leaf.of(programs.nodes[v].meta["val"]) for v in end.gathered}
    gathers = tuple(RowGather(ranks, tuple(names), tuple(leaf[v] for v in names),
                              tuple(end.gathered[v][0] for v in names)) for ranks, names in groups.items())
    return gathers, tuple(map(tuple, end.joins)), tuple(map(tuple, end.chained))


def _rows_made(low: Lowered, programs: Programs) -> dict[str, int]:
    """The step's results that sharded updates make by rows (name -> parts): each new parameter, and each new
    state of the parameter's shape (not Adam's step counter, which every part computes whole)."""
    outs, out = set(programs.outputs), {}
    for prog in low.programs:
        for t in prog:
            if t.kind == SHARD:
                shape = programs.nodes[t.head].meta["val"].shape
                for name in t.nodes:
                    if name in outs and programs.nodes[name].meta["val"].shape == shape:
                        out[name] = t.part[2]
    return out


def _rows_layout(whole: Layout, parts: int, k: int) -> Layout:
    """How part k of a value made by rows travels: its rows, contiguous."""
    leaf = whole.leaves[0]
    shape = (row_counts(leaf.shape[0], parts)[k], *leaf.shape[1:])
    return Layout(whole.spec, (Leaf.contiguous(shape, leaf.dtype),))


def _owners(low: Lowered, programs: Programs) -> dict[int, tuple[int, ...]]:
    """Reduce-scatters that the ranks run as such (`programs.scattered`: not one a gradient clip's norm also
    reads whole) -> the rank that updates each row part."""
    device_of = {t.op: d for d, prog in enumerate(low.programs) for t in prog}
    given, out = scattered(low), {}
    for a, names in low.allreduces.items():
        if names and set(names) <= given:
            by_part = {low.graph.ops[s].split[1]: device_of[s] for s in low.graph.succs[a]
                       if low.graph.ops[s].split}
            out[a] = tuple(by_part[p] for p in range(len(by_part)))
    return out


def _new_state(low: Lowered, programs: Programs,
               where: dict[Value, int]) -> tuple[dict[str, str], tuple[str, ...], dict[str, list]]:
    """The step's new state: (placeholder -> the value that is its new value, the buffers' placeholders, the
    buffers replica 0 updates slice by slice -> (device, dim, k, parts) per slice). A buffer updated whole is
    its own new value, written in place on the device that `where` then says holds it."""
    step, out = low.step, programs.outputs
    n, n_buf = len(step.param_names), len(step.buffer_names)
    ph = programs.placeholders
    params, buffers = ph[:n], ph[n:n + n_buf]
    states = ph[n + n_buf:n + n_buf + len(out) - 1 - 2 * n]
    new = dict(zip(params, out[1 + n:1 + 2 * n])) | dict(zip(states, out[1 + 2 * n:]))
    partial: dict[str, list[tuple[int, int, int, int]]] = {}
    for x, d, region in programs.writeback:
        if region is not None:
            partial.setdefault(x, []).append((d, *region))
    for x, d, region in programs.writeback:
        if x in buffers and x not in partial:
            new[x] = x
            where[0, x] = d
    return new, buffers, partial


def _readers(low: Lowered, programs: Programs, names: Sequence[str]) -> dict[str, set[int]]:
    """The ranks that read each of `names` (placeholders) in a step; rank 0 for one no rank reads."""
    nodes = programs.nodes
    # Tasks read a parameter itself or through a view of it made before the step (the prelude).
    root: dict[str, str] = {}
    for name in low.prelude:
        if nodes[name].op == "get_attr":  # a constant: every rank holds it, nobody updates it
            continue
        base = nodes[name].all_input_nodes[0].name
        root[name] = root.get(base, base)
    readers: dict[str, set[int]] = {x: set() for x in names}
    for d, segs in enumerate(programs.devices):
        for seg in segs:
            for name in reads(low, programs, seg):
                if root.get(name, name) in readers:
                    readers[root.get(name, name)].add(d)
    return {x: r or {0} for x, r in readers.items()}
