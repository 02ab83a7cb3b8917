"""Sequence models of the zoo: Transformer-base (``torch.nn.Transformer``), an LSTM language model and GNMT.

Every builder here has the signature ``build(size, batch, dropout) -> (model, loss_fn, example_inputs)``; the
last example input is the target token ids and the loss is cross entropy over the flattened logits. All
recurrent layers are ``nn.LSTM`` with ``batch_first=True``; sequence lengths are fixed, so there is no
data-dependent control flow (``make_fx`` unrolls the LSTMs over time).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastt.zoo.vision import Built, _p, cross_entropy


def _tokens(batch: int, length: int, vocab: int) -> torch.Tensor:
    """Random token ids ``(batch, length)`` in ``[0, vocab)``."""
    return torch.randint(0, vocab, (batch, length))


def _sinusoids(length: int, d_model: int, device: torch.device | None = None) -> torch.Tensor:
    """The sinusoidal position encodings of Vaswani et al. 2017, ``(length, d_model)`` (sin and cos halves
    concatenated rather than interleaved, which is equivalent up to a fixed permutation of features)."""
    pos = torch.arange(length, dtype=torch.float32, device=device).unsqueeze(1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=device)
                     * (-math.log(10000.0) / d_model))
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)


# ------------------------------------------------------------------------------------------------ Transformer


class Transformer(nn.Module):
    """Encoder-decoder Transformer: ``nn.Transformer`` (post-norm, ReLU) between a shared token embedding with
    sinusoidal positions and an output projection tied to that embedding (Vaswani et al. 2017, section
    3.4)."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, ffn: int, max_len: int,
                 dropout: float) -> None:
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.embed = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        self.drop = nn.Dropout(dropout)
        # nn.Transformer deep-copies one prototype layer per layer, and deepcopy of a FakeTensor lands in a
        # new FakeTensorMode ("Mixing fake modes" later); so build it with 0 layers and add fresh ones.
        t = nn.Transformer(d_model, heads, 0, 0, ffn, dropout, batch_first=True)
        t.encoder.layers = nn.ModuleList(nn.TransformerEncoderLayer(d_model, heads, ffn, dropout,
                                                                    batch_first=True)
                                         for _ in range(layers))
        t.decoder.layers = nn.ModuleList(nn.TransformerDecoderLayer(d_model, heads, ffn, dropout,
                                                                    batch_first=True)
                                         for _ in range(layers))
        t.encoder.num_layers = t.decoder.num_layers = layers
        for p in t.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)  # as nn.Transformer._reset_parameters does
        self.transformer = t
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = _sinusoids(tokens.shape[1], self.embed.embedding_dim, tokens.device)
        return self.drop(self.embed(tokens) * self.scale + pos)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        # Positions and the causal mask are computed here, not kept as buffers: a real buffer would be a
        # captured constant, which a fake-mode trace of a real-tensor workload rejects.
        t = tgt.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tgt.device), diagonal=1)
        # tgt_is_causal=True: nn.Transformer would otherwise compare the mask to a causal one
        # (data-dependent).
        h = self.transformer(self._embed(src), self._embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.out(h)


def transformer(size: str, batch: int, dropout: bool) -> Built:
    """Transformer-base (Vaswani et al. 2017). paper: d_model 512, 8 heads, 6+6 layers, FFN 2048, dropout 0.1,
    shared source/target vocabulary of 32000 BPE tokens tied with the output projection (60.5M params),
    source and target length 128, batch 64 sentence pairs (8192 target tokens; the paper used ~25k tokens per
    batch over 8 GPUs). test: d_model 256, 4 heads, 2+2 layers, FFN 1024, vocab 2000, length 32, batch 16.
    Inputs (src, tgt_in), target = tgt_in shifted by one token."""
    p = _p(dropout, 0.1)
    if size == "paper":
        vocab, d, heads, layers, ffn, length = 32000, 512, 8, 6, 2048, 128
    else:
        vocab, d, heads, layers, ffn, length = 2000, 256, 4, 2, 1024, 32
    model = Transformer(vocab, d, heads, layers, ffn, length, p)
    tgt = _tokens(batch, length + 1, vocab)
    src = _tokens(batch, length, vocab)
    return model, cross_entropy, (src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous())


# ------------------------------------------------------------------------------------------------------ RNNLM


class RNNLM(nn.Module):
    """Word-level LSTM language model: embedding, stacked LSTM, dropout, linear decoder (Zaremba et al.
    2014)."""

    def __init__(self, vocab: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=dropout)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.drop(self.embed(tokens)))
        return self.out(self.drop(h))


