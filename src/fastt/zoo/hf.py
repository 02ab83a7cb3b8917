"""Hugging Face models of the zoo (BERT-base, BERT-large, GPT-2 small), built from a config with no download.

``transformers`` is imported lazily inside the builders, so importing ``fastt.zoo`` stays fast and works without
it. Every model uses ``attn_implementation="eager"`` (attention as plain matmul/softmax ops) and is wrapped in
:class:`LogitsOnly`, whose forward returns a plain logits tensor. Builders have the signature
``build(size, batch, dropout) -> (model, loss_fn, (input_ids, labels))``.
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
    """Wraps a Hugging Face LM: ``forward(input_ids)`` returns the logits tensor ``(batch, length, vocab)``.

    BERT gets no attention mask (every position is a real token), so transformers builds none; given a padding
    mask it would check its values (``mask.all()``), a data-dependent branch that symbolic tracing cannot take.
    GPT-2 gets an all-ones mask: without one, transformers inspects ``position_ids`` for packed sequences (also
    data-dependent). ``pad_token_id`` is None, so no padding check on the token values runs either. For BERT
    (``bert=True``) position and token type ids are passed explicitly, so its real ``position_ids`` and
    ``token_type_ids`` buffers are never read (a fake-mode trace of a real-tensor workload rejects real tensors
    it did not get as inputs).
    """

    def __init__(self, model: nn.Module, bert: bool = False) -> None:
        super().__init__()
        self.model = model
        self.bert = bert

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, torch.Tensor] = {}
        if not self.bert:
            kwargs["attention_mask"] = torch.ones_like(input_ids)
        else:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
            kwargs["position_ids"] = pos.unsqueeze(0).expand_as(input_ids)
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        return self.model(input_ids=input_ids, return_dict=True, **kwargs).logits


def _transformers() -> Any:
    """Import transformers, or say how to install it."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise FasttError("the bert-base, bert-large and gpt2 zoo models need transformers: "
                         "pip install 'fastt[zoo]'") from e
    return transformers


def _bert(size: str, batch: int, dropout: bool, large: bool) -> Built:
    tf = _transformers()
    p = 0.1 if dropout else 0.0
    if size == "paper":
        hidden, layers, heads, length, vocab = (1024, 24, 16, 128, 30522) if large else (768, 12, 12, 128, 30522)
    else:
        hidden, layers, heads, length, vocab = (256, 2, 4, 64, 2000)
    config = tf.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=512,
                           hidden_dropout_prob=p, attention_probs_dropout_prob=p, pad_token_id=None,
                           attn_implementation="eager")
    model = LogitsOnly(tf.BertForMaskedLM(config), bert=True)
    ids = torch.randint(0, vocab, (batch, length))
    masked = torch.rand(batch, length) < MASK_FRACTION
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return model, cross_entropy, (ids, labels)


def bert_base(size: str, batch: int, dropout: bool) -> Built:
    """BERT-base masked LM (Devlin et al. 2019): 12 layers, hidden 768, 12 heads, FFN 3072, WordPiece vocabulary
    30522, dropout 0.1 (BertForMaskedLM: no pooler, decoder tied to the word embedding; 109.5M params).
    paper: sequence length 128 (BERT's phase-1 pretraining length), batch 32. test: 2 layers, hidden 256,
    4 heads, vocab 2000, length 64, batch 16. Labels: 15% of positions carry the token (no [MASK]
    substitution; inputs are random anyway), the rest -100, ignored by cross entropy."""
    return _bert(size, batch, dropout, large=False)


def bert_large(size: str, batch: int, dropout: bool) -> Built:
    """BERT-large masked LM: 24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522 (335.1M params).
    paper: sequence length 128, batch 32. test: the same small config as bert-base's test size."""
    return _bert(size, batch, dropout, large=True)


def gpt2(size: str, batch: int, dropout: bool) -> Built:
    """GPT-2 small (Radford et al. 2019): 12 layers, d_model 768, 12 heads, BPE vocabulary 50257, context 1024,
    LM head tied to the token embedding (124.4M params), dropout 0.1. paper: length 1024, batch 8 (GPT-2's
    512-sequence batches split over many devices; 8 x 1024 fits a 32 GB GPU). test: 2 layers, d_model 256,
    4 heads, vocab 2000, length 64, batch 16. Input tokens[:, :-1], target tokens[:, 1:]."""
    tf = _transformers()
    p = 0.1 if dropout else 0.0
    if size == "paper":
        d, layers, heads, length, vocab = 768, 12, 12, 1024, 50257
    else:
        d, layers, heads, length, vocab = 256, 2, 4, 64, 2000
    config = tf.GPT2Config(vocab_size=vocab, n_positions=max(length, 1024), n_embd=d, n_layer=layers,
                           n_head=heads, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                           bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=None,
                           attn_implementation="eager")
    model = LogitsOnly(tf.GPT2LMHeadModel(config))
    tokens = torch.randint(0, vocab, (batch, length + 1))
    return model, cross_entropy, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
