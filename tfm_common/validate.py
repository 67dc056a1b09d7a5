"""Argument checks shared by both tracks: one rule for sizes, flags and options, so the tracks accept and refuse
the same things. No NumPy array or torch tensor is checked here (each track checks its own inputs); these are the
constructor's plain Python arguments.

Python ints and NumPy integers are accepted as sizes alike (`np.int64(8)` is a size; `8.0`, `True` and `"8"` are
not): a size read off an array's shape is a NumPy integer, and refusing it would be pedantry, while a float size is
almost always a bug (`d_model / n_heads`).
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

__all__ = ["check_size", "check_sizes", "check_flag", "check_choice", "check_seed", "check_real", "check_probability",
           "check_padding_idx", "check_positions", "check_adam_args", "normalized_shape",
           "check_decode_cache", "decreed_zero_rows", "check_mask_axes",
           "behind_door", "check_fill", "check_rope_tables",
           "check_int", "check_window_count"]  # fmt: skip


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_size(
    owner: str, arg: str, value, minimum: int = 1, *, allow_none: bool = False, wrong_type=TypeError, say_int=True
) -> int | None:
    """The one integer check: an int (Python or NumPy, not a bool) >= `minimum`, returned as a Python int.

    The exception policy: a value below `minimum` raises ValueError; a value that is not an int raises
    `wrong_type`, TypeError everywhere except the decoding functions' arguments (greedy_decode's max_len,
    beam_search's beam_size, ...), which have always raised ValueError for both (`wrong_type=ValueError`).
    `allow_none` lets None through (returned as None). The ValueError says "must be an int >= 1" (sizes, decoding)
    or, with `say_int=False`, "must be >= 1" (the data and training helpers' counts: their TypeError says "int").
    """
    if value is None and allow_none:
        return None
    if not _is_int(value) and wrong_type is ValueError:
        raise ValueError(f"{owner}: {arg} must be an int >= {minimum}, got {value!r}")
    if not _is_int(value):
        none = " or None" if allow_none else ""
        raise TypeError(f"{owner}: {arg} expected an int{none}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {arg} must be {'an int ' if say_int else ''}>= {minimum}, got {value!r}")
    return int(value)


def check_sizes(owner: str, minimum: int = 1, **sizes) -> dict[str, int]:
    """`check_size` for several keyword arguments at once: {arg: int}."""
    return {arg: check_size(owner, arg, value, minimum) for arg, value in sizes.items()}


def check_flag(owner: str, arg: str, value) -> bool:
    """True or False (Python or NumPy bool); 0, 1 and None are refused: a flag is not a number."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}: {arg} expected True or False, got {value!r}")
    return bool(value)


