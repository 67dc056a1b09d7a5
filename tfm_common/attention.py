"""What the attention of both tracks shares: the rules of MultiHeadAttention's and GroupedQueryAttention's arguments,
their doors and constructors, use_attention's loop, the attn_impl option's repr, and the flash kernels' tiles.

The doors (as tfm_common.doors's) check a call from outside the library before anything is projected, cached or
stored, so that a refused call changes nothing (a backward after it still differentiates the last good forward). The
track supplies its array checks as static methods: `_check_float` (its check_input) and `_check_mask`.

The two attentions' constructors are written here once too, from the track's building blocks `_parts`
(`check_dtype`, `as_rng`, `check_attn_impl`, `Linear`, `Dropout` and, for GroupedQueryAttention, `RotaryEmbedding`).
"""

from __future__ import annotations

import math

from .pitfalls import SCORE_SCALES
from .validate import check_choice, check_flag, check_positions, check_size, check_sizes

__all__ = ["check_heads", "check_kv_heads", "check_rotary", "refuse_flash_dropout", "cached_positions",
           "MultiHeadAttentionDoor", "GroupedQueryAttentionDoor", "switch_attention", "attn_impl_repr", "tiles",
           "mask_tile"]  # fmt: skip


def check_heads(owner: str, d_model, n_heads) -> tuple[int, int, int]:
    """Positive sizes, d_model divisible by n_heads: returns (d_model, n_heads, d_head)."""
    d_model, n_heads = check_sizes(owner, d_model=d_model, n_heads=n_heads).values()
    if d_model % n_heads != 0:
        raise ValueError(f"{owner}: d_model={d_model} must be divisible by n_heads={n_heads}")
    return d_model, n_heads, d_model // n_heads


