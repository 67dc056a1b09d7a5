"""Encoder-only, PyTorch track: the BERT-style masked language model, with the same names, arguments and state_dict
keys as tfm_numpy.bert; autograd does the backward."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from tfm_common.config import own_init
from tfm_common.mlm import BERTDoor

from .gpt import GPTBlock, make_norm
from .layers import GELU, Dropout, Embedding, Linear
from .masks import padding_mask
from .modern import RotaryEmbedding
from .module import Module, as_generator, check_dtype, check_indices, scale_
from .positional import LearnedPositionalEmbedding, PositionalEncoding
from .transformer import xavier_uniform_

__all__ = ["BERT"]


class BERT(BERTDoor, Module):
    """The encoder-only masked language model, twin of tfm_numpy.BERT (see its docstring for the options).
    `model(tokens)` (B, T) -> MLM logits (B, T, vocab_size); `model.encode(tokens)` -> hidden states (B, T, d_model)
    after the final norm (position 0: the [CLS] token's). A tied weight is one nn.Parameter under two names."""

    _check_ids = staticmethod(check_indices)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encode(tokens)  # (B, T, d)
        return self.output_projection(self.head_norm(self.head_act(self.head_dense(h))))  # (B, T, V)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d_model)
        if self.pos is not None:
            x = self.pos(x)
        x = self.dropout(x)
        mask = None if self.pad_id is None else padding_mask(tokens, self.pad_id)  # (B, 1, 1, T)
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


# the building blocks of the constructor written in tfm_common.mlm (BERTDoor.__init__)
BERT._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_generator, Embedding=Embedding, scale_=scale_,
    LearnedPositionalEmbedding=LearnedPositionalEmbedding, PositionalEncoding=PositionalEncoding, Dropout=Dropout,
    RotaryEmbedding=RotaryEmbedding, GPTBlock=GPTBlock, ModuleList=nn.ModuleList, make_norm=make_norm, Linear=Linear,
    GELU=GELU, xavier_uniform_=xavier_uniform_,
)  # fmt: skip
own_init(BERT)  # a wrong argument is refused in the name of BERT, not of its door
