"""Sampling the next token, shared by both tracks: one check of the GPT's tokens and `generate`'s arguments, and one
sampler, so that the NumPy and PyTorch GPTs accept and refuse the same things and, given the same logits and the
same seed, draw the same tokens.

Filtering order, as in Hugging Face's `generate` (its logits processors: temperature, then top-k, then top-p):
the logits are divided by the temperature, the top_k largest kept, and of those the nucleus kept: the smallest
set of the most probable tokens whose probability reaches top_p (Holtzman et al., 2020). Temperature 0 is
greedy and ignores both filters.

The sampler works on NumPy float64 logits (the torch track hands over its last position's logits, B x V numbers per
step): the random numbers come from one `numpy.random.Generator` in both tracks.
"""

from __future__ import annotations

import numbers

import numpy as np

from .validate import check_real, check_seed, check_size

__all__ = [
    "check_token_window",
    "check_generate",
    "check_top_p",
    "as_numpy_rng",
    "sample_next",
    "nucleus",
    "check_logits",
]


def check_token_window(owner: str, shape: tuple, offset: int, max_len: int) -> int:
    """Tokens of shape (B, T), T >= 1, that fit in max_len positions after `offset` cached ones; returns T."""
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"{owner}: tokens expected shape (B, T) with T >= 1, got {shape}")
    if offset + shape[1] > max_len:
        start = f" after {offset} cached positions" if offset else ""
        raise ValueError(f"{owner}: tokens has length {shape[1]}{start}, more than max_len={max_len}")
    return shape[1]


def as_numpy_rng(owner: str, rng) -> np.random.Generator:
    """A numpy Generator from a Generator, an int seed or None (seed 0: never hidden global state)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(0 if rng is None else check_seed(owner, rng))


def check_generate(owner: str, prompt_length: int, max_new_tokens, temperature, top_k, rng, vocab_size: int,
                   max_len: int, top_p=None) -> tuple:  # fmt: skip
    """`generate`'s arguments after its prompt (of `prompt_length` tokens, checked by the model): returns
    (max_new_tokens, temperature >= 0 (0: greedy), top_k None or in [1, vocab_size], a numpy Generator, top_p None
    or in (0, 1]). The last sampled token is never fed back, so a prompt of T0 tokens and n new ones need
    T0 + n - 1 positions."""
    n = check_size(owner, "max_new_tokens", max_new_tokens, minimum=0)
    temperature = check_real(owner, "temperature", temperature, low=0.0)
    if top_k is not None:
        top_k = check_size(owner, "top_k", top_k)
        if top_k > vocab_size:
            raise ValueError(f"{owner}: top_k must be <= vocab_size={vocab_size}, got {top_k}")
    top_p = check_top_p(owner, top_p)
    if prompt_length + n - 1 > max_len:
        raise ValueError(f"{owner}: a prompt of {prompt_length} tokens and max_new_tokens={n} need "
                         f"{prompt_length + n - 1} positions, more than max_len={max_len}")  # fmt: skip
    return n, temperature, top_k, as_numpy_rng(owner, rng), top_p


def check_top_p(owner: str, top_p) -> float | None:
    """top_p: None (no nucleus filter) or a real number in (0, 1]; 1 keeps every token."""
    if top_p is None:
        return None
    if isinstance(top_p, (bool, np.bool_)) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"{owner}: top_p expected a float in (0, 1] or None, got {type(top_p).__name__} {top_p!r}")
    if not 0 < top_p <= 1:  # also refuses nan
        raise ValueError(f"{owner}: top_p must be in (0, 1] (a probability mass to keep), got {top_p}")
    return float(top_p)


def sample_next(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator, *,
                top_p: float | None = None, name: str = "sample_next") -> np.ndarray:  # fmt: skip
    """One token per row from logits (B, V): argmax if temperature == 0, else a draw from softmax(logits / T)
    restricted to the top_k largest logits (all of them if None; ties with the k-th are kept), then to the nucleus
    of what is left: the most probable tokens, in decreasing order, up to and including the first at which their
    probability reaches top_p of the total (None or 1: no filter; ties with the last one kept are kept).

    The draw is by inverse CDF: one uniform u per row, the token is the first whose cumulative probability exceeds
    u times the total. A zero-probability token is never chosen. Returns (B,) int64.

    Infinities are the limits of softmax: a +inf logit takes all the probability (several +inf share it equally;
    argmax takes the first), a -inf one none. A temperature so small that logits / T overflows gives the limit
    T -> 0: the largest logit (ties shared equally). A NaN logit, or a row whose logits are all -inf, has no
    distribution to draw from: FloatingPointError naming `name` (the caller, e.g. GPT.generate), before any draw.
    """
    logits = np.asarray(logits, dtype=np.float64)
    check_logits(name, logits)
    top_p = check_top_p(name, top_p)
    if temperature == 0:
        return logits.argmax(axis=-1).astype(np.int64)  # the first of equal maxima, as torch.argmax
    z = _scaled(logits, temperature)
    if top_k is not None:
        kth = np.sort(z, axis=-1)[:, -top_k, None]  # (B, 1): the k-th largest
        z = np.where(z >= kth, z, -np.inf)
    with np.errstate(over="ignore"):  # a gap beyond the float range (a tiny temperature) is -inf: probability 0
        p = np.exp(z - z.max(axis=-1, keepdims=True))  # (B, V), unnormalized
    if top_p is not None and top_p < 1:
        p = nucleus(p, top_p)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(p))[:, None] * cdf[:, -1:]  # (B, 1), in [0, total)
    return np.minimum((cdf <= u).sum(axis=-1), p.shape[-1] - 1).astype(np.int64)


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """p (B, V), unnormalized, with every token outside each row's nucleus set to 0."""
    ranked = -np.sort(-p, axis=-1)  # (B, V), largest first
    mass = np.cumsum(ranked, axis=-1)
    last = np.minimum((mass < top_p * mass[:, -1:]).sum(axis=-1), p.shape[-1] - 1)  # (B,): the one reaching top_p
    smallest = ranked[np.arange(len(p)), last][:, None]  # (B, 1): the smallest probability kept
    return np.where(p >= smallest, p, 0.0)


def check_logits(name: str, logits: np.ndarray) -> None:
    """Logits (B, V) with a distribution in every row: no NaN, and not every logit -inf."""
    nan = np.isnan(logits).any(axis=-1)
    if nan.any():
        raise FloatingPointError(
            f"{name}: the logits of row {int(nan.argmax())} hold NaN: no distribution to sample from (are the "
            "model's weights finite?)"
        )
    dead = (logits == -np.inf).all(axis=-1)
    if dead.any():
        raise FloatingPointError(f"{name}: every logit of row {int(dead.argmax())} is -inf: no token can be drawn")


def _scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    """logits / temperature, with the limits of softmax where that has none: a row holding +inf logits becomes 0
    there and -inf elsewhere; if the division overflows (a tiny temperature), the gaps to the row's largest logit
    are divided instead (0 for the largest, -inf for the rest: the same softmax, without inf - inf)."""
    top = np.isposinf(logits)
    if top.any():
        logits = np.where(top.any(axis=-1, keepdims=True), np.where(top, 0.0, -np.inf), logits)
    with np.errstate(over="ignore"):
        z = logits / temperature
        if (np.isinf(z) & np.isfinite(logits)).any():
            z = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    return z
