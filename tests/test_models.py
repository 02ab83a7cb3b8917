"""Models as people write them train exactly as eager PyTorch does: transformers' Llama (constants in the step, a
ModelOutput, labels that are the input ids), DistilBERT called with a padding mask (a branch on the batch's values,
taken from the example batch and guarded), and the guards themselves."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fastt
from fastt.capture import capture_step
from fastt.errors import FasttError
from fastt.runtime import parallelize, reference

transformers = pytest.importorskip("transformers")

VOCAB = 128


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The runtime gives each of two devices one thread: so does the eager reference (a kernel's rounding
    depends on its thread count)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class Logits(nn.Module):
    """`model(input_ids=..., attention_mask=...).logits`, as users write it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            return self.model(input_ids=input_ids).logits
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def distilbert() -> nn.Module:
    torch.manual_seed(0)
    return Logits(transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0)))


def padded(batch: int = 4, length: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels): rows end in padding (mask 0, labels -100), the first row is full."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, length), generator=g) * mask
    return ids, mask, torch.where(mask.bool(), ids, -100)


def runner(how: str, model: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer, example: tuple) -> Callable:
    """The captured step on one device (`fx`), or the local runtime under a planner."""
    if how == "fx":
        step = fastt.capture(model, loss_fn, opt, example).fx
        return lambda *batch: step.run(model, opt, *batch)
    step = parallelize(model, loss_fn, opt, example, "cpu:2", how)
    assert how != "dpos" or len(set(step.strategy.placement.values())) == 2  # a plan over both devices
    return step


