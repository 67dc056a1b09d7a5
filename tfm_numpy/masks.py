"""Masks and the checks of attention's inputs, NumPy track.

Masks are boolean and `True` means "may attend". A padding mask has shape `(B, 1, 1, Tk)`, a causal
mask `(1, 1, T, T)`; both broadcast against the scores `(B, H, Tq, Tk)`. (`torch.nn.MultiheadAttention`
uses the opposite meaning, True = "may NOT attend"; convert at that boundary with `~mask`.)

A mask gives every axis of the scores it is used with (sizes 1 to broadcast), or is a (Tk,) mask of keys for every
row: with fewer axes broadcasting aligns it from the right, and a (B, Tk) padding mask would silently be read as
(Tq, Tk) whenever Tq == B (`check_mask` refuses it, `tfm_common.validate.check_mask_axes`).
"""

from __future__ import annotations

import numpy as np

from tfm_common.rolling_cache import check_window_options, window_allowed
from tfm_common.validate import behind_door, check_mask_axes, check_size

from .module import FLOAT_DTYPES

__all__ = ["padding_mask", "causal_mask", "band_mask", "decoder_mask", "check_mask", "check_qkv"]


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


def _check_padding_mask(tokens, pad_id) -> None:
    """padding_mask's door: pad_id a token id, an int >= 0 (None or a float would mask nothing, silently)."""
    check_size("padding_mask", "pad_id", pad_id, minimum=0)


padding_mask = behind_door(padding_mask, _check_padding_mask)  # the printed body stays the lesson


def causal_mask(T: int) -> np.ndarray:
    """(1, 1, T, T) bool, lower triangular: query i may attend to keys 0..i, never to the future."""
    if T < 1:
        raise ValueError(f"causal_mask: T must be positive, got {T}")
    return np.tril(np.ones((T, T), dtype=bool))[None, None]


def band_mask(T: int, window: int, sinks: int = 0) -> np.ndarray:
    """(1, 1, T, T) bool, a causal band: query i may attend to keys i - window + 1 .. i (the last `window`
    positions, itself included) and to the first `sinks` positions (chapter 21c). window >= T is `causal_mask(T)`."""
    i = np.arange(T)
    return window_allowed(i[:, None], i[None, :], window, sinks)[None, None]  # k <= q, q - k < window or k < sinks


def _check_band_mask(T, window, sinks=0) -> None:
    check_size("band_mask", "T", T)
    if window is None:
        raise TypeError("band_mask: window expected an int >= 1, got None")
    check_window_options("band_mask", window, sinks)


band_mask = behind_door(band_mask, _check_band_mask)


def decoder_mask(tgt_tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """The decoder's self-attention mask: causal AND not padding. (B, T) tokens -> (B, 1, T, T) bool."""
    return padding_mask(tgt_tokens, pad_id) & causal_mask(np.shape(tgt_tokens)[1])


def check_mask(mask, scores_shape: tuple[int, ...]) -> None:
    """A boolean array that broadcasts to the scores' shape (..., Tq, Tk) without growing it, along the
    right axes (`check_mask_axes`)."""
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
        got = f"dtype {mask.dtype}" if isinstance(mask, np.ndarray) else type(mask).__name__
        raise TypeError(f"mask: expected a boolean numpy array (True = may attend), got {got}; use mask.astype(bool)")
    try:
        ok = np.broadcast_shapes(mask.shape, scores_shape) == scores_shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"mask: shape {mask.shape} does not broadcast to the attention scores' shape {scores_shape}")
    check_mask_axes(mask.shape, scores_shape)


def check_qkv(q, k, v=None, *, mask=None, name: str = "scaled_dot_product_attention") -> None:
    """Attention's inputs: float arrays of one dtype, q/k sizes equal, keys and values paired; the mask, if given,
    against the scores (..., Tq, Tk). `name`: the function the messages name."""
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
    if k.shape[-2] == 0:  # softmax over no keys: nothing to normalize (one rule for the explicit and tiled kernels)
        raise ValueError(f"{name}: k must hold at least one key (Tk >= 1), got k {k.shape}")
    if mask is not None:
        check_mask(mask, (*q.shape[:-1], k.shape[-2]))
