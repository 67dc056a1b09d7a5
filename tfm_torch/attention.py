"""Attention, PyTorch track: the same functions, class, arguments and state_dict keys as tfm_numpy.attention.

Autograd does the backward. Masks (boolean, True = "may attend") are made and checked in `masks`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tfm_common.attention import MultiHeadAttentionDoor, refuse_flash_dropout, switch_attention
from tfm_common.config import own_init
from tfm_common.pitfalls import HEAD_PROJECTIONS, SCORE_SCALES
from tfm_common.validate import behind_door, check_choice, check_fill, check_size

from .flash import flash_attention
from .kv_cache import cache_append
from .layers import Dropout, Linear
from .masks import check_mask, check_qkv
from .module import Module, as_generator, at_the_door, check_dtype, check_input

__all__ = [
    "attention_weights",
    "scaled_dot_product_attention",
    "AttentionImpl",
    "MultiHeadAttention",
    "ScaledLinear",
    "SharedHeadProjectionAttention",
    "make_attention",
    "ATTN_IMPLS",
    "SCORE_SCALES",
    "HEAD_PROJECTIONS",
    "use_attention",
]

# "sdpa" (torch.nn.functional.scaled_dot_product_attention: fused kernels on a GPU) exists in this track only; the
# NumPy track refuses it by name (tfm_numpy.attention.check_attn_impl)
ATTN_IMPLS = ("explicit", "flash", "sdpa")


def check_attn_impl(owner: str, attn_impl, tile_size) -> tuple[str, int]:
    """The attn_impl option (tfm_numpy's two, and "sdpa") and the tile size."""
    return check_choice(owner, "attn_impl", attn_impl, ATTN_IMPLS), check_size(owner, "tile_size", tile_size)


# -- scaled dot-product attention ----------------------------------------------------------------------------


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, fill=None):
    """softmax(q k^T / sqrt(dk)) over the keys, masked keys left out: P (..., Tq, Tk), as tfm_numpy's (an all-masked
    row gets zeros; `fill` replaces the masked scores and takes a plain softmax)."""
    if at_the_door():  # inside a module, its door has checked q, k and the mask
        check_qkv(q, k, mask=mask)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # (..., Tq, Tk)
    if fill is not None:
        return torch.softmax(scores if mask is None else scores.masked_fill(~mask, fill), dim=-1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: a masked key gets exactly zero weight
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., Tq, 1); softmax ignores the shift, so detach
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # an all-masked row has max -inf
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)  # >= 1 for a row with an allowed key, else 0
    return e / torch.where(denom > 0, denom, 1.0)  # all-masked row: 0 / 1 = 0


def scaled_dot_product_attention(q, k, v, mask=None, *, fill=None):
    """softmax(Q K^T / sqrt(dk)) V: (output (..., Tq, dv), weights (..., Tq, Tk)), as tfm_numpy's."""
    check_qkv(q, k, v)
    weights = attention_weights(q, k, mask, fill=fill)  # (..., Tq, Tk)
    return weights @ v, weights  # (..., Tq, dv)


# `fill` checked in front of the printed functions (tfm_common.validate.behind_door): their bodies stay the lesson
def _check_attention_weights(q, k, mask=None, *, fill=None) -> None:
    check_fill("attention_weights", fill)


def _check_sdpa(q, k, v, mask=None, *, fill=None) -> None:
    check_fill("scaled_dot_product_attention", fill)


attention_weights = behind_door(attention_weights, _check_attention_weights)
scaled_dot_product_attention = behind_door(scaled_dot_product_attention, _check_sdpa)

# -- multi-head attention ------------------------------------------------------------------------------------


class AttentionImpl:
    """Twin of tfm_numpy.AttentionImpl (autograd: no `_attend_backward`), plus "sdpa" (this track only):
    torch.nn.functional.scaled_dot_product_attention, its fused kernels on a GPU (attention dropout from torch's
    global generator, not `rng`; no weights kept)."""

    attn_impl: str
    tile_size: int

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """q (B, H, Tq, dk), k (B, H, Tk, dk), v (B, H, Tk, dv) -> the heads' output (B, H, Tq, dv)."""
        attend = {"flash": self._attend_flash, "sdpa": self._attend_sdpa}.get(self.attn_impl, self._attend_explicit)
        return attend(q, k, v, mask)

    def _attend_explicit(self, q, k, v, mask) -> torch.Tensor:
        p = attention_weights(q, k, mask)  # (B, H, Tq, Tk)
        self.attn_weights = p.detach()
        return self.dropout(p) @ v  # (B, H, Tq, dv)

    def _attend_flash(self, q, k, v, mask) -> torch.Tensor:
        refuse_flash_dropout(type(self).__name__, self)
        self.attn_weights = None
        return flash_attention(q, k, v, mask, tile_size=self.tile_size)[0]  # (B, H, Tq, dv); lse is not needed

    def _attend_sdpa(self, q, k, v, mask) -> torch.Tensor:
        self.attn_weights = None
        p, gqa = self.dropout.p if self.training else 0.0, k.shape[1] < q.shape[1]  # gqa: fewer key/value heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)  # (B, H, Tq, dv)


