"""Attention, NumPy track: scaled dot-product attention, masks and multi-head attention, forward and backward.

Shapes: `B` batch, `H` heads, `Tq` queries, `Tk` keys (= values), `dk` the query/key size per head,
`dv` the value size per head. Any leading dimensions may stand in for `(B, H)`.

Masks are boolean and `True` means "may attend". A padding mask has shape `(B, 1, 1, Tk)`, a causal
mask `(1, 1, T, T)`; both broadcast against the scores `(B, H, Tq, Tk)`. (`torch.nn.MultiheadAttention`
uses the opposite meaning, True = "may NOT attend"; convert at that boundary with `~mask`.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tfm_common.pitfalls import HEAD_PROJECTIONS, SCORE_SCALES
from tfm_common.validate import check_choice, check_size, check_sizes

from .flash import flash_attention, flash_attention_backward
from .kv_cache import cache_append
from .layers import Dropout, Linear
from .module import FLOAT_DTYPES, Module, as_rng, check_dtype, check_grad, check_input

__all__ = [
    "attention_weights",
    "attention_weights_backward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
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

ATTENTION = ("explicit", "flash")


# -- scaled dot-product attention ----------------------------------------------------------------------------


def _check_qkv(q, k, v=None) -> None:
    """Validate the public inputs: float arrays of one dtype, q/k sizes equal, keys and values paired."""
    name = "scaled_dot_product_attention"
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            continue
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: {arg} must be a numpy.ndarray, got {type(x).__name__}")
        if x.dtype.type not in FLOAT_DTYPES:
            raise TypeError(f"{name}: {arg} must be float32 or float64, got dtype {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: q and {arg} must share a dtype, got {q.dtype} and {x.dtype}")
        if x.ndim < 2:
            raise ValueError(f"{name}: {arg} must have at least 2 dimensions (T, d), got shape {x.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: q and k must have the same last dimension dk, got q {q.shape} and k {k.shape}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"{name}: q and k must have the same leading dimensions, got q {q.shape} and k {k.shape}")
    if v is not None and v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{name}: k and v must have the same shape but the last dim, got k {k.shape} and v {v.shape}")


def _check_mask(mask, scores_shape: tuple[int, ...]) -> None:
    """A boolean array that broadcasts to the scores' shape (..., Tq, Tk) without growing it."""
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
        got = f"dtype {mask.dtype}" if isinstance(mask, np.ndarray) else type(mask).__name__
        raise TypeError(f"mask: expected a boolean numpy array (True = may attend), got {got}; use mask.astype(bool)")
    try:
        ok = np.broadcast_shapes(mask.shape, scores_shape) == scores_shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"mask: shape {mask.shape} does not broadcast to the attention scores' shape {scores_shape}")


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
    _check_qkv(q, k)
    scale = 1.0 / math.sqrt(q.shape[-1])  # a python float: keeps float32 float32
    scores = q @ np.swapaxes(k, -1, -2)  # (..., Tq, dk) @ (..., dk, Tk) -> (..., Tq, Tk): a new array, so the
    scores *= scale  # steps below may work in place (no more arrays of this size, the largest of the attention)
    if mask is not None:
        _check_mask(mask, scores.shape)
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
    _check_qkv(q, k, v)
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


# -- masks ---------------------------------------------------------------------------------------------------


