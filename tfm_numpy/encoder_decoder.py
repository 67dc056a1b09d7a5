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

Options for the pitfalls of chapter 16a (keyword-only; the defaults are the paper's and change nothing, except
`ff_dropout=True` and the dropout on the attention weights, which come from tensor2tensor, not the paper's text):
`score_scale` and `head_projection` go to the attentions (see `MultiHeadAttention`, `make_attention`),
`ff_dropout=False` removes the feed-forward's hidden dropout, and `dropout_place="after_norm"` (Post-LN only)
builds the variant `DropoutAfterNormEncoderLayer` (`...DecoderLayer`), whose residual dropout follows the LayerNorm:
x = dropout(norm(x + sublayer(x))). The stacks pass their keyword `**layer_options` on to every layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tfm_common.config import own_init
from tfm_common.doors import DecoderLayerDoor, EncoderLayerDoor, StackDoor
from tfm_common.pitfalls import DROPOUT_PLACES

from .attention import make_attention
from .layers import Dropout, LayerNorm
from .masks import check_mask
from .module import Module, ModuleList, as_rng, check_dtype, check_input
from .sublayers import PositionwiseFeedForward

__all__ = ["DROPOUT_PLACES", "EncoderLayer", "DecoderLayer", "DropoutAfterNormEncoderLayer",
           "DropoutAfterNormDecoderLayer", "Encoder", "Decoder"]  # fmt: skip


class _Layer(Module):
    """What an encoder and a decoder layer share: the door's checks and the building blocks of their constructor
    (`tfm_common.doors.LayerDoor.__init__`: self_attn, the decoder's cross_attn, ff, norm1, ..., dropout1, ...)."""

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    _owner, _cross = "EncoderLayer", False
    _parts = SimpleNamespace(check_dtype=check_dtype, as_rng=as_rng, make_attention=make_attention,
                             Dropout=Dropout, LayerNorm=LayerNorm, PositionwiseFeedForward=PositionwiseFeedForward,
                             ModuleList=ModuleList)  # fmt: skip

    # -- the self-attention sublayer, the same in both layers, with its backward ---------------------------------
    def _sa_block(self, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        return self.dropout1(self.self_attn(x, x, x, mask))  # (B, T, d)

    def _sa_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        d_query, d_key, d_value = self.self_attn.backward(self.dropout1.backward(grad_out))
        return d_query + d_key + d_value  # x fed all three inputs: its gradient is the sum


class EncoderLayer(EncoderLayerDoor, _Layer):
    """Self-attention, then a position-wise feed-forward network, each in a residual connection with a LayerNorm.

    forward(x (B, S, d), src_mask (B, 1, 1, S) or None) -> (B, S, d); backward(dy) -> dx.
    After a forward, `self_attn.attn_weights` holds the attention weights (B, H, S, S).
    """

    def forward(self, x: np.ndarray, src_mask: np.ndarray | None = None) -> np.ndarray:
        self._cache = (x.shape, x.dtype)  # a backward may follow, once
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask))
            x = self.norm2(x + self._ff_block(x))
        return x  # (B, S, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        self._saved()
        # A residual x + f(x) passes its gradient on unchanged AND through f: d(x + f(x)) = dy + f'(x)^T dy.
        dx = grad_out
        if self.norm_first:
            dx = dx + self.norm2.backward(self._ff_block_backward(dx))
            dx = dx + self.norm1.backward(self._sa_block_backward(dx))
        else:
            dx = self.norm2.backward(dx)
            dx = dx + self._ff_block_backward(dx)
            dx = self.norm1.backward(dx)
            dx = dx + self._sa_block_backward(dx)
        return dx  # (B, S, d)

    # -- the feed-forward sublayer with its backward (the self-attention's: _Layer) ------------------------------
    def _ff_block(self, x: np.ndarray) -> np.ndarray:
        return self.dropout2(self.ff(x))  # (B, S, d)

    def _ff_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.ff.backward(self.dropout2.backward(grad_out))


