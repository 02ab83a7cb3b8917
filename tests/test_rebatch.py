"""The step at another batch, derived from the capture for planning, is the step traced at that batch."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fastt
from fastt import zoo
from fastt.coarsen import capture_graph
from fastt.cost import measure
from fastt.errors import FasttError
from fastt.graph import rebatch
from fastt.rebatch import Undecided, _groups, derive

# convolutions, a transformer's heads (a view that splits the batch's dim with the heads), an LSTM's time
# steps, embedding tables and a mean's divisor, rotary slices and SDPA, padded attention masks, concatenations
MODELS = ("vgg19", "transformer", "gnmt", "dlrm", "llama", "distilbert-padded", "inception_v3")


def node_shapes(g: fastt.OpGraph) -> dict[str, object]:
    def shape(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.stride(), v.dtype
        return tuple(map(shape, v)) if isinstance(v, (list, tuple)) else None
    return {n.name: shape(n.meta.get("val")) for n in g.fx.gm.graph.nodes}


@pytest.mark.parametrize("name", MODELS)
def test_derived_step_is_the_traced_step(name: str) -> None:
    """Op for op (FLOPs, bytes, signatures, parts) and node for node (shapes, strides, dtypes), at a quarter of
    the batch, the planning graph equals the step traced again at that batch."""
    w = zoo.get(name, "test")
    g = capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=name)
    derived, traced = rebatch(g, g.batch // 4), rebatch(g, g.batch // 4, traced=True)
    assert derived.fx.derived and not traced.fx.derived  # derived, not traced again
    assert derived.ops == traced.ops
    assert node_shapes(derived) == node_shapes(traced)


def test_a_derived_step_does_not_run() -> None:
    """Its constants computed from the batch keep the captured batch's values: it plans, it never runs."""
    w = zoo.get("mlp", "test")
    g = capture_graph(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    sub = rebatch(g, g.batch // 2)
    assert sub.fx.derived
    with pytest.raises(FasttError, match="derived for planning"):
        sub.fx.run(w.model, w.optimizer, *[x[:g.batch // 2] for x in w.example_inputs])
    with pytest.raises(FasttError, match="derived for planning"):
        measure(sub, [])


class _Folded(nn.Module):
    """Folds the batch into the rows of a matrix product and back: after the product, no rule can tell which
    of two equal dims (batch 8, 8 rows a sample) holds the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, f = x.shape
        return self.fc(x.reshape(b * t, f)).reshape(t, b, f).sum(0)


def test_where_no_rule_decides_the_step_is_traced_again() -> None:
    model = _Folded()
    x, y = torch.randn(8, 8, 4), torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = capture_graph(model, nn.functional.mse_loss, opt, (x, y))
    assert derive(g.fx, 4) is None
    sub = rebatch(g, 4)
    assert not sub.fx.derived and sub.batch == 4 and sub.ops == rebatch(g, 4, traced=True).ops


@st.composite
def regrouped(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A shape and a view of it that merges runs of its dims and splits some dims in two."""
    a = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=6))
    b: list[int] = []
    k = 0
    while k < len(a):
        run = draw(st.integers(1, len(a) - k))
        size = math.prod(a[k:k + run])
        cut = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        b += [cut, size // cut] if cut not in (1, size) else [size]
        k += run
    return a, b


@settings(max_examples=200, deadline=None)
@given(regrouped())
def test_view_groups_cover_both_shapes_with_equal_products(shapes) -> None:
    """`_groups` pairs runs of a view's input and output dims: in order, each dim once, equal products."""
    a, b = shapes
    try:
        groups = _groups(a, b)
    except Undecided:
        pytest.fail(f"no groups for a view from {a} to {b}")
    assert [i for ins, _ in groups for i in ins] == list(range(len(a)))
    assert [o for _, outs in groups for o in outs] == list(range(len(b)))
    for ins, outs in groups:
        assert math.prod(a[i] for i in ins) == math.prod(b[o] for o in outs)
