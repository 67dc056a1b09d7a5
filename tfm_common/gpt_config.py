"""The GPT's configuration and its sampling step, shared by both tracks: one rule for what a GPT may be built with,
and one sampler, so that the NumPy and PyTorch models accept and refuse the same things and, given the same
logits and the same seed, draw the same tokens.

The sampler works on NumPy float64 logits (the torch track hands over its last position's logits, B x V numbers per
step): the random numbers come from one `numpy.random.Generator` in both tracks.
"""

from __future__ import annotations

import numpy as np

from .validate import check_choice, check_flag, check_real, check_seed, check_size, check_sizes

__all__ = ["NORMS", "POSITIONAL", "ACTIVATIONS", "check_gpt_config", "check_sampling", "as_numpy_rng", "sample_next"]

NORMS = ("layernorm", "rmsnorm")
POSITIONAL = ("learned", "sinusoidal", "rope")
ACTIVATIONS = ("gelu", "relu", "swiglu")


def check_gpt_config(owner: str, c: dict) -> dict:
    """Validate GPT's constructor arguments (a dict of them) before anything is allocated; returns a clean copy."""
    c = dict(c)
    c.update(check_sizes(owner, **{k: c[k] for k in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers",
                                                     "max_len")}))  # fmt: skip
    if c["d_model"] % c["n_heads"]:
        raise ValueError(f"{owner}: d_model={c['d_model']} must be divisible by n_heads={c['n_heads']}")
    c["dropout"] = check_real(owner, "dropout", c["dropout"], low=0.0, high=1.0)
    if c["dropout"] == 1:
        raise ValueError(f"{owner}: dropout must be in [0, 1), got {c['dropout']!r}")
    check_choice(owner, "norm", c["norm"], NORMS)
    check_choice(owner, "positional", c["positional"], POSITIONAL)
    check_choice(owner, "activation", c["activation"], ACTIVATIONS)
    if c["positional"] == "sinusoidal" and c["d_model"] % 2:
        raise ValueError(f"{owner}: sinusoidal positions need an even d_model, got d_model={c['d_model']}")
    if c["positional"] == "rope" and (c["d_model"] // c["n_heads"]) % 2:
        raise ValueError(f"{owner}: rope needs an even d_head = d_model / n_heads, got {c['d_model'] // c['n_heads']}")
    if c["n_kv_heads"] is not None:
        c["n_kv_heads"] = check_size(owner, "n_kv_heads", c["n_kv_heads"])
        if c["n_heads"] % c["n_kv_heads"]:
            raise ValueError(f"{owner}: n_heads={c['n_heads']} must be divisible by n_kv_heads={c['n_kv_heads']}")
    c["tie_output"] = check_flag(owner, "tie_output", c["tie_output"])
    return c


def check_sampling(owner: str, temperature, top_k, vocab_size: int) -> tuple[float, int | None]:
    """temperature >= 0 (0: greedy); top_k None or an int in [1, vocab_size]."""
    temperature = check_real(owner, "temperature", temperature, low=0.0)
    if top_k is not None:
        top_k = check_size(owner, "top_k", top_k)
        if top_k > vocab_size:
            raise ValueError(f"{owner}: top_k must be <= vocab_size={vocab_size}, got {top_k}")
    return temperature, top_k


def as_numpy_rng(owner: str, rng) -> np.random.Generator:
    """A numpy Generator from a Generator, an int seed or None (seed 0: never hidden global state)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(0 if rng is None else check_seed(owner, rng))


def sample_next(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
    """One token per row from logits (B, V): argmax if temperature == 0, else a draw from softmax(logits / T)
    restricted to the top_k largest logits (all of them if None; ties with the k-th are kept).

    The draw is by inverse CDF: one uniform u per row, the token is the first whose cumulative probability exceeds
    u times the total. A zero-probability token is never chosen. Returns (B,) int64.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return logits.argmax(axis=-1).astype(np.int64)  # the first of equal maxima, as torch.argmax
    z = logits / temperature
    if top_k is not None:
        kth = np.sort(z, axis=-1)[:, -top_k, None]  # (B, 1): the k-th largest
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))  # (B, V), unnormalized
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(p))[:, None] * cdf[:, -1:]  # (B, 1), in [0, total)
    return np.minimum((cdf <= u).sum(axis=-1), p.shape[-1] - 1).astype(np.int64)