def rnnlm(size: str, batch: int, dropout: bool) -> Built:
    """2-layer LSTM LM, the "large" Penn Treebank setup of Zaremba et al. 2014: vocabulary 10000, embedding
    and hidden size 1500, dropout 0.65, unrolled 35 steps (66.0M params). paper batch: 64 (Zaremba used 20 on
    one GPU; 64 is a common per-iteration batch when training on several devices). test: hidden 256, vocab
    2000, 20 steps, batch 64. Input tokens[:, :-1], target tokens[:, 1:]."""
    p = _p(dropout, 0.65)
    if size == "paper":
        vocab, hidden, length = 10000, 1500, 35
    else:
        vocab, hidden, length = 2000, 256, 20
    tokens = _tokens(batch, length + 1, vocab)
    return RNNLM(vocab, hidden, 2, p), cross_entropy, (tokens[:, :-1].contiguous(),
                                                       tokens[:, 1:].contiguous())


# ------------------------------------------------------------------------------------------------------- GNMT


class GNMT(nn.Module):
    """GNMT with 4 encoder and 4 decoder LSTM layers, as in the MLPerf reference ("GNMT v2", Wu et al. 2016).

    Encoder: a bidirectional first layer, then 3 unidirectional layers with residual connections from the
    third on. Decoder: the first LSTM layer's outputs attend over the encoder outputs (Luong "general"
    attention, a simplification of GNMT's additive attention); the context is concatenated to the input of
    every upper layer, with residual connections from the third layer on. Source and target share one
    embedding (shared wordpiece vocabulary); the classifier is separate.
    """

    def __init__(self, vocab: int, hidden: int, dropout: float) -> None:
        super().__init__()
        h = hidden
        self.embed = nn.Embedding(vocab, h)
        self.drop = nn.Dropout(dropout)
        self.enc_bi = nn.LSTM(h, h, batch_first=True, bidirectional=True)
        self.enc = nn.ModuleList([nn.LSTM(2 * h, h, batch_first=True)]
                                 + [nn.LSTM(h, h, batch_first=True) for _ in range(2)])
        self.dec1 = nn.LSTM(h, h, batch_first=True)
        self.attn = nn.Linear(h, h, bias=False)
        self.dec = nn.ModuleList([nn.LSTM(2 * h, h, batch_first=True) for _ in range(3)])
        self.classifier = nn.Linear(h, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x, _ = self.enc_bi(self.drop(self.embed(src)))
        for i, lstm in enumerate(self.enc):
            y, _ = lstm(self.drop(x))
            x = y + x if i > 0 else y
        memory = x                                                          # (B, S, H)
        q, _ = self.dec1(self.drop(self.embed(tgt)))                        # (B, T, H)
        scores = torch.bmm(q, self.attn(memory).transpose(1, 2))            # (B, T, S)
        context = torch.bmm(F.softmax(scores, dim=-1), memory)              # (B, T, H)
        x = q
        for i, lstm in enumerate(self.dec):
            y, _ = lstm(self.drop(torch.cat([x, context], dim=-1)))
            x = y + x if i > 0 else y
        return self.classifier(self.drop(x))


def gnmt(size: str, batch: int, dropout: bool) -> Built:
    """GNMT-4 (the MLPerf translation reference): hidden 1024, shared vocabulary of 32000 wordpieces, dropout
    0.2, source and target length 50 (MLPerf's training cap), batch 128 (the GNMT paper's and MLPerf's per-GPU
    batch). test: hidden 256, vocab 2000, length 10, batch 64. Inputs (src, tgt_in), target = tgt_in shifted
    by one."""
    p = _p(dropout, 0.2)
    if size == "paper":
        vocab, hidden, length = 32000, 1024, 50
    else:
        vocab, hidden, length = 2000, 256, 10
    tgt = _tokens(batch, length + 1, vocab)
    src = _tokens(batch, length, vocab)
    return GNMT(vocab, hidden, p), cross_entropy, (src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous())
