"""Speculative decoding's plumbing, once for both tracks (Leviathan et al., 2023; Chen et al., 2023): the checks
of `speculative_generate`, the distributions the draft and the target sample from, the acceptance rule with its
residual distribution, and the statistics of a run. Everything here works on NumPy float64 arrays (the torch track
hands over its logits, as `GPT.generate` does to `tfm_common.sampling.sample_next`), and every random number comes
from one numpy Generator: the two tracks draw the same tokens from the same weights and seed.

Also here, for the proofs: the exact probability of every continuation of a prompt (by enumeration, on a small
vocabulary) and Pearson's chi-square test of sampled counts against it, with its p-value from a regularized
incomplete gamma function written out (no scipy).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from .sampling import check_generate, check_logits, check_token_window
from .validate import check_size

__all__ = [
    "rollback_cache",
    "SpeculativeOutput",
    "check_speculative",
    "check_rollback",
    "distribution",
    "sample_from",
    "verify",
    "continuation_probabilities",
    "chi_square_test",
    "chi2_sf",
    "gamma_q",
]

OWNER = "speculative_generate"


class SpeculativeOutput(NamedTuple):
    """What `speculative_generate` returns: the tokens (1, T0 + max_new_tokens), in the track's array type, and
    per round (one target forward each) the number of proposals the draft made and how many the target accepted."""

    tokens: object
    proposed: np.ndarray  # (rounds,) int64: draft proposals verified in each round (k, fewer near the end)
    accepted: np.ndarray  # (rounds,) int64: how many of them the target accepted
    target_forwards: int  # = rounds: one forward_step of the target per round
    draft_forwards: int  # forward_step calls of the draft

    @property
    def new_tokens(self) -> int:
        """Tokens generated: each round gives its accepted proposals plus one token of the target's own."""
        return int(self.accepted.sum()) + len(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals / proposals: the share of the draft's work kept (nan if it proposed nothing)."""
        total = int(self.proposed.sum())
        return int(self.accepted.sum()) / total if total else math.nan

    @property
    def alpha(self) -> float:
        """The rate at which the rule accepts the proposals it looks at: accepted / (accepted + rejections), each
        round ending in at most one rejection (the proposals after it are never looked at). The alpha of
        Leviathan et al.'s expected tokens per round (1 - alpha^(k+1)) / (1 - alpha); nan if none was looked at."""
        looked_at = int(self.accepted.sum()) + int((self.accepted < self.proposed).sum())
        return int(self.accepted.sum()) / looked_at if looked_at else math.nan

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward: 1 for plain decoding, up to k + 1 here."""
        return self.new_tokens / self.target_forwards if self.target_forwards else math.nan


def check_speculative(target, draft, tokens_shape: tuple, max_new_tokens, k, temperature, top_k, rng) -> tuple:
    """The arguments of `speculative_generate` (the models are GPTs of the caller's track, the token ids already
    checked against the target's vocabulary): returns (max_new_tokens, k, temperature, top_k, numpy Generator).
    Refused: k < 1, a draft with another vocabulary, a batch of more than one row, and whatever `GPT.generate`
    refuses (temperature < 0, max_new_tokens < 0, a prompt or a generation longer than either model's max_len)."""
    k = check_size(OWNER, "k", k)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{OWNER}: the draft's vocab_size={draft.vocab_size} differs from the target's "
                         f"vocab_size={target.vocab_size}: the draft must propose the target's tokens")  # fmt: skip
    T0 = check_token_window(OWNER, tokens_shape, 0, min(target.max_len, draft.max_len))
    if tokens_shape[0] != 1:
        raise ValueError(f"{OWNER}: tokens expected one row, shape (1, T), got {tokens_shape}: each row would "
                         "accept a different number of proposals (batch the calls instead)")  # fmt: skip
    max_len = min(target.max_len, draft.max_len)
    n, temperature, top_k, rng, _ = check_generate(OWNER, T0, max_new_tokens, temperature, top_k, rng,
                                                   target.vocab_size, max_len)  # fmt: skip
    return n, k, temperature, top_k, rng


def check_rollback(cache: dict, length) -> int:
    """`rollback_cache`'s length: an int from 0 to the cache's own length (a rollback never grows a cache), on a
    growing cache (a rolling one, chapter 21c, has overwritten what a rollback would need)."""
    length = check_size("rollback_cache", "length", length, minimum=0)
    if "slots" in cache:
        raise ValueError("rollback_cache: expected a growing cache (GPT.forward_step's), got a rolling one (slots)")
    if length > cache.get("length", 0):
        raise ValueError(f"rollback_cache: length must be <= the cache's length {cache.get('length', 0)}, got {length}")
    return length


def rollback_cache(cache: dict, length: int) -> dict:
    """Forget the positions of a `GPT.forward_step` cache from `length` on (rejected proposals): each layer's keys
    and values (and the int8 cache's scales) become views of their first `length` positions, and cache["length"] =
    length. The buffers stay; the next forward_step writes over the forgotten positions. Returns the cache (changed
    in place). The same slicing in both tracks (NumPy arrays and torch tensors)."""
    length = check_rollback(cache, length)
    for layer in cache.get("layers", []):
        for name in ("k", "v", "k_scale", "v_scale"):
            if name in layer:
                layer[name] = layer[name][:, :, :length]  # (B, Hkv, length, dh or 1)
    cache["length"] = length
    return cache


def distribution(logits: np.ndarray, temperature: float, top_k: int | None) -> np.ndarray:
    """The distribution (..., V) float64 that `sample_next` draws from: softmax(logits / temperature) over the top_k
    largest logits (ties with the k-th kept; all if None); temperature 0: all the mass on the argmax (the first of
    equal maxima), so that greedy decoding is the same rule with one-hot distributions."""
    logits = np.asarray(logits, dtype=np.float64)
    check_logits("speculative_generate", logits.reshape(-1, logits.shape[-1]))
    if temperature == 0:
        return np.eye(logits.shape[-1])[logits.argmax(axis=-1)]
    z = logits / temperature
    if top_k is not None:
        z = np.where(z >= np.sort(z, axis=-1)[..., -top_k, None], z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def sample_from(p: np.ndarray, u: float) -> int:
    """The token of distribution p (V,) at uniform u in [0, 1), by inverse CDF: the first whose cumulative
    probability exceeds u times the total (as `sample_next`); a zero-probability token is never chosen."""
    cdf = np.cumsum(p)
    return int(min((cdf <= u * cdf[-1]).sum(), len(p) - 1))


def verify(p: np.ndarray, q: np.ndarray, drafted: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """One round's acceptance rule: the target's distributions p (n + 1, V) at the n drafted positions and one more,
    the draft's q (n, V) that drafted (n,) were sampled from. Proposal i is accepted with probability
    min(1, p_i(x) / q_i(x)), in order, until the first rejection, which draws from the residual
    norm(max(0, p_i - q_i)); if all n are accepted, one bonus token comes from p_n. Returns (accepted, next token):
    the round adds drafted[:accepted] and the next token. Each token is then distributed exactly as p's."""
    u = rng.random(len(drafted) + 1)  # n acceptance draws, one for the token after them
    for i, x in enumerate(drafted):
        if u[i] * q[i, x] >= p[i, x]:  # rejected: u >= p/q (q[i, x] > 0: x was drawn from q)
            residual = np.maximum(p[i] - q[i], 0.0)
            return i, sample_from(residual if residual.sum() > 0 else p[i], u[-1])
    return len(drafted), sample_from(p[len(drafted)], u[-1])


# -- the proof: exact probabilities by enumeration and a chi-square test ------------------------------------------
def continuation_probabilities(logits_fn, prompt: np.ndarray, n: int, temperature: float, top_k=None) -> np.ndarray:
    """P(the next n tokens = t_1 .. t_n | prompt), an array (V,) * n, for a model sampled as `GPT.generate` samples
    it: `logits_fn(tokens (B, T)) -> logits (B, T, V)` (a NumPy array; e.g. a GPT's forward), prompt (T0,) ids.
    Enumerates all V ** (n - 1) prefixes in one batch: for small vocabularies only."""
    prompt = np.asarray(prompt, dtype=np.int64)
    probs = np.ones(())
    for step in range(n):
        V = probs.shape[-1] if step else 0
        prefixes = np.array(list(itertools.product(range(V), repeat=step)), dtype=np.int64).reshape(V**step, step)
        seqs = np.concatenate([np.broadcast_to(prompt, (len(prefixes), len(prompt))), prefixes], axis=1)
        p = distribution(np.asarray(logits_fn(seqs))[:, -1], temperature, top_k)  # (V ** step, V)
        probs = probs[..., None] * p.reshape(probs.shape + p.shape[-1:])
    return probs


class ChiSquare(NamedTuple):
    statistic: float
    dof: int
    p_value: float


def chi_square_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> ChiSquare:
    """Pearson's goodness-of-fit test of observed `counts` against the exact `probs` (same shape, summing to 1):
    cells expected fewer than `min_expected` times are pooled into one (the chi-square approximation needs a few
    expected counts per cell). A count in a cell of probability 0 makes the statistic inf (p-value 0)."""
    counts, probs = np.asarray(counts, dtype=np.float64).ravel(), np.asarray(probs, dtype=np.float64).ravel()
    expected = counts.sum() * probs
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
        if counts[small].sum() > 0:
            return ChiSquare(math.inf, len(exp), 0.0)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return ChiSquare(stat, dof, chi2_sf(stat, dof))


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with `dof` degrees of freedom: Q(dof / 2, x / 2)."""
    return 1.0 if x <= 0 else gamma_q(dof / 2, x / 2)


def gamma_q(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x) = Gamma(a, x) / Gamma(a), a > 0, x >= 0: by its
    series where x < a + 1 (P = 1 - Q converges fast there), by its continued fraction (modified Lentz) beyond
    (Numerical Recipes, section 6.2). About 1e-14 relative."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)  # x^a e^-x / Gamma(a)
    if x < a + 1:  # P(a, x) = x^a e^-x / Gamma(a + 1) * sum_n x^n / ((a + 1) ... (a + n))
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return 1.0 - total * math.exp(log_front)
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h
