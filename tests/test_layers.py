"""Layers found from the captured step's structure, checked against the models' own modules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from test_baselines import steps

from fastt import zoo
from fastt.api import capture
from fastt.graph import INPUT, PARAM, RESIDENT, UPDATE, OpGraph
from fastt.layers import layers, where


def captured(name: str) -> OpGraph:
    w = zoo.get(name)
    return capture(w.model, w.loss_fn, w.optimizer, w.example_inputs, name=name)


def modules_in_order(name: str) -> list[str]:
    """The model's parametrised modules in the order named_parameters lists them (the forward order of a
    sequential model)."""
    w = zoo.get(name)
    return list(dict.fromkeys(n.rpartition(".")[0] for n, _ in w.model.named_parameters()))


def check_cover(g: OpGraph) -> None:
    """Every parameter in exactly one layer, with its gradient's producer and its update; every op that computes
    something in a layer, except what serves several updates."""
    found = layers(g)
    assert sorted(p for layer in found.layers for p in layer.params) == g.of_kind(PARAM)
    for k, layer in enumerate(found.layers):
        assert layer.ops == tuple(i for i, x in enumerate(found.of) if x == k)
        for p in layer.params:
            assert all(found.of[s] == k for s in g.succs[p] if g.ops[s].kind != "allreduce")
    for i, op in enumerate(g.ops):
        if op.kind not in RESIDENT and op.kind != INPUT and op.name != "update:*":
            assert found.of[i] >= 0, op.name
        if op.kind == UPDATE and op.name != "update:*":
            assert {found.of[u] for u in op.updates} == {found.of[i]}


@pytest.mark.parametrize("name", ["lenet", "alexnet", "vgg19", "mlp"])
def test_sequential_models_layer_by_layer(name: str) -> None:
    """A sequential model's layers are its modules, in their order; each forward op's layer is that of its
    parameters or the one before (an activation after its linear layer)."""
    g = captured(name)
    found = layers(g)
    assert [layer.name for layer in found.layers] == modules_in_order(name)
    check_cover(g)


def test_vgg19_fc_layer_holds_its_ops() -> None:
    """classifier.0 (VGG's first FC layer): its matmul, the ReLU and dropout after it, the backward of those
    (the ReLU's backward reads the ReLU's output), both matmuls of its backward and the bias gradient."""
    g = captured("vgg19")
    found = layers(g)
    fc = next(layer for layer in found.layers if layer.name == "classifier.0")
    targets = sorted(g.ops[i].target.split(".")[1] for i in fc.ops if g.ops[i].kind == "compute")
    assert targets.count("addmm") == 1 and targets.count("mm") == 2 and "relu" in targets
    assert "threshold_backward" in targets and "sum" in targets


@pytest.mark.parametrize("name", ["resnet50", "bert-base", "gpt2", "llama", "transformer", "rnnlm",
                                  "distilbert-padded"])
def test_zoo_models_are_covered(name: str) -> None:
    check_cover(captured(name))


def test_tied_embedding_is_one_layer() -> None:
    """BERT's decoder reads the word embeddings (tied weights): one layer, named by both modules, before the
    encoder (the position embeddings' lookup of their own buffer may come first)."""
    found = layers(captured("bert-base"))
    names = [layer.name for layer in found.layers]
    tied = [k for k, name in enumerate(names) if "word_embeddings" in name]
    assert [names[k] for k in tied] == ["model.bert.embeddings.word_embeddings+model.cls.predictions"]
    assert tied[0] < min(k for k, name in enumerate(names) if ".encoder." in name), names
    assert found.layers[-1].name.startswith("model.cls.predictions.transform")


def test_replicated_graph_is_refused() -> None:
    from fastt.graph import data_parallel_graph

    with pytest.raises(ValueError, match="captured step"):
        layers(data_parallel_graph(captured("mlp"), 2))


@settings(max_examples=60, deadline=None)
@given(steps())
def test_random_steps(g: OpGraph) -> None:
    """Hand-built steps (no loss known): every parameter still anchors a layer with its update."""
    check_cover(g)


def test_where_says_which_layers_a_plan_holds_where() -> None:
    """owt on vgg19: the convolutions on every device, each FC layer on one device, in runs of layers."""
    from fastt.cluster import cluster
    from fastt.plan.mixed import owt

    w = zoo.get("vgg19", "test")
    g = capture(w.model, w.loss_fn, w.optimizer, w.example_inputs)
    cl = cluster("2x2xV100")
    held = where(g, owt(g, cl).holders, [d.node for d in cl.devices])
    assert held[0] == ("features.0 … features.34 (16 layers)", "every device")
    rest = " ".join(name for name, _ in held[1:])
    assert rest.startswith("classifier.0") and rest.endswith(("classifier.6", "classifier.6 (2 layers)"))
    assert all(devs.startswith("device ") for _, devs in held[1:])
    assert where(g, {op.name: (0, 1) for op in g.ops}, [0, 0, 1, 1])[0][1] == "node 0 (devices 0-1)"