def padding_mask(tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """(B, T) integer tokens -> (B, 1, 1, T) bool, True where the token is real (not `pad_id`).

    It masks keys (the last axis), so it broadcasts over heads and query positions.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"padding_mask: tokens must be a (B, T) integer array, got shape {tokens.shape}, {tokens.dtype}"
        )
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(T: int) -> np.ndarray:
    """(1, 1, T, T) bool, lower triangular: query i may attend to keys 0..i, never to the future."""
    if T < 1:
        raise ValueError(f"causal_mask: T must be positive, got {T}")
    return np.tril(np.ones((T, T), dtype=bool))[None, None]


def decoder_mask(tgt_tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """The decoder's self-attention mask: causal AND not padding. (B, T) tokens -> (B, 1, T, T) bool."""
    return padding_mask(tgt_tokens, pad_id) & causal_mask(np.shape(tgt_tokens)[1])


# -- multi-head attention ------------------------------------------------------------------------------------


class _FlashSaved(NamedTuple):
    """What a tiled forward keeps for its backward: the heads' inputs, output and log-sum-exp, not the weights."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    ctx: np.ndarray
    lse: np.ndarray
    mask: np.ndarray | None
    out_shape: tuple


class MultiHeadAttention(Module):
    """Multi-head attention: project, split into heads, attend in each head, merge, project back.

    forward(query (B, Tq, d), key (B, Tk, d), value (B, Tk, d), mask) -> (B, Tq, d). The heads are a batch
    dimension: (B, T, d) -> (B, T, H, dk) -> (B, H, T, dk). After a forward, `attn_weights` holds the
    softmax weights (B, H, Tq, Tk) (before dropout; torch.nn.MultiheadAttention returns them after).

    attention="flash" computes the heads with `flash_attention` in tiles of `block_size` (the same numbers to
    rounding, no (Tq, Tk) array kept: `attn_weights` stays None). It has no dropout on the attention weights, so
    training with dropout > 0 is refused (eval mode, or dropout=0, is fine).

    score_scale="d_model" divides the scores by sqrt(d_model) instead of sqrt(dk), a pitfall of chapter 16a: the
    queries are multiplied by sqrt(dk / d_model) = 1/sqrt(H) after the split, so the softmax runs at a temperature
    sqrt(H) times too low. The default "d_k" is the paper's (and changes nothing).

    backward(grad_out) returns (d_query, d_key, d_value). When one tensor fed several inputs, add its
    gradients: self-attention `dx = sum(mha.backward(g))`, cross-attention `d_memory = d_key + d_value`.
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
        dtype=np.float32,
    ):
        super().__init__()
        owner = type(self).__name__
        d_model, n_heads = check_sizes(owner, d_model=d_model, n_heads=n_heads).values()
        if d_model % n_heads != 0:
            raise ValueError(f"{owner}: d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.attention, self.block_size = check_attention(owner, attention, block_size)
        self.score_scale = check_choice(owner, "score_scale", score_scale, SCORE_SCALES)
        # 1/sqrt(H) on the queries turns the 1/sqrt(dk) of the attention into 1/sqrt(d_model); None: the paper's
        self._q_scale = None if score_scale == "d_k" else 1.0 / math.sqrt(n_heads)
        dt, g = check_dtype(dtype), as_rng(rng)
        self._make_projections(d_model, bias, g, dt)
        self.out_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.dropout = Dropout(dropout, rng=g)  # on the attention weights, in training only
        self.attn_weights: np.ndarray | None = None

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        """The query, key and value projections: each (d_model -> d_model), every head its own d_k columns."""
        self.q_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.k_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)
        self.v_proj = Linear(d_model, d_model, bias, rng=g, dtype=dt)

    def _heads(self, proj: Linear, x: np.ndarray) -> np.ndarray:
        """(B, T, d) -> projected and split into heads (B, H, T, dk): project, then split."""
        return self._split(proj(x))

    def _heads_backward(self, proj: Linear, grad: np.ndarray) -> np.ndarray:
        """Backward of `_heads`: (B, H, T, dk) -> (B, T, d)."""
        return proj.backward(self._merge(grad))

    def _queries(self, query: np.ndarray) -> np.ndarray:
        """The queries' heads (B, H, Tq, dk), times 1/sqrt(H) for score_scale="d_model"."""
        q = self._heads(self.q_proj, query)
        return q if self._q_scale is None else q * q.dtype.type(self._q_scale)

    def _queries_backward(self, dq: np.ndarray) -> np.ndarray:
        dq = dq if self._q_scale is None else dq * dq.dtype.type(self._q_scale)
        return self._heads_backward(self.q_proj, dq)

    def _split(self, x: np.ndarray) -> np.ndarray:
        """(B, T, d) -> (B, H, T, dk). The transpose matters: a bare reshape to (B, H, T, dk) mixes positions."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.n_heads, self.d_head).transpose(0, 2, 1, 3)

    def _merge(self, x: np.ndarray) -> np.ndarray:
        """(B, H, T, dk) -> (B, T, d): the inverse of `_split`."""
        B, _, T, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, T, self.d_model)

    def _check(self, query, key, value) -> None:
        dt = self.q_proj.weight.dtype
        for arg, x in (("query", query), ("key", key), ("value", value)):
            check_input(f"MultiHeadAttention: {arg}", x, last_dim=self.d_model, dtype=dt)
            if x.ndim != 3:
                raise ValueError(f"MultiHeadAttention: {arg} must be (B, T, d_model), got shape {x.shape}")
        if not query.shape[0] == key.shape[0] == value.shape[0]:
            raise ValueError(
                f"MultiHeadAttention: batch sizes differ: query {query.shape}, key {key.shape}, value {value.shape}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"MultiHeadAttention: key and value lengths differ: key {key.shape}, value {value.shape}")

    def forward(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None = None):
        self._check(query, key, value)
        check_attention_call("MultiHeadAttention", self, query.shape[0], query.shape[1], key.shape[1], mask)
        q = self._queries(query)  # (B, H, Tq, dk)
        k = self._heads(self.k_proj, key)  # (B, H, Tk, dk)
        v = self._heads(self.v_proj, value)  # (B, H, Tk, dk)
        if self.attention == "flash":  # tiled (chapter 15b): no (Tq, Tk) array
            return self._forward_flash(q, k, v, mask, query.shape)
        p = attention_weights(q, k, mask)  # (B, H, Tq, Tk)
        p_drop = self.dropout(p)  # identity in eval or with p = 0
        ctx = p_drop @ v  # (B, H, Tq, dk)
        self.attn_weights = p
        self._cache = (q, k, v, p, p_drop, query.shape)
        return self.out_proj(self._merge(ctx))  # (B, Tq, d)

    def _forward_flash(self, q, k, v, mask, out_shape):
        ctx, lse = self._flash(q, k, v, mask)  # (B, H, Tq, dk), (B, H, Tq): the weights are not kept
        self.attn_weights = None
        self._cache = _FlashSaved(q, k, v, ctx, lse, mask, out_shape)
        return self.out_proj(self._merge(ctx))  # (B, Tq, d)

    def _backward_flash(self, grad_out):
        q, k, v, ctx, lse, mask, out_shape = self._saved()
        check_grad("MultiHeadAttention", grad_out, out_shape, q.dtype)
        d_ctx = self._split(self.out_proj.backward(grad_out))  # (B, H, Tq, dk)
        dq, dk, dv = flash_attention_backward(d_ctx, q, k, v, ctx, lse, mask, block_size=self.block_size)
        d_query = self._queries_backward(dq)  # (B, Tq, d)
        return d_query, self._heads_backward(self.k_proj, dk), self._heads_backward(self.v_proj, dv)

    def _flash(self, q, k, v, mask):
        return flash_heads("MultiHeadAttention", self, q, k, v, mask)

    def forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> np.ndarray:
        """`forward` for incremental decoding (inference only: no backward), keeping keys and values in `cache`.

        static=False (self-attention): key and value are the new positions only (B, Tn, d); their projections
        are appended to cache["k"], cache["v"] (B, H, T, dk), and the queries attend to every position so far.
        Appended in place: they are written into buffers allocated once for cache["capacity"] positions (see
        `cache_append`), and cache["k"], cache["v"] are views of the part written so far.
        static=True (cross-attention): key and value are the same memory at every step, projected on the first
        call only. `mask` covers all the keys so far, (B, 1, Tn, T) or (B, 1, 1, S).
        """
        self._check(query, key, value)
        cached = cache["k"].shape[2] if "k" in cache else 0  # positions (or, static, memory keys) already there
        keys = cached if static and "k" in cache else cached + key.shape[1]
        check_attention_call("MultiHeadAttention", self, query.shape[0], query.shape[1], keys, mask, cache)
        self._cache = None  # nothing for a backward: one after this step is an error, not a wrong gradient
        if not (static and "k" in cache):
            k = self._heads(self.k_proj, key)  # (B, H, Tn, dk), or (B, H, S, dk) for the memory
            v = self._heads(self.v_proj, value)
            if static:  # cross-attention: the memory's keys and values, once
                cache["k"], cache["v"] = k, v
            else:  # self-attention: the new positions written after the earlier ones, in place (no copy of those)
                cache_append(cache, "k", k, axis=2)
                cache_append(cache, "v", v, axis=2)
        q = self._queries(query)  # (B, H, Tn, dk)
        if self.attention == "flash":
            return self.out_proj(self._merge(self._flash(q, cache["k"], cache["v"], mask)[0]))
        p = attention_weights(q, cache["k"], mask)  # (B, H, Tn, T)
        return self.out_proj(self._merge(self.dropout(p) @ cache["v"]))  # (B, Tn, d)

    def backward(self, grad_out: np.ndarray):
        if isinstance(self._cache, _FlashSaved):  # after a tiled forward: the weights recomputed from lse
            return self._backward_flash(grad_out)
        q, k, v, p, p_drop, out_shape = self._saved()
        check_grad("MultiHeadAttention", grad_out, out_shape, q.dtype)
        d_ctx = self._split(self.out_proj.backward(grad_out))  # (B, H, Tq, dk)
        dv = np.swapaxes(p_drop, -1, -2) @ d_ctx  # (B, H, Tk, dk)
        dp = self.dropout.backward(d_ctx @ np.swapaxes(v, -1, -2))  # (B, H, Tq, Tk), through the dropout mask
        dq, dk = attention_weights_backward(dp, q, k, p)  # (B, H, Tq, dk), (B, H, Tk, dk)
        d_query = self._queries_backward(dq)  # (B, Tq, d)
        d_key = self._heads_backward(self.k_proj, dk)  # (B, Tk, d)
        d_value = self._heads_backward(self.v_proj, dv)  # (B, Tk, d)
        return d_query, d_key, d_value

    def extra_repr(self) -> str:
        flash = f", attention='flash', block_size={self.block_size}" if self.attention == "flash" else ""
        scale = ", score_scale='d_model'" if self.score_scale == "d_model" else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}{flash}{scale}"


class SharedHeadProjectionAttention(MultiHeadAttention):
    """A pitfall of chapter 16a: split into heads FIRST, then project every head with one shared (dk, dk) matrix.

    The input's d_model features are cut into H slices of dk; head h sees only slice h, and all heads use the
    same q_proj, k_proj, v_proj of shape (dk, dk) (H^2 times fewer weights than the (d_model, d_model) ones).
    A head can neither mix features from other slices nor differ from the others except through its input
    slice. out_proj stays (d_model, d_model). Same arguments, same state_dict names, smaller shapes.
    """

    def _make_projections(self, d_model: int, bias: bool, g, dt) -> None:
        dk = self.d_head
        self.q_proj = Linear(dk, dk, bias, rng=g, dtype=dt)  # one (dk, dk) for every head
        self.k_proj = Linear(dk, dk, bias, rng=g, dtype=dt)
        self.v_proj = Linear(dk, dk, bias, rng=g, dtype=dt)

    def _heads(self, proj: Linear, x: np.ndarray) -> np.ndarray:
        return proj(self._split(x))  # split (B, H, T, dk), then the shared projection on the last axis

    def _heads_backward(self, proj: Linear, grad: np.ndarray) -> np.ndarray:
        return self._merge(proj.backward(grad))  # the shared weight's gradient sums over the heads


def make_attention(head_projection: str, d_model: int, n_heads: int, dropout: float = 0.0, **kwargs):
    """MultiHeadAttention (head_projection="full") or SharedHeadProjectionAttention ("shared")."""
    head_projection = check_choice("make_attention", "head_projection", head_projection, HEAD_PROJECTIONS)
    cls = MultiHeadAttention if head_projection == "full" else SharedHeadProjectionAttention
    return cls(d_model, n_heads, dropout, **kwargs)


def flash_heads(owner: str, module, q, k, v, mask):
    """`flash_attention(q, k, v, mask)` in tiles of `module.block_size`: (out, lse). The tiled kernel has no dropout
    on the weights, so a module training with attention dropout is refused rather than silently trained without."""
    _refuse_flash_dropout(owner, module)
    return flash_attention(q, k, v, mask, block_size=module.block_size)


def _refuse_flash_dropout(owner: str, module) -> None:
    if module.attention == "flash" and module.training and module.dropout.p > 0:
        raise ValueError(
            f"{owner}: attention='flash' has no dropout on the attention weights, got dropout="
            f"{module.dropout.p} in training mode; use dropout=0.0, eval(), or attention='explicit'"
        )


def check_attention_call(owner: str, module, batch: int, tq: int, tk: int, mask, cache: dict | None = None) -> None:
    """What an attention module checks before it projects, caches or stores anything, so that a refused call
    changes nothing (a backward after it still differentiates the last good forward): the mask against the scores'
    shape (B, H, Tq, Tk), the rows of a decoding cache, and the tiled kernel's refusal of attention dropout."""
    if cache is not None and "k" in cache and cache["k"].shape[0] != batch:
        raise ValueError(
            f"{owner}: the cache holds {cache['k'].shape[0]} rows, the input has {batch}; start a new cache for a "
            "new batch (or reorder it with reorder_cache)"
        )
    if mask is not None:
        _check_mask(mask, (batch, module.n_heads, tq, tk))
    _refuse_flash_dropout(owner, module)


