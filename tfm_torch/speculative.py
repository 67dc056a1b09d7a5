"""Speculative decoding, PyTorch track: the twin of tfm_numpy.speculative (same rounds, same rule from
tfm_common.speculative on the logits handed over in float64, same numpy Generator: the same tokens)."""

from __future__ import annotations

import numpy as np
import torch

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


@torch.no_grad()
def speculative_generate(target, draft, tokens, max_new_tokens, *, k, temperature, top_k=None, rng):
    """The prompt `tokens` (1, T0) followed by max_new_tokens tokens distributed as `target.generate`'s, as
    tfm_numpy.speculative_generate; the tokens come back as a tensor on the prompt's device."""
    n, k, temperature, top_k, rng = _check(target, draft, tokens, max_new_tokens, k, temperature, top_k, rng)
    out, end, dev = tokens[0].long().tolist(), tokens.shape[1] + n, tokens.device
    t_cache, d_cache, proposed, accepted, draft_calls = {}, {}, [], [], 0
    with eval_mode(target), eval_mode(draft):
        while len(out) < end:
            m = min(k, end - len(out) - 1)
            drafted, q = [], np.zeros((m, target.vocab_size))
            for i in range(m):
                new = torch.tensor([(out + drafted)[d_cache.get("length", 0) :]], device=dev)
                q[i] = distribution(draft.forward_step(new, d_cache)[0, -1].double().cpu().numpy(), temperature, top_k)
                drafted.append(sample_from(q[i], rng.random()))
            new = torch.tensor([(out + drafted)[t_cache.get("length", 0) :]], device=dev)
            logits = target.forward_step(new, t_cache)[0, -(m + 1) :].double().cpu().numpy()  # ONE target forward
            a, nxt = verify(distribution(logits, temperature, top_k), q, np.array(drafted, dtype=np.int64), rng)
            out += drafted[:a] + [nxt]
            rollback_cache(t_cache, len(out) - 1)
            rollback_cache(d_cache, min(d_cache.get("length", 0), len(out) - 1))
            proposed.append(m)
            accepted.append(a)
            draft_calls += m
    return SpeculativeOutput(torch.tensor([out], dtype=torch.long, device=dev), np.array(proposed, dtype=np.int64),
                             np.array(accepted, dtype=np.int64), len(accepted), draft_calls)  # fmt: skip


def _check(target, draft, tokens, max_new_tokens, k, temperature, top_k, rng) -> tuple:
    for name, model in (("target", target), ("draft", draft)):
        if not isinstance(model, GPT):
            raise TypeError(f"speculative_generate: {name} expected a tfm_torch.GPT, got {type(model).__name__}")
    check_indices("speculative_generate: tokens", tokens, target.vocab_size)
    return check_speculative(target, draft, tuple(tokens.shape), max_new_tokens, k, temperature, top_k, rng)
