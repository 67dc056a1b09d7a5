"""Encoder and decoder layers and their stacks, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.encoder_decoder; autograd does the backward.

    norm_first=False (Post-LN, the paper):  x = norm(x + dropout(sublayer(x)))
    norm_first=True  (Pre-LN):              x = x + dropout(sublayer(norm(x)))
"""

from __future__ import annotations

import torch
from torch import nn

from tfm_common.pitfalls import DROPOUT_PLACES
from tfm_common.validate import check_choice, check_flag, check_sizes

from .attention import make_attention
from .layers import Dropout, LayerNorm
from .module import Module, as_generator, check_dtype, check_input
from .sublayers import PositionwiseFeedForward, check_activation

__all__ = ["DROPOUT_PLACES", "EncoderLayer", "DecoderLayer", "Encoder", "Decoder"]


def _check_bool(owner: str, arg: str, value) -> bool:
    return check_flag(owner, arg, value)


def _check_positive(owner: str, **sizes) -> dict[str, int]:
    return check_sizes(owner, **sizes)


def _check_x(name: str, x, norm: LayerNorm) -> None:
    """A (B, T, d_model) float tensor of the parameters' dtype (read off a LayerNorm of the layer)."""
    check_input(name, x, ndim_min=3, last_dim=norm.normalized_shape[0], dtype=norm.weight.dtype)
    if x.dim() != 3:
        raise ValueError(f"{name}: expected shape (B, T, d_model), got {tuple(x.shape)}")


def _check_options(owner: str, norm_first: bool, dropout_place, ff_dropout) -> tuple[str, bool]:
    """The layer's pitfall options (as tfm_numpy's): residual dropout place, FFN hidden dropout."""
    dropout_place = check_choice(owner, "dropout_place", dropout_place, DROPOUT_PLACES)
    if norm_first and dropout_place == "after_norm":
        raise ValueError(f"{owner}: dropout_place='after_norm' needs Post-LN (norm_first=False), got norm_first=True")
    return dropout_place, check_flag(owner, "ff_dropout", ff_dropout)


class _Residual(Module):
    """Where a layer's residual dropout goes: on the sublayer's output (`_sub`) or after the LayerNorm (`_post`)."""

    def _sub(self, drop: Dropout, y: torch.Tensor) -> torch.Tensor:
        return drop(y) if self.dropout_place == "sublayer" else y

    def _post(self, drop: Dropout, y: torch.Tensor) -> torch.Tensor:
        return drop(y) if self.dropout_place == "after_norm" else y

    def _options_repr(self) -> str:
        opts = {"dropout_place": (self.dropout_place, "sublayer"), "ff_dropout": (self.ff_dropout, True)}
        return "".join(f", {k}={v!r}" for k, (v, default) in opts.items() if v != default)


class EncoderLayer(_Residual):
    """Self-attention, then feed-forward, each in a residual connection with a LayerNorm (twin of tfm_numpy's)."""

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
        _check_positive("EncoderLayer", d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        check_activation("EncoderLayer", activation)
        self.norm_first = _check_bool("EncoderLayer", "norm_first", norm_first)
        self.dropout_place, self.ff_dropout = _check_options("EncoderLayer", norm_first, dropout_place, ff_dropout)
        dt, g = check_dtype(dtype), as_generator(rng)
        attn = dict(score_scale=score_scale, rng=g, dtype=dt)
        self.self_attn = make_attention(head_projection, d_model, n_heads, dropout, **attn)
        ff = dict(hidden_dropout=ff_dropout, rng=g, dtype=dt)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation, **ff)
        self.norm1 = LayerNorm(d_model, dtype=dt)
        self.norm2 = LayerNorm(d_model, dtype=dt)
        self.dropout1 = Dropout(dropout, rng=g)
        self.dropout2 = Dropout(dropout, rng=g)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        _check_x("EncoderLayer: x", x, self.norm1)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self._post(self.dropout1, self.norm1(x + self._sa_block(x, src_mask)))
            x = self._post(self.dropout2, self.norm2(x + self._ff_block(x)))
        return x  # (B, S, d)

    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self._sub(self.dropout1, self.self_attn(x, x, x, mask))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self._sub(self.dropout2, self.ff(x))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}{self._options_repr()}"


