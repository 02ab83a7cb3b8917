"""How a captured step's loss reduces over its batch, so that data-parallel replicas compute the whole
batch's.

Replica k of n computes the loss L_k of its share of the batch. Averaging the L_k (and their gradients) gives
the whole batch's loss only for a mean with equal shares: for a sum it is n times too small, and for a mean
over a count that differs between shares (tokens not labelled -100) it weighs the shares wrongly. So the step
takes a `weight` input that scales its loss's gradient, and replica k runs with s_k such that the mean over
replicas of s_k * L_k is the whole batch's loss:

    sum:    L = sum_k L_k                      s_k = n
    mean:   L = mean over items, equal shares  s_k = 1
    ratio:  L = sum_k S_k / sum_k C_k          s_k = n * C_k / sum_j C_j  (L_k = S_k/C_k, C_k from the batch)

times the ratio of the loss's constant factor at the whole batch to the replica's (`loss.sum() / x.shape[0]`
divides by the batch: a sum at one batch size, a mean across them). `reduction_of` reads the kind from the
captured graph: the op that reduces the loss to a scalar (mean, sum, a loss op's `reduction`, nll_loss's count
of counted targets), through constant factors, divisions by a count computed from the batch alone, terms
that do not depend on the batch (a weight penalty), and sums of reductions of one kind (a loss and an
auxiliary mean; label smoothing's two means over the targets cross-entropy counts, told alike by what they
count), whose terms' constant factors must scale alike from the whole batch to a share. Anything else is
`unknown`, and data parallelism refuses it rather than train with another loss. Batch statistics (batch norm
per replica) are the one documented exception, as in DDP.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from .errors import FasttError

aten = torch.ops.aten
SUM, MEAN, RATIO, UNKNOWN = "sum", "mean", "ratio", "unknown"
_NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_SCALE = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default)
_ADD = (aten.add.Tensor, aten.sub.Tensor)
_SAME = (aten._to_copy.default, aten.clone.default, aten.view.default, aten.reshape.default,
         aten.squeeze.default,
         aten.alias.default, aten.detach.default)  # the loss as it was


@dataclass(frozen=True)
class Reduction:
    """How one captured step's loss reduces over its batch (see the module docstring). `factor`: the constant
    the reduced value is multiplied by; `items`: for a sum or mean, the elements it reduces; `count(*batch)`:
    for a ratio, the count of a batch (share); `why`: what was found, for messages."""

    kind: str
    factor: float = 1.0
    items: int = 0
    count: Callable[..., torch.Tensor] | None = None
    why: str = ""
    # a sum of reductions of one kind: each term's (factor, items), which the whole batch's and a share's must
    # scale alike; for a ratio, what its count counts (`_Walk.counted`), which every term's must be
    terms: tuple[tuple[float, int], ...] = ()
    counts: object = None

    def scaled(self, c: float) -> Reduction:
        """This reduction times the constant c."""
        return dataclasses.replace(self, factor=self.factor * c,
                                   terms=tuple((f * c, items) for f, items in self.terms))


@dataclass(frozen=True)
class ReplicaWeights:
    """The loss weights of data-parallel replicas: `of(shares)` gives s_k for each replica's share."""

    kind: str
    scale: float = 1.0
    count: Callable[..., torch.Tensor] | None = None

    @property
    def counts(self) -> bool:
        """Whether the weights depend on what each share counts (a ratio), not only on the number of
        replicas."""
        return self.kind == RATIO

    def of(self, shares: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        n = len(shares)
        return self.weighed([float(self.count(*share)) for share in shares] if self.counts and n > 1
                            else [0.0] * n)

    def weighed(self, counts: Sequence[float]) -> list[float]:
        """s_k from each replica's count (`count(*share)`, read for a ratio only): a distributed rank counts
        its own shares and the ranks gather the counts."""
        n = len(counts)
        if self.kind == SUM:
            return [n * self.scale] * n
        if self.kind == MEAN or n == 1:
            return [self.scale] * n
        total = sum(counts)
        if not all(c > 0 for c in counts):
            k = next(i for i, c in enumerate(counts) if not c > 0)
            raise FasttError(f"replica {k}'s share of the batch has nothing the loss counts (count "
                             f"{counts[k]}): data parallelism cannot weigh it; use a larger batch or a plan "
                             "without replicas")
        return [n * c / total * self.scale for c in counts]


ONE = ReplicaWeights(MEAN)


def replica_weights(whole: Reduction | None, share: Reduction | None, n: int) -> ReplicaWeights:
    """The weights of n replicas, each running the step captured at batch/n (`share`), so that together they
    compute the loss of the step captured at the whole batch (`whole`); FasttError if they cannot."""
    if n == 1:
        return ONE
    for r in (whole, share):
        if r is None or r.kind == UNKNOWN:
            why = r.why if r is not None else "the graph was not captured from a loss_fn"
            raise FasttError(f"fastt cannot tell how loss_fn reduces over the batch ({why}), so data "
                             "parallelism could train with another loss: reduce the loss with a mean, a sum "
                             "or a masked mean over the batch, or use a plan without replicas (planner "
                             "single or dpos)")
    pairs = list(zip(whole.terms or [(whole.factor, whole.items)],
                     share.terms or [(share.factor, share.items)]))
    scale = next((w[0] / s[0] for w, s in pairs if s[0]), 1.0)
    if (whole.kind != share.kind or len(whole.terms) != len(share.terms)
            or whole.kind != RATIO and any(w[1] != n * s[1] for w, s in pairs)
            or any(not math.isclose(w[0], scale * s[0]) for w, s in pairs)):
        raise FasttError(f"loss_fn reduces the whole batch as {whole.why} but a 1/{n} share as {share.why}: "
                         "data parallelism would change the loss; use a plan without replicas (planner "
                         "single or dpos)")
    return ReplicaWeights(whole.kind, scale, share.count)


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _reduces_all(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() == 1


def _reduction_arg(node: fx.Node) -> int | None:
    """A loss op's `reduction` argument (0 none, 1 mean, 2 sum), or None for an op without one."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "reduction" not in names:
        return None
    k = names.index("reduction")
    if k < len(node.args):
        return node.args[k]
    return node.kwargs.get("reduction", schema.arguments[k].default_value)


class _Walk:
    """Reads a step's loss node down to its batch reduction; `depends[n]` is the set of roles ("batch",
    "model") a node's value depends on."""

    def __init__(self, gm: fx.GraphModule, roles: Sequence[tuple[str, str]]) -> None:
        self.gm = gm
        kinds = {"input": "batch", "param": "model", "buffer": "model", "state": "model"}
        self.inputs: list[fx.Node] = []
        self.depends: dict[fx.Node, frozenset[str]] = {}
        placeholders = iter(roles)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                role = next(placeholders)[0]
                self.depends[n] = frozenset({kinds[role]} if role in kinds else ())
                if role == "input":
                    self.inputs.append(n)
            else:
                self.depends[n] = frozenset().union(*(self.depends[a] for a in n.all_input_nodes))

    def const(self, a: object) -> float | None:
        """The value of a Python number argument (None for a tensor)."""
        return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None

    def count_fn(self, outs: Sequence[object], finish: Callable) -> Callable[..., torch.Tensor]:
        """A function of a batch computing `finish(*outs)`, `outs` being nodes of the batch alone (copied out
        of the step) or constants."""
        g = fx.Graph()
        env = {n: g.placeholder(n.name) for n in self.inputs}
        needed: set[fx.Node] = set()
        stack = [o for o in outs if isinstance(o, fx.Node)]
        while stack:
            n = stack.pop()
            if n not in needed and n not in env:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        for n in self.gm.graph.nodes:
            if n in needed:
                env[n] = g.node_copy(n, lambda a: env[a])
        g.output(tuple(env[o] if isinstance(o, fx.Node) else None for o in outs))
        fn = fx.GraphModule(self.gm, g)
        consts = [None if isinstance(o, fx.Node) else o for o in outs]

        def count(*batch: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                vals = fn(*batch[:len(self.inputs)])
            return finish(*(c if v is None else v for v, c in zip(vals, consts)))
        return count

    def reduce(self, n: object) -> Reduction:
        if not isinstance(n, fx.Node) or n.op != "call_function":
            return Reduction(UNKNOWN, why=f"the loss is {getattr(n, 'op', type(n).__name__)}")
        t = n.target
        if "batch" not in self.depends[n]:
            return Reduction(UNKNOWN, why="the loss does not depend on the batch")
        if t in _SAME:
            return self.reduce(n.args[0])
        if t in _SCALE:
            return self.scaled(n)
        if t in _ADD:
            return self.added(n)
        whole = (aten.mean.default, aten.mean.dim, aten.sum.default, aten.sum.dim_IntList)
        if t in whole and _reduces_all(n):
            kind = MEAN if t in (aten.mean.default, aten.mean.dim) else SUM
            return Reduction(kind, items=_numel(n.args[0]), why=f"a {kind} of {_numel(n.args[0])} elements")
        if t is operator.getitem and n.args[1] == 0 and getattr(n.args[0], "target", None) in _NLL:
            return self.nll(n.args[0])
        r = _reduction_arg(n)
        if r in (1, 2):
            kind = MEAN if r == 1 else SUM
            return Reduction(kind, items=_numel(n.args[0]),
                             why=f"{t.__name__}'s {kind} of {_numel(n.args[0])} elements")
        return Reduction(UNKNOWN, why=f"the loss comes from {getattr(t, '__name__', t)}")

    def scaled(self, n: fx.Node) -> Reduction:
        """A constant times (or over) a reduction; a sum over a count of the batch alone is a ratio."""
        a, b = (list(n.args) + [None])[:2]
        if n.target is aten.neg.default:
            return self.reduce(a).scaled(-1.0)
        divide = n.target in (aten.div.Tensor, aten.div.Scalar)
        for x, y in ((a, b), (b, a)) if not divide else ((a, b),):
            c = self.const(y)
            if c is not None or isinstance(y, fx.Node) and not self.depends[y]:
                if c is None:
                    return Reduction(UNKNOWN, why="the loss is scaled by a tensor constant")
                if not c:
                    return Reduction(UNKNOWN, why="scaled by 0")
                return self.reduce(x).scaled(1 / c if divide else c)
        if divide and isinstance(b, fx.Node) and self.depends[b] == {"batch"}:
            r = self.reduce(a)
            if r.kind == SUM:
                count = self.count_fn([b], lambda c: c.sum())
                return Reduction(RATIO, r.factor, count=count, why=f"{r.why} over a count of the batch",
                                 terms=r.terms, counts=self.counted(b))
        why = f"the loss is a {n.target.__name__} of two values that depend on the batch"
        return Reduction(UNKNOWN, why=why)

    def added(self, n: fx.Node) -> Reduction:
        """A reduction plus a term of the model alone (a penalty), or two reductions of one kind."""
        a, b = n.args[:2]
        terms = [x for x in (a, b) if isinstance(x, fx.Node) and "batch" in self.depends[x]]
        if len(terms) == 1:
            r = self.reduce(terms[0])
            # The replicas' weights average to one for a mean or a ratio, so a term without the batch stays
            # whole.
            if r.kind in (MEAN, RATIO) and math.isclose(r.factor, 1.0):
                return r
            return Reduction(UNKNOWN, why=f"{r.why} plus a term that does not depend on the batch")
        alpha = n.kwargs.get("alpha", 1) * (-1 if n.target is aten.sub.Tensor else 1)
        ra, rb = self.reduce(a), self.reduce(b).scaled(alpha)
        # Two reductions of one kind (a loss and an auxiliary one; label smoothing's two terms, each a mean
        # over the targets cross-entropy counts): the replicas' weights of one are the other's.
        if ra.kind == rb.kind and ra.kind in (MEAN, SUM, RATIO) and (ra.kind != RATIO or ra.counts is not None
                                                                    and ra.counts == rb.counts):
            terms = (*(ra.terms or [(ra.factor, ra.items)]), *(rb.terms or [(rb.factor, rb.items)]))
            return Reduction(ra.kind, ra.factor + rb.factor, ra.items + rb.items, ra.count,
                             f"{ra.why} plus {rb.why}", terms, ra.counts)
        return Reduction(UNKNOWN, why=f"the loss adds {ra.why} and {rb.why}")

    def counted(self, b: fx.Node) -> object:
        """What count `b` counts, where two counts can be told alike: the targets not equal to a value (what
        cross-entropy counts without class weights), else `b` itself."""
        while b.target in _SAME or b.target is aten.sum.default and len(b.args) == 1:
            b = b.args[0]
        if b.target is aten.bitwise_not.default and getattr(b.args[0], "target", None) is aten.eq.Scalar:
            return ("not equal", self.source(b.args[0].args[0]), b.args[0].args[1])
        if b.target is aten.ne.Scalar:
            return ("not equal", self.source(b.args[0]), b.args[1])
        return b

    def source(self, x: object) -> object:
        """`x` before the copies and views that leave its values as they are."""
        while isinstance(x, fx.Node) and x.target in _SAME:
            x = x.args[0]
        return x

    def nll(self, n: fx.Node) -> Reduction:
        """nll_loss (cross_entropy): a mean over the targets not equal to ignore_index, weighted by class."""
        _, target, weight, reduction, ignore = n.args[:5]
        if reduction == 2:
            return Reduction(SUM, items=_numel(target), why="nll_loss's sum")
        if reduction != 1 or "model" in self.depends.get(weight, frozenset()):
            return Reduction(UNKNOWN, why="nll_loss without a reduction to a scalar")

        def counted(t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
            kept = t != ignore
            return kept.sum() if w is None else torch.where(kept, w[t.clamp(min=0)], 0).sum()
        return Reduction(RATIO, count=self.count_fn([target, weight], counted),
                         why="nll_loss's mean over the targets it counts",
                         counts=("not equal", self.source(target), ignore) if weight is None else n)


def reduction_of(gm: fx.GraphModule, roles: Sequence[tuple[str, str]]) -> Reduction:
    """How the loss (the step's first output) of a captured step reduces over the batch."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return _Walk(gm, roles).reduce(out.args[0][0])
