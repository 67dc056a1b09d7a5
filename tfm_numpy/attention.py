"""Attention, NumPy track: scaled dot-product attention and multi-head attention, forward and backward.

Shapes: `B` batch, `H` heads, `Tq` queries, `Tk` keys (= values), `dk` the query/key size per head,
`dv` the value size per head. Any leading dimensions may stand in for `(B, H)`. Masks (boolean, True = may
attend, broadcasting to the scores `(B, H, Tq, Tk)`) are made and checked in `masks`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from tfm_common.attention import MultiHeadAttentionDoor, refuse_flash_dropout, switch_attention
from tfm_common.config import own_init
from tfm_common.pitfalls import HEAD_PROJECTIONS, SCORE_SCALES
from tfm_common.validate import behind_door, check_choice, check_fill, check_size

from .flash import flash_attention, flash_attention_backward
from .kv_cache import cache_append
from .layers import Dropout, Linear
from .masks import check_mask, check_qkv
from .module import Module, as_rng, at_the_door, check_dtype, check_grad, check_input

__all__ = [
    "attention_weights",
    "attention_weights_backward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
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

ATTN_IMPLS = ("explicit", "flash")


def check_attn_impl(owner: str, attn_impl, tile_size) -> tuple[str, int]:
    """The attn_impl option: "explicit" (weights formed, kept for inspection) or "flash" (tiled), and its tile."""
    if attn_impl == "sdpa":  # the torch track's third choice, named so that the refusal says where it lives
        raise ValueError(f"{owner}: attn_impl='sdpa' (torch.nn.functional.scaled_dot_product_attention) exists in "
                         f"tfm_torch only; tfm_numpy has attn_impl in {ATTN_IMPLS}")  # fmt: skip
    return check_choice(owner, "attn_impl", attn_impl, ATTN_IMPLS), check_size(owner, "tile_size", tile_size)


# -- scaled dot-product attention ----------------------------------------------------------------------------


def attention_weights(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None = None, *, fill: float | None = None):
    """softmax(q k^T / sqrt(dk)) over the keys, with masked keys left out.  q (..., Tq, dk), k (..., Tk, dk).

    Returns the weights P (..., Tq, Tk); each row sums to 1 over the keys it may attend to.

    A query row with *nothing* to attend to (every key masked, e.g. a padding query under a left-padded
    causal mask) gets all-zero weights, hence a zero output and zero gradients, never NaN. That is our
    choice: such a row carries no information, so it should pass none on.

    `fill` is for the book's experiment only: replace masked scores by that number (-1e9, -1e4, -inf) and
    take a plain softmax, as most code does. A fully masked row then becomes uniform over *all* keys
    (finite fills: it attends to the padding) or NaN (-inf: exp(-inf - -inf)); we silence NumPy's warning
    on purpose there, the NaN is the lesson. Rows with at least one allowed key agree with the default.
    """
    if at_the_door():  # inside a module, its door has checked q, k and the mask
        check_qkv(q, k, mask=mask)
    scale = 1.0 / math.sqrt(q.shape[-1])  # a python float: keeps float32 float32
    scores = q @ np.swapaxes(k, -1, -2)  # (..., Tq, dk) @ (..., dk, Tk) -> (..., Tq, Tk): a new array, so the
    scores *= scale  # steps below may work in place (no more arrays of this size, the largest of the attention)
    if fill is not None:
        return _softmax_filled(scores, mask, fill)
    if mask is not None:
        np.copyto(scores, -np.inf, where=~mask)  # exp(-inf) = 0: a masked key gets exactly zero weight
    row_max = scores.max(axis=-1, keepdims=True)  # (..., Tq, 1), subtracted for stability
    row_max[~np.isfinite(row_max)] = 0  # an all-masked row has max -inf; any finite shift will do
    scores -= row_max
    e = np.exp(scores, out=scores)  # exp(scores - row_max), in place
    denom = e.sum(axis=-1, keepdims=True)  # >= 1 for a row with an allowed key (its max gives exp(0)), else 0
    denom[denom == 0] = 1  # all-masked row: 0 / 1 = 0
    e /= denom
    return e


def _softmax_filled(scores: np.ndarray, mask: np.ndarray | None, fill: float) -> np.ndarray:
    """The common recipe: masked scores := fill, then a plain softmax (for showing what the fill does)."""
    if mask is not None:
        scores = np.where(mask, scores, np.asarray(fill, dtype=scores.dtype))
    with np.errstate(invalid="ignore"):  # -inf - -inf = NaN in an all-masked row: deliberately shown, not hidden
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def attention_weights_backward(grad_weights, q, k, weights, mask=None):
    """Backward of `attention_weights`: returns (dq, dk) from dL/dP (..., Tq, Tk).

    Softmax backward row by row, never a Jacobian: dS = P * (dP - rowsum(dP * P)). Masked keys and
    all-masked rows have P = 0, so their dS is already 0. `mask` is needed only after a `fill` forward,
    where masked scores were constants (their dS must be 0 even where P is not).
    """
    row = (grad_weights * weights).sum(axis=-1, keepdims=True)  # (..., Tq, 1): rowsum(dP * P)
    ds = grad_weights - row  # (..., Tq, Tk), a new array: the rest in place
    ds *= weights  # dS = P * (dP - rowsum(dP * P))
    if mask is not None:
        ds = np.where(mask, ds, 0)
    ds *= 1.0 / math.sqrt(q.shape[-1])  # through S = q k^T / sqrt(dk)
    dq = ds @ k  # (..., Tq, Tk) @ (..., Tk, dk) -> (..., Tq, dk)
    dk = np.swapaxes(ds, -1, -2) @ q  # (..., Tk, Tq) @ (..., Tq, dk) -> (..., Tk, dk)
    return dq, dk


def scaled_dot_product_attention(q, k, v, mask=None, *, fill=None):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(dk)) V.  q (..., Tq, dk), k (..., Tk, dk), v (..., Tk, dv).

    Returns (output (..., Tq, dv), weights (..., Tq, Tk)). `mask` is boolean, True = may attend, and
    broadcasts to (..., Tq, Tk), e.g. (B, 1, 1, Tk) or (1, 1, Tq, Tk). A query row with nothing to attend
    to gives a zero output row and zero gradients (see `attention_weights`, also for `fill`).
    """
    check_qkv(q, k, v)
    weights = attention_weights(q, k, mask, fill=fill)  # (..., Tq, Tk)
    return weights @ v, weights  # (..., Tq, dv)


