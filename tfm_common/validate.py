"""Argument checks shared by both tracks: one rule for sizes, flags and options, so the tracks accept and refuse
the same things. No NumPy array or torch tensor is checked here (each track checks its own inputs); these are the
constructor's plain Python arguments.

Python ints and NumPy integers are accepted as sizes alike (`np.int64(8)` is a size; `8.0`, `True` and `"8"` are
not): a size read off an array's shape is a NumPy integer, and refusing it would be pedantry, while a float size is
almost always a bug (`d_model / n_heads`).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["check_size", "check_sizes", "check_flag", "check_choice", "check_seed", "check_real", "check_real_arg",
           "check_adam_args", "normalized_shape", "check_decode_cache"]  # fmt: skip


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_size(owner: str, arg: str, value, minimum: int = 1) -> int:
    """An integer size >= `minimum`, returned as a Python int; the message names owner, argument and value."""
    if not _is_int(value):
        raise TypeError(f"{owner}: {arg} expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {arg} must be an int >= {minimum}, got {value!r}")
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


def check_real(owner: str, arg: str, value, low: float | None = None, high: float | None = None) -> float:
    """A finite real number (not a bool) in [low, high] where given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise TypeError(f"{owner}: {arg} expected a finite float, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{owner}: {arg} must be in [{low}, {high}], got {value!r}")
    return float(value)


def check_real_arg(name: str, arg: str, value, low: float, high: float | None = None, high_open=True) -> float:
    """A finite real number (not a bool) >= low, and below (or up to) high where given; the optimizers' rule."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: {arg} expected a float, got {type(value).__name__}")
    ok = low <= value and (high is None or (value < high if high_open else value <= high)) and math.isfinite(value)
    if not ok:
        bound = f"[{low}, {high})" if high is not None else f">= {low} and finite"
        raise ValueError(f"{name}: {arg} must be {'in ' if high is not None else ''}{bound}, got {value}")
    return float(value)


def check_adam_args(name: str, lr, betas, eps, weight_decay) -> tuple[float, tuple[float, float], float, float]:
    """Adam's arguments, checked alike in both tracks: lr >= 0, betas a pair in [0, 1), eps >= 0, weight_decay >= 0."""
    lr = check_real_arg(name, "lr", lr, 0.0)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name}: betas expected a pair (beta1, beta2), got {betas!r}")
    betas = tuple(check_real_arg(name, f"betas[{i}]", b, 0.0, 1.0) for i, b in enumerate(betas))
    return lr, betas, check_real_arg(name, "eps", eps, 0.0), check_real_arg(name, "weight_decay", weight_decay, 0.0)


def normalized_shape(owner: str, value) -> tuple[int, ...]:
    """A LayerNorm's normalized_shape: an int or a non-empty sequence of ints, each >= 1, as a tuple of ints."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{owner}: normalized_shape must not be empty")
        return tuple(check_size(owner, f"normalized_shape[{i}]", n) for i, n in enumerate(value))
    return (check_size(owner, "normalized_shape", value),)


def check_decode_cache(cache, batch: int) -> None:
    """Transformer.decode_step's cache (either track): a dict, empty at the first step, then of one batch size."""
    if not isinstance(cache, dict):
        raise TypeError(
            f"Transformer.decode_step: cache expected a dict (empty at the first step), got {type(cache).__name__}"
        )
    if "keep" in cache and cache["keep"].shape[0] != batch:
        raise ValueError(
            f"Transformer.decode_step: the cache holds {cache['keep'].shape[0]} sequences, tgt_new has {batch}: "
            "start a new cache ({}) for another batch, or select rows with reorder_cache"
        )
