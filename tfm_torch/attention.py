"""Attention, PyTorch track: the same functions, class, arguments and state_dict keys as tfm_numpy.attention.

Autograd does the backward. Masks (boolean, True = "may attend") are made and checked in `masks`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tfm_common.pitfalls import HEAD_PROJECTIONS, SCORE_SCALES
from tfm_common.validate import check_choice, check_size, check_sizes

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
    "ATTENTION",
    "SCORE_SCALES",
    "HEAD_PROJECTIONS",
    "use_attention",
]

# "sdpa" (torch.nn.functional.scaled_dot_product_attention: fused kernels on a GPU) exists in this track only; the
# NumPy track refuses it by name (tfm_numpy.attention.check_attention)
ATTENTION = ("explicit", "flash", "sdpa")


# -- scaled dot-product attention ----------------------------------------------------------------------------


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, fill=None):
    """softmax(q k^T / sqrt(dk)) over the keys, masked keys left out.  q (..., Tq, dk), k (..., Tk, dk).

    Returns P (..., Tq, Tk). A query row with nothing to attend to gets all-zero weights (a zero output,
    zero gradients, never NaN), as in tfm_numpy. `fill` (-1e9, -1e4, float('-inf')) instead replaces the
    masked scores and takes a plain softmax, to show what that common recipe does to such a row.
    """
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
    """softmax(Q K^T / sqrt(dk)) V.  q (..., Tq, dk), k (..., Tk, dk), v (..., Tk, dv), mask True = may attend.

    Returns (output (..., Tq, dv), weights (..., Tq, Tk)).
    """
    check_qkv(q, k, v)
    weights = attention_weights(q, k, mask, fill=fill)  # (..., Tq, Tk)
    return weights @ v, weights  # (..., Tq, dv)


# -- multi-head attention ------------------------------------------------------------------------------------


class AttentionImpl:
    """How an attention module's heads compute softmax(q k^T / sqrt(dk)) v, as tfm_numpy's: `attention="explicit"`
    forms the weights (kept, detached, in `attn_weights`; dropout on them), "flash" runs chapter 15b's tiled kernel
    in tiles of `tile_size`, "sdpa" torch.nn.functional.scaled_dot_product_attention (its fused kernels on a GPU;
    dropout on the weights from torch's global generator, not `rng`). `use_attention` switches every module deriving
    from this class. Such a module has `dropout` (a Dropout) and `attn_weights`, sets `attention` and `tile_size`
    with `check_attention`, and calls `ctx = self._attend(q, k, v, mask)` in its forward."""

    attention: str
    tile_size: int

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """q (B, H, Tq, dk), k (B, H, Tk, dk), v (B, H, Tk, dv) -> the heads' output (B, H, Tq, dv)."""
        attend = {"flash": self._attend_flash, "sdpa": self._attend_sdpa}.get(self.attention, self._attend_explicit)
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
        p = self.dropout.p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, H, Tq, dv)