def scaled_dot_product_attention_backward(grad_out, q, k, v, weights, mask=None):
    """Backward of `scaled_dot_product_attention`: returns (dq, dk, dv) from dL/doutput (..., Tq, dv).

    Needs the forward's inputs and its weights; pass the mask only after a `fill` forward.
    """
    check_grad("scaled_dot_product_attention", grad_out, (*weights.shape[:-1], v.shape[-1]), weights.dtype)
    dv = np.swapaxes(weights, -1, -2) @ grad_out  # (..., Tk, Tq) @ (..., Tq, dv) -> (..., Tk, dv)
    d_weights = grad_out @ np.swapaxes(v, -1, -2)  # (..., Tq, dv) @ (..., dv, Tk) -> (..., Tq, Tk)
    dq, dk = attention_weights_backward(d_weights, q, k, weights, mask)
    return dq, dk, dv


# `fill` checked in front of the printed functions (tfm_common.validate.behind_door): their bodies stay the lesson
def _check_attention_weights(q, k, mask=None, *, fill=None) -> None:
    check_fill("attention_weights", fill)


def _check_sdpa(q, k, v, mask=None, *, fill=None) -> None:
    check_fill("scaled_dot_product_attention", fill)


attention_weights = behind_door(attention_weights, _check_attention_weights)
scaled_dot_product_attention = behind_door(scaled_dot_product_attention, _check_sdpa)

# -- multi-head attention ------------------------------------------------------------------------------------