def check_choice(owner: str, arg: str, value, choices) -> str:
    """One of a fixed set of option strings."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {arg} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_seed(owner: str, value) -> int:
    """A non-negative integer seed (Python or NumPy int), returned as a Python int."""
    if not _is_int(value):
        raise TypeError(f"{owner}: expected a numpy.random.Generator/torch.Generator, an int seed or None, "
                        f"got {type(value).__name__}")  # fmt: skip
    if value < 0:
        raise ValueError(f"{owner}: a seed must be >= 0, got {value!r}")
    return int(value)


def check_real(
    owner: str, arg: str, value, low=None, high=None, *, high_open: bool = False, nonfinite=TypeError
) -> float:
    """The one real-number check: a finite real number (not a bool) in [low, high] (or [low, high) with
    `high_open`) where the bounds are given, returned as a float.

    The exception policy: a value that is not a real number raises TypeError, one out of range ValueError; a
    non-finite one (nan, inf) raises `nonfinite`: TypeError for the constructors' constants (eps, base, timeout,
    ...), ValueError for the optimizers' arguments and probabilities (`check_adam_args`, `check_probability`), as
    each always has. Bounds print as given: pass 0 and 1 to read "[0, 1)".
    """
    finite_word = "finite " if nonfinite is TypeError else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {arg} expected a {finite_word}float, got {type(value).__name__} {value!r}")
    if not np.isfinite(value) and nonfinite is TypeError:
        raise TypeError(f"{owner}: {arg} expected a finite float, got {value!r}")
    above = high is None or (value < high if high_open else value <= high)
    if not (np.isfinite(value) and (low is None or low <= value) and above):
        lower = "(-inf" if low is None else f"[{low}"
        upper = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        raise ValueError(f"{owner}: {arg} must be in {lower}, {upper}, got {value}")
    return float(value)


def check_probability(owner: str, arg: str, p, allow_one: bool) -> float:
    """A probability in [0, 1) (a dropout rate) or [0, 1] (label smoothing); the message names the argument."""
    return check_real(owner, arg, p, 0, 1, high_open=not allow_one, nonfinite=ValueError)


def check_padding_idx(owner: str, padding_idx, num_embeddings: int) -> int | None:
    """torch's rule: padding_idx None, or an int in [-num_embeddings, num_embeddings), negative counting from the
    end; returned as the row it names (in [0, num_embeddings))."""
    if padding_idx is None:
        return None
    if not _is_int(padding_idx):
        raise TypeError(f"{owner}: padding_idx expected an int or None, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"{owner}: padding_idx must be in [-{num_embeddings}, {num_embeddings}), got {padding_idx}")
    return int(padding_idx) % num_embeddings


def check_positions(owner: str, T: int, offset: int, max_len: int) -> None:
    """Positions offset .. offset + T - 1 of a table of max_len (a positional encoding's, read at `offset`)."""
    if offset < 0:
        raise ValueError(f"{owner}: offset must be >= 0, got {offset}")
    if offset + T > max_len:
        start = f" starting at position {offset}" if offset else ""
        raise ValueError(f"{owner}: sequence length {T}{start} exceeds max_len {max_len}")


def check_adam_args(name: str, lr, betas, eps, weight_decay) -> tuple[float, tuple[float, float], float, float]:
    """Adam's arguments, checked alike in both tracks: lr >= 0, betas a pair in [0, 1), eps >= 0, weight_decay >= 0."""
    real = dict(nonfinite=ValueError)
    lr = check_real(name, "lr", lr, 0.0, **real)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name}: betas expected a pair (beta1, beta2), got {betas!r}")
    betas = tuple(check_real(name, f"betas[{i}]", b, 0.0, 1.0, high_open=True, **real) for i, b in enumerate(betas))
    eps, weight_decay = (
        check_real(name, "eps", eps, 0.0, **real),
        check_real(name, "weight_decay", weight_decay, 0.0, **real),
    )
    return lr, betas, eps, weight_decay


def normalized_shape(owner: str, value) -> tuple[int, ...]:
    """A LayerNorm's normalized_shape: an int or a non-empty sequence of ints, each >= 1, as a tuple of ints."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{owner}: normalized_shape must not be empty")
        return tuple(check_size(owner, f"normalized_shape[{i}]", n) for i, n in enumerate(value))
    return (check_size(owner, "normalized_shape", value),)


def check_decode_cache(cache, batch: int, n_layers: int | None = None, heads: int | None = None,
                       d_head: int | None = None) -> None:  # fmt: skip
    """Transformer.decode_step's cache (either track): a dict, empty at the first step, then of one batch size; where
    the model's n_layers, heads and d_head are given, filled by a model of those (one self-attention cache per layer,
    keys (B, heads, length, d_head)), so that another model's cache is refused before anything is appended."""
    if not isinstance(cache, dict):
        raise TypeError(
            f"Transformer.decode_step: cache expected a dict (empty at the first step), got {type(cache).__name__}"
        )
    if "keep" in cache and cache["keep"].shape[0] != batch:
        raise ValueError(
            f"Transformer.decode_step: the cache holds {cache['keep'].shape[0]} sequences, tgt_new has {batch}: "
            "start a new cache ({}) for another batch, or select rows with reorder_cache"
        )
    if n_layers is None or "layers" not in cache:
        return
    layers, length = cache["layers"], cache.get("length", 0)
    if not isinstance(layers, list) or len(layers) != n_layers:
        got = f"{len(layers)} layers" if isinstance(layers, list) else f"layers {type(layers).__name__}"
        raise ValueError(f"Transformer.decode_step: the cache holds {got}, this model has {n_layers}: a cache from "
                         "another model; start a new cache ({})")  # fmt: skip
    want = (batch, heads, length, d_head)
    for i, layer in enumerate(layers):
        k = layer.get("self_attn", {}).get("k") if isinstance(layer, dict) else None
        if k is not None and tuple(k.shape) != want:
            raise ValueError(f"Transformer.decode_step: layer {i} of the cache holds keys {tuple(k.shape)}, expected "
                             f"(B, n_heads, length, d_head) = {want}: a cache from another model; start a new cache "
                             "({})")  # fmt: skip


