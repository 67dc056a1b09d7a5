"""Speculative decoding, NumPy track (Leviathan et al., 2023; Chen et al., 2023): a small draft GPT proposes k
tokens with its own cached steps, the target GPT scores all of them in one cached forward, and the acceptance rule
of `tfm_common.speculative.verify` keeps a prefix of them plus one token of the target's own, so that the output is
distributed exactly as the target's own samples (at temperature 0: equal to its greedy output). Both caches are
then rolled back to the accepted length (`rollback_cache`). Batch size 1."""

from __future__ import annotations

import numpy as np

from tfm_common.speculative import (
    SpeculativeOutput,
    check_speculative,
    distribution,
    rollback_cache,
    sample_from,
    verify,
)
from tfm_common.training import eval_mode

from .gpt import GPT
from .module import check_indices

__all__ = ["speculative_generate", "rollback_cache"]


def speculative_generate(target, draft, tokens, max_new_tokens, *, k, temperature, top_k=None, rng):
    """The prompt `tokens` (1, T0) followed by max_new_tokens tokens distributed as `target.generate`'s (equal to
    them at temperature 0), in rounds of: k draft proposals, one target forward over them, the acceptance rule.
    Returns a SpeculativeOutput: the tokens (1, T0 + max_new_tokens) and per-round statistics. `rng`: a numpy
    Generator or an int seed; the same seed draws the same tokens in tfm_torch."""
    n, k, temperature, top_k, rng = _check(target, draft, tokens, max_new_tokens, k, temperature, top_k, rng)
    out, end = tokens[0].astype(np.int64).tolist(), tokens.shape[1] + n
    t_cache, d_cache, proposed, accepted, draft_calls = {}, {}, [], [], 0
    with eval_mode(target), eval_mode(draft):
        while len(out) < end:
            m = min(k, end - len(out) - 1)  # proposals this round: never more tokens than asked for
            drafted, q = [], np.zeros((m, target.vocab_size))
            for i in range(m):  # the draft: m cached steps (the first feeds what its cache lacks)
                new = (out + drafted)[d_cache.get("length", 0) :]
                q[i] = distribution(draft.forward_step(np.array([new]), d_cache)[0, -1], temperature, top_k)
                drafted.append(sample_from(q[i], rng.random()))
            new = (out + drafted)[t_cache.get("length", 0) :]  # the last token and the m proposals (all at first)
            logits = target.forward_step(np.array([new]), t_cache)[0, -(m + 1) :]  # ONE target forward, (m + 1, V)
            a, nxt = verify(distribution(logits, temperature, top_k), q, np.array(drafted, dtype=np.int64), rng)
            out += drafted[:a] + [nxt]
            rollback_cache(t_cache, len(out) - 1)  # every token but the newest is in the caches
            rollback_cache(d_cache, min(d_cache.get("length", 0), len(out) - 1))
            proposed.append(m)
            accepted.append(a)
            draft_calls += m
    return SpeculativeOutput(np.array([out], dtype=np.int64), np.array(proposed, dtype=np.int64),
                             np.array(accepted, dtype=np.int64), len(accepted), draft_calls)  # fmt: skip


def _check(target, draft, tokens, max_new_tokens, k, temperature, top_k, rng) -> tuple:
    for name, model in (("target", target), ("draft", draft)):
        if not isinstance(model, GPT):
            raise TypeError(f"speculative_generate: {name} expected a tfm_numpy.GPT, got {type(model).__name__}")
    check_indices("speculative_generate: tokens", tokens, target.vocab_size)
    return check_speculative(target, draft, tuple(tokens.shape), max_new_tokens, k, temperature, top_k, rng)