def check_kv_heads(owner: str, n_heads: int, n_kv_heads) -> int:
    """n_kv_heads (None: n_heads) must divide n_heads: each key/value head serves n_heads / n_kv_heads query heads."""
    if n_kv_heads is None:
        return n_heads
    n_kv_heads = check_size(owner, "n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"{owner}: n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
    return n_kv_heads


def check_rotary(owner: str, rotary, d_head: int, rotary_class: type) -> None:
    """None, or a RotaryEmbedding (the track's `rotary_class`) for heads of d_head."""
    if rotary is not None and (not isinstance(rotary, rotary_class) or rotary.d_head != d_head):
        raise ValueError(f"{owner}: rotary expected a RotaryEmbedding with d_head={d_head}, got {rotary!r}")


def refuse_flash_dropout(owner: str, module) -> None:
    """The tiled kernel has no dropout on the weights: a module training with attention dropout is refused rather
    than silently trained without."""
    if module.attn_impl == "flash" and module.training and module.dropout.p > 0:
        raise ValueError(
            f"{owner}: attn_impl='flash' has no dropout on the attention weights, got dropout="
            f"{module.dropout.p} in training mode; use dropout=0.0, eval(), or attn_impl='explicit'"
        )


def cached_positions(owner: str, cache: dict, batch: int, heads: int | None = None, d_head: int | None = None) -> int:
    """How many positions a self-attention's decoding cache holds, after checking it is a dict holding the input's
    batch (and, where given, keys of `heads` heads of d_head: a cache from another model is refused, not misread)."""
    if not isinstance(cache, dict):
        raise TypeError(f"{owner}: cache expected a dict (empty at the first step), got {type(cache).__name__}")
    if "k" in cache and cache["k"].shape[0] != batch:
        raise ValueError(
            f"{owner}: the cache holds {cache['k'].shape[0]} rows, the input has {batch}; start a new cache for "
            "a new batch (or reorder it with reorder_cache)"
        )
    if "k" in cache and heads is not None and tuple(cache["k"].shape[1::2]) != (heads, d_head):
        raise ValueError(
            f"{owner}: the cache holds keys of shape {tuple(cache['k'].shape)}, this module's are (B, {heads}, T, "
            f"{d_head}): a cache from another model; start a new cache"
        )
    return cache["k"].shape[2] if "k" in cache else 0


class AttentionDoor:
    def _check_inputs(self, owner: str, inputs: dict, **kwargs) -> None:
        """Each input (B, T, d_model) of the module's dtype; for query, key and value one batch size, and keys and
        values of one length."""
        for arg, x in inputs.items():
            self._check_float(f"{owner}: {arg}", x, last_dim=self.d_model, dtype=self.q_proj.weight.dtype, **kwargs)
            if x.ndim != 3:
                raise ValueError(f"{owner}: {arg} must be (B, T, d_model), got shape {tuple(x.shape)}")
        if len(inputs) < 3:
            return
        q, k, v = (tuple(x.shape) for x in inputs.values())
        if not q[0] == k[0] == v[0]:
            raise ValueError(f"{owner}: batch sizes differ: query {q}, key {k}, value {v}")
        if k[1] != v[1]:
            raise ValueError(f"{owner}: key and value lengths differ: key {k}, value {v}")

    def _check_call(self, owner: str, batch: int, tq: int, tk: int, mask) -> None:
        """The mask against the scores (B, H, Tq, Tk) (also for attn_impl="sdpa", whose kernel would read a float
        mask as an additive bias); the tiled kernel's refusal of attention dropout. At least one key: a softmax over
        none has nothing to normalize (scaled_dot_product_attention refuses it alike)."""
        if tk < 1:
            raise ValueError(f"{owner}: attention needs at least one key (Tk >= 1), got Tk=0")
        if mask is not None:
            self._check_mask(mask, (batch, self.n_heads, tq, tk))
        refuse_flash_dropout(owner, self)


class MultiHeadAttentionDoor(AttentionDoor):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        attn_impl: str = "explicit",
        tile_size: int = 64,
        score_scale: str = "d_k",
        rng=None,
        dtype=None,
    ):
        """q_proj, k_proj, v_proj (the class's `_make_projections`), out_proj, and `dropout` on the attention
        weights, registered in that order."""
        super().__init__()
        owner, parts = type(self).__name__, self._parts
        self.d_model, self.n_heads, self.d_head = check_heads(owner, d_model, n_heads)
        bias = check_flag(owner, "bias", bias)  # "no" would be truthy: biases the caller did not ask for
        self.attn_impl, self.tile_size = parts.check_attn_impl(owner, attn_impl, tile_size)
        self.score_scale = check_choice(owner, "score_scale", score_scale, SCORE_SCALES)
        # 1/sqrt(H) on the queries turns the 1/sqrt(dk) of the attention into 1/sqrt(d_model); None: the paper's
        self.q_scale = None if score_scale == "d_k" else 1.0 / math.sqrt(n_heads)
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self._make_projections(d_model, bias, rng, dt)
        self.out_proj = parts.Linear(d_model, d_model, bias, rng=rng, dtype=dt)
        self.dropout = parts.Dropout(dropout, rng=rng)  # on the attention weights, in training only
        self.attn_weights = None

    def _check_forward(self, query, key, value, mask=None) -> None:
        self._check_inputs("MultiHeadAttention", {"query": query, "key": key, "value": value})
        self._check_call("MultiHeadAttention", query.shape[0], query.shape[1], key.shape[1], mask)

    def _check_forward_step(self, query, key, value, cache: dict, mask=None, *, static: bool = False) -> None:
        self._check_inputs("MultiHeadAttention", {"query": query, "key": key, "value": value})
        cached = cached_positions("MultiHeadAttention", cache, query.shape[0], self.n_heads, self.d_head)  # or memory
        keys = cached if static and "k" in cache else cached + key.shape[1]
        self._check_call("MultiHeadAttention", query.shape[0], query.shape[1], keys, mask)

    def extra_repr(self) -> str:
        scale = ", score_scale='d_model'" if self.score_scale == "d_model" else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}{attn_impl_repr(self)}{scale}"


