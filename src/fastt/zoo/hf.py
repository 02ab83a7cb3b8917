"""Hugging Face models of the zoo (BERT-base, BERT-large at lengths 128 and 64, GPT-2 small, medium and large,
a Llama, DistilBERT on padded batches), built from a config with no download.

``transformers`` is imported lazily inside the builders, so importing ``fastt.zoo`` stays fast and works
without it. BERT and GPT-2 use ``attn_implementation="eager"`` (attention as plain matmul/softmax ops); the
Llama and DistilBERT keep the default (SDPA), as users build them. Every model is wrapped in
:class:`LogitsOnly`, whose forward returns a plain logits tensor. Builders have the signature ``build(size,
batch, dropout) -> (model, loss_fn, (input_ids, [attention_mask,] labels))``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from fastt.errors import FasttError
from fastt.zoo.vision import Built, cross_entropy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MASK_FRACTION = 0.15  # BERT's masked-LM fraction; the other positions are labelled -100 (ignored by the loss)


class LogitsOnly(nn.Module):
    """Wraps a Hugging Face LM: ``forward(input_ids[, attention_mask])`` returns the logits tensor
    ``(batch, length, vocab)``.

    What transformers is given decides which of its checks on tensor values run: a branch on values, which
    fake tracing takes from a real example batch and guards (`fastt.guards`) but cannot take from fake tensors
    (the zoo's paper size). BERT gets no attention mask (every position is a real token), so transformers
    builds none. GPT-2 gets an all-ones mask: without one, transformers inspects ``position_ids`` for packed
    sequences. The Llama gets neither (``ones_mask=False``): its key/value cache makes transformers skip that
    inspection, and its causal mask is SDPA's ``is_causal``. A padded batch's 2D ``attention_mask`` is passed
    on as the 4D boolean mask transformers would build from it: given the 2D mask, transformers first checks
    whether anything is padded (``mask.all()``), to skip it. ``pad_token_id`` is None, so no padding check on
    the token values runs either. BERT (``bert=True``) gets explicit all-zero ``token_type_ids`` (else its
    buffer is expanded and gathered) but no ``position_ids``: its embeddings slice their own buffer, and
    since transformers 5.25 position ids given without an attention mask are inspected for packed sequences
    (``find_packed_sequence_indices``), a branch on their values.
    """

    def __init__(self, model: nn.Module, bert: bool = False, ones_mask: bool = True) -> None:
        super().__init__()
        self.model = model
        self.bert = bert
        self.ones_mask = ones_mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        kwargs: dict[str, torch.Tensor] = {}
        if attention_mask is not None:  # (batch, 1, query, key): True where a query may attend
            n = input_ids.shape[1]
            kwargs["attention_mask"] = attention_mask.bool()[:, None, None, :].expand(-1, 1, n, n)
        elif not self.bert:
            if self.ones_mask:
                kwargs["attention_mask"] = torch.ones_like(input_ids)
        else:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        return self.model(input_ids=input_ids, return_dict=True, **kwargs).logits


def _transformers() -> Any:
    """Import transformers, or say how to install it."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise FasttError("the bert, gpt2, llama and distilbert-padded zoo models need transformers: "
                         "pip install 'fastt[zoo]'") from e
    return transformers


def _bert(size: str, batch: int, dropout: bool, large: bool, length: int = 128) -> Built:
    tf = _transformers()
    p = 0.1 if dropout else 0.0
    if size == "paper":
        hidden, layers, heads, vocab = (1024, 24, 16, 30522) if large else (768, 12, 12, 30522)
    else:
        hidden, layers, heads, length, vocab = (256, 2, 4, 64, 2000)
    config = tf.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=4 * hidden,
                           max_position_embeddings=512,
                           hidden_dropout_prob=p, attention_probs_dropout_prob=p, pad_token_id=None,
                           attn_implementation="eager")
    model = LogitsOnly(tf.BertForMaskedLM(config), bert=True)
    ids = torch.randint(0, vocab, (batch, length))
    masked = torch.rand(batch, length) < MASK_FRACTION
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return model, cross_entropy, (ids, labels)


def bert_base(size: str, batch: int, dropout: bool) -> Built:
    """BERT-base masked LM (Devlin et al. 2019): 12 layers, hidden 768, 12 heads, FFN 3072, WordPiece
    vocabulary 30522, dropout 0.1 (BertForMaskedLM: no pooler, decoder tied to the word embedding; 109.5M
    params). paper: sequence length 128 (BERT's phase-1 pretraining length), batch 32. test: 2 layers, hidden
    256, 4 heads, vocab 2000, length 64, batch 16. Labels: 15% of positions carry the token (no [MASK]
    substitution; inputs are random anyway), the rest -100, ignored by cross entropy."""
    return _bert(size, batch, dropout, large=False)


def bert_large(size: str, batch: int, dropout: bool) -> Built:
    """BERT-large masked LM: 24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522 (335.1M params).
    paper: sequence length 128, batch 32. test: the same small config as bert-base's test size."""
    return _bert(size, batch, dropout, large=True)


def bert_large_seq64(size: str, batch: int, dropout: bool) -> Built:
    """BERT-large at sequence length 64, FastT's memory case: paper: length 64, batch 32 (as bert-large's).
    test: bert-large's (and so bert-base's) test size, the same computation."""
    return _bert(size, batch, dropout, large=True, length=64)


