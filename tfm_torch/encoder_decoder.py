"""Encoder and decoder layers and their stacks, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.encoder_decoder; autograd does the backward.

    norm_first=False (Post-LN, the paper):  x = norm(x + dropout(sublayer(x)))
    norm_first=True  (Pre-LN):              x = x + dropout(sublayer(norm(x)))

dropout_place="after_norm" (chapter 16a) builds `DropoutAfterNormEncoderLayer` (`...DecoderLayer`), as tfm_numpy's.
"""

from __future__ import annotations

import torch
from torch import nn

from tfm_common.config import FF_ACTIVATIONS, own_init
from tfm_common.doors import DecoderLayerDoor, EncoderLayerDoor, StackDoor
from tfm_common.pitfalls import DROPOUT_PLACES
from tfm_common.validate import check_choice, check_flag, check_sizes

from .attention import make_attention
from .layers import Dropout, LayerNorm
from .masks import check_mask
from .module import Module, as_generator, check_dtype, check_input
from .sublayers import PositionwiseFeedForward

__all__ = ["DROPOUT_PLACES", "EncoderLayer", "DecoderLayer", "DropoutAfterNormEncoderLayer",
           "DropoutAfterNormDecoderLayer", "Encoder", "Decoder"]  # fmt: skip


class _Layer(Module):
    """The construction an encoder and a decoder layer share: self_attn (and the decoder's cross_attn), ff, and per
    sublayer one LayerNorm (norm1, ...) and one residual Dropout (dropout1, ...), registered in that order."""

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    _owner, _cross = "EncoderLayer", False

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
        dtype=None,
    ):
        super().__init__()
        check_sizes(self._owner, d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        check_choice(self._owner, "activation", activation, FF_ACTIVATIONS)
        self._options(self._owner, norm_first, dropout_place, ff_dropout)
        dt, gen = check_dtype(dtype), as_generator(rng)
        attn = dict(score_scale=score_scale, rng=gen, dtype=dt)
        self.self_attn = make_attention(head_projection, d_model, n_heads, dropout, **attn)
        if self._cross:  # the decoder's attention to the encoder's output
            self.cross_attn = make_attention(head_projection, d_model, n_heads, dropout, **attn)
        ff_p = dropout if self.ff_dropout else 0.0  # ff_dropout=False (chapter 16a): none on the hidden units
        self.ff = PositionwiseFeedForward(d_model, d_ff, ff_p, activation, rng=gen, dtype=dt)
        n_sublayers = 3 if self._cross else 2
        for i in range(1, n_sublayers + 1):
            setattr(self, f"norm{i}", LayerNorm(d_model, dtype=dt))
        for i in range(1, n_sublayers + 1):  # on sublayer i's output, before the residual sum
            setattr(self, f"dropout{i}", Dropout(dropout, rng=gen))

    # -- the self-attention sublayer, the same in both layers -----------------------------------------------------
    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.dropout1(self.self_attn(x, x, x, mask))


class EncoderLayer(EncoderLayerDoor, _Layer):
    """Self-attention, then feed-forward, each in a residual connection with a LayerNorm (twin of tfm_numpy's)."""

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask))
            x = self.norm2(x + self._ff_block(x))
        return x  # (B, S, d)

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.ff(x))


