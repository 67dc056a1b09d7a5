"""Decoder-only, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.gpt (the GPT block, the
GPT, sampling with a key/value cache); autograd does the backward."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from tfm_common.config import own_init
from tfm_common.model_doors import GPTBlockDoor, GPTDoor, WindowedGPTDoor
from tfm_common.rolling_cache import EMPTY_SLOT, kept_positions, rolling_slots, window_allowed
from tfm_common.sampling import sample_next
from tfm_common.training import eval_mode

from .attention import check_attn_impl, use_attention
from .layers import Dropout, Embedding, LayerNorm, Linear
from .masks import band_mask, causal_mask
from .modern import (
    GroupedQueryAttention,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUFeedForward,
    rope_angles_at,
    swiglu_hidden_size,
)
from .module import Module, as_generator, check_dtype, check_indices, scale_
from .positional import LearnedPositionalEmbedding, PositionalEncoding
from .sublayers import PositionwiseFeedForward
from .transformer import xavier_uniform_

__all__ = ["GPTBlock", "GPT", "WindowedGPT"]


def make_norm(norm: str, d_model: int, dtype) -> nn.Module:
    return LayerNorm(d_model, dtype=dtype) if norm == "layernorm" else RMSNorm(d_model, dtype=dtype)


class GPTBlock(GPTBlockDoor, Module):
    """x = x + dropout1(self_attn(norm1(x))); x = x + dropout2(ff(norm2(x))) (twin of tfm_numpy's)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        *,
        norm: str = "layernorm",
        activation: str = "gelu",
        n_kv_heads: int | None = None,
        rotary: RotaryEmbedding | None = None,
        rng=None,
        dtype=None,
    ):
        super().__init__()
        dt, rng = check_dtype(dtype), as_generator(rng)
        self.self_attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, dropout, rotary=rotary, rng=rng, dtype=dt)
        if activation == "swiglu":
            self.ff = SwiGLUFeedForward(d_model, swiglu_hidden_size(d_ff), dropout, rng=rng, dtype=dt)
        else:
            self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation, rng=rng, dtype=dt)
        self.norm1 = make_norm(norm, d_model, dt)
        self.norm2 = make_norm(norm, d_model, dt)
        self.dropout1 = Dropout(dropout, rng=rng)
        self.dropout2 = Dropout(dropout, rng=rng)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        x = x + self.dropout1(self.self_attn(self.norm1(x), mask, offset))
        return x + self.dropout2(self.ff(self.norm2(x)))

    def forward_step(self, x: torch.Tensor, cache: dict, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout1(self.self_attn.forward_step(self.norm1(x), cache, mask))
        return x + self.dropout2(self.ff(self.norm2(x)))

    def forward_rolling(self, x: torch.Tensor, cache: dict, mask: torch.Tensor, angles, keep, slots) -> torch.Tensor:
        x = x + self.dropout1(self.self_attn.forward_rolling(self.norm1(x), cache, mask, angles, keep, slots))
        return x + self.dropout2(self.ff(self.norm2(x)))


class GPT(GPTDoor, Module):
    """The decoder-only Transformer, twin of tfm_numpy.GPT (see its docstring for the options and initialization).
    `model(tokens)` (B, T) -> logits (B, T, vocab_size). A tied weight is one nn.Parameter under two names."""

    _check_ids = staticmethod(check_indices)  # see tfm_common.model_doors

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self._embed(tokens, 0)  # (B, T, d)
        mask = causal_mask(tokens.shape[1], device=tokens.device)  # (1, 1, T, T)
        for layer in self.layers:
            x = layer(x, mask)
        return self.output_projection(self.norm(x))  # (B, T, V)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states (B, T, d_model) after the final norm: `forward` without the output projection (as
        tfm_numpy's; chapter 22b puts a classifier on them)."""
        x = self._embed(tokens, 0)  # (B, T, d)
        mask = self._encode_mask(tokens.shape[1], tokens.device)
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)  # (B, T, d)

    def _encode_mask(self, T: int, device) -> torch.Tensor:
        return causal_mask(T, device=device)  # (1, 1, T, T)

    def _check_encode(self, tokens) -> None:
        self._check_tokens(tokens, 0)

    def _embed(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d_model)
        if self.pos is not None:
            x = self.pos(x, offset)
        return self.dropout(x)

    def forward_step(self, tokens: torch.Tensor, cache: dict) -> torch.Tensor:
        """The logits (B, Tn, V) of new tokens given the cache of the earlier calls (layout of tfm_numpy's)."""
        t0, Tn = cache.get("length", 0), tokens.shape[1]
        mask = torch.ones(Tn, t0 + Tn, dtype=torch.bool, device=tokens.device).tril(t0)[None, None]
        x = self._embed(tokens, t0)
        layers = cache.setdefault("layers", [{} for _ in self.layers])
        for layer, layer_cache in zip(self.layers, layers, strict=True):
            x = layer.forward_step(x, layer_cache, mask)
        cache["length"] = t0 + Tn
        return self.output_projection(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        tokens,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k=None,
        rng=None,
        use_cache=True,
        *,
        top_p=None,
        kv_dtype="float",
    ):
        """The prompt (B, T0) followed by max_new_tokens sampled tokens, as tfm_numpy.GPT.generate. `rng` is a
        numpy Generator or an int seed, as there: the uniforms come from NumPy in both tracks (the last position's
        logits, B x V numbers per step, are handed to tfm_common's sampler in float64), hence the same tokens."""
        n, temperature, top_k, rng, top_p = self._check_generate(tokens, max_new_tokens, temperature, top_k, rng,
                                                                 use_cache, top_p, kv_dtype)  # fmt: skip
        out = tokens.to(torch.long)
        with eval_mode(self):
            cache = self.new_cache(kv_dtype) if use_cache else None
            for i in range(n):
                if cache is None:
                    logits = self.forward(out)[:, -1]
                else:
                    logits = self.forward_step(out if i == 0 else out[:, -1:], cache)[:, -1]
                logits = logits.double().cpu().numpy()  # (B, V): the sampler is NumPy's, in both tracks
                nxt = sample_next(logits, temperature, top_k, rng, top_p=top_p, name="GPT.generate")
                out = torch.cat([out, torch.from_numpy(nxt).to(out.device)[:, None]], dim=1)
        return out