class MultiHeadAttention(AttentionImpl, Module):
    """Multi-head attention, the twin of tfm_numpy.MultiHeadAttention (same submodules, same keys).

    forward(query (B, Tq, d), key (B, Tk, d), value (B, Tk, d), mask) -> (B, Tq, d); `attn_weights` keeps
    the last softmax weights (B, H, Tq, Tk), detached, before dropout. attention="flash" computes the heads with
    `flash_attention` in tiles of `tile_size` (its hand-written backward; `attn_weights` stays None; no dropout
    on the weights, so training with dropout > 0 is refused), as in tfm_numpy. attention="sdpa" (this track only)
    calls torch.nn.functional.scaled_dot_product_attention with the same mask (its fused kernels on a GPU; a row
    with nothing to attend to gives zeros, as here; `attn_weights` stays None). score_scale="d_model" divides the
    scores by sqrt(d_model) instead of sqrt(dk) (a `ScaledLinear` query projection: times 1/sqrt(H)), as in tfm_numpy.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        attention: str = "explicit",
        tile_size: int = 64,
        score_scale: str = "d_k",
        rng=None,
        dtype=None,
    ):
        super().__init__()
        owner = type(self).__name__
        d_model, n_heads = check_sizes(owner, d_model=d_model, n_heads=n_heads).values()
        if d_model % n_heads != 0:
            raise ValueError(f"{owner}: d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.attention, self.tile_size = check_attention(owner, attention, tile_size)
        self.score_scale = check_choice(owner, "score_scale", score_scale, SCORE_SCALES)
        self._q_scale = None if score_scale == "d_k" else 1.0 / math.sqrt(n_heads)
        dt, g = check_dtype(dtype), as_generator(rng)
        self._make_projections(d_model, bias, g, dt)
        self.out_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.dropout = Dropout(dropout, rng=g)  # on the attention weights, in training only
        self.attn_weights: torch.Tensor | None = None

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        self.q_proj = self._query_projection(d_model, bias, g, dt)
        self.k_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.v_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)

    def _query_projection(self, d: int, bias: bool, g, dt) -> Linear:
        """A (d -> d) Linear for the queries; for chapter 16a's score_scale="d_model", one that scales its output by
        1/sqrt(H) (the scores then divide by sqrt(d_model), not sqrt(dk)): same weights, same state_dict key."""
        if self._q_scale is None:
            return Linear(d, d, bias, rng=g, dtype=dt)
        return ScaledLinear(d, d, bias, rng=g, dtype=dt, scale=self._q_scale)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, H, T, dk)."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.d_head).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, dk) -> (B, T, d)."""
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.d_model)

    def _check_forward(self, query, key, value, mask=None) -> None:
        """At the door, before anything is projected, cached or stored (a refused call changes nothing)."""
        self._check_inputs(query, key, value)
        check_attention_call("MultiHeadAttention", self, query.shape[0], query.shape[1], key.shape[1], mask)

    def _check_forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> None:
        self._check_inputs(query, key, value)
        cached = cache["k"].shape[2] if "k" in cache else 0  # positions (or, static, memory keys) already there
        keys = cached if static and "k" in cache else cached + key.shape[1]
        check_attention_call("MultiHeadAttention", self, query.shape[0], query.shape[1], keys, mask, cache)

    def _check_inputs(self, query, key, value) -> None:
        dt = self.q_proj.weight.dtype
        for arg, x in (("query", query), ("key", key), ("value", value)):
            check_input(f"MultiHeadAttention: {arg}", x, last_dim=self.d_model, dtype=dt)
            if x.dim() != 3:
                raise ValueError(f"MultiHeadAttention: {arg} must be (B, T, d_model), got shape {tuple(x.shape)}")
        if not query.shape[0] == key.shape[0] == value.shape[0]:
            shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            raise ValueError(f"MultiHeadAttention: batch sizes differ: {shapes}")
        if key.shape[1] != value.shape[1]:
            shapes = f"key {tuple(key.shape)}, value {tuple(value.shape)}"
            raise ValueError(f"MultiHeadAttention: key and value lengths differ: {shapes}")

    def forward(self, query, key, value, mask=None) -> torch.Tensor:
        q = self._split(self.q_proj(query))  # (B, H, Tq, dk)
        k = self._split(self.k_proj(key))  # (B, H, Tk, dk)
        v = self._split(self.v_proj(value))  # (B, H, Tk, dk)
        ctx = self._attend(q, k, v, mask)  # (B, H, Tq, dk): softmax(q k^T / sqrt(dk)) v in every head
        return self.out_proj(self._merge(ctx))  # (B, Tq, d)

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> torch.Tensor:
        """`forward` for incremental decoding (inference), keeping keys and values in `cache` (as tfm_numpy's):
        static=False (self-attention) appends the new positions' keys and values to cache["k"], cache["v"]
        (B, H, T, dk), in place in preallocated buffers (see `cache_append`); static=True (cross-attention)
        projects the memory on the first call only."""
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

    def extra_repr(self) -> str:
        impl = {"flash": f", attention='flash', tile_size={self.tile_size}", "sdpa": ", attention='sdpa'"}
        scale = ", score_scale='d_model'" if self.score_scale == "d_model" else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}{impl.get(self.attention, '')}{scale}"


class ScaledLinear(Linear):
    """A Linear whose output is multiplied by `scale`: chapter 16a's score_scale="d_model" as the query projection
    (times 1/sqrt(H)), the twin of tfm_numpy's. Same parameters and state_dict names as a Linear."""

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


def refuse_flash_dropout(owner: str, module) -> None:
    """The tiled kernel has no dropout on the weights: a module training with attention dropout is refused rather
    than silently trained without."""
    if module.attention == "flash" and module.training and module.dropout.p > 0:
        raise ValueError(
            f"{owner}: attention='flash' has no dropout on the attention weights, got dropout="
            f"{module.dropout.p} in training mode; use dropout=0.0, eval(), or attention='explicit'"
        )


def check_attention_call(owner: str, module, batch: int, tq: int, tk: int, mask, cache: dict | None = None) -> None:
    """What an attention module checks at its door, before it projects, caches or stores anything, as tfm_numpy's (a
    refused call changes nothing): the mask against the scores' shape (B, H, Tq, Tk), also for attention="sdpa",
    whose kernel would read a float mask as an additive bias; the rows of a decoding cache; the tiled kernel's
    refusal of attention dropout."""
    if cache is not None and "k" in cache and cache["k"].shape[0] != batch:
        raise ValueError(
            f"{owner}: the cache holds {cache['k'].shape[0]} rows, the input has {batch}; start a new cache for a "
            "new batch (or reorder it with reorder_cache)"
        )
    if mask is not None:
        check_mask(mask, (batch, module.n_heads, tq, tk))
    refuse_flash_dropout(owner, module)


def check_attention(owner: str, attention, tile_size) -> tuple[str, int]:
    """The attention option: "explicit" (weights formed, kept for inspection), "flash" (tiled) or "sdpa" (torch's
    fused kernels; this track only), and the tile size."""
    return check_choice(owner, "attention", attention, ATTENTION), check_size(owner, "tile_size", tile_size)


def use_attention(model, attention: str = "explicit", tile_size: int = 64):
    """Switch every attention module inside `model` (each `AttentionImpl`: MultiHeadAttention, the GPT's
    GroupedQueryAttention) to `attention` ("explicit", "flash" or "sdpa") with `tile_size`; returns the model (as
    tfm_numpy.use_attention)."""
    attention, tile_size = check_attention("use_attention", attention, tile_size)
    switched = 0
    for m in model.modules():
        if isinstance(m, AttentionImpl):
            m.attention, m.tile_size = attention, tile_size
            switched += 1
    if not switched:  # nothing would change: say so rather than return the model as it was
        raise ValueError(f"use_attention: {type(model).__name__} has no attention module to switch to {attention!r}")
    return model
