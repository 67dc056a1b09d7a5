"""Since 2017, NumPy track: RMSNorm, rotary position embedding (RoPE), the SwiGLU feed-forward and grouped-query
attention, each with its forward and hand-written backward.

Shapes: `(B, T, d_model)` activations; per head `(B, H, T, d_head)`. Masks are boolean, True = may attend, as in
`attention`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tfm_common.attention import GroupedQueryAttentionDoor, check_kv_heads
from tfm_common.config import own_init
from tfm_common.validate import (
    behind_door,
    check_positions,
    check_real,
    check_rope_tables,
    check_size,
    check_sizes,
)

from .attention import AttentionImpl, check_attn_impl
from .kv_cache import ring_store, store_kv
from .layers import Dropout, Linear, norm_scaled
from .masks import check_mask
from .module import Module, Parameter, as_rng, at_the_door, check_dtype, check_input

__all__ = [
    "RMSNorm",
    "rope_angles",
    "rope_angles_at",
    "apply_rope",
    "RotaryEmbedding",
    "swiglu_hidden_size",
    "SwiGLUFeedForward",
    "check_kv_heads",
    "repeat_kv",
    "GroupedQueryAttention",
]


class RMSNorm(Module):
    """Root-mean-square normalization (Zhang and Sennrich, 2019), as torch.nn.RMSNorm over the last dimension:

        rrms = 1 / sqrt(mean(x^2) + eps),   xhat = x * rrms,   y = xhat * weight      (weight = 1 at first)

    LayerNorm without the mean subtraction and without the bias: one reduction instead of two.
    Backward, per row of n values, with g = dL/dy:
        dL/dweight = sum over rows of g * xhat
        dxhat = g * weight,   dL/dx = rrms * (dxhat - xhat * mean(dxhat * xhat))
    from d xhat_i / d x_j = rrms (delta_ij - xhat_i xhat_j / n): only the component along xhat is removed (the one
    direction that scaling x cannot change), not the mean as well, as in LayerNorm.

    A row so large that x^2 would overflow (float32 |x| above 2^32; 1e30 squares to inf, and the plain formula
    returns zeros) is divided by c = max|x| before squaring, rrms = 1 / (c sqrt(mean((x/c)^2) + eps / c^2)), as
    careful implementations do (`norm_scaled`); every other row is computed as written above, bit for bit.
    """

    def __init__(self, d: int, eps: float = 1e-6, *, dtype=np.float32):
        super().__init__()
        self.d = check_size("RMSNorm", "d", d)
        self.eps = check_real("RMSNorm", "eps", eps, low=0.0)
        if not self.eps > 0:
            raise ValueError(f"RMSNorm: eps must be > 0, got {eps!r}")
        self.weight = Parameter(np.ones(self.d, dtype=check_dtype(dtype)))

    def _check_forward(self, x) -> None:
        check_input("RMSNorm", x, last_dim=self.d, dtype=self.weight.dtype)

    def forward(self, x: np.ndarray) -> np.ndarray:
        u, c = norm_scaled(x, -1)  # x / c: c = max|x| where x^2 would overflow (a float32 x of 1e30), else 1 (u is x)
        r = 1 / np.sqrt(np.square(u).mean(axis=-1, keepdims=True) + self.eps / c / c)  # (N..., 1): rrms times c
        xhat = u * r  # (N..., d): x * rrms
        self._cache = (xhat, r / c)  # rrms = 1 / sqrt(mean(x^2) + eps)
        return xhat * self.weight.data

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        xhat, rrms = self._saved()
        self.weight.grad += (grad_out * xhat).reshape(-1, self.d).sum(axis=0)
        dxhat = grad_out * self.weight.data
        dx = dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)  # remove the component along xhat
        dx *= rrms
        return dx

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


# -- rotary position embedding ---------------------------------------------------------------------------------------


def rope_angles(max_len: int, d_head: int, base: float = 10000.0, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (max_len, d_head / 2): the angles p * w_i, w_i = base^(-2i / d_head), of chapter 7's table.

    Computed in float64, then cast (as sinusoidal_positional_encoding). d_head must be even: pairs of columns.
    """
    check_sizes("rope_angles", max_len=max_len, d_head=d_head)
    if d_head % 2:
        raise ValueError(f"rope_angles: d_head must be even (the columns rotate in pairs), got d_head={d_head}")
    base = check_real("rope_angles", "base", base, low=1.0)
    omega = base ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)  # (d_head / 2,)
    angle = np.arange(max_len, dtype=np.float64)[:, None] * omega  # (max_len, d_head / 2)
    dt = check_dtype(dtype)
    return np.cos(angle).astype(dt), np.sin(angle).astype(dt)


