"""Encoder and decoder layers and their stacks, NumPy track: forward and hand-written backward side by side.

Shapes: `x` is `(B, T, d_model)` (the decoder's target side), `memory` `(B, S, d_model)` (the encoder's output).
Masks are boolean, True = may attend: `src_mask` `(B, 1, 1, S)` (padding), `tgt_mask` `(B, 1, T, T)` (causal and
padding), `memory_mask` `(B, 1, 1, S)` (the source padding again, for cross-attention).

Each sublayer (attention or feed-forward) sits inside a residual connection with a LayerNorm, in one of two
places, as `torch.nn.TransformerEncoderLayer(norm_first=...)` does:

    norm_first=False (Post-LN, the paper):  x = norm(x + dropout(sublayer(x)))
    norm_first=True  (Pre-LN):              x = x + dropout(sublayer(norm(x)))

In Pre-LN nothing normalizes the residual stream itself, so a stack of Pre-LN layers ends with one more
LayerNorm (`final_norm`, on by default for Pre-LN only). Names follow torch's layers (`self_attn`, `norm1`,
`dropout1`, `_sa_block`, `_ff_block`, ...); the cross-attention torch calls `multihead_attn` is `cross_attn`
here and the feed-forward network is one submodule, `ff` (torch's `linear1`, `linear2` sit on the layer).

Options for the pitfalls of chapter 16a (keyword-only; the defaults are the paper's and change nothing):
`score_scale` and `head_projection` go to the attentions (see `MultiHeadAttention`, `make_attention`),
`ff_dropout=False` removes the feed-forward's hidden dropout, and `dropout_place="after_norm"` (Post-LN only)
moves the residual dropout from the sublayer's output to after the LayerNorm: x = dropout(norm(x + sublayer(x))).
The stacks pass their keyword `**layer_options` on to every layer.
"""

from __future__ import annotations

import numpy as np

from tfm_common.pitfalls import DROPOUT_PLACES
from tfm_common.validate import check_choice, check_flag, check_sizes

from .attention import make_attention
from .layers import Dropout, LayerNorm
from .module import Module, ModuleList, as_rng, check_dtype, check_grad, check_input
from .sublayers import PositionwiseFeedForward, check_activation

__all__ = ["DROPOUT_PLACES", "EncoderLayer", "DecoderLayer", "Encoder", "Decoder"]


def _check_bool(owner: str, arg: str, value) -> bool:
    return check_flag(owner, arg, value)


def _check_positive(owner: str, **sizes) -> dict[str, int]:
    return check_sizes(owner, **sizes)


def _check_options(owner: str, norm_first: bool, dropout_place, ff_dropout) -> tuple[str, bool]:
    """The layer's pitfall options: where the residual dropout sits, and whether the FFN's hidden units get one."""
    dropout_place = check_choice(owner, "dropout_place", dropout_place, DROPOUT_PLACES)
    if norm_first and dropout_place == "after_norm":
        raise ValueError(f"{owner}: dropout_place='after_norm' needs Post-LN (norm_first=False), got norm_first=True")
    return dropout_place, check_flag(owner, "ff_dropout", ff_dropout)


class _Residual(Module):
    """Where a layer's residual dropout goes: on the sublayer's output (`_sub`) or after the LayerNorm (`_post`)."""

    def _sub(self, drop: Dropout, y: np.ndarray) -> np.ndarray:
        return drop(y) if self.dropout_place == "sublayer" else y

    def _sub_backward(self, drop: Dropout, g: np.ndarray) -> np.ndarray:
        return drop.backward(g) if self.dropout_place == "sublayer" else g

    def _post(self, drop: Dropout, y: np.ndarray) -> np.ndarray:
        return drop(y) if self.dropout_place == "after_norm" else y

    def _post_backward(self, drop: Dropout, g: np.ndarray) -> np.ndarray:
        return drop.backward(g) if self.dropout_place == "after_norm" else g

    def _options_repr(self) -> str:
        opts = {"dropout_place": (self.dropout_place, "sublayer"), "ff_dropout": (self.ff_dropout, True)}
        return "".join(f", {k}={v!r}" for k, (v, default) in opts.items() if v != default)


def _check_x(name: str, x, norm: LayerNorm) -> None:
    """A (B, T, d_model) float array of the parameters' dtype (read off a LayerNorm of the layer)."""
    check_input(name, x, ndim_min=3, last_dim=norm.normalized_shape[0], dtype=norm.weight.dtype)
    if x.ndim != 3:
        raise ValueError(f"{name}: expected shape (B, T, d_model), got {x.shape}")


