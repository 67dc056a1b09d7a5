"""Masks and the checks of attention's inputs, PyTorch track: the twins of tfm_numpy.masks.

Masks are boolean, True = "may attend" (the opposite of `torch.nn.MultiheadAttention`'s `attn_mask` /
`key_padding_mask`; the same as the boolean `attn_mask` of `torch.nn.functional.scaled_dot_product_attention`).
A mask gives every axis of the scores (sizes 1 to broadcast) or is a (Tk,) mask of keys, as tfm_numpy.masks says.
"""

from __future__ import annotations

import numpy as np
import torch

from tfm_common.rolling_cache import check_window_options, window_allowed
from tfm_common.validate import behind_door, check_mask_axes, check_size

from .module import autocast_dtype

__all__ = ["padding_mask", "causal_mask", "band_mask", "decoder_mask", "check_mask", "check_qkv"]


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) integer tokens -> (B, 1, 1, T) torch.bool, True where the token is real (not `pad_id`)."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 2
        or tokens.is_floating_point()
        or tokens.is_complex()
        or tokens.dtype == torch.bool
    ):
        got = f"shape {tuple(tokens.shape)}, {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens)
        raise ValueError(f"padding_mask: tokens must be a (B, T) integer tensor, got {got}")
    return (tokens != pad_id)[:, None, None, :]


def _check_padding_mask(tokens, pad_id) -> None:
    """padding_mask's door: pad_id a token id, an int >= 0 (None or a float would mask nothing, silently)."""
    check_size("padding_mask", "pad_id", pad_id, minimum=0)


padding_mask = behind_door(padding_mask, _check_padding_mask)  # the printed body stays the lesson


def causal_mask(T: int, device=None) -> torch.Tensor:
    """(1, 1, T, T) torch.bool, lower triangular: query i may attend to keys 0..i."""
    if T < 1:
        raise ValueError(f"causal_mask: T must be positive, got {T}")
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def band_mask(T: int, window: int, sinks: int = 0, device=None) -> torch.Tensor:
    """(1, 1, T, T) torch.bool, a causal band of `window` keys (and the first `sinks`), as tfm_numpy.band_mask."""
    i = np.arange(T)
    return torch.from_numpy(window_allowed(i[:, None], i[None, :], window, sinks)[None, None]).to(device)


def _check_band_mask(T, window, sinks=0, device=None) -> None:
    check_size("band_mask", "T", T)
    if window is None:
        raise TypeError("band_mask: window expected an int >= 1, got None")
    check_window_options("band_mask", window, sinks)


band_mask = behind_door(band_mask, _check_band_mask)


def decoder_mask(tgt_tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The decoder's self-attention mask: causal AND not padding. (B, T) tokens -> (B, 1, T, T) torch.bool."""
    return padding_mask(tgt_tokens, pad_id) & causal_mask(tgt_tokens.shape[1], device=tgt_tokens.device)


def check_mask(mask, scores_shape: tuple[int, ...]) -> None:
    """A boolean tensor that broadcasts to the scores' shape (..., Tq, Tk) without growing it, along the
    right axes (`check_mask_axes`)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask: expected a boolean torch.Tensor (True = may attend), got {got}; use mask.bool()")
    try:
        ok = tuple(torch.broadcast_shapes(mask.shape, scores_shape)) == scores_shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask: shape {tuple(mask.shape)} does not broadcast to the attention scores' shape {scores_shape}"
        )
    check_mask_axes(tuple(mask.shape), scores_shape)


def check_qkv(q, k, v=None, *, mask=None, name: str = "scaled_dot_product_attention") -> None:
    """Attention's inputs: float tensors of one dtype, q/k sizes equal, keys and values paired; the mask, if given,
    against the scores (..., Tq, Tk). `name`: the function the messages name."""
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float64) and not autocast_dtype(x):
            raise TypeError(f"{name}: {arg} must be float32 or float64, got dtype {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: q and {arg} must share a dtype, got {q.dtype} and {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"{name}: {arg} must have at least 2 dimensions (T, d), got shape {tuple(x.shape)}")
    qs, ks = tuple(q.shape), tuple(k.shape)
    if qs[-1] != ks[-1]:
        raise ValueError(f"{name}: q and k must have the same last dimension dk, got q {qs} and k {ks}")
    if qs[:-2] != ks[:-2]:
        raise ValueError(f"{name}: q and k must have the same leading dimensions, got q {qs} and k {ks}")
    if v is not None and tuple(v.shape[:-1]) != ks[:-1]:
        raise ValueError(
            f"{name}: k and v must have the same shape but the last dim, got k {ks} and v {tuple(v.shape)}"
        )
    if ks[-2] == 0:  # softmax over no keys: nothing to normalize (one rule for the explicit and tiled kernels)
        raise ValueError(f"{name}: k must hold at least one key (Tk >= 1), got k {ks}")
    if mask is not None:
        check_mask(mask, (*qs[:-1], ks[-2]))