def rope_angles_at(positions, d_head: int, base: float = 10000.0, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (len(positions), d_head / 2): `rope_angles`' rows for any positions, max_len or beyond (the
    rolling cache of chapter 21c rotates keys past the table). The same float64 products, so a row equals the table's
    row bit for bit."""
    omega = float(base) ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)  # (d_head / 2,)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * omega
    dt = check_dtype(dtype)
    return np.cos(angle).astype(dt), np.sin(angle).astype(dt)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) of x (..., T, d) by the angle whose cos and sin are (T, d/2):

        (x0, x1) -> (x0 cos - x1 sin,  x0 sin + x1 cos)

    Its transpose (the backward) is the rotation by minus the angle: apply_rope(grad, cos, -sin).
    """
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (..., T, d/2) views: the two members of each pair
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _check_apply_rope(x, cos, sin) -> None:
    """apply_rope's door (RotaryEmbedding's own calls pass: it checks x and slices its tables itself): x (..., T, d)
    floats, cos and sin (T, d/2) of x's dtype (an int x would come back truncated to ints)."""
    if not at_the_door():
        return
    check_input("apply_rope: x", x, ndim_min=2)
    for arg, table in (("cos", cos), ("sin", sin)):
        check_input(f"apply_rope: {arg}", table)
        if table.dtype != x.dtype:
            raise TypeError(f"apply_rope: {arg} expected x's dtype {x.dtype}, got {table.dtype}")
    check_rope_tables("apply_rope", x.shape, cos.shape, sin.shape)


apply_rope = behind_door(apply_rope, _check_apply_rope)  # the printed body stays the lesson


class RotaryEmbedding(Module):
    """Rotary position embedding (Su et al., 2021): position p turns each pair of a query or key by p * w_i.

    Chapter 7 showed that the sinusoidal table moves from position p to p + k by a rotation M_k that depends on k
    only. RoPE applies that rotation to the queries and keys themselves, per head: q_p -> M_p q_p, k_s -> M_s k_s.
    Then (M_p q) . (M_s k) = q . M_p^T M_s k = q . M_(s-p) k: the score depends on the offset s - p, not on p.
    Nothing is added to the embeddings, and there are no parameters (no state_dict keys).

    forward(x (..., T, d_head), offset=0) rotates positions offset .. offset + T - 1; backward(grad) rotates back
    (the transpose of a rotation is its inverse). `rotate(x, offset, inverse)` is the same map without a cache, for
    a caller that rotates both queries and keys (GroupedQueryAttention).
    """

    def __init__(self, d_head: int, max_len: int, base: float = 10000.0, *, dtype=np.float32):
        super().__init__()
        self.dtype = check_dtype(dtype)
        self.cos, self.sin = rope_angles(max_len, d_head, base, self.dtype)  # (max_len, d_head / 2) each
        self.d_head, self.max_len, self.base = d_head, max_len, float(base)

    def rotate(self, x: np.ndarray, offset: int = 0, inverse: bool = False) -> np.ndarray:
        if self.cos.dtype != self.dtype:  # astype() changed the module's dtype: rebuild the tables exactly
            self.cos, self.sin = rope_angles(self.max_len, self.d_head, self.base, self.dtype)
        check_input("RotaryEmbedding", x, ndim_min=2, last_dim=self.d_head, dtype=self.dtype)
        T = x.shape[-2]
        offset = check_size("RotaryEmbedding", "offset", offset, minimum=0)
        check_positions("RotaryEmbedding", T, offset, self.max_len)
        sin = self.sin[offset : offset + T]
        return apply_rope(x, self.cos[offset : offset + T], -sin if inverse else sin)

    def forward(self, x: np.ndarray, offset: int = 0) -> np.ndarray:
        y = self.rotate(x, offset)
        self._cache = offset  # the backward rotates back by the same angles
        return y

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        offset = self._saved()
        return self.rotate(grad_out, offset, inverse=True)  # y = M x  ->  dx = M^T dy

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, max_len={self.max_len}, base={self.base}"


# -- SwiGLU ----------------------------------------------------------------------------------------------------------


def swiglu_hidden_size(d_ff: int) -> int:
    """The hidden size that gives a SwiGLU feed-forward the parameters of a two-matrix one of width d_ff.

    Two matrices d_model x d_ff hold 2 d_model d_ff weights; three of d_model x h hold 3 d_model h: equal for
    h = 2 d_ff / 3 (Shazeer, 2020; Llama rounds it up to a multiple of 256). Rounded to the nearest int.
    """
    return max(1, round(2 * check_size("swiglu_hidden_size", "d_ff", d_ff) / 3))


