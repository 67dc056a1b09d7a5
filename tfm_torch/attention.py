"""Attention, PyTorch track: the same functions, class, arguments and state_dict keys as tfm_numpy.attention.

Autograd does the backward. Masks are boolean, True = "may attend" (the opposite of
`torch.nn.MultiheadAttention`'s `attn_mask` / `key_padding_mask`; the same as the boolean `attn_mask`
of `torch.nn.functional.scaled_dot_product_attention`).
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
from .module import Module, _autocast_dtype, as_generator, check_dtype, check_input

__all__ = [
    "attention_weights",
    "scaled_dot_product_attention",
    "padding_mask",
    "causal_mask",
    "decoder_mask",
    "MultiHeadAttention",
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


def _check_qkv(q, k, v=None) -> None:
    """Validate the public inputs: float tensors of one dtype, q/k sizes equal, keys and values paired."""
    name = "scaled_dot_product_attention"
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float64) and not _autocast_dtype(x):
            raise TypeError(f"{name}: {arg} must be float32 or float64, got dtype {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: q and {arg} must share a dtype, got {q.dtype} and {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"{name}: {arg} must have at least 2 dimensions (T, d), got shape {tuple(x.shape)}")
    qs, ks = tuple(q.shape), tuple(k.shape)
    if qs[-1] != ks[-1]:
        raise ValueError(f"{name}: q and k must have the same last dimension dk, got q {qs} and k {ks}")
    if qs[:-2] != ks[:-2]:
        raise ValueError(f"{name}: q and k must have the same leading dimensions, got q {qs} and k {ks}")
    if v is not None and tuple(v.shape[:-1]) != ks[:-1]:
        raise ValueError(
            f"{name}: k and v must have the same shape but the last dim, got k {ks} and v {tuple(v.shape)}"
        )


def _check_mask(mask, scores_shape: tuple[int, ...]) -> None:
    """A boolean tensor that broadcasts to the scores' shape (..., Tq, Tk) without growing it."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask: expected a boolean torch.Tensor (True = may attend), got {got}; use mask.bool()")
    try:
        ok = tuple(torch.broadcast_shapes(mask.shape, scores_shape)) == scores_shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask: shape {tuple(mask.shape)} does not broadcast to the attention scores' shape {scores_shape}"
        )


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, fill=None):
    """softmax(q k^T / sqrt(dk)) over the keys, masked keys left out.  q (..., Tq, dk), k (..., Tk, dk).

    Returns P (..., Tq, Tk). A query row with nothing to attend to gets all-zero weights (a zero output,
    zero gradients, never NaN), as in tfm_numpy. `fill` (-1e9, -1e4, float('-inf')) instead replaces the
    masked scores and takes a plain softmax, to show what that common recipe does to such a row.
    """
    _check_qkv(q, k)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # (..., Tq, Tk)
    if mask is not None:
        _check_mask(mask, tuple(scores.shape))
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
    _check_qkv(q, k, v)
    weights = attention_weights(q, k, mask, fill=fill)  # (..., Tq, Tk)
    return weights @ v, weights  # (..., Tq, dv)