def check_attention(owner: str, attention, block_size) -> tuple[str, int]:
    """The attention option: "explicit" (weights formed, kept for inspection) or "flash" (tiled), and its block."""
    if attention == "sdpa":  # the torch track's third choice, named so that the refusal says where it lives
        raise ValueError(f"{owner}: attention='sdpa' (torch.nn.functional.scaled_dot_product_attention) exists in "
                         f"tfm_torch only; tfm_numpy has attention in {ATTENTION}")  # fmt: skip
    return check_choice(owner, "attention", attention, ATTENTION), check_size(owner, "block_size", block_size)


def use_attention(model, attention: str = "explicit", block_size: int = 64):
    """Switch every MultiHeadAttention and GroupedQueryAttention (the GPT's) inside `model` to `attention`
    ("explicit" or "flash") with `block_size`; returns the model. The weights are untouched: only how the heads
    compute softmax(q k^T / sqrt(dk)) v."""
    from .modern import GroupedQueryAttention  # here, not at the top: modern imports this module

    attention, block_size = check_attention("use_attention", attention, block_size)
    switched = 0
    for _, m in model.named_modules():
        if isinstance(m, (MultiHeadAttention, GroupedQueryAttention)):
            m.attention, m.block_size, m.tile_size = attention, block_size, block_size
            switched += 1
    if not switched:  # nothing would change: say so rather than return the model as it was
        raise ValueError(f"use_attention: {type(model).__name__} has no attention module to switch to {attention!r}")
    return model
