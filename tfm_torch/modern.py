"""Since 2017, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.modern (RMSNorm, rotary
position embedding, the SwiGLU feed-forward, grouped-query attention); autograd does the backward."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tfm_common.attention import GroupedQueryAttentionDoor, check_kv_heads
from tfm_common.config import own_init
from tfm_common.validate import check_positions, check_real, check_rope_tables, check_size, check_sizes

from .attention import AttentionImpl, check_attn_impl
from .kv_cache import ring_store, store_kv
from .layers import Dropout, Linear, norm_scaled
from .masks import check_mask
from .module import Module, as_generator, at_the_door, autocast_dtype, check_dtype, check_input

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
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, twin of tfm_numpy's (and of torch.nn.RMSNorm)."""

    def __init__(self, d: int, eps: float = 1e-6, *, dtype=None):
        super().__init__()
        self.d = check_size("RMSNorm", "d", d)
        self.eps = check_real("RMSNorm", "eps", eps, low=0.0)
        if not self.eps > 0:
            raise ValueError(f"RMSNorm: eps must be > 0, got {eps!r}")
        self.weight = nn.Parameter(torch.ones(self.d, dtype=check_dtype(dtype)))

    def _check_forward(self, x) -> None:
        check_input("RMSNorm", x, last_dim=self.d, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, c = norm_scaled(x, (-1,))  # x / c: c = max|x| where x^2 would overflow (see tfm_numpy's RMSNorm), else 1
        return u * torch.rsqrt((u * u).mean(dim=-1, keepdim=True) + self.eps / c / c) * self.weight

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


def rope_angles(max_len: int, d_head: int, base: float = 10000.0, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_len, d_head / 2), of the angles p * base^(-2i / d_head); float64, then cast."""
    check_sizes("rope_angles", max_len=max_len, d_head=d_head)
    if d_head % 2:
        raise ValueError(f"rope_angles: d_head must be even (the columns rotate in pairs), got d_head={d_head}")
    base = check_real("rope_angles", "base", base, low=1.0)
    omega = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (d_head / 2,)
    angle = torch.arange(max_len, dtype=torch.float64)[:, None] * omega  # (max_len, d_head / 2)
    dt = check_dtype(dtype)
    return torch.cos(angle).to(dt), torch.sin(angle).to(dt)


def rope_angles_at(positions, d_head: int, base: float = 10000.0, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (len(positions), d_head / 2) for any positions, as tfm_numpy.rope_angles_at: `rope_angles`' rows,
    bit for bit, past max_len too. `positions` a sequence or array of ints."""
    omega = float(base) ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (d_head / 2,)
    angle = torch.as_tensor(positions, dtype=torch.float64)[:, None] * omega
    dt = check_dtype(dtype)
    return torch.cos(angle).to(dt), torch.sin(angle).to(dt)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x[..., 2i], x[..., 2i+1]) -> (x0 cos - x1 sin, x0 sin + x1 cos); cos, sin (T, d/2)."""
    if at_the_door():  # RotaryEmbedding's own calls pass: it checks x and slices its tables itself
        _check_apply_rope(x, cos, sin)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)  # pairs back in place


def _check_apply_rope(x, cos, sin) -> None:
    """x (..., T, d) floats, cos and sin (T, d/2) of x's dtype, as tfm_numpy's (under torch.autocast x comes in its
    dtype and the tables stay float32)."""
    check_input("apply_rope: x", x, ndim_min=2)
    for arg, table in (("cos", cos), ("sin", sin)):
        check_input(f"apply_rope: {arg}", table)
        if table.dtype != x.dtype and not autocast_dtype(x):
            raise TypeError(f"apply_rope: {arg} expected x's dtype {x.dtype}, got {table.dtype}")
    check_rope_tables("apply_rope", tuple(x.shape), tuple(cos.shape), tuple(sin.shape))


class RotaryEmbedding(Module):
    """Rotary position embedding, twin of tfm_numpy's; the tables are non-persistent buffers (no state_dict)."""

    def __init__(self, d_head: int, max_len: int, base: float = 10000.0, *, dtype=None):
        super().__init__()
        cos, sin = rope_angles(max_len, d_head, base, check_dtype(dtype))
        self.register_buffer("cos", cos, persistent=False)  # moves with .to()/.double(), not saved
        self.register_buffer("sin", sin, persistent=False)
        self.d_head, self.max_len, self.base = d_head, max_len, float(base)

    def rotate(self, x: torch.Tensor, offset: int = 0, inverse: bool = False) -> torch.Tensor:
        check_input("RotaryEmbedding", x, ndim_min=2, last_dim=self.d_head, dtype=self.cos.dtype)
        T = x.shape[-2]
        offset = check_size("RotaryEmbedding", "offset", offset, minimum=0)
        check_positions("RotaryEmbedding", T, offset, self.max_len)
        sin = self.sin[offset : offset + T]
        return apply_rope(x, self.cos[offset : offset + T], -sin if inverse else sin)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return self.rotate(x, offset)

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, max_len={self.max_len}, base={self.base}"