# -- masks ---------------------------------------------------------------------------------------------------


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) integer tokens -> (B, 1, 1, T) torch.bool, True where the token is real (not `pad_id`)."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 2
        or tokens.is_floating_point()
        or tokens.is_complex()
        or tokens.dtype == torch.bool
    ):
        got = f"shape {tuple(tokens.shape)}, {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens)
        raise ValueError(f"padding_mask: tokens must be a (B, T) integer tensor, got {got}")
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(T: int, device=None) -> torch.Tensor:
    """(1, 1, T, T) torch.bool, lower triangular: query i may attend to keys 0..i."""
    if T < 1:
        raise ValueError(f"causal_mask: T must be positive, got {T}")
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def decoder_mask(tgt_tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The decoder's self-attention mask: causal AND not padding. (B, T) tokens -> (B, 1, T, T) torch.bool."""
    return padding_mask(tgt_tokens, pad_id) & causal_mask(tgt_tokens.shape[1], device=tgt_tokens.device)


# -- multi-head attention ------------------------------------------------------------------------------------


class MultiHeadAttention(Module):
    """Multi-head attention, the twin of tfm_numpy.MultiHeadAttention (same submodules, same keys).

    forward(query (B, Tq, d), key (B, Tk, d), value (B, Tk, d), mask) -> (B, Tq, d); `attn_weights` keeps
    the last softmax weights (B, H, Tq, Tk), detached, before dropout. attention="flash" computes the heads with
    `flash_attention` in tiles of `block_size` (its hand-written backward; `attn_weights` stays None; no dropout
    on the weights, so training with dropout > 0 is refused), as in tfm_numpy. attention="sdpa" (this track only)
    calls torch.nn.functional.scaled_dot_product_attention with the same mask (its fused kernels on a GPU; a row
    with nothing to attend to gives zeros, as here; dropout on the weights from torch's global generator, not
    `rng`; `attn_weights` stays None). score_scale="d_model" divides the
    scores by sqrt(d_model) instead of sqrt(dk) (the queries times 1/sqrt(H)), as in tfm_numpy.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        attention: str = "explicit",
        block_size: int = 64,
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
        self.attention, self.block_size = check_attention(owner, attention, block_size)
        self.score_scale = check_choice(owner, "score_scale", score_scale, SCORE_SCALES)
        self._q_scale = None if score_scale == "d_k" else 1.0 / math.sqrt(n_heads)
        dt, g = check_dtype(dtype), as_generator(rng)
        self._make_projections(d_model, bias, g, dt)
        self.out_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.dropout = Dropout(dropout, rng=g)  # on the attention weights, in training only
        self.attn_weights: torch.Tensor | None = None

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        self.q_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.k_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.v_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)

    def _heads(self, proj: Linear, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, H, T, dk): project, then split."""
        return self._split(proj(x))

    def _queries(self, query: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.q_proj, query)  # (B, H, Tq, dk)
        return q if self._q_scale is None else q * self._q_scale

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, H, T, dk)."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.d_head).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, dk) -> (B, T, d)."""
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.d_model)

    def _check(self, query, key, value) -> None:
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
        self._check(query, key, value)
        check_attention_call("MultiHeadAttention", self, query.shape[0], query.shape[1], key.shape[1], mask)
        q = self._queries(query)  # (B, H, Tq, dk)
        k = self._heads(self.k_proj, key)  # (B, H, Tk, dk)
        v = self._heads(self.v_proj, value)  # (B, H, Tk, dk)
        if self.attention != "explicit":
            self.attn_weights = None
            return self.out_proj(self._merge(self._fused(q, k, v, mask)))
        p = attention_weights(q, k, mask)  # (B, H, Tq, Tk)
        self.attn_weights = p.detach()
        ctx = self.dropout(p) @ v  # (B, H, Tq, dk)
        return self.out_proj(self._merge(ctx))  # (B, Tq, d)

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> torch.Tensor:
        """`forward` for incremental decoding (inference), keeping keys and values in `cache` (as tfm_numpy's):
        static=False (self-attention) appends the new positions' keys and values to cache["k"], cache["v"]
        (B, H, T, dk), in place in preallocated buffers (see `cache_append`); static=True (cross-attention)
        projects the memory on the first call only."""
        self._check(query, key, value)
        cached = cache["k"].shape[2] if "k" in cache else 0  # positions (or, static, memory keys) already there
        keys = cached if static and "k" in cache else cached + key.shape[1]
        check_attention_call("MultiHeadAttention", self, query.shape[0], query.shape[1], keys, mask, cache)
        if not (static and "k" in cache):
            k = self._heads(self.k_proj, key)  # (B, H, Tn, dk), or (B, H, S, dk) for the memory
            v = self._heads(self.v_proj, value)
            if static:  # cross-attention: the memory's keys and values, once
                cache["k"], cache["v"] = k, v
            else:  # self-attention: the new positions written after the earlier ones, in place (no copy of those)
                cache_append(cache, "k", k, axis=2)
                cache_append(cache, "v", v, axis=2)
        q = self._queries(query)  # (B, H, Tn, dk)
        if self.attention != "explicit":
            return self.out_proj(self._merge(self._fused(q, cache["k"], cache["v"], mask)))
        p = attention_weights(q, cache["k"], mask)  # (B, H, Tn, T)
        return self.out_proj(self._merge(self.dropout(p) @ cache["v"]))  # (B, Tn, d)

    def _fused(self, q, k, v, mask) -> torch.Tensor:
        """The heads' softmax(q k^T / sqrt(dk)) v without keeping the weights: tiled ("flash") or torch's ("sdpa")."""
        if self.attention == "sdpa":
            p = self.dropout.p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, H, Tq, dk)
        return flash_heads("MultiHeadAttention", self, q, k, v, mask)  # (B, H, Tq, dk)

    def extra_repr(self) -> str:
        impl = {"flash": f", attention='flash', block_size={self.block_size}", "sdpa": ", attention='sdpa'"}
        scale = ", score_scale='d_model'" if self.score_scale == "d_model" else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}{impl.get(self.attention, '')}{scale}"