def decreed_zero_rows(module) -> dict[str, int]:
    """{parameter name: row} for every Embedding-like submodule with a padding_idx (grad_check of both tracks)."""
    names = {id(p): n for n, p in module.named_parameters()}
    rows = {}
    for _, m in module.named_modules():
        if getattr(m, "padding_idx", None) is not None and id(getattr(m, "weight", None)) in names:
            rows[names[id(m.weight)]] = m.padding_idx
    return rows


def check_mask_axes(mask_shape: tuple[int, ...], scores_shape: tuple[int, ...]) -> None:
    """A mask (broadcasting to the scores) names its axes: as many dimensions as the scores (..., Tq, Tk), or one,
    (Tk,), the same keys for every row. With fewer, broadcasting aligns the mask from the right, and a (B, Tk) padding
    mask would be read as (Tq, Tk) whenever Tq == B: silently the wrong axis. Both tracks' check_mask call this."""
    if len(mask_shape) not in (1, len(scores_shape)):
        raise ValueError(
            f"mask: shape {tuple(mask_shape)} has {len(mask_shape)} dimensions, the attention scores "
            f"{tuple(scores_shape)} have {len(scores_shape)}: give every axis (size 1 to broadcast), e.g. "
            "(B, 1, 1, Tk) for padding or (1, 1, Tq, Tk) for a causal mask, or a (Tk,) mask for every row"
        )


def behind_door(func, check):
    """`func` with its checks in front: `check(*args, **kwargs)` runs, then `func(*args, **kwargs)`. For a public
    function a chapter prints (padding_mask, apply_rope, attention_weights): its printed body keeps the math alone,
    since `show_source` (inspect.getsource) and tests/test_printed_methods.py follow `__wrapped__` to it."""

    @functools.wraps(func)
    def door(*args, **kwargs):
        check(*args, **kwargs)
        return func(*args, **kwargs)

    return door


def check_fill(owner: str, fill) -> None:
    """attention_weights' `fill` (the book's experiment): None, or the number masked scores become (-1e9, -1e4,
    -inf): a real number, not NaN and not +inf (either would make every masked row NaN or all-masked)."""
    if fill is None:
        return
    if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, numbers.Real):
        raise TypeError(f"{owner}: fill expected None or a float such as -1e9 or float('-inf'), got "
                        f"{type(fill).__name__} {fill!r}")  # fmt: skip
    if np.isnan(fill) or fill == np.inf:
        raise ValueError(f"{owner}: fill must be a number below +inf such as -1e9 or float('-inf'), got {fill}")


def check_rope_tables(owner: str, x_shape: tuple[int, ...], cos_shape: tuple[int, ...], sin_shape: tuple[int, ...]):
    """apply_rope's shapes: x (..., T, d) with d even, cos and sin (T, d/2) exactly, one angle per position and pair:
    a table of another length would broadcast (one of length 1 turns every position by position 0's angles)."""
    T, d = x_shape[-2], x_shape[-1]
    if d % 2:
        raise ValueError(f"{owner}: x's last dimension must be even (its columns rotate in pairs), got shape {x_shape}")
    for arg, shape in (("cos", cos_shape), ("sin", sin_shape)):
        if tuple(shape) != (T, d // 2):
            raise ValueError(
                f"{owner}: {arg} expected shape ({T}, {d // 2}) (x's T positions, d/2 pairs), got {tuple(shape)}; "
                f"take the table's rows of x's positions, e.g. {arg}[offset : offset + T]"
            )


def check_int(owner: str, arg: str, value) -> int:
    """An int of either sign (Python or NumPy, not a bool): a shift, say. Returned as a Python int."""
    if not _is_int(value):
        raise TypeError(f"{owner}: {arg} expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_window_count(owner: str, shape: tuple[int, ...], window_size: int, H: int, W: int) -> None:
    """window_reverse's windows (B nW, M M, C) for an H x W grid (a checked one): M M tokens each, and a whole number
    of images of nW = (H/M)(W/M) windows. (An H and W of another nW that still divides the count cannot be told
    from another batch size: the result then has B nW / nW' images.)"""
    M, nW = window_size, (H // window_size) * (W // window_size)
    if len(shape) != 3 or shape[1] != M * M:
        raise ValueError(f"{owner}: windows expected shape (B nW, {M * M}, C) for window_size={M}, got {tuple(shape)}")
    if shape[0] % nW:
        raise ValueError(
            f"{owner}: {shape[0]} windows are not a whole number of {H}x{W} grids of nW={nW} windows each "
            f"(window_size={M}); pass the H and W that window_partition was given"
        )
