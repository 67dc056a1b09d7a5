"""Encoder-only, NumPy track: a BERT-style masked language model (Devlin et al., 2019), forward and hand-written
backward.

Shapes: tokens `(B, T)` ids, hidden states `(B, T, d_model)`, logits `(B, T, vocab_size)`. Every position sees
every other (no causal mask); with `pad_id` set, keys holding the padding token are masked out of attention.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tfm_common.config import own_init
from tfm_common.mlm import BERTDoor

from .gpt import GPTBlock, make_norm
from .layers import GELU, Dropout, Embedding, Linear
from .masks import padding_mask
from .modern import RotaryEmbedding
from .module import Module, ModuleList, as_rng, check_dtype, check_indices, scale_
from .positional import LearnedPositionalEmbedding, PositionalEncoding
from .transformer import xavier_uniform_

__all__ = ["BERT"]


class BERT(BERTDoor, Module):
    """An encoder-only Transformer trained to fill in masked tokens: token embedding (+ positions), n_layers
    GPTBlocks WITHOUT the causal mask (Pre-LN, the GPT's options), a final norm, then the MLM head of BERT: a dense
    layer, GELU and a norm, and an output projection (tied to the embedding by default) with a bias.

    `model(tokens)` (B, T) -> logits (B, T, vocab_size), where logits[:, t] predict the token at t from all the
    others; `model.backward(dlogits)` fills every parameter's gradient. `model.encode(tokens)` -> hidden states
    (B, T, d_model) after the final norm (position 0, the [CLS] token, is the pooled output a classifier reads);
    `model.encode_backward(dhidden)` fills the gradients of the embedding and the blocks. Options as the GPT's:
      norm        "layernorm" or "rmsnorm"        positional  "learned", "sinusoidal" or "rope"
      activation  "gelu", "relu" or "swiglu"      n_kv_heads  grouped-query attention (None: n_heads)
      tie_output  the output projection's weight IS the token embedding (BERT does this)
      pad_id      None, or the padding token: keys equal to it are masked out of attention
    """

    _check_ids = staticmethod(check_indices)

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        h = self._encode(tokens)  # (B, T, d)
        self._cache = h.shape  # a forward to differentiate, once
        return self.output_projection(self.head_norm(self.head_act(self.head_dense(h))))  # (B, T, V)

    def backward(self, grad_logits: np.ndarray) -> None:
        """After `forward`: add dL/dparam into every parameter's grad (a tied weight gets both uses)."""
        self._saved()
        dh = self.head_dense.backward(self.head_act.backward(self.head_norm.backward(
            self.output_projection.backward(grad_logits))))  # fmt: skip
        self._encode_backward(dh)

    def encode(self, tokens: np.ndarray) -> np.ndarray:
        h = self._encode(tokens)
        self._cache = h.shape
        return h  # (B, T, d): position 0 is the [CLS] token's

    def encode_backward(self, grad_hidden: np.ndarray) -> None:
        """After `encode`: add dL/dparam into the embedding's, the blocks' and the final norm's grads."""
        self._saved()
        self._encode_backward(grad_hidden)

    def _encode(self, tokens: np.ndarray) -> np.ndarray:
        x = self.embed(tokens) * math.sqrt(self.d_model)  # (B, T, d)
        if self.pos is not None:
            x = self.pos(x)
        x = self.dropout(x)
        mask = None if self.pad_id is None else padding_mask(tokens, self.pad_id)  # (B, 1, 1, T): real keys only
        for layer in self.layers:
            x = layer(x, mask)  # every query sees every (real) key: no causal mask
        return self.norm(x)

    def _encode_backward(self, dh: np.ndarray) -> None:
        dx = self.norm.backward(dh)
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        dx = self.dropout.backward(dx)
        if self.pos is not None:
            dx = self.pos.backward(dx)
        self.embed.backward(dx * math.sqrt(self.d_model))


# the building blocks of the constructor written in tfm_common.mlm (BERTDoor.__init__)
BERT._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_rng, Embedding=Embedding, scale_=scale_,
    LearnedPositionalEmbedding=LearnedPositionalEmbedding, PositionalEncoding=PositionalEncoding, Dropout=Dropout,
    RotaryEmbedding=RotaryEmbedding, GPTBlock=GPTBlock, ModuleList=ModuleList, make_norm=make_norm, Linear=Linear,
    GELU=GELU, xavier_uniform_=xavier_uniform_,
)  # fmt: skip
own_init(BERT, dtype=np.float32)  # a wrong argument is refused in the name of BERT; tfm_numpy's default dtype
