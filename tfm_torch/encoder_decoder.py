"""Encoder and decoder layers and their stacks, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.encoder_decoder; autograd does the backward.

    norm_first=False (Post-LN, the paper):  x = norm(x + dropout(sublayer(x)))
    norm_first=True  (Pre-LN):              x = x + dropout(sublayer(norm(x)))

dropout_place="after_norm" (chapter 16a) builds `DropoutAfterNormEncoderLayer` (`...DecoderLayer`), as tfm_numpy's.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tfm_common.config import own_init
from tfm_common.doors import DecoderLayerDoor, EncoderLayerDoor, StackDoor
from tfm_common.pitfalls import DROPOUT_PLACES

from .attention import make_attention
from .layers import Dropout, LayerNorm
from .masks import check_mask
from .module import Module, as_generator, check_dtype, check_input
from .sublayers import PositionwiseFeedForward

__all__ = ["DROPOUT_PLACES", "EncoderLayer", "DecoderLayer", "DropoutAfterNormEncoderLayer",
           "DropoutAfterNormDecoderLayer", "Encoder", "Decoder"]  # fmt: skip


class _Layer(Module):
    """What an encoder and a decoder layer share: the door's checks and the building blocks of their constructor
    (`tfm_common.doors.LayerDoor.__init__`: self_attn, the decoder's cross_attn, ff, norm1, ..., dropout1, ...)."""

    _check_float, _check_mask = staticmethod(check_input), staticmethod(check_mask)  # the door's checks
    _owner, _cross = "EncoderLayer", False
    _parts = SimpleNamespace(check_dtype=check_dtype, as_rng=as_generator, make_attention=make_attention,
                             Dropout=Dropout, LayerNorm=LayerNorm, PositionwiseFeedForward=PositionwiseFeedForward,
                             ModuleList=nn.ModuleList)  # fmt: skip

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
    """n_layers layers of `_layer` (`layers.0`, ...), then `norm` if final_norm (None: as norm_first), built by
    `tfm_common.doors.StackDoor.__init__`."""

    _parts = _Layer._parts


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


# a wrong argument is refused in the name of the class built, not of its door
for _cls in (EncoderLayer, DecoderLayer, Encoder, Decoder):
    own_init(_cls)
