"""Split chains: part k of a split op reads part k of the split op before it, no join between them (the
column-split matmul, relu, row-split matmul of a Megatron MLP). Oracle: the plain one-device eager step."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastt
from fastt import zoo
from fastt.errors import FasttError
from fastt.layers import where
from fastt.plan import get_planner
from fastt.plan.common import strategy_from
from fastt.plan.dpos import dpos_strategy
from fastt.plan.portfolio import with_chains
from fastt.runtime import parallelize
from fastt.runtime.reference import eager_step, max_param_rel_diff, take_state
from fastt.shard import sharded_residents
from fastt.simulate import simulate_plan
from fastt.split import chain, chain_links, chain_update, graph_for, split, splittable, update_link
from fastt.strategy import Split, Strategy

CL = fastt.cluster("cpu:2")
# fc1 by its output columns, its relu by dim1, fc2 by its reduction dim (summed); in the backward, relu_2's
# gradient by dim1 and the input gradient it feeds by the reduction dim
BLOCK = (Split("addmm", "cols", 2), Split("relu", "dim1", 2), Split("addmm_1", "reduction", 2),
         Split("threshold_backward", "dim1", 2), Split("mm_2", "reduction", 2))


def _make(optimizer: str = "sgd") -> tuple:
    torch.manual_seed(0)
    w = zoo.get("mlp", "test", dropout=False, optimizer=optimizer)
    return w.model, w.loss_fn, w.optimizer, w.example_inputs


@pytest.fixture(scope="module")
def mlp() -> fastt.OpGraph:
    model, loss_fn, opt, inputs = _make()
    return fastt.capture(model, loss_fn, opt, inputs)


def _plan(g: fastt.OpGraph, splits: tuple[Split, ...], replicas: int = 1) -> Strategy:
    """DPOS's placement of `g` with `splits`, then every split chained that can be."""
    start = fastt.plan(g, CL, "dp" if replicas > 1 else "single")
    s = dataclasses.replace(start, splits=splits)
    s = dataclasses.replace(dpos_strategy(graph_for(g, s), CL, replicas=replicas), splits=splits)
    return with_chains(g, s) or s


def _steps_as_eager(model, opt, step, ref: tuple, inputs: tuple, steps: int, tol: float = 1e-5) -> None:
    """`steps` steps, each from the same state as the eager reference's (the summed parts add in another
    order than eager's sums), equal to `tol` (the loss also to min(tol, 1e-6) absolute)."""
    for _ in range(steps):
        take_state(model, opt, ref[0], ref[2])
        torch.testing.assert_close(step(*inputs), eager_step(ref[0], ref[1], ref[2], inputs), rtol=tol,
                                   atol=min(tol, 1e-6))
        assert max_param_rel_diff(ref[0], model) <= tol


def test_a_chain_reads_the_producers_parts_and_drops_the_join_nothing_else_reads(mlp) -> None:
    s = _plan(mlp, BLOCK)
    assert s.chained == ("relu", "addmm_1", "mm_2")
    g = graph_for(mlp, s)
    assert "addmm#join" not in g.index  # only relu read it
    assert "relu#join" in g.index  # the weight gradient and relu's backward still read relu whole
    for k in range(2):
        assert g.ops[g.index[f"relu#{k}"]].inputs == (g.index[f"addmm#{k}"],)
        assert g.index[f"relu#{k}"] in g.ops[g.index[f"addmm_1#{k}"]].inputs
    unchained = graph_for(mlp, dataclasses.replace(s, chained=()))
    assert len(g.ops) == len(unchained.ops) - 1
    # no join, and no slice of it, between the chained ops: fewer bytes read across the edges
    assert sum(map(sum, (op.in_bytes for op in g.ops))) < sum(map(sum, (op.in_bytes for op in unchained.ops)))


