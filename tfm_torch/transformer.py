"""The full encoder-decoder Transformer, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.transformer; autograd does the backward. (The same model built from `torch.nn.Transformer`, and the
conversion of weights between the two, are in `tfm_torch.reference`.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from tfm_common.config import own_init
from tfm_common.doors import TransformerDoor

from .attention import check_attn_impl, use_attention
from .encoder_decoder import Decoder, Encoder
from .kv_cache import cache_append
from .layers import Dropout, Embedding, LayerNorm, Linear
from .masks import causal_mask, check_mask, decoder_mask, padding_mask
from .module import Module, as_generator, check_dtype, check_indices, check_input, scale_
from .positional import LearnedPositionalEmbedding, PositionalEncoding

__all__ = ["xavier_uniform_", "Transformer"]


@torch.no_grad()
def xavier_uniform_(p: torch.Tensor, rng=None) -> torch.Tensor:
    """In place: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) for a (fan_out, fan_in) matrix (Glorot and Bengio,
    2010), drawn from an explicit generator; what torch.nn.init.xavier_uniform_ does for 2-D weights."""
    if p.dim() != 2:
        raise ValueError(f"xavier_uniform_: expected a matrix, got shape {tuple(p.shape)}")
    fan_out, fan_in = p.shape
    a = math.sqrt(6.0 / (fan_in + fan_out))
    return p.uniform_(-a, a, generator=as_generator(rng))


class Transformer(TransformerDoor, Module):
    """The encoder-decoder Transformer, twin of tfm_numpy.Transformer (see its docstring for the options, the
    weight sharing and the initialization). `model(src, tgt_in)` -> logits (B, T, tgt_vocab_size).

    Tied weights are one nn.Parameter registered under two (or three) names: autograd adds the gradients of
    every use into its one `.grad`; `named_parameters()` and `num_parameters()` list it once, `state_dict()`
    under each name.
    """

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) ids -> (memory (B, S, d), src_mask (B, 1, 1, S), True at real tokens)."""
        src_mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        x = self._embed(src, self.src_embed, self.src_pos, self.src_dropout, self.src_embed_norm)  # (B, S, d)
        return self.encoder(x, src_mask), src_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """tgt_in (B, T) ids, memory (B, S, d), src_mask (B, 1, 1, S) -> logits (B, T, tgt_vocab_size)."""
        tgt_mask = self._tgt_mask(tgt_in)  # (B, 1, T, T): causal and not padding
        y = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm)  # (B, T, d)
        y = self.decoder(y, memory, tgt_mask, src_mask)  # (B, T, d)
        return self._logits(y)  # (B, T, V)

    def decode_step(self, tgt_new: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: dict):
        """Incremental decoding (inference): the logits (B, Tn, V) of the new target tokens `tgt_new` (B, Tn) given
        the `cache` of the earlier calls (a dict, empty at first, filled here; the layout of tfm_numpy's: the target
        side's keys, values and padding mask in buffers of cache["capacity"] positions, written in place)."""
        t0, Tn = cache.get("length", 0), tgt_new.shape[1]
        cap = min(cache.setdefault("capacity", self.max_len), self.max_len)  # positions to make room for, once
        keep = cache_append(cache, "keep", padding_mask(tgt_new, self.pad_id), axis=3)  # (B, 1, 1, T), in place
        causal = torch.ones(Tn, t0 + Tn, dtype=torch.bool, device=tgt_new.device).tril(t0)  # new i sees 0 .. t0 + i
        tgt_mask = keep & causal if self.tgt_padding_mask else causal  # (B, 1, Tn, T), or (Tn, T): causal only
        y = self._embed(tgt_new, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm, t0)  # (B, Tn, d)
        room = {"capacity": cap, "preallocate": cache.get("preallocate", True)}
        layers = cache.setdefault("layers", [{"self_attn": dict(room)} for _ in self.decoder.layers])
        y = self.decoder.forward_step(y, memory, layers, tgt_mask, src_mask)  # (B, Tn, d)
        cache["length"] = t0 + Tn
        return self._logits(y)  # (B, Tn, V)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)  # (B, T, V)

    def _embed(self, tokens: torch.Tensor, embed: Embedding, pos: nn.Module, drop: Dropout, norm, offset: int = 0):
        x = embed(tokens)  # (B, T, d)
        if self._in_scale is not None:
            x = x * self._in_scale
        x = drop(pos(x, offset))
        return x if norm is None else norm(x)  # embed_norm=True: one more LayerNorm before the first layer

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        logits = self.output_projection(y)  # (B, T, V)
        return logits if self._out_scale is None else logits * self._out_scale

    def _tgt_mask(self, tgt_in: torch.Tensor) -> torch.Tensor:
        """Causal and not padding (B, 1, T, T); causal only (1, 1, T, T) with tgt_padding_mask=False."""
        if self.tgt_padding_mask:
            return decoder_mask(tgt_in, self.pad_id)
        return causal_mask(tgt_in.shape[1], tgt_in.device)

    _check_ids, _check_float = staticmethod(check_indices), staticmethod(check_input)  # see tfm_common.doors
    _check_mask = staticmethod(check_mask)

    # -- inspection -------------------------------------------------------------------------------------------
    def attention_weights(self) -> dict[str, list[torch.Tensor]]:
        """{"encoder": [(B, H, S, S)], "decoder": [(B, H, T, T)], "cross": [(B, H, T, S)]}, one per layer."""
        return {
            "encoder": self.encoder.attention_weights(),
            "decoder": self.decoder.attention_weights("self"),
            "cross": self.decoder.attention_weights("cross"),
        }

    def extra_repr(self) -> str:
        c = self.config
        return ", ".join(f"{k}={c[k]!r}" for k in ("norm_first", "positional", "share_embeddings", "tie_output"))


# the building blocks of the constructor written in tfm_common.doors (TransformerDoor.__init__)
Transformer._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_generator, check_attn_impl=check_attn_impl, use_attention=use_attention,
    Embedding=Embedding, scale_=scale_, PositionalEncoding=PositionalEncoding,
    LearnedPositionalEmbedding=LearnedPositionalEmbedding, Dropout=Dropout, LayerNorm=LayerNorm, Encoder=Encoder,
    Decoder=Decoder, Linear=Linear, xavier_uniform_=xavier_uniform_,
)  # fmt: skip
own_init(Transformer)  # a wrong argument is refused in the name of the Transformer, not of its door