class WindowedGPT(WindowedGPTDoor, GPT):
    """The GPT with sliding-window attention and a rolling cache, twin of tfm_numpy.WindowedGPT (see its docstring):
    `GPT(..., window=w, sinks=s)` builds one."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self._embed(tokens, 0)  # (B, T, d)
        mask = band_mask(tokens.shape[1], self.window, self.sinks, device=tokens.device)  # (1, 1, T, T)
        for layer in self.layers:
            x = layer(x, mask)
        return self.output_projection(self.norm(x))  # (B, T, V)

    def _encode_mask(self, T: int, device) -> torch.Tensor:
        return band_mask(T, self.window, self.sinks, device=device)  # `encode` sees what `forward` sees

    def forward_step(self, tokens: torch.Tensor, cache: dict) -> torch.Tensor:
        """The logits (B, Tn, V) of new tokens given the rolling cache of the earlier calls (layout of tfm_numpy's;
        cache["slots"] a NumPy array)."""
        t0, Tn, size = cache.get("length", 0), tokens.shape[1], self.sinks + self.window
        new = np.arange(t0, t0 + Tn)
        slots = cache.get("slots", np.full(size, EMPTY_SLOT))
        keys = np.concatenate([slots, new])
        mask = torch.from_numpy(window_allowed(new[:, None], keys[None, :], self.window, self.sinks)[None, None])
        keep = kept_positions(new, t0 + Tn - 1, self.window, self.sinks)
        where = rolling_slots(new[keep], self.window, self.sinks)
        rotary = self.layers[0].self_attn.rotary
        angles = None
        if rotary is not None:
            angles = [a.to(tokens.device) for a in rope_angles_at(new, rotary.d_head, rotary.base, rotary.cos.dtype)]
        x = self._embed(tokens, t0)
        layers = cache.setdefault("layers", [{} for _ in self.layers])
        for layer, layer_cache in zip(self.layers, layers, strict=True):
            x = layer.forward_rolling(x, layer_cache, mask.to(tokens.device), angles, keep, where)
        slots = slots.copy()
        slots[where] = new[keep]
        cache["slots"], cache["length"] = slots, t0 + Tn
        return self.output_projection(self.norm(x))


# the building blocks of the constructor written in tfm_common.model_doors (GPTDoor.__init__)
GPT._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_generator, check_attn_impl=check_attn_impl, use_attention=use_attention,
    Embedding=Embedding, scale_=scale_, LearnedPositionalEmbedding=LearnedPositionalEmbedding,
    PositionalEncoding=PositionalEncoding, Dropout=Dropout, RotaryEmbedding=RotaryEmbedding, GPTBlock=GPTBlock,
    ModuleList=nn.ModuleList, make_norm=make_norm, Linear=Linear, xavier_uniform_=xavier_uniform_,
)  # fmt: skip
own_init(GPT)  # a wrong argument is refused in the name of GPT, not of its door
GPT._windowed = WindowedGPT  # what GPT(..., window=w) builds (GPTDoor.__new__)