def assert_trains_as_eager(make: Callable[[], nn.Module], make_opt: Callable, loss_fn: Callable, example: tuple,
                           batches: list[tuple], how: str) -> None:
    ref, ours = make(), make()
    ref_opt, ours_opt = make_opt(ref.parameters()), make_opt(ours.parameters())
    run = runner(how, ours, loss_fn, ours_opt, example)
    for batch in batches:
        expected = reference.eager_step(ref, loss_fn, ref_opt, batch)
        torch.testing.assert_close(run(*batch), expected, rtol=1e-5, atol=1e-6)
    for (n, x), y in zip(ref.state_dict().items(), ours.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def sgd(ps) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


# The Llama trains with SGD here: torch.func.grad differentiates with grad mode on, so SiLU's backward is
# autograd's twice-differentiable formula (sigmoid, mul, add) where eager's calls the fused silu_backward kernel.
# Gradients differ in the last bits; Adam's normalised step carries that to 2e-5 of a tensor's largest value.
@pytest.mark.parametrize("how", ["fx", "single", "dpos"])
def test_llama_as_users_write_it_trains_as_eager(how: str) -> None:
    """Default config and attention: the key/value cache's empty tensors are constants (get_attr) of the step,
    and the labels are the input ids themselves (one tensor passed twice)."""
    ids = torch.randint(0, VOCAB, (4, 16))
    batches = [reference.batch_like((ids, ids), seed) for seed in range(3)]
    assert_trains_as_eager(lambda: Logits(llama()), sgd, lm_loss, (ids, ids), batches, how)


def test_a_model_output_trains_as_eager() -> None:
    """The model returns a ModelOutput (CausalLMOutputWithPast); loss_fn reads its logits."""
    ids = torch.randint(0, VOCAB, (4, 16))
    batches = [reference.batch_like((ids, ids), seed) for seed in range(3)]
    assert_trains_as_eager(llama, sgd, lambda out, y: lm_loss(out.logits, y), (ids, ids), batches, "dpos")


def test_the_step_holds_the_llamas_constants() -> None:
    ids = torch.randint(0, VOCAB, (4, 16))
    model = Logits(llama())
    g = fastt.capture(model, lm_loss, sgd(model.parameters()), (ids, ids))
    constants = [n for n in g.fx.gm.graph.nodes if n.op == "get_attr"]
    assert constants and all(n.name not in op.nodes for op in g.ops for n in constants)


@pytest.mark.parametrize("how", ["fx", "single", "dpos"])
def test_distilbert_with_a_padding_mask_trains_as_eager(how: str) -> None:
    example = padded()
    batches = [padded(seed=seed) for seed in range(1, 4)]
    assert_trains_as_eager(distilbert, lambda ps: torch.optim.Adam(ps, lr=1e-3), lm_loss, example, batches, how)


@pytest.mark.parametrize("how", ["fx", "single"])
@pytest.mark.parametrize("example_padded", [True, False])
def test_a_batch_that_takes_the_other_mask_branch_is_refused(how: str, example_padded: bool) -> None:
    """transformers skips the mask when nothing is padded (`padding_mask.all()`): the step captured for padded
    batches materialises it, the one captured without padding ignores it and would train padded batches as if
    every token were real. Either refuses the other kind of batch, before it changes the model."""
    ids, mask, labels = padded()
    full = torch.ones_like(mask)
    example, other = ((ids, mask, labels), (ids, full, ids)) if example_padded else ((ids, full, ids), (ids, mask, labels))
    model = distilbert()
    opt = sgd(model.parameters())
    run = runner(how, model, lm_loss, opt, example)
    run(*example)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FasttError, match=r"another branch.*masking_utils\.py:\d+.*padding_mask\.all\(\)") as e:
        run(*other)
    assert "\n" not in str(e.value) and "capture the step again" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Branchy(nn.Module):
    """Flips the sign of its input unless every element is positive: a branch on the batch's values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 0).all():
            return self.lin(x)
        return self.lin(-x)


def test_a_branch_on_the_batch_takes_the_examples_side_and_guards_it() -> None:
    torch.manual_seed(0)
    ref, ours = Branchy(), Branchy()
    ours.load_state_dict(ref.state_dict())
    ref_opt, ours_opt = sgd(ref.parameters()), sgd(ours.parameters())
    loss_fn = nn.functional.cross_entropy
    positive = (torch.rand(8, 4) + 0.1, torch.randint(0, 2, (8,)))
    rng_state = torch.get_rng_state()
    step = capture_step(ours, loss_fn, ours_opt, positive)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the trace computed real values on the side
    for seed in range(3):
        batch = (torch.rand(8, 4, generator=torch.Generator().manual_seed(seed)) + 0.1, positive[1])
        torch.testing.assert_close(step.run(ours, ours_opt, *batch), reference.eager_step(ref, loss_fn, ref_opt, batch))
    with pytest.raises(FasttError, match=r"test_models\.py:\d+ in forward \(`if \(x > 0\)\.all\(\):`\)"):
        step.run(ours, ours_opt, -positive[0], positive[1])


def test_each_data_parallel_replica_is_guarded() -> None:
    """Under data parallelism every replica runs the step captured for a share: each share is checked."""
    torch.manual_seed(0)
    model = Branchy()
    x, y = torch.rand(8, 4) + 0.1, torch.randint(0, 2, (8,))
    step = parallelize(model, nn.functional.cross_entropy, sgd(model.parameters()), (x, y), "cpu:2", "dp")
    assert step.strategy.replicas == 2
    step(x, y)
    x[5, 0] = -1.0
    with pytest.raises(FasttError, match="replica 1's share of this batch takes another branch"):
        step(x, y)


def test_a_branch_on_fake_inputs_or_on_the_model_is_refused_clearly() -> None:
    class OnWeights(Branchy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) if self.lin.weight.sum() > 0 else self.lin(-x)

    model = OnWeights()
    with pytest.raises(FasttError, match="computed from the model, not from the batch alone"):
        capture_step(model, nn.functional.cross_entropy, sgd(model.parameters()), (torch.rand(8, 4), torch.zeros(8).long()))
    with FakeTensorMode():
        model = Branchy()
        batch = (torch.rand(8, 4), torch.zeros(8, dtype=torch.long))
        opt = sgd(model.parameters())
    with pytest.raises(FasttError, match=r"branches on the batch's values at .*test_models\.py.*needs real example"):
        capture_step(model, nn.functional.cross_entropy, opt, batch)


class Reverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training), old style: forward(ctx, ...), an attribute on ctx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.scale * g, None


class StraightThrough(torch.autograd.Function):
    """A clamp whose gradient passes where |x| < 2 (a straight-through estimator), new style, saving its input."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1, 1)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * (x.abs() < 2).to(g.dtype)