def _gpt2(size: str, batch: int, dropout: bool, d: int, layers: int, heads: int) -> Built:
    """GPT2LMHeadModel with d_model `d`, `layers` layers and `heads` heads at paper size (BPE vocabulary
    50257, length 1024), else the test size shared by every GPT-2 of the zoo."""
    tf = _transformers()
    p = 0.1 if dropout else 0.0
    if size == "paper":
        length, vocab = 1024, 50257
    else:
        d, layers, heads, length, vocab = 256, 2, 4, 64, 2000
    config = tf.GPT2Config(vocab_size=vocab, n_positions=max(length, 1024), n_embd=d, n_layer=layers,
                           n_head=heads, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                           bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=None,
                           attn_implementation="eager")
    model = LogitsOnly(tf.GPT2LMHeadModel(config))
    tokens = torch.randint(0, vocab, (batch, length + 1))
    return model, cross_entropy, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def gpt2(size: str, batch: int, dropout: bool) -> Built:
    """GPT-2 small (Radford et al. 2019): 12 layers, d_model 768, 12 heads, BPE vocabulary 50257, context
    1024, LM head tied to the token embedding (124.4M params), dropout 0.1. paper: length 1024, batch 8
    (GPT-2's 512-sequence batches split over many devices; 8 x 1024 fits a 32 GB GPU). test: 2 layers, d_model
    256, 4 heads, vocab 2000, length 64, batch 16. Input tokens[:, :-1], target tokens[:, 1:]."""
    return _gpt2(size, batch, dropout, 768, 12, 12)


def gpt2_medium(size: str, batch: int, dropout: bool) -> Built:
    """GPT-2 medium (Radford et al. 2019, the 345M model; 354.8M params counted once with the tied head):
    24 layers, d_model 1024, 16 heads. paper: length 1024, batch 8, as gpt2's. test: gpt2's test size."""
    return _gpt2(size, batch, dropout, 1024, 24, 16)


def gpt2_large(size: str, batch: int, dropout: bool) -> Built:
    """GPT-2 large (Radford et al. 2019, the 762M model; 774.0M params with the tied head): 36 layers,
    d_model 1280, 20 heads. paper: length 1024, batch 8, as gpt2's. test: gpt2's test size."""
    return _gpt2(size, batch, dropout, 1280, 36, 20)


def llama(size: str, batch: int, dropout: bool) -> Built:
    """A Llama-style decoder as users build it: ``LlamaForCausalLM`` from a config, with RMSNorm, rotary
    position embeddings, grouped-query attention, a SwiGLU MLP and the default (SDPA) attention; the default
    config also builds a key/value cache, whose empty tensors are constants of the step. Llamas train without
    dropout, so ``dropout`` changes nothing. paper: TinyLlama-1.1B (Zhang et al. 2024): 22 layers, hidden
    2048, 32 query heads over 4 key/value heads, FFN 5632, vocabulary 32000, untied LM head (1.1B params),
    length 2048, batch 8. test: 2 layers, hidden 128, 4 heads over 2 key/value heads, FFN 344, vocab 2000,
    length 64, batch 16. Input tokens[:, :-1], target tokens[:, 1:]."""
    tf = _transformers()
    paper, test = (2048, 5632, 22, 32, 4, 2048, 32000), (128, 344, 2, 4, 2, 64, 2000)
    d, ffn, layers, heads, kv, length, vocab = paper if size == "paper" else test
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=length,
                            pad_token_id=None)
    model = LogitsOnly(tf.LlamaForCausalLM(config), ones_mask=False)
    tokens = torch.randint(0, vocab, (batch, length + 1))
    return model, cross_entropy, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def distilbert_padded(size: str, batch: int, dropout: bool) -> Built:
    """DistilBERT masked LM (Sanh et al. 2019) on padded batches, as an encoder trains on sentences of
    different lengths: ``DistilBertForMaskedLM`` with the default (SDPA) attention; 6 layers, hidden 768, 12
    heads, FFN 3072, vocabulary 30522, dropout 0.1 (67.0M params with the MLM head). Rows are padded at the
    end to the batch's length (the first row is full, the others uniformly half to all of it), with token 0
    ([PAD]) and attention mask 0 there; 15% of the real positions carry their token as label, the rest and the
    padding -100 (a masked mean: the loss counts the labelled positions). paper: length 128, batch 32. test: 2
    layers, hidden 128, 4 heads, FFN 512, vocab 2000, length 64, batch 16. Inputs (input_ids,
    attention_mask)."""
    tf = _transformers()
    p = 0.1 if dropout else 0.0
    paper, test = (768, 6, 12, 128, 30522), (128, 2, 4, 64, 2000)
    d, layers, heads, length, vocab = paper if size == "paper" else test
    config = tf.DistilBertConfig(vocab_size=vocab, dim=d, hidden_dim=4 * d, n_layers=layers, n_heads=heads,
                                 max_position_embeddings=512, dropout=p, attention_dropout=p,
                                 pad_token_id=None)
    model = LogitsOnly(tf.DistilBertForMaskedLM(config))
    lengths = torch.randint(length // 2, length + 1, (batch,))
    lengths[0] = length
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (batch, length)) * mask
    labelled = (torch.rand(batch, length) < MASK_FRACTION) & mask.bool()
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    return model, cross_entropy, (ids, mask, labels)