class SharedHeadProjectionAttention(MultiHeadAttention):
    """Split into heads first, then one shared (dk, dk) projection for every head (twin of tfm_numpy's)."""

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        dk = self.d_head
        self.q_proj = Linear(dk, dk, bias, rng=g, dtype=dt)
        self.k_proj = Linear(dk, dk, bias, rng=g, dtype=dt)
        self.v_proj = Linear(dk, dk, bias, rng=g, dtype=dt)

    def _heads(self, proj: Linear, x: torch.Tensor) -> torch.Tensor:
        return proj(self._split(x))  # (B, H, T, dk), the shared projection on the last axis


def make_attention(head_projection: str, d_model: int, n_heads: int, dropout: float = 0.0, **kwargs):
    """MultiHeadAttention (head_projection="full") or SharedHeadProjectionAttention ("shared")."""
    head_projection = check_choice("make_attention", "head_projection", head_projection, HEAD_PROJECTIONS)
    cls = MultiHeadAttention if head_projection == "full" else SharedHeadProjectionAttention
    return cls(d_model, n_heads, dropout, **kwargs)


def flash_heads(owner: str, module, q, k, v, mask) -> torch.Tensor:
    """The heads' output of `flash_attention(q, k, v, mask)` in tiles of `module.block_size` (as tfm_numpy's, which
    also returns lse): a module training with attention dropout is refused, the tiled kernel has none."""
    _refuse_flash_dropout(owner, module)
    return flash_attention(q, k, v, mask, block_size=module.block_size)[0]


def _refuse_flash_dropout(owner: str, module) -> None:
    if module.attention == "flash" and module.training and module.dropout.p > 0:
        raise ValueError(
            f"{owner}: attention='flash' has no dropout on the attention weights, got dropout="
            f"{module.dropout.p} in training mode; use dropout=0.0, eval(), or attention='explicit'"
        )


def check_attention_call(owner: str, module, batch: int, tq: int, tk: int, mask, cache: dict | None = None) -> None:
    """What an attention module checks before it projects, caches or stores anything, as tfm_numpy's (a refused
    call changes nothing): the mask against the scores' shape (B, H, Tq, Tk), also for attention="sdpa", whose
    kernel would read a float mask as an additive bias; the rows of a decoding cache; the tiled kernel's refusal of
    attention dropout."""
    if cache is not None and "k" in cache and cache["k"].shape[0] != batch:
        raise ValueError(
            f"{owner}: the cache holds {cache['k'].shape[0]} rows, the input has {batch}; start a new cache for a "
            "new batch (or reorder it with reorder_cache)"
        )
    if mask is not None:
        _check_mask(mask, (batch, module.n_heads, tq, tk))
    _refuse_flash_dropout(owner, module)


def check_attention(owner: str, attention, block_size) -> tuple[str, int]:
    """The attention option: "explicit" (weights formed, kept for inspection), "flash" (tiled) or "sdpa" (torch's
    fused kernels; this track only), and the tile size."""
    return check_choice(owner, "attention", attention, ATTENTION), check_size(owner, "block_size", block_size)


def use_attention(model, attention: str = "explicit", block_size: int = 64):
    """Switch every MultiHeadAttention and GroupedQueryAttention (the GPT's) inside `model` to `attention`
    ("explicit", "flash" or "sdpa") with `block_size`; returns the model (as tfm_numpy.use_attention)."""
    from .modern import GroupedQueryAttention  # here, not at the top: modern imports this module

    attention, block_size = check_attention("use_attention", attention, block_size)
    switched = 0
    for m in model.modules():
        if isinstance(m, (MultiHeadAttention, GroupedQueryAttention)):
            m.attention, m.block_size, m.tile_size = attention, block_size, block_size
            switched += 1
    if not switched:  # nothing would change: say so rather than return the model as it was
        raise ValueError(f"use_attention: {type(model).__name__} has no attention module to switch to {attention!r}")
    return model