class SwiGLUFeedForward(Module):
    """FFN_SwiGLU(x) = down( silu(gate(x)) * up(x) ), silu(a) = a sigmoid(a) (Shazeer, 2020): a gated linear unit.

    Three bias-free matrices, gate and up d_model -> d_ff, down d_ff -> d_model (state_dict keys gate_proj.weight,
    up_proj.weight, down_proj.weight). Pass d_ff = swiglu_hidden_size(width) to match the parameters of a
    PositionwiseFeedForward of that width. Dropout on the hidden product, as PositionwiseFeedForward's.

    Backward, with a = gate(x), b = up(x), s = silu(a), h = s * b, and sigma = sigmoid(a):
        dh = down^T dy,  ds = dh * b,  db = dh * s,  da = ds * sigma (1 + a (1 - sigma))     [silu'(a)]
        dx = gate^T da + up^T db
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, *, rng=None, dtype=np.float32):
        super().__init__()
        check_sizes("SwiGLUFeedForward", d_model=d_model, d_ff=d_ff)
        dt, g = check_dtype(dtype), as_rng(rng)
        self.d_model, self.d_ff = d_model, d_ff
        self.gate_proj = Linear(d_model, d_ff, bias=False, rng=g, dtype=dt)  # (d_ff, d_model)
        self.up_proj = Linear(d_model, d_ff, bias=False, rng=g, dtype=dt)  # (d_ff, d_model)
        self.dropout = Dropout(dropout, rng=g)
        self.down_proj = Linear(d_ff, d_model, bias=False, rng=g, dtype=dt)  # (d_model, d_ff)

    def forward(self, x: np.ndarray) -> np.ndarray:
        a, b = self.gate_proj(x), self.up_proj(x)  # (B, T, d_ff) each
        sigma = 1 / (1 + np.exp(-a))  # sigmoid(a); exp overflows to inf for a < -88 (float32): 1/inf = 0, correct
        s = a * sigma  # silu(a)
        self._cache = (a, b, sigma, s)
        return self.down_proj(self.dropout(s * b))  # (B, T, d_model)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        a, b, sigma, s = self._saved()
        dh = self.dropout.backward(self.down_proj.backward(grad_out))  # (B, T, d_ff)
        da = dh * b * sigma * (1 + a * (1 - sigma))  # through the product, then silu'(a)
        return self.gate_proj.backward(da) + self.up_proj.backward(dh * s)  # x fed both: the gradients add

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"


# -- grouped-query attention -----------------------------------------------------------------------------------------


def repeat_kv(x: np.ndarray, n_rep: int) -> np.ndarray:
    """(B, Hkv, T, d) -> (B, Hkv * n_rep, T, d): key/value head j serves query heads j n_rep .. (j + 1) n_rep - 1
    (torch's enable_gqa layout). Its backward sums each group: grad.reshape(B, Hkv, n_rep, T, d).sum(axis=2)."""
    if at_the_door():  # inside GroupedQueryAttention, n_rep is its own
        _check_repeat_kv(x, n_rep)
    return x if n_rep == 1 else np.repeat(x, n_rep, axis=1)


def _check_repeat_kv(x, n_rep) -> None:
    check_size("repeat_kv", "n_rep", n_rep)  # a float would be truncated by np.repeat
    if not isinstance(x, np.ndarray) or x.ndim != 4:
        got = f"shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"repeat_kv: x expected a numpy.ndarray (B, Hkv, T, d), got {got}")


class GroupedQueryAttention(AttentionImpl, GroupedQueryAttentionDoor, Module):
    """Causal-or-not self-attention with n_kv_heads key/value heads shared by n_heads query heads (Ainslie et al.,
    2023); n_kv_heads = n_heads is multi-head attention, 1 is multi-query attention (Shazeer, 2019).

    forward(x (B, T, d), mask, offset=0) -> (B, T, d); backward(dy) -> dx. Projections q_proj (d -> d), k_proj and
    v_proj (d -> n_kv_heads d_head), out_proj (d -> d): with n_kv_heads = n_heads MultiHeadAttention's keys, shapes
    and function. `rotary` (a RotaryEmbedding for d_head, or None) rotates queries and keys at positions offset ..
    offset + T - 1, after the split into heads. The cache of `forward_step` holds n_kv_heads heads. `attn_impl` as
    MultiHeadAttention's (the tiled kernel runs on the repeated key/value heads).
    """

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    # the building blocks of the constructor written in tfm_common.attention (GroupedQueryAttentionDoor.__init__)
    _parts = SimpleNamespace(check_dtype=check_dtype, as_rng=as_rng, check_attn_impl=check_attn_impl, Linear=Linear,
                             Dropout=Dropout, RotaryEmbedding=RotaryEmbedding)  # fmt: skip

    def _split(self, x: np.ndarray, n: int) -> np.ndarray:
        """(B, T, n * d_head) -> (B, n, T, d_head)."""
        B, T, _ = x.shape
        return x.reshape(B, T, n, self.d_head).transpose(0, 2, 1, 3)

    def _merge(self, x: np.ndarray) -> np.ndarray:
        """(B, n, T, d_head) -> (B, T, n * d_head)."""
        B, n, T, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, T, n * self.d_head)

    # -- the door: a caller's arguments, checked before anything is projected, cached or stored ----------------------

    def _project(self, x: np.ndarray, offset: int):
        """Queries (B, H, T, dh), keys and values (B, Hkv, T, dh), queries and keys rotated if RoPE is on."""
        q = self._split(self.q_proj(x), self.n_heads)
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, offset), self.rotary.rotate(k, offset)
        return q, k, v

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        q, k, v = self._project(x, offset)
        n_rep = self.n_heads // self.n_kv_heads
        k_rep, v_rep = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, T, dh): each kv head to its query heads
        ctx = self._attend(q, k_rep, v_rep, mask)  # (B, H, T, dh): softmax(q k^T / sqrt(dh)) v, per head
        self.offset = offset  # where RoPE rotated: the backward rotates back there
        return self.out_proj(self._merge(ctx))  # (B, T, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        saved = self._saved()
        d_ctx = self._split(self.out_proj.backward(grad_out), self.n_heads)  # (B, H, T, dh)
        dq, dk_rep, dv_rep = self._attend_backward(d_ctx, saved)
        return self._heads_backward(dq, dk_rep, dv_rep, self.offset)

    def _heads_backward(self, dq, dk_rep, dv_rep, offset: int) -> np.ndarray:
        """From the gradients of the heads' q (B, H, T, dh) and repeated k, v to dx (B, T, d)."""
        dk, dv = self._sum_groups(dk_rep), self._sum_groups(dv_rep)  # (B, Hkv, T, dh): a shared head adds up
        if self.rotary is not None:  # q = M q0, k = M k0: dq0 = M^T dq
            dq, dk = self.rotary.rotate(dq, offset, inverse=True), self.rotary.rotate(dk, offset, inverse=True)
        dx = self.q_proj.backward(self._merge(dq))
        dx += self.k_proj.backward(self._merge(dk))
        dx += self.v_proj.backward(self._merge(dv))
        return dx  # (B, T, d): x fed all three projections

    def _sum_groups(self, g: np.ndarray) -> np.ndarray:
        """The backward of repeat_kv: (B, H, T, dh) -> (B, Hkv, T, dh), summing the n_rep copies of each head."""
        B, _, T, dh = g.shape
        return g.reshape(B, self.n_kv_heads, self.n_heads // self.n_kv_heads, T, dh).sum(axis=2)

    def forward_step(self, x: np.ndarray, cache: dict, mask: np.ndarray | None = None) -> np.ndarray:
        """`forward` for new positions x (B, Tn, d) only (inference: no backward). cache["k"], cache["v"]
        (B, Hkv, T, dh) hold the earlier positions' keys and values (rotated at their positions); the new ones, rotated
        at T.., are appended in place (`cache_append`). `mask` covers all keys so far, (B or 1, 1, Tn, T + Tn)."""
        q, k, v = self._project(x, cache["k"].shape[2] if "k" in cache else 0)
        k, v = store_kv(cache, k, v)  # (B, Hkv, T + Tn, dh): the un-repeated heads are stored (cache_append)
        n_rep = self.n_heads // self.n_kv_heads
        ctx = self._attend(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)  # (B, H, Tn, dh)
        self._cache = None  # nothing for a backward: one after this step is an error, not a wrong gradient
        return self.out_proj(self._merge(ctx))

    def forward_rolling(self, x, cache: dict, mask, angles, keep, slots) -> np.ndarray:
        """`forward_step` with the rolling cache of a sliding window (chapter 21c; inference only): x (B, Tn, d) at
        positions whose RoPE `angles` (cos, sin) (Tn, d_head / 2) are given (None without RoPE: any position, past
        max_len too); the queries attend to the cache's slots and the new keys, under `mask` (1, 1, Tn, slots + Tn);
        then the new positions that stay needed (`keep`) are written into their `slots` (`ring_store`)."""
        q = self._split(self.q_proj(x), self.n_heads)
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if angles is not None:
            q, k = apply_rope(q, *angles), apply_rope(k, *angles)
        size = mask.shape[-1] - x.shape[1]  # the cache's slots
        k, v = ring_store(cache, "k", k, keep, slots, size), ring_store(cache, "v", v, keep, slots, size)
        n_rep = self.n_heads // self.n_kv_heads
        ctx = self._attend(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)  # (B, H, Tn, dh)
        self._cache = None
        return self.out_proj(self._merge(ctx))


# a wrong argument is refused in the name of GroupedQueryAttention, not of its door
own_init(GroupedQueryAttention, dtype=np.float32)  # tfm_numpy's default dtype