# SGD: Adam's first steps amplify a rounding difference of the summed parts to the size of lr
@pytest.mark.parametrize("optimizer,replicas", [("sgd", 1), ("sgd", 2)])
def test_a_chained_mlp_block_trains_as_eager(optimizer: str, replicas: int) -> None:
    model, loss_fn, opt, inputs = _make(optimizer)
    g = fastt.capture(model, loss_fn, opt, inputs)
    splits = BLOCK if replicas == 1 else tuple(Split(f"r0/{sp.op}", sp.dim, sp.parts) for sp in BLOCK)
    s = _plan(g, splits, replicas)
    assert len(s.chained) == 3
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s)
    ref = _make(optimizer)
    _steps_as_eager(model, opt, step, ref, inputs, 5)


def test_ops_that_do_not_chain_are_named(mlp) -> None:
    g = split(split(mlp, "addmm", "rows", 2), "relu", "dim1", 2)  # rows feed a split by columns
    assert chain_links(g, "relu") == {}
    with pytest.raises(FasttError, match="'relu' cannot be chained"):
        chain(g, "relu")
    with pytest.raises(FasttError, match="'addmm_1' cannot be chained"):
        chain(g, "addmm_1")  # not split at all


def test_strategy_version_3_round_trips_its_chains_and_version_2_still_reads(mlp) -> None:
    s = _plan(mlp, BLOCK)
    assert Strategy.from_json(s.to_json()) == s
    old = json.loads(dataclasses.replace(s, chained=()).to_json())
    old["version"] = 2
    del old["chained"]
    assert Strategy.from_json(json.dumps(old)).chained == ()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_chains_keep_the_plan_sound_and_the_step_exact(mlp, data) -> None:
    """Random splits of the mlp's compute ops (2 parts along any dim that fits), chained wherever layouts
    agree: the plan validates and simulates, and one step of it equals the eager step."""
    ops = [op.name for op in mlp.ops if splittable(op, mlp)]
    names = data.draw(st.lists(st.sampled_from(ops), min_size=2, max_size=8, unique=True))
    splits = tuple(Split(n, data.draw(st.sampled_from(splittable(mlp.ops[mlp.index[n]], mlp))), 2)
                   for n in sorted(names, key=mlp.index.__getitem__))
    s = _plan(mlp, splits)
    g = graph_for(mlp, s)
    s.validate(g)
    assert simulate_plan(mlp, s, CL).iteration_s > 0
    for name in s.chained:
        for k in range(2):  # each chained part reads some producer's part k
            part = g.ops[g.index[f"{name}#{k}"]]
            assert any(g.ops[j].split and g.ops[j].split[1] == k for j in part.inputs)
    model, loss_fn, opt, inputs = _make()
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s)
    ref = _make()
    torch.testing.assert_close(step(*inputs), eager_step(ref[0], ref[1], ref[2], inputs), rtol=1e-5, atol=1e-6)
    assert max_param_rel_diff(ref[0], model) <= 1e-5


def test_a_bert_mlp_chains_through_its_reshapes_and_trains_as_eager() -> None:
    """bert's intermediate dense (2-d, by columns) is viewed as [B, T, 4H] for its gelu (by dim2) and back to
    2-d for the output dense (by its reduction dim): the parts chain through both views."""
    def make() -> tuple:
        torch.manual_seed(0)
        w = zoo.get("bert-base", "test", dropout=False)
        return w.model, w.loss_fn, w.optimizer, w.example_inputs
    model, loss_fn, opt, inputs = make()
    g = fastt.capture(model, loss_fn, opt, inputs)
    s = _plan(g, (Split("addmm_4", "cols", 2), Split("gelu", "dim2", 2), Split("addmm_5", "reduction", 2)))
    assert s.chained == ("gelu", "addmm_5")
    split_g = graph_for(g, s)
    assert split_g.ops[split_g.index["gelu#1"]].inputs == (split_g.index["addmm_4#1"],)
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s)
    ref = make()
    _steps_as_eager(model, opt, step, ref, inputs, 3)