class EncoderLayer(_Residual):
    """Self-attention, then a position-wise feed-forward network, each in a residual connection with a LayerNorm.

    forward(x (B, S, d), src_mask (B, 1, 1, S) or None) -> (B, S, d); backward(dy) -> dx.
    After a forward, `self_attn.attn_weights` holds the attention weights (B, H, S, S).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        *,
        score_scale: str = "d_k",
        head_projection: str = "full",
        dropout_place: str = "sublayer",
        ff_dropout: bool = True,
        rng=None,
        dtype=np.float32,
    ):
        super().__init__()
        _check_positive("EncoderLayer", d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        check_activation("EncoderLayer", activation)
        self.norm_first = _check_bool("EncoderLayer", "norm_first", norm_first)
        self.dropout_place, self.ff_dropout = _check_options("EncoderLayer", norm_first, dropout_place, ff_dropout)
        dt, g = check_dtype(dtype), as_rng(rng)
        attn = dict(score_scale=score_scale, rng=g, dtype=dt)
        self.self_attn = make_attention(head_projection, d_model, n_heads, dropout, **attn)
        ff = dict(hidden_dropout=ff_dropout, rng=g, dtype=dt)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation, **ff)
        self.norm1 = LayerNorm(d_model, dtype=dt)
        self.norm2 = LayerNorm(d_model, dtype=dt)
        self.dropout1 = Dropout(dropout, rng=g)  # on the self-attention's output, before the residual sum
        self.dropout2 = Dropout(dropout, rng=g)  # on the feed-forward's output

    def forward(self, x: np.ndarray, src_mask: np.ndarray | None = None) -> np.ndarray:
        _check_x("EncoderLayer: x", x, self.norm1)
        self._cache = (x.shape, x.dtype)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self._post(self.dropout1, self.norm1(x + self._sa_block(x, src_mask)))
            x = self._post(self.dropout2, self.norm2(x + self._ff_block(x)))
        return x  # (B, S, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        check_grad("EncoderLayer", grad_out, *self._saved())
        # A residual x + f(x) passes its gradient on unchanged AND through f: d(x + f(x)) = dy + f'(x)^T dy.
        dx = grad_out
        if self.norm_first:
            dx = dx + self.norm2.backward(self._ff_block_backward(dx))
            dx = dx + self.norm1.backward(self._sa_block_backward(dx))
        else:
            dx = self.norm2.backward(self._post_backward(self.dropout2, dx))
            dx = dx + self._ff_block_backward(dx)
            dx = self.norm1.backward(self._post_backward(self.dropout1, dx))
            dx = dx + self._sa_block_backward(dx)
        return dx  # (B, S, d)

    # -- the two sublayers, each with its backward --------------------------------------------------------------
    def _sa_block(self, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        return self._sub(self.dropout1, self.self_attn(x, x, x, mask))  # (B, S, d)

    def _sa_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        d_query, d_key, d_value = self.self_attn.backward(self._sub_backward(self.dropout1, grad_out))
        return d_query + d_key + d_value  # x fed all three inputs: its gradient is the sum

    def _ff_block(self, x: np.ndarray) -> np.ndarray:
        return self._sub(self.dropout2, self.ff(x))  # (B, S, d)

    def _ff_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.ff.backward(self._sub_backward(self.dropout2, grad_out))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}{self._options_repr()}"


class DecoderLayer(_Residual):
    """Masked self-attention, cross-attention to the encoder's output, feed-forward; each sublayer in a residual
    connection with a LayerNorm.

    forward(x (B, T, d), memory (B, S, d), tgt_mask (B, 1, T, T), memory_mask (B, 1, 1, S)) -> (B, T, d);
    backward(dy) -> (dx, dmemory). Cross-attention is the only place where the decoder sees the source: its
    queries come from the target side, its keys and values from `memory`.
    After a forward, `self_attn.attn_weights` (B, H, T, T) and `cross_attn.attn_weights` (B, H, T, S).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        *,
        score_scale: str = "d_k",
        head_projection: str = "full",
        dropout_place: str = "sublayer",
        ff_dropout: bool = True,
        rng=None,
        dtype=np.float32,
    ):
        super().__init__()
        _check_positive("DecoderLayer", d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        check_activation("DecoderLayer", activation)
        self.norm_first = _check_bool("DecoderLayer", "norm_first", norm_first)
        self.dropout_place, self.ff_dropout = _check_options("DecoderLayer", norm_first, dropout_place, ff_dropout)
        dt, g = check_dtype(dtype), as_rng(rng)
        attn = dict(score_scale=score_scale, rng=g, dtype=dt)
        self.self_attn = make_attention(head_projection, d_model, n_heads, dropout, **attn)
        self.cross_attn = make_attention(head_projection, d_model, n_heads, dropout, **attn)
        ff = dict(hidden_dropout=ff_dropout, rng=g, dtype=dt)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation, **ff)
        self.norm1 = LayerNorm(d_model, dtype=dt)
        self.norm2 = LayerNorm(d_model, dtype=dt)
        self.norm3 = LayerNorm(d_model, dtype=dt)
        self.dropout1 = Dropout(dropout, rng=g)
        self.dropout2 = Dropout(dropout, rng=g)
        self.dropout3 = Dropout(dropout, rng=g)

    def forward(
        self,
        x: np.ndarray,
        memory: np.ndarray,
        tgt_mask: np.ndarray | None = None,
        memory_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        _check_x("DecoderLayer: x", x, self.norm1)
        _check_x("DecoderLayer: memory", memory, self.norm1)
        self._cache = (x.shape, x.dtype)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self._post(self.dropout1, self.norm1(x + self._sa_block(x, tgt_mask)))
            x = self._post(self.dropout2, self.norm2(x + self._mha_block(x, memory, memory_mask)))
            x = self._post(self.dropout3, self.norm3(x + self._ff_block(x)))
        return x  # (B, T, d)

    def forward_step(
        self,
        x: np.ndarray,
        memory: np.ndarray,
        cache: dict,
        tgt_mask: np.ndarray | None = None,
        memory_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """`forward` for the new target positions x (B, Tn, d) only, the earlier ones' keys and values read from
        `cache` (a dict, empty at the first step; inference only). tgt_mask (B, 1, Tn, T) covers all T positions
        so far. The same sublayers as `forward`, with the attentions' `forward_step` (see MultiHeadAttention)."""
        _check_x("DecoderLayer: x", x, self.norm1)
        _check_x("DecoderLayer: memory", memory, self.norm1)
        self._cache = None  # inference only: a backward after this is an error
        sa, ca = cache.setdefault("self_attn", {}), cache.setdefault("cross_attn", {})
        if self.norm_first:
            x = x + self._sa_block_step(self.norm1(x), tgt_mask, sa)
            x = x + self._mha_block_step(self.norm2(x), memory, memory_mask, ca)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self._post(self.dropout1, self.norm1(x + self._sa_block_step(x, tgt_mask, sa)))
            x = self._post(self.dropout2, self.norm2(x + self._mha_block_step(x, memory, memory_mask, ca)))
            x = self._post(self.dropout3, self.norm3(x + self._ff_block(x)))
        return x  # (B, Tn, d)

    def _sa_block_step(self, x: np.ndarray, mask: np.ndarray | None, cache: dict) -> np.ndarray:
        return self._sub(self.dropout1, self.self_attn.forward_step(x, x, x, cache, mask))  # new keys/values appended

    def _mha_block_step(self, x: np.ndarray, memory: np.ndarray, mask: np.ndarray | None, cache: dict) -> np.ndarray:
        return self._sub(self.dropout2, self.cross_attn.forward_step(x, memory, memory, cache, mask, static=True))

    def backward(self, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        check_grad("DecoderLayer", grad_out, *self._saved())
        dx = grad_out
        if self.norm_first:
            dx = dx + self.norm3.backward(self._ff_block_backward(dx))
            d_query, d_memory = self._mha_block_backward(dx)
            dx = dx + self.norm2.backward(d_query)
            dx = dx + self.norm1.backward(self._sa_block_backward(dx))
        else:
            dx = self.norm3.backward(self._post_backward(self.dropout3, dx))
            dx = dx + self._ff_block_backward(dx)
            dx = self.norm2.backward(self._post_backward(self.dropout2, dx))
            d_query, d_memory = self._mha_block_backward(dx)
            dx = self.norm1.backward(self._post_backward(self.dropout1, dx + d_query))
            dx = dx + self._sa_block_backward(dx)
        return dx, d_memory  # (B, T, d), (B, S, d)

    # -- the three sublayers, each with its backward ------------------------------------------------------------
    def _sa_block(self, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        return self._sub(self.dropout1, self.self_attn(x, x, x, mask))  # (B, T, d)

    def _sa_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        d_query, d_key, d_value = self.self_attn.backward(self._sub_backward(self.dropout1, grad_out))
        return d_query + d_key + d_value

    def _mha_block(self, x: np.ndarray, memory: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        return self._sub(self.dropout2, self.cross_attn(x, memory, memory, mask))  # queries x, keys/values memory

    def _mha_block_backward(self, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d_query, d_key, d_value = self.cross_attn.backward(self._sub_backward(self.dropout2, grad_out))
        return d_query, d_key + d_value  # memory fed both the keys and the values

    def _ff_block(self, x: np.ndarray) -> np.ndarray:
        return self._sub(self.dropout3, self.ff(x))  # (B, T, d)

    def _ff_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.ff.backward(self._sub_backward(self.dropout3, grad_out))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}{self._options_repr()}"


class Encoder(Module):
    """A stack of `n_layers` EncoderLayers (`layers.0`, `layers.1`, ...), then `norm` (a LayerNorm) if final_norm.

    final_norm=None means "as norm_first": on for Pre-LN (whose residual stream is never normalized otherwise),
    off for Post-LN (whose last layer already ends with a LayerNorm). `attention_weights()` lists each layer's
    self-attention weights (B, H, S, S) from the last forward.
    """

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        final_norm: bool | None = None,
        *,
        rng=None,
        dtype=np.float32,
        **layer_options,
    ):
        super().__init__()
        _check_positive("Encoder", n_layers=n_layers)
        final_norm = _check_bool("Encoder", "final_norm", norm_first if final_norm is None else final_norm)
        dt, g = check_dtype(dtype), as_rng(rng)
        self.layers = ModuleList(
            EncoderLayer(d_model, n_heads, d_ff, dropout, activation, norm_first, rng=g, dtype=dt, **layer_options)
            for _ in range(n_layers)
        )
        self.norm = LayerNorm(d_model, dtype=dt) if final_norm else None

    def forward(self, x: np.ndarray, src_mask: np.ndarray | None = None) -> np.ndarray:
        for layer in self.layers:
            x = layer(x, src_mask)  # (B, S, d)
        return self.norm(x) if self.norm is not None else x

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        dx = self.norm.backward(grad_out) if self.norm is not None else grad_out
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        return dx

    def attention_weights(self) -> list[np.ndarray]:
        """[(B, H, S, S) per layer]: the self-attention weights of the last forward (None before one)."""
        return [layer.self_attn.attn_weights for layer in self.layers]


class Decoder(Module):
    """A stack of `n_layers` DecoderLayers, every one attending to the same `memory`, then an optional `norm`.

    forward(x, memory, tgt_mask, memory_mask) -> (B, T, d); backward(dy) -> (dx, dmemory), where dmemory sums
    the gradients from every layer's cross-attention. final_norm as in `Encoder`.
    """

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        final_norm: bool | None = None,
        *,
        rng=None,
        dtype=np.float32,
        **layer_options,
    ):
        super().__init__()
        _check_positive("Decoder", n_layers=n_layers)
        final_norm = _check_bool("Decoder", "final_norm", norm_first if final_norm is None else final_norm)
        dt, g = check_dtype(dtype), as_rng(rng)
        self.layers = ModuleList(
            DecoderLayer(d_model, n_heads, d_ff, dropout, activation, norm_first, rng=g, dtype=dt, **layer_options)
            for _ in range(n_layers)
        )
        self.norm = LayerNorm(d_model, dtype=dt) if final_norm else None

    def forward(
        self,
        x: np.ndarray,
        memory: np.ndarray,
        tgt_mask: np.ndarray | None = None,
        memory_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        for layer in self.layers:
            x = layer(x, memory, tgt_mask, memory_mask)  # (B, T, d)
        return self.norm(x) if self.norm is not None else x

    def forward_step(
        self,
        x: np.ndarray,
        memory: np.ndarray,
        caches: list[dict],
        tgt_mask: np.ndarray | None = None,
        memory_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """`forward` for new target positions only, with one key/value cache per layer (see DecoderLayer)."""
        if len(caches) != len(self.layers):
            raise ValueError(f"Decoder.forward_step: expected {len(self.layers)} layer caches, got {len(caches)}")
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer.forward_step(x, memory, cache, tgt_mask, memory_mask)  # (B, Tn, d)
        return self.norm(x) if self.norm is not None else x

    def backward(self, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        dx = self.norm.backward(grad_out) if self.norm is not None else grad_out
        d_memory = 0
        for layer in reversed(list(self.layers)):
            dx, dm = layer.backward(dx)
            d_memory = d_memory + dm  # every layer read the same memory: the gradients add
        return dx, d_memory

    def attention_weights(self, kind: str = "self") -> list[np.ndarray]:
        """[(B, H, T, T) per layer] for kind="self", [(B, H, T, S) per layer] for kind="cross"."""
        if kind not in ("self", "cross"):
            raise ValueError(f"Decoder.attention_weights: kind must be 'self' or 'cross', got {kind!r}")
        return [(layer.self_attn if kind == "self" else layer.cross_attn).attn_weights for layer in self.layers]