class _Tiles(NamedTuple):
    """What a tiled forward keeps for its backward: the heads' inputs, output and log-sum-exp, not the weights."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    ctx: np.ndarray
    lse: np.ndarray
    mask: np.ndarray | None


class AttentionImpl:
    """How an attention module's heads compute softmax(q k^T / sqrt(dk)) v: `attn_impl="explicit"` forms the
    weights (B, H, Tq, Tk), with dropout on them, and keeps them in `attn_weights`; "flash" runs chapter 15b's tiled
    kernel in tiles of `tile_size` (no weights kept, no dropout). `use_attention` switches every module deriving from
    this class. Such a module has `dropout` (a Dropout) and `attn_weights`, sets `attn_impl` and `tile_size` with
    `check_attn_impl`, calls `ctx = self._attend(q, k, v, mask)` in its forward and
    `dq, dk, dv = self._attend_backward(d_ctx, self._saved())` in its backward."""

    attn_impl: str
    tile_size: int

    def _attend(self, q, k, v, mask):
        """q (B, H, Tq, dk), k (B, H, Tk, dk), v (B, H, Tk, dv) -> the heads' output (B, H, Tq, dv)."""
        attend = self._attend_flash if self.attn_impl == "flash" else self._attend_explicit
        return attend(q, k, v, mask)

    def _attend_backward(self, d_ctx, saved):
        """From the gradient of the heads' output (B, H, Tq, dv) to (dq, dk, dv), with what `_attend` kept."""
        backward = self._attend_flash_backward if isinstance(saved, _Tiles) else self._attend_explicit_backward
        return backward(d_ctx, saved)

    def _attend_explicit(self, q, k, v, mask):
        p = attention_weights(q, k, mask)  # (B, H, Tq, Tk)
        p_drop = self.dropout(p)  # identity in eval or with p = 0
        self.attn_weights = p
        self._cache = (q, k, v, p, p_drop)  # the weights before and after dropout
        return p_drop @ v  # (B, H, Tq, dv)

    def _attend_explicit_backward(self, d_ctx, saved: tuple):
        q, k, v, p, p_drop = saved
        dv = np.swapaxes(p_drop, -1, -2) @ d_ctx  # (B, H, Tk, dv)
        dp = self.dropout.backward(d_ctx @ np.swapaxes(v, -1, -2))  # (B, H, Tq, Tk), through the dropout mask
        dq, dk = attention_weights_backward(dp, q, k, p)  # (B, H, Tq, dk), (B, H, Tk, dk)
        return dq, dk, dv

    def _attend_flash(self, q, k, v, mask):
        refuse_flash_dropout(type(self).__name__, self)
        ctx, lse = flash_attention(q, k, v, mask, tile_size=self.tile_size)  # the weights are not kept
        self.attn_weights = None
        self._cache = _Tiles(q, k, v, ctx, lse, mask)
        return ctx  # (B, H, Tq, dv)

    def _attend_flash_backward(self, d_ctx, saved: _Tiles):
        q, k, v, ctx, lse, mask = saved  # each tile's weights recomputed from lse
        return flash_attention_backward(d_ctx, q, k, v, ctx, lse, mask, tile_size=self.tile_size)