# Tensor parallelism of the mlp's first two layers, as Megatron's MLP: layers.0 by its output features
# (column-parallel: its weight's rows), layers.3 by its input features (row-parallel: its weight's columns),
# each weight's gradient made by parts and each part updating its rows or columns where it was made.
TP_SPLITS = tuple(Split(a, b, 2) for a, b in [
    ("addmm", "cols"), ("relu", "dim1"), ("addmm_1", "reduction"),  # forward
    ("mm_4", "cols"), ("threshold_backward_2", "dim1"),  # the input gradients, through relu
    ("mm_6", "rows"), ("sum_4", "dim1"), ("mm_5", "cols")])  # layers.0's weight and bias, layers.3's weight
TP_CHAINED = ("relu", "addmm_1", "threshold_backward_2", "mm_6", "sum_4", "mm_5", "update:layers.0.weight",
              "update:layers.0.bias", "update:layers.3.weight")


def _tensor_parallel(g: fastt.OpGraph) -> Strategy:
    """Part k of every split on device k, the rest on device 0."""
    s = dataclasses.replace(fastt.plan(g, CL, "single"), splits=TP_SPLITS, chained=TP_CHAINED)
    split_g = graph_for(g, s)
    return dataclasses.replace(strategy_from(split_g, "tp", 2, [op.split[1] if op.split else 0
                                                                 for op in split_g.ops]),
                               splits=TP_SPLITS, chained=TP_CHAINED)


def test_a_tensor_parallel_mlp_holds_each_weight_once_and_trains_as_eager() -> None:
    model, loss_fn, opt, inputs = _make()
    g = fastt.capture(model, loss_fn, opt, inputs)
    s = _tensor_parallel(g)
    split_g = graph_for(g, s)
    held = {split_g.ops[r].name for r in sharded_residents(split_g)}
    assert held == {f"{kind}:layers.{i}.{p}{state}" for i, p in ((0, "weight"), (0, "bias"), (3, "weight"))
                    for kind, state in (("param", ""), ("state", ":momentum_buffer"))}
    assert "mm_6#join" not in split_g.index and "update:layers.0.weight" not in split_g.index
    one, tp = simulate_plan(g, fastt.plan(g, CL, "single"), CL), simulate_plan(g, s, CL)
    w = sum(p.numel() * 4 for name, p in model.named_parameters() if name in ("layers.0.weight",
                                                                               "layers.3.weight"))
    # each device holds half of both weights and their momentum: the one device's peak less about 2 x w/2
    assert max(tp.peak_memory_bytes) < one.peak_memory_bytes[0] - 0.8 * w
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s)
    ref = _make()
    _steps_as_eager(model, opt, step, ref, inputs, 4)
    torch.testing.assert_close(opt.state_dict()["state"][0]["momentum_buffer"],
                               ref[2].state_dict()["state"][0]["momentum_buffer"], rtol=1e-5, atol=1e-7)


def test_an_update_whose_gradient_is_not_split_does_not_chain(mlp) -> None:
    g = graph_for(mlp, dataclasses.replace(fastt.plan(mlp, CL, "single"), splits=TP_SPLITS))
    assert update_link(g, "update:layers.0.weight") is not None
    assert update_link(g, "update:layers.3.bias") is None  # its gradient, sum_3, is whole
    with pytest.raises(FasttError, match="'update:layers.3.bias' cannot be chained"):
        chain_update(g, "update:layers.3.bias")


def _double(name: str) -> tuple:
    """The zoo model in float64: relu's mask flips where a split reassociates a float32 sum within an ulp of
    zero, and a step from the same state then differs by up to 2e-3 of a gradient (the transformer, measured);
    in float64 a plan that computes the step exactly agrees with eager to about 1e-15."""
    torch.manual_seed(0)
    w = zoo.get(name, "test", dropout=False)
    model = w.model.double()
    return model, w.loss_fn, type(w.optimizer)(model.parameters(), **w.optimizer.defaults), w.example_inputs