def swiglu_hidden_size(d_ff: int) -> int:
    """round(2 d_ff / 3): a SwiGLU feed-forward of that width has the weights of a two-matrix one of width d_ff."""
    return max(1, round(2 * check_size("swiglu_hidden_size", "d_ff", d_ff) / 3))


class SwiGLUFeedForward(Module):
    """down(silu(gate(x)) * up(x)), three bias-free matrices (twin of tfm_numpy's)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, *, rng=None, dtype=None):
        super().__init__()
        check_sizes("SwiGLUFeedForward", d_model=d_model, d_ff=d_ff)
        dt, g = check_dtype(dtype), as_generator(rng)
        self.d_model, self.d_ff = d_model, d_ff
        self.gate_proj = Linear(d_model, d_ff, bias=False, rng=g, dtype=dt)
        self.up_proj = Linear(d_model, d_ff, bias=False, rng=g, dtype=dt)
        self.dropout = Dropout(dropout, rng=g)
        self.down_proj = Linear(d_ff, d_model, bias=False, rng=g, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.gate_proj(x)  # (B, T, d_ff)
        return self.down_proj(self.dropout(a * torch.sigmoid(a) * self.up_proj(x)))  # silu(a) * b

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, T, d) -> (B, Hkv * n_rep, T, d), head j to query heads j n_rep .. (j + 1) n_rep - 1."""
    if at_the_door():  # inside GroupedQueryAttention, n_rep is its own
        _check_repeat_kv(x, n_rep)
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _check_repeat_kv(x, n_rep) -> None:
    check_size("repeat_kv", "n_rep", n_rep)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"repeat_kv: x expected a torch.Tensor (B, Hkv, T, d), got {got}")


class GroupedQueryAttention(AttentionImpl, GroupedQueryAttentionDoor, Module):
    """Grouped-query self-attention, twin of tfm_numpy's; attn_impl="sdpa" (this track only) takes the key/value heads
    unrepeated (enable_gqa)."""

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    # the building blocks of the constructor written in tfm_common.attention (GroupedQueryAttentionDoor.__init__)
    _parts = SimpleNamespace(check_dtype=check_dtype, as_rng=as_generator, check_attn_impl=check_attn_impl,
                             Linear=Linear, Dropout=Dropout, RotaryEmbedding=RotaryEmbedding)  # fmt: skip

    def _split(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.reshape(B, T, n, self.d_head).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        B, n, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, n * self.d_head)

    def _project(self, x: torch.Tensor, offset: int):
        q = self._split(self.q_proj(x), self.n_heads)
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, offset), self.rotary.rotate(k, offset)
        return q, k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        q, k, v = self._project(x, offset)  # (B, H, T, dh), k and v (B, Hkv, T, dh)
        return self.out_proj(self._merge(self._attend(q, k, v, mask)))  # (B, T, d)

    def forward_step(self, x: torch.Tensor, cache: dict, mask: torch.Tensor | None = None) -> torch.Tensor:
        """As tfm_numpy's: cache["k"], cache["v"] (B, Hkv, T, dh) grow by the new positions, in place."""
        q, k, v = self._project(x, cache["k"].shape[2] if "k" in cache else 0)
        k, v = store_kv(cache, k, v)  # (B, Hkv, T + Tn, dh): as floats (int8 codes in an int8 cache)
        return self.out_proj(self._merge(self._attend(q, k, v, mask)))

    def forward_rolling(self, x, cache: dict, mask, angles, keep, slots) -> torch.Tensor:
        """`forward_step` with the rolling cache of a sliding window, as tfm_numpy's (`ring_store`)."""
        q = self._split(self.q_proj(x), self.n_heads)
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if angles is not None:
            q, k = apply_rope(q, *angles), apply_rope(k, *angles)
        size = mask.shape[-1] - x.shape[1]
        k, v = ring_store(cache, "k", k, keep, slots, size), ring_store(cache, "v", v, keep, slots, size)
        return self.out_proj(self._merge(self._attend(q, k, v, mask)))

    # The key/value heads come in unrepeated (B, Hkv, Tk, dh): repeated to the query heads for the kernels of
    # AttentionImpl, passed as they are to torch's (AttentionImpl._attend_sdpa: enable_gqa).
    def _attend_explicit(self, q, k, v, mask) -> torch.Tensor:
        n_rep = self.n_heads // self.n_kv_heads
        return super()._attend_explicit(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)

    def _attend_flash(self, q, k, v, mask) -> torch.Tensor:
        n_rep = self.n_heads // self.n_kv_heads
        return super()._attend_flash(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)


# a wrong argument is refused in the name of GroupedQueryAttention, not of its door
own_init(GroupedQueryAttention)