class DecoderLayer(_Residual):
    """Masked self-attention, cross-attention to `memory`, feed-forward; each in a residual connection with a
    LayerNorm (twin of tfm_numpy's)."""

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
        _check_positive("DecoderLayer", d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        check_activation("DecoderLayer", activation)
        self.norm_first = _check_bool("DecoderLayer", "norm_first", norm_first)
        self.dropout_place, self.ff_dropout = _check_options("DecoderLayer", norm_first, dropout_place, ff_dropout)
        dt, g = check_dtype(dtype), as_generator(rng)
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
        x: torch.Tensor,
        memory: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_x("DecoderLayer: x", x, self.norm1)
        _check_x("DecoderLayer: memory", memory, self.norm1)
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
        x: torch.Tensor,
        memory: torch.Tensor,
        cache: dict,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` for the new target positions x (B, Tn, d) only, the earlier ones' keys and values read from
        `cache` (as tfm_numpy's; inference only)."""
        _check_x("DecoderLayer: x", x, self.norm1)
        _check_x("DecoderLayer: memory", memory, self.norm1)
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

    def _sa_block_step(self, x: torch.Tensor, mask: torch.Tensor | None, cache: dict) -> torch.Tensor:
        return self._sub(self.dropout1, self.self_attn.forward_step(x, x, x, cache, mask))  # new keys/values appended

    def _mha_block_step(self, x, memory, mask, cache: dict) -> torch.Tensor:
        return self._sub(self.dropout2, self.cross_attn.forward_step(x, memory, memory, cache, mask, static=True))

    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self._sub(self.dropout1, self.self_attn(x, x, x, mask))

    def _mha_block(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self._sub(self.dropout2, self.cross_attn(x, memory, memory, mask))  # queries x, keys and values memory

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self._sub(self.dropout3, self.ff(x))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}{self._options_repr()}"


class Encoder(Module):
    """`n_layers` EncoderLayers (`layers.0`, ...), then `norm` if final_norm (None: as norm_first)."""

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
        _check_positive("Encoder", n_layers=n_layers)
        final_norm = _check_bool("Encoder", "final_norm", norm_first if final_norm is None else final_norm)
        dt, g = check_dtype(dtype), as_generator(rng)
        self.layers = nn.ModuleList(
            EncoderLayer(d_model, n_heads, d_ff, dropout, activation, norm_first, rng=g, dtype=dt, **layer_options)
            for _ in range(n_layers)
        )
        self.norm = LayerNorm(d_model, dtype=dt) if final_norm else None

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)  # (B, S, d)
        return self.norm(x) if self.norm is not None else x

    def attention_weights(self) -> list[torch.Tensor]:
        """[(B, H, S, S) per layer]: the self-attention weights of the last forward (detached)."""
        return [layer.self_attn.attn_weights for layer in self.layers]


class Decoder(Module):
    """`n_layers` DecoderLayers, every one attending to the same `memory`, then `norm` if final_norm."""

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
        _check_positive("Decoder", n_layers=n_layers)
        final_norm = _check_bool("Decoder", "final_norm", norm_first if final_norm is None else final_norm)
        dt, g = check_dtype(dtype), as_generator(rng)
        self.layers = nn.ModuleList(
            DecoderLayer(d_model, n_heads, d_ff, dropout, activation, norm_first, rng=g, dtype=dt, **layer_options)
            for _ in range(n_layers)
        )
        self.norm = LayerNorm(d_model, dtype=dt) if final_norm else None

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
        if len(caches) != len(self.layers):
            raise ValueError(f"Decoder.forward_step: expected {len(self.layers)} layer caches, got {len(caches)}")
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer.forward_step(x, memory, cache, tgt_mask, memory_mask)  # (B, Tn, d)
        return self.norm(x) if self.norm is not None else x

    def attention_weights(self, kind: str = "self") -> list[torch.Tensor]:
        """[(B, H, T, T) per layer] for kind="self", [(B, H, T, S) per layer] for kind="cross"."""
        if kind not in ("self", "cross"):
            raise ValueError(f"Decoder.attention_weights: kind must be 'self' or 'cross', got {kind!r}")
        return [(layer.self_attn if kind == "self" else layer.cross_attn).attn_weights for layer in self.layers]