class DecoderLayer(DecoderLayerDoor, _Layer):
    """Masked self-attention, cross-attention to `memory`, feed-forward; each in a residual connection with a
    LayerNorm (twin of tfm_numpy's)."""

    _owner, _cross = "DecoderLayer", True

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
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
        x: torch.Tensor,
        memory: torch.Tensor,
        cache: dict,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` for the new target positions x (B, Tn, d) only, the earlier ones' keys and values read from
        `cache` (as tfm_numpy's; inference only)."""
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

    def _sa_block_step(self, x: torch.Tensor, mask: torch.Tensor | None, cache: dict) -> torch.Tensor:
        return self.dropout1(self.self_attn.forward_step(x, x, x, cache, mask))  # new keys/values appended

    def _mha_block_step(self, x, memory, mask, cache: dict) -> torch.Tensor:
        return self.dropout2(self.cross_attn.forward_step(x, memory, memory, cache, mask, static=True))

    def _mha_block(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.dropout2(self.cross_attn(x, memory, memory, mask))  # queries x, keys and values memory

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout3(self.ff(x))


# -- chapter 16a's pitfall: the residual dropout after the LayerNorm -------------------------------------------------
class DropoutAfterNormEncoderLayer(EncoderLayer):
    """`EncoderLayer(..., dropout_place="after_norm")` (Post-LN only): x = dropout(norm(x + sublayer(x)))."""

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.dropout1(self.norm1(x + self.self_attn(x, x, x, src_mask)))
        return self.dropout2(self.norm2(x + self.ff(x)))  # (B, S, d)


class DropoutAfterNormDecoderLayer(DecoderLayer):
    """`DecoderLayer(..., dropout_place="after_norm")` (Post-LN only), as DropoutAfterNormEncoderLayer."""

    def forward(self, x, memory, tgt_mask=None, memory_mask=None) -> torch.Tensor:
        x = self.dropout1(self.norm1(x + self.self_attn(x, x, x, tgt_mask)))
        x = self.dropout2(self.norm2(x + self.cross_attn(x, memory, memory, memory_mask)))
        return self.dropout3(self.norm3(x + self.ff(x)))  # (B, T, d)

    def forward_step(self, x, memory, cache: dict, tgt_mask=None, memory_mask=None) -> torch.Tensor:
        sa, ca = cache.setdefault("self_attn", {}), cache.setdefault("cross_attn", {})
        x = self.dropout1(self.norm1(x + self.self_attn.forward_step(x, x, x, sa, tgt_mask)))
        x = self.dropout2(self.norm2(x + self.cross_attn.forward_step(x, memory, memory, ca, memory_mask, static=True)))
        return self.dropout3(self.norm3(x + self.ff(x)))  # (B, Tn, d)


EncoderLayer._after_norm, DecoderLayer._after_norm = DropoutAfterNormEncoderLayer, DropoutAfterNormDecoderLayer


class _Stack(StackDoor, Module):
    """n_layers layers of `_layer` (`layers.0`, ...), then `norm` if final_norm (None: as norm_first)."""

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
        dtype=None,
        **layer_options,
    ):
        super().__init__()
        owner, make = type(self).__name__, self._layer
        check_sizes(owner, n_layers=n_layers)
        final_norm = check_flag(owner, "final_norm", norm_first if final_norm is None else final_norm)
        dt, gen = check_dtype(dtype), as_generator(rng)
        self.layers = nn.ModuleList(
            make(d_model, n_heads, d_ff, dropout, activation, norm_first, rng=gen, dtype=dt, **layer_options)
            for _ in range(n_layers)
        )
        self.norm = LayerNorm(d_model, dtype=dt) if final_norm else None


class Encoder(_Stack):
    """`n_layers` EncoderLayers (`layers.0`, ...), then `norm` if final_norm (None: as norm_first)."""

    _layer = EncoderLayer

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)  # (B, S, d)
        return self.norm(x) if self.norm is not None else x

    def attention_weights(self) -> list[torch.Tensor]:
        """[(B, H, S, S) per layer]: the self-attention weights of the last forward (detached)."""
        return [layer.self_attn.attn_weights for layer in self.layers]


class Decoder(_Stack):
    """`n_layers` DecoderLayers, every one attending to the same `memory`, then `norm` if final_norm."""

    _layer = DecoderLayer

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory, tgt_mask, memory_mask)  # (B, T, d)
        return self.norm(x) if self.norm is not None else x

    def forward_step(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        caches: list[dict],
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` for new target positions only, with one key/value cache per layer (see DecoderLayer)."""
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer.forward_step(x, memory, cache, tgt_mask, memory_mask)  # (B, Tn, d)
        return self.norm(x) if self.norm is not None else x

    def attention_weights(self, kind: str = "self") -> list[torch.Tensor]:
        """[(B, H, T, T) per layer] for kind="self", [(B, H, T, S) per layer] for kind="cross"."""
        if kind not in ("self", "cross"):
            raise ValueError(f"Decoder.attention_weights: kind must be 'self' or 'cross', got {kind!r}")
        return [(layer.self_attn if kind == "self" else layer.cross_attn).attn_weights for layer in self.layers]


for _cls in (EncoderLayer, DecoderLayer, Encoder, Decoder):
    own_init(_cls)  # a wrong argument is refused in the name of the class built, not of _Layer / _Stack