class GroupedQueryAttentionDoor(AttentionDoor):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        rotary=None,
        attn_impl: str = "explicit",
        tile_size: int = 64,
        rng=None,
        dtype=None,
    ):
        """q_proj (d_model -> d_model), k_proj and v_proj (d_model -> n_kv_heads d_head), out_proj, `dropout` on the
        attention weights, and `rotary` (None, or a RotaryEmbedding for d_head), registered in that order."""
        super().__init__()
        owner, parts = "GroupedQueryAttention", self._parts
        self.d_model, self.n_heads, self.d_head = check_heads(owner, d_model, n_heads)
        self.n_kv_heads = check_kv_heads(owner, n_heads, n_kv_heads)
        bias = check_flag(owner, "bias", bias)
        check_rotary(owner, rotary, self.d_head, parts.RotaryEmbedding)
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        d_kv = self.n_kv_heads * self.d_head
        self.q_proj = parts.Linear(d_model, d_model, bias, rng=rng, dtype=dt)
        self.k_proj = parts.Linear(d_model, d_kv, bias, rng=rng, dtype=dt)
        self.v_proj = parts.Linear(d_model, d_kv, bias, rng=rng, dtype=dt)
        self.out_proj = parts.Linear(d_model, d_model, bias, rng=rng, dtype=dt)
        self.dropout = parts.Dropout(dropout, rng=rng)
        self.rotary = rotary
        self.attn_impl, self.tile_size = parts.check_attn_impl(owner, attn_impl, tile_size)
        self.attn_weights = None

    def _check_forward(self, x, mask=None, offset=0) -> None:
        self._check_inputs("GroupedQueryAttention", {"x": x}, ndim_min=3)
        # the position of x's first token, with or without RoPE (a model passes it on to its layers alike)
        offset = check_size("GroupedQueryAttention", "offset", offset, minimum=0)
        if self.rotary is not None:
            check_positions("GroupedQueryAttention", x.shape[1], offset, self.rotary.max_len)
        self._check_call("GroupedQueryAttention", x.shape[0], x.shape[1], x.shape[1], mask)

    def _check_forward_step(self, x, cache, mask=None) -> None:
        self._check_inputs("GroupedQueryAttention", {"x": x}, ndim_min=3)
        cached = cached_positions("GroupedQueryAttention", cache, x.shape[0], self.n_kv_heads, self.d_head)
        keys = cached + x.shape[1]  # and the new ones
        self._check_call("GroupedQueryAttention", x.shape[0], x.shape[1], keys, mask)

    def extra_repr(self) -> str:
        rope = ", rotary" if self.rotary is not None else ""
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}{rope}{attn_impl_repr(self)}"
        )


def switch_attention(model, modules, attn_impl: str, tile_size: int):
    """`use_attention`'s loop: set `attn_impl` and `tile_size` on each of `modules` (the model's attention modules,
    checked options); refuses a model without any. Returns the model."""
    switched = 0
    for m in modules:
        m.attn_impl, m.tile_size = attn_impl, tile_size
        switched += 1
    if not switched:  # nothing would change: say so rather than return the model as it was
        raise ValueError(
            f"use_attention: {type(model).__name__} has no attention module to switch to attn_impl={attn_impl!r}"
        )
    return model


def attn_impl_repr(module) -> str:
    """The attn_impl option in a module's repr: nothing for the default "explicit"."""
    if module.attn_impl == "flash":
        return f", attn_impl='flash', tile_size={module.tile_size}"
    return ", attn_impl='sdpa'" if module.attn_impl == "sdpa" else ""


def tiles(n: int, size: int) -> list[slice]:
    """[0:size], [size:2 size], ...: the blocks of an axis of length n (the last one may be shorter)."""
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def mask_tile(mask, rows: slice, cols: slice):
    """The mask's (..., Br, Bc) tile; an axis of size 1 (broadcast) is kept whole. None: no mask."""
    if mask is None:
        return None
    return mask[..., rows if mask.shape[-2] > 1 else slice(None), cols if mask.shape[-1] > 1 else slice(None)]