class DecoderLayer(DecoderLayerDoor, _Layer):
    """Masked self-attention, cross-attention to the encoder's output, feed-forward; each sublayer in a residual
    connection with a LayerNorm.

    forward(x (B, T, d), memory (B, S, d), tgt_mask (B, 1, T, T), memory_mask (B, 1, 1, S)) -> (B, T, d);
    backward(dy) -> (dx, dmemory). Cross-attention is the only place where the decoder sees the source: its
    queries come from the target side, its keys and values from `memory`.
    After a forward, `self_attn.attn_weights` (B, H, T, T) and `cross_attn.attn_weights` (B, H, T, S).
    """

    _owner, _cross = "DecoderLayer", True

    def forward(
        self,
        x: np.ndarray,
        memory: np.ndarray,
        tgt_mask: np.ndarray | None = None,
        memory_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        self._cache = (x.shape, x.dtype)  # a backward may follow, once
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask))
            x = self.norm3(x + self._ff_block(x))
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
        self._cache = None  # inference only: a backward after this is an error
        sa, ca = cache.setdefault("self_attn", {}), cache.setdefault("cross_attn", {})
        if self.norm_first:
            x = x + self._sa_block_step(self.norm1(x), tgt_mask, sa)
            x = x + self._mha_block_step(self.norm2(x), memory, memory_mask, ca)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block_step(x, tgt_mask, sa))
            x = self.norm2(x + self._mha_block_step(x, memory, memory_mask, ca))
            x = self.norm3(x + self._ff_block(x))
        return x  # (B, Tn, d)

    def _sa_block_step(self, x: np.ndarray, mask: np.ndarray | None, cache: dict) -> np.ndarray:
        return self.dropout1(self.self_attn.forward_step(x, x, x, cache, mask))  # new keys/values appended

    def _mha_block_step(self, x: np.ndarray, memory: np.ndarray, mask: np.ndarray | None, cache: dict) -> np.ndarray:
        return self.dropout2(self.cross_attn.forward_step(x, memory, memory, cache, mask, static=True))

    def backward(self, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._saved()
        dx = grad_out
        if self.norm_first:
            dx = dx + self.norm3.backward(self._ff_block_backward(dx))
            d_query, d_memory = self._mha_block_backward(dx)
            dx = dx + self.norm2.backward(d_query)
            dx = dx + self.norm1.backward(self._sa_block_backward(dx))
        else:
            dx = self.norm3.backward(dx)
            dx = dx + self._ff_block_backward(dx)
            dx = self.norm2.backward(dx)
            d_query, d_memory = self._mha_block_backward(dx)
            dx = self.norm1.backward(dx + d_query)
            dx = dx + self._sa_block_backward(dx)
        return dx, d_memory  # (B, T, d), (B, S, d)

    # -- the cross-attention and feed-forward sublayers with their backward (the self-attention's: _Layer) -------
    def _mha_block(self, x: np.ndarray, memory: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        return self.dropout2(self.cross_attn(x, memory, memory, mask))  # queries x, keys/values memory

    def _mha_block_backward(self, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d_query, d_key, d_value = self.cross_attn.backward(self.dropout2.backward(grad_out))
        return d_query, d_key + d_value  # memory fed both the keys and the values

    def _ff_block(self, x: np.ndarray) -> np.ndarray:
        return self.dropout3(self.ff(x))  # (B, T, d)

    def _ff_block_backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.ff.backward(self.dropout3.backward(grad_out))


# -- chapter 16a's pitfall: the residual dropout after the LayerNorm -------------------------------------------------
class DropoutAfterNormEncoderLayer(EncoderLayer):
    """`EncoderLayer(..., dropout_place="after_norm")` (Post-LN only): x = dropout(norm(x + sublayer(x))), the
    dropout on the residual stream itself instead of on the sublayer's output. The same submodules and weights."""

    def forward(self, x: np.ndarray, src_mask: np.ndarray | None = None) -> np.ndarray:
        self._cache = (x.shape, x.dtype)
        x = self.dropout1(self.norm1(x + self.self_attn(x, x, x, src_mask)))
        return self.dropout2(self.norm2(x + self.ff(x)))  # (B, S, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        self._saved()
        dx = self.norm2.backward(self.dropout2.backward(grad_out))  # through the dropout mask first
        dx = dx + self.ff.backward(dx)
        dx = self.norm1.backward(self.dropout1.backward(dx))
        d_query, d_key, d_value = self.self_attn.backward(dx)
        return dx + (d_query + d_key + d_value)  # (B, S, d)


class DropoutAfterNormDecoderLayer(DecoderLayer):
    """`DecoderLayer(..., dropout_place="after_norm")` (Post-LN only), as DropoutAfterNormEncoderLayer."""

    def forward(self, x, memory, tgt_mask=None, memory_mask=None) -> np.ndarray:
        self._cache = (x.shape, x.dtype)
        x = self.dropout1(self.norm1(x + self.self_attn(x, x, x, tgt_mask)))
        x = self.dropout2(self.norm2(x + self.cross_attn(x, memory, memory, memory_mask)))
        return self.dropout3(self.norm3(x + self.ff(x)))  # (B, T, d)

    def forward_step(self, x, memory, cache: dict, tgt_mask=None, memory_mask=None) -> np.ndarray:
        self._cache = None  # inference only
        sa, ca = cache.setdefault("self_attn", {}), cache.setdefault("cross_attn", {})
        x = self.dropout1(self.norm1(x + self.self_attn.forward_step(x, x, x, sa, tgt_mask)))
        x = self.dropout2(self.norm2(x + self.cross_attn.forward_step(x, memory, memory, ca, memory_mask, static=True)))
        return self.dropout3(self.norm3(x + self.ff(x)))  # (B, Tn, d)

    def backward(self, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._saved()
        dx = self.norm3.backward(self.dropout3.backward(grad_out))
        dx = dx + self.ff.backward(dx)
        dx = self.norm2.backward(self.dropout2.backward(dx))
        d_query, d_key, d_value = self.cross_attn.backward(dx)
        dx = self.norm1.backward(self.dropout1.backward(dx + d_query))
        dq, dk, dv = self.self_attn.backward(dx)
        return dx + (dq + dk + dv), d_key + d_value  # (B, T, d), (B, S, d)


EncoderLayer._after_norm, DecoderLayer._after_norm = DropoutAfterNormEncoderLayer, DropoutAfterNormDecoderLayer


class _Stack(StackDoor, Module):
    """n_layers layers of `_layer` (`layers.0`, ...), then `norm` if final_norm (None: as norm_first), built by
    `tfm_common.doors.StackDoor.__init__`."""

    _parts = _Layer._parts

    _cacheless_backwards = ("backward",)  # the layers keep the caches


class Encoder(_Stack):
    """A stack of `n_layers` EncoderLayers (`layers.0`, `layers.1`, ...), then `norm` (a LayerNorm) if final_norm.

    final_norm=None means "as norm_first": on for Pre-LN (whose residual stream is never normalized otherwise),
    off for Post-LN (whose last layer already ends with a LayerNorm). `attention_weights()` lists each layer's
    self-attention weights (B, H, S, S) from the last forward.
    """

    _layer = EncoderLayer

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


class Decoder(_Stack):
    """A stack of `n_layers` DecoderLayers, every one attending to the same `memory`, then an optional `norm`.

    forward(x, memory, tgt_mask, memory_mask) -> (B, T, d); backward(dy) -> (dx, dmemory), where dmemory sums
    the gradients from every layer's cross-attention. final_norm as in `Encoder`.
    """

    _layer = DecoderLayer

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


# a wrong argument is refused in the name of the class built, not of its door; the dtype is float32 by default
for _cls in (EncoderLayer, DecoderLayer, Encoder, Decoder):
    own_init(_cls, dtype=np.float32)
