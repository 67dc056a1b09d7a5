"""The argument checks of the decoding searches (greedy_decode, beam_search, sequence_scores), the same in both
tracks: they read only plain Python arguments and the model's sizes, never an array or a tensor."""

from __future__ import annotations

import math
import numbers

from .validate import check_size

__all__ = ["check_search_args", "describe"]


def check_search_args(name: str, model, bos_id, eos_id, max_len=None, *, beam_size=1, alpha=0.0) -> int:
    """Special ids are tokens of the target vocabulary other than pad; max_len (where given) fits the model's
    positions; beam_size is an int >= 1 and alpha a float >= 0. Returns beam_size as an int."""
    V, pad = model.tgt_vocab_size, model.pad_id
    for arg, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < V:
            raise ValueError(f"{name}: {arg} must be a token id in [0, {V}) (the target vocabulary), got {value!r}")
        if value == pad:
            raise ValueError(f"{name}: {arg}={value} is the model's pad_id: padding is masked, it cannot be {arg}")
    if max_len is not None:
        check_size(name, "max_len", max_len, wrong_type=ValueError)
        if max_len > model.max_len:
            raise ValueError(
                f"{name}: max_len={max_len} exceeds the model's max_len={model.max_len} (the decoder reads bos and "
                f"up to max_len - 1 generated tokens, one position each)"
            )
    beam_size = check_size(name, "beam_size", beam_size, wrong_type=ValueError)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha < math.inf:
        raise ValueError(f"{name}: alpha must be a float >= 0, got {alpha!r}")
    return beam_size


def describe(x, array_type: type) -> str:
    """What an argument is, for a message: the shape and dtype of an array of the track's `array_type`, else the
    type's name."""
    return f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, array_type) else type(x).__name__