class Adversarial(nn.Module):
    def __init__(self, functions: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.functions = functions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        h = Reverse.apply(StraightThrough.apply(h), 0.5) if self.functions else h.clamp(-1, 1)
        return self.c(h)


@pytest.mark.parametrize("how", ["fx", "dp", "dpos"])
def test_custom_autograd_functions_train_with_their_own_backward(how: str) -> None:
    """An old-style and a new-style autograd.Function: eager's step is the oracle, and their backward matters (the
    same net without them trains otherwise)."""
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    batches = [reference.batch_like((x, y), seed) for seed in range(3)]
    assert_trains_as_eager(Adversarial, sgd, nn.CrossEntropyLoss(), (x, y), batches, how)
    plain, custom = Adversarial(functions=False), Adversarial()
    for model in (plain, custom):
        reference.eager_step(model, nn.CrossEntropyLoss(), sgd(model.parameters()), batches[0])
    assert not torch.allclose(plain.a.weight, custom.a.weight, rtol=1e-3)


def test_bloom_trains_as_eager() -> None:
    """transformers' Bloom runs its GeLU as an old-style autograd.Function in training."""
    torch.manual_seed(0)
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2,
                                                                   n_head=4))
    ids = torch.randint(0, VOCAB, (4, 16))
    batches = [reference.batch_like((ids, ids), seed) for seed in range(3)]
    assert_trains_as_eager(lambda: Logits(copy.deepcopy(bloom)), sgd, lm_loss, (ids, ids), batches, "dp")


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return 2 * g


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InPlace.apply(super().forward(x) * 1)


def test_an_in_place_custom_function_is_refused_by_name() -> None:
    model = Doubled(8, 2)
    with pytest.raises(FasttError, match="InPlace changes its input in place"):
        fastt.capture(model, nn.functional.mse_loss, sgd(model.parameters()), (torch.randn(4, 8), torch.randn(4, 2)))


def mixtral(experts: str = "grouped_mm") -> nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_implementation=experts))


def test_mixtral_trains_as_eager() -> None:
    """transformers' Mixtral runs its experts with `aten._grouped_mm` by default, whose fake kernel refuses float32
    (`fastt.fake_kernels`); the routing's offsets are computed in the step."""
    moe = mixtral()
    assert moe.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, VOCAB, (4, 16))
    batches = [reference.batch_like((ids, ids), seed) for seed in range(3)]
    assert_trains_as_eager(lambda: Logits(copy.deepcopy(moe)), sgd, lm_loss, (ids, ids), batches, "dp")


def test_a_grouped_matmul_costs_the_flops_of_the_batched_matmuls_it_stands_for() -> None:
    """Mixtral's experts as one grouped matmul (`coarsen.grouped_mm_flop`) or, with experts_implementation
    "batched_mm", as batched matmuls that torch's flop counter knows: the step's FLOPs are the same."""
    ids = torch.randint(0, VOCAB, (4, 16))
    flops = []
    for experts in ("grouped_mm", "batched_mm"):
        model = Logits(mixtral(experts))
        graph = fastt.capture(model, lm_loss, sgd(model.parameters()), (ids, ids))
        flops.append(sum(op.flops for op in graph.ops))
    assert flops[0] == flops[1] > 0


class FlatTargets(nn.Module):
    """A language model whose targets come flattened, (batch * length,), beside tokens (batch, length)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.hidden, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(ids)))).reshape(-1, VOCAB)


def test_a_target_whose_rows_are_not_the_batch_trains_unreplicated_and_dp_says_why() -> None:
    ids = torch.randint(0, VOCAB, (8, 12))
    example = (ids, torch.randint(0, VOCAB, (8 * 12,)))
    batches = [reference.batch_like(example, seed) for seed in range(3)]
    assert_trains_as_eager(FlatTargets, sgd, nn.functional.cross_entropy, example, batches, "fx")
    model = FlatTargets()
    opt = sgd(model.parameters())
    strategy = fastt.plan(fastt.capture(model, nn.functional.cross_entropy, opt, example), "cpu:2", "dpos")
    assert strategy.replicas == 1 and len(set(strategy.placement.values())) == 2
    step = parallelize(model, nn.functional.cross_entropy, opt, example, "cpu:2", strategy=strategy)
    ref = FlatTargets()
    ref_opt = sgd(ref.parameters())
    for batch in batches:
        torch.testing.assert_close(step(*batch), reference.eager_step(ref, nn.functional.cross_entropy, ref_opt,
                                                                      batch), rtol=1e-5, atol=1e-6)
    model = FlatTargets()
    with pytest.raises(FasttError, match=r"input 1 .* has shape \[96\]: replicas split every input"):
        parallelize(model, nn.functional.cross_entropy, sgd(model.parameters()), example, "cpu:2", "dp")


def test_a_compiled_model_is_refused_with_what_to_pass() -> None:
    model = nn.Linear(8, 2)
    with pytest.raises(FasttError, match=r"torch.compile's wrapper.*model._orig_mod"):
        fastt.capture(torch.compile(model), nn.functional.mse_loss, sgd(model.parameters()),
                      (torch.randn(4, 8), torch.randn(4, 2)))