@pytest.mark.parametrize("name", ["bert-base", "gpt2", "transformer"])
def test_megatron_cuts_every_mlp_and_trains_as_eager(name: str) -> None:
    """The megatron planner finds each MLP block's column- and row-parallel weights by propagating the cut
    (bert's and the transformer's nn.Linear, gpt2's Conv1D with its weight the other way round): each is held
    once across cpu:2 with its state, no join sits inside the block, and training equals eager step by step
    (float32 for the gelu models, float64 for the transformer's relu)."""
    make = _double if name == "transformer" else lambda n: _workload(n)
    model, loss_fn, opt, inputs = make(name)
    g = fastt.capture(model, loss_fn, opt, inputs)
    s = get_planner("megatron")(g, CL)
    split_g = graph_for(g, s)
    ffn = re.compile(r"(mlp\.c_fc|mlp\.c_proj|intermediate\.dense|\d\.output\.dense|linear1|linear2)\.weight$")
    mlps = {n for n, _ in model.named_parameters() if ffn.search(n)}
    held = {split_g.ops[r].name for r in sharded_residents(split_g)}
    assert {f"param:{n}" for n in mlps} <= held and len(mlps) >= 4
    assert all(f"update:{n}" in s.chained for n in mlps)
    said = dict(where(g, s.holders, [0, 0], s.sharded, s.chained))
    assert sum("tensor-parallel" in d for d in said.values()) >= 2  # fastt plan's words for the blocks
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s)
    _steps_as_eager(model, opt, step, make(name), inputs, 3, tol=1e-12 if name == "transformer" else 1e-5)


def _workload(name: str) -> tuple:
    torch.manual_seed(0)
    w = zoo.get(name, "test", dropout=False)
    return w.model, w.loss_fn, w.optimizer, w.example_inputs


def test_megatron_on_several_nodes_is_data_parallel_across_them_and_trains_as_eager() -> None:
    """On 2 nodes of 2 devices, megatron is data parallelism of the one-node plan: replica k on node k, each
    tensor-parallel weight's gradient averaged part by part (part j of both replicas, on device j of each
    node), each device holding its part of the weight and its state; training equals eager step by step on
    cpu:4 (float64: the transformer's relu)."""
    model, loss_fn, opt, inputs = _double("transformer")
    g = fastt.capture(model, loss_fn, opt, inputs)
    s = get_planner("megatron")(g, fastt.cluster("2x2xV100"))
    assert s.replicas == 2 and {sp.op.split("/")[0] for sp in s.splits} == {"r0", "r1"}
    split_g = graph_for(g, s)
    parts = [op for op in split_g.ops if op.kind == "allreduce" and op.name.endswith(("#0", "#1"))]
    assert len(parts) >= 8
    for op in parts:  # part j of each replica's gradient, made on device j of its node
        j = int(op.name[-1])
        assert [s.placement[split_g.ops[i].name] for i in op.inputs] == [j, 2 + j]
        assert [split_g.ops[i].name.split("/")[0] for i in op.inputs] == ["r0", "r1"]
    held = {split_g.ops[r].name for r in sharded_residents(split_g)}
    assert "param:transformer.encoder.layers.0.linear1.weight" in held
    step = parallelize(model, loss_fn, opt, inputs, "cpu:4", strategy=s)
    _steps_as_eager(model, opt, step, _double("transformer"), inputs, 3, tol=1e-12)


@pytest.mark.parametrize("spec", ["cpu:2", "2x2xV100"])
def test_megatron_cuts_sdpa_attention_by_heads_and_trains_as_eager(spec: str) -> None:
    """On a model whose attention is SDPA (DistilBERT, as transformers builds it by default), megatron cuts
    each attention by its heads as Megatron does: the query, key and value projections column-parallel,
    SDPA and its backward split along the heads, the output projection row-parallel, and every one of those
    weights held in parts with its state. The only joins left are the row-parallel layers' sums (Megatron's
    allreduces). Training equals eager step by step, on one node of 2 and on 2 nodes of 2 (cpu:4)."""
    model, loss_fn, opt, inputs = _workload("distilbert-padded")
    g = fastt.capture(model, loss_fn, opt, inputs)
    s = get_planner("megatron")(g, fastt.cluster(spec))
    split_g = graph_for(g, s)
    assert sum("scaled_dot_product" in sp.op for sp in s.splits) == 4 * s.replicas  # 2 layers, fwd and bwd
    attention = {n for n, _ in model.named_parameters() if re.search(r"attention\.(q|k|v|out)_lin\.weight$", n)}
    held = {split_g.ops[r].name for r in sharded_residents(split_g)}
    assert len(attention) == 8 and {f"param:{n}" for n in attention} <= held
    joins = [op for op in split_g.ops if op.name.endswith("#join")]
    assert joins and all(op.target == "join:sum" for op in joins)
    step = parallelize(model, loss_fn, opt, inputs, f"cpu:{s.n_devices}", strategy=s)
    _steps_as_eager(model, opt, step, _workload("distilbert-padded"), inputs, 3)