class MultiHeadAttention(AttentionImpl, MultiHeadAttentionDoor, Module):
    """Multi-head attention: project, split into heads, attend in each head, merge, project back.

    forward(query (B, Tq, d), key (B, Tk, d), value (B, Tk, d), mask) -> (B, Tq, d). The heads are a batch
    dimension: (B, T, d) -> (B, T, H, dk) -> (B, H, T, dk). After a forward, `attn_weights` holds the
    softmax weights (B, H, Tq, Tk) (before dropout; torch.nn.MultiheadAttention returns them after).
    `attn_impl` and `tile_size`: see `AttentionImpl`. score_scale="d_model" (chapter 16a): see `ScaledLinear`.

    backward(grad_out) returns (d_query, d_key, d_value). When one tensor fed several inputs, add its
    gradients: self-attention `dx = sum(mha.backward(g))`, cross-attention `d_memory = d_key + d_value`.
    """

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    # the building blocks of the constructor written in tfm_common.attention (MultiHeadAttentionDoor.__init__)
    _parts = SimpleNamespace(check_dtype=check_dtype, as_rng=as_rng, check_attn_impl=check_attn_impl, Linear=Linear,
                             Dropout=Dropout)  # fmt: skip

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        """The query, key and value projections: each (d_model -> d_model), every head its own d_k columns."""
        self.q_proj = self._query_projection(d_model, bias, g, dt)
        self.k_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.v_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)

    def _query_projection(self, d: int, bias: bool, g, dt) -> Linear:
        """A (d -> d) Linear for the queries; for chapter 16a's score_scale="d_model", one that scales its output by
        1/sqrt(H) (the scores then divide by sqrt(d_model), not sqrt(dk)): same weights, same state_dict key."""
        if self.q_scale is None:
            return Linear(d, d, bias, rng=g, dtype=dt)
        return ScaledLinear(d, d, bias, rng=g, dtype=dt, scale=self.q_scale)

    def _split(self, x: np.ndarray) -> np.ndarray:
        """(B, T, d) -> (B, H, T, dk). The transpose matters: a bare reshape to (B, H, T, dk) mixes positions."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.d_head).transpose(0, 2, 1, 3)

    def _merge(self, x: np.ndarray) -> np.ndarray:
        """(B, H, T, dk) -> (B, T, d): the inverse of `_split`."""
        B, _, T, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, T, self.d_model)

    def forward(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None = None):
        q = self._split(self.q_proj(query))  # (B, H, Tq, dk)
        k = self._split(self.k_proj(key))  # (B, H, Tk, dk)
        v = self._split(self.v_proj(value))  # (B, H, Tk, dk)
        ctx = self._attend(q, k, v, mask)  # (B, H, Tq, dk): softmax(q k^T / sqrt(dk)) v in every head
        return self.out_proj(self._merge(ctx))  # (B, Tq, d)

    def backward(self, grad_out: np.ndarray):
        saved = self._saved()  # what the forward's _attend kept
        d_ctx = self._split(self.out_proj.backward(grad_out))  # (B, H, Tq, dk)
        dq, dk, dv = self._attend_backward(d_ctx, saved)  # (B, H, Tq, dk), (B, H, Tk, dk), (B, H, Tk, dk)
        d_query = self.q_proj.backward(self._merge(dq))  # (B, Tq, d)
        d_key = self.k_proj.backward(self._merge(dk))  # (B, Tk, d)
        d_value = self.v_proj.backward(self._merge(dv))  # (B, Tk, d)
        return d_query, d_key, d_value

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> np.ndarray:
        """`forward` for incremental decoding (inference only: no backward), keeping keys and values in `cache`.

        static=False (self-attention): key and value are the new positions only (B, Tn, d); their projections
        are appended to cache["k"], cache["v"] (B, H, T, dk), and the queries attend to every position so far.
        Appended in place: they are written into buffers allocated once for cache["capacity"] positions (see
        `cache_append`), and cache["k"], cache["v"] are views of the part written so far.
        static=True (cross-attention): key and value are the same memory at every step, projected on the first
        call only. `mask` covers all the keys so far, (B, 1, Tn, T) or (B, 1, 1, S).
        """
        if not (static and "k" in cache):
            k = self._split(self.k_proj(key))  # (B, H, Tn, dk), or (B, H, S, dk) for the memory
            v = self._split(self.v_proj(value))
            if static:  # cross-attention: the memory's keys and values, once
                cache["k"], cache["v"] = k, v
            else:  # self-attention: the new positions written after the earlier ones, in place (no copy of those)
                cache_append(cache, "k", k, axis=2)
                cache_append(cache, "v", v, axis=2)
        q = self._split(self.q_proj(query))  # (B, H, Tn, dk)
        ctx = self._attend(q, cache["k"], cache["v"], mask)  # (B, H, Tn, dk)
        self._cache = None  # nothing for a backward: one after this step is an error, not a wrong gradient
        return self.out_proj(self._merge(ctx))  # (B, Tn, d)


# a wrong argument is refused in the name of MultiHeadAttention, not of its door
own_init(MultiHeadAttention, dtype=np.float32)  # tfm_numpy's default dtype; SharedHeadProjectionAttention inherits it


class ScaledLinear(Linear):
    """A pitfall of chapter 16a (score_scale="d_model") as a query projection: a Linear whose output is multiplied
    by `scale` = 1/sqrt(H), so that the attention's 1/sqrt(dk) becomes 1/sqrt(d_model): the softmax runs at a
    temperature sqrt(H) times too low. Same parameters and state_dict names as the Linear it stands for."""

    def __init__(self, *args, scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, x: np.ndarray) -> np.ndarray:
        y = super().forward(x)
        return y * y.dtype.type(self.scale)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return super().backward(grad_out * grad_out.dtype.type(self.scale))


class SharedHeadProjectionAttention(MultiHeadAttention):
    """A pitfall of chapter 16a: split into heads FIRST, then project every head with one shared (dk, dk) matrix.

    The input's d_model features are cut into H slices of dk; head h sees only slice h, and all heads use the
    same q_proj, k_proj, v_proj of shape (dk, dk) (H^2 times fewer weights than the (d_model, d_model) ones).
    A head can neither mix features from other slices nor differ from the others except through its input
    slice. out_proj stays (d_model, d_model). Same arguments, same state_dict names, smaller shapes.
    """

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        dk = self.d_head
        self.q_proj = self._query_projection(dk, bias, g, dt)  # one (dk, dk) for every head
        self.k_proj = Linear(dk, dk, bias, rng=g, dtype=dt)
        self.v_proj = Linear(dk, dk, bias, rng=g, dtype=dt)

    def forward(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None = None):
        q = self.q_proj(self._split(query))  # split (B, H, Tq, dk), then the shared projection on the last axis
        k = self.k_proj(self._split(key))  # (B, H, Tk, dk)
        v = self.v_proj(self._split(value))  # (B, H, Tk, dk)
        return self.out_proj(self._merge(self._attend(q, k, v, mask)))  # (B, Tq, d)

    def backward(self, grad_out: np.ndarray):
        saved = self._saved()
        d_ctx = self._split(self.out_proj.backward(grad_out))  # (B, H, Tq, dk)
        dq, dk, dv = self._attend_backward(d_ctx, saved)
        projs = ((self.q_proj, dq), (self.k_proj, dk), (self.v_proj, dv))
        return tuple(self._merge(proj.backward(g)) for proj, g in projs)  # a shared weight's gradient: over the heads

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> np.ndarray:
        """`MultiHeadAttention.forward_step` with the shared projections, after the split."""
        if not (static and "k" in cache):
            k, v = self.k_proj(self._split(key)), self.v_proj(self._split(value))  # (B, H, Tn or S, dk)
            if static:
                cache["k"], cache["v"] = k, v
            else:
                cache_append(cache, "k", k, axis=2)
                cache_append(cache, "v", v, axis=2)
        ctx = self._attend(self.q_proj(self._split(query)), cache["k"], cache["v"], mask)  # (B, H, Tn, dk)
        self._cache = None  # nothing for a backward
        return self.out_proj(self._merge(ctx))  # (B, Tn, d)


def make_attention(head_projection: str, d_model: int, n_heads: int, dropout: float = 0.0, **kwargs):
    """MultiHeadAttention (head_projection="full") or SharedHeadProjectionAttention ("shared")."""
    head_projection = check_choice("make_attention", "head_projection", head_projection, HEAD_PROJECTIONS)
    cls = MultiHeadAttention if head_projection == "full" else SharedHeadProjectionAttention
    return cls(d_model, n_heads, dropout, **kwargs)


def use_attention(model, attn_impl: str = "explicit", tile_size: int = 64):
    """Switch every attention module inside `model` (each `AttentionImpl`: MultiHeadAttention, the GPT's
    GroupedQueryAttention) to `attn_impl` ("explicit" or "flash") with `tile_size`; returns the model. The weights
    are untouched: only how the heads compute softmax(q k^T / sqrt(dk)) v."""
    attn_impl, tile_size = check_attn_impl("use_attention", attn_impl, tile_size)
    modules = [m for _, m in model.named_modules() if isinstance(m, AttentionImpl)]
    return switch_attention(model, modules, attn_impl, tile_size)