class MultiHeadAttention(AttentionImpl, MultiHeadAttentionDoor, Module):
    """Twin of tfm_numpy.MultiHeadAttention (same submodules, same keys); `attn_weights` are detached. attn_impl="sdpa"
    (this track only) takes the same mask (a row with nothing to attend to gives zeros, as here)."""

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    # the building blocks of the constructor written in tfm_common.attention (MultiHeadAttentionDoor.__init__)
    _parts = SimpleNamespace(check_dtype=check_dtype, as_rng=as_generator, check_attn_impl=check_attn_impl,
                             Linear=Linear, Dropout=Dropout)  # fmt: skip

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        self.q_proj = self._query_projection(d_model, bias, g, dt)
        self.k_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.v_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)

    def _query_projection(self, d: int, bias: bool, g, dt) -> Linear:
        if self.q_scale is None:  # score_scale="d_model": a ScaledLinear, as tfm_numpy's
            return Linear(d, d, bias, rng=g, dtype=dt)
        return ScaledLinear(d, d, bias, rng=g, dtype=dt, scale=self.q_scale)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, H, T, dk)."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.d_head).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, dk) -> (B, T, d)."""
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.d_model)

    def forward(self, query, key, value, mask=None) -> torch.Tensor:
        q = self._split(self.q_proj(query))  # (B, H, Tq, dk)
        k = self._split(self.k_proj(key))  # (B, H, Tk, dk)
        v = self._split(self.v_proj(value))  # (B, H, Tk, dk)
        ctx = self._attend(q, k, v, mask)  # (B, H, Tq, dk): softmax(q k^T / sqrt(dk)) v in every head
        return self.out_proj(self._merge(ctx))  # (B, Tq, d)

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> torch.Tensor:
        """As tfm_numpy's: static=False appends to cache["k"], cache["v"] (B, H, T, dk); static=True: the memory's."""
        if not (static and "k" in cache):
            k = self._split(self.k_proj(key))  # (B, H, Tn, dk), or (B, H, S, dk) for the memory
            v = self._split(self.v_proj(value))
            if static:  # cross-attention: the memory's keys and values, once
                cache["k"], cache["v"] = k, v
            else:  # self-attention: the new positions written after the earlier ones, in place (no copy of those)
                cache_append(cache, "k", k, axis=2)
                cache_append(cache, "v", v, axis=2)
        q = self._split(self.q_proj(query))  # (B, H, Tn, dk)
        return self.out_proj(self._merge(self._attend(q, cache["k"], cache["v"], mask)))  # (B, Tn, d)


# a wrong argument is refused in the name of MultiHeadAttention, not of its door
own_init(MultiHeadAttention)  # SharedHeadProjectionAttention inherits it


class ScaledLinear(Linear):
    """A Linear whose output is multiplied by `scale` (twin of tfm_numpy's)."""

    def __init__(self, *args, scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class SharedHeadProjectionAttention(MultiHeadAttention):
    """Split into heads first, then one shared (dk, dk) projection for every head (twin of tfm_numpy's)."""

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        dk = self.d_head
        self.q_proj = self._query_projection(dk, bias, g, dt)
        self.k_proj = Linear(dk, dk, bias, rng=g, dtype=dt)
        self.v_proj = Linear(dk, dk, bias, rng=g, dtype=dt)

    def forward(self, query, key, value, mask=None) -> torch.Tensor:
        q = self.q_proj(self._split(query))  # (B, H, Tq, dk), the shared projection on the last axis
        k = self.k_proj(self._split(key))
        v = self.v_proj(self._split(value))
        return self.out_proj(self._merge(self._attend(q, k, v, mask)))  # (B, Tq, d)

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> torch.Tensor:
        if not (static and "k" in cache):
            k, v = self.k_proj(self._split(key)), self.v_proj(self._split(value))  # (B, H, Tn or S, dk)
            if static:
                cache["k"], cache["v"] = k, v
            else:
                cache_append(cache, "k", k, axis=2)
                cache_append(cache, "v", v, axis=2)
        ctx = self._attend(self.q_proj(self._split(query)), cache["k"], cache["v"], mask)  # (B, H, Tn, dk)
        return self.out_proj(self._merge(ctx))  # (B, Tn, d)


def make_attention(head_projection: str, d_model: int, n_heads: int, dropout: float = 0.0, **kwargs):
    """MultiHeadAttention (head_projection="full") or SharedHeadProjectionAttention ("shared")."""
    head_projection = check_choice("make_attention", "head_projection", head_projection, HEAD_PROJECTIONS)
    cls = MultiHeadAttention if head_projection == "full" else SharedHeadProjectionAttention
    return cls(d_model, n_heads, dropout, **kwargs)


def use_attention(model, attn_impl: str = "explicit", tile_size: int = 64):
    """Switch every `AttentionImpl` inside `model` to `attn_impl` with `tile_size` (as tfm_numpy.use_attention)."""
    attn_impl, tile_size = check_attn_impl("use_attention", attn_impl, tile_size)
    modules = [m for m in model.modules() if isinstance(m, AttentionImpl)]
    return switch_attention(model, modules, attn_impl, tile_size)