def test_megatron_in_bf16_cuts_what_it_cuts_in_fp32_and_trains_as_eager_autocast() -> None:
    """Under autocast a matmul reads the weight's bf16 copy (`_to_copy`), not the weight: megatron looks past
    that cast for its seeds and splits the cast with the weight, so DistilBERT's MLP and attention weights
    are held in parts as in fp32, and training equals eager under the same autocast, step by step, within
    bf16's unit (the row-parallel layers sum bf16 parts where eager's matmul accumulates in fp32)."""
    model, loss_fn, opt, inputs = _workload("distilbert-padded")
    held = {}
    for dtype in (None, torch.bfloat16):
        g = fastt.capture(model, loss_fn, opt, inputs, autocast=dtype)
        s = get_planner("megatron")(g, CL)
        held[dtype] = {g.ops[r].name for r in sharded_residents(graph_for(g, s))}
    assert held[torch.bfloat16] == held[None] and len(held[None]) >= 12
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s, autocast=torch.bfloat16)
    ref = _workload("distilbert-padded")
    for _ in range(3):
        take_state(model, opt, ref[0], ref[2])
        torch.testing.assert_close(step(*inputs), eager_step(*ref[:3], inputs, autocast=torch.bfloat16),
                                   rtol=2**-8, atol=0)
        assert max_param_rel_diff(ref[0], model) <= 2**-8


def test_megatron_refuses_single_device_nodes_and_models_without_an_mlp() -> None:
    model, loss_fn, opt, inputs = _workload("transformer")
    g = fastt.capture(model, loss_fn, opt, inputs)
    with pytest.raises(FasttError, match="two devices or more on every node"):
        get_planner("megatron")(g, fastt.cluster("4x1xV100@10Gbps"))
    model, loss_fn, opt, inputs = _workload("lenet")
    with pytest.raises(FasttError, match="no MLP to cut|no weight"):
        get_planner("megatron")(fastt.capture(model, loss_fn, opt, inputs), CL)


def test_owt_with_its_linear_layers_in_parts_trains_as_eager() -> None:
    """`held_in_parts` (fastt's portfolio): owt's plan of vgg19 with its large linear layer tensor-parallel
    over the node's devices instead of on one device; at test size classifier.3 (16% of the parameters) is
    column-parallel and classifier.6 after it row-parallel, each device holding its part of both weights with
    their momentum and computing it for every shard. Training equals eager step by step on cpu:2."""
    from fastt.plan.megatron import held_in_parts

    model, loss_fn, opt, inputs = _workload("vgg19")
    g = fastt.capture(model, loss_fn, opt, inputs)
    owt = get_planner("owt")(g, CL)
    s = held_in_parts(g, CL, owt)
    assert s.replicas == owt.replicas == 2 and s.splits and s.chained
    held = {graph_for(g, s).ops[r].name for r in sharded_residents(graph_for(g, s))}
    assert {"param:classifier.3.weight", "param:classifier.6.weight"} <= held
    convs = {name: devs for name, devs in s.holders.items() if name.startswith("param:features")}
    assert convs and all(devs == (0, 1) for devs in convs.values())  # the convolutions stay data-parallel
    step = parallelize(model, loss_fn, opt, inputs, "cpu:2", strategy=s)
    _steps_as_eager(model, opt, step, _workload("vgg19"), inputs, 3)
