"""Decoding, NumPy track: greedy search and beam search with a length penalty (the key/value cache: kv_cache.py).

A trained model gives p(next token | source, target so far); decoding turns that into an output sequence, one
token at a time, each choice fed back as the next input (autoregressive: never teacher-forced).

- `greedy_decode` takes the most probable token at every step.
- `beam_search` keeps the `beam_size` most probable prefixes and ranks the completed ones by
  log p(Y | X) / lp(Y), with the length penalty of Wu et al. (2016), lp(Y) = ((5 + |Y|) / 6)^alpha: without it
  (alpha = 0) every extra token lowers the log-probability, and short outputs win. "Attention Is All You Need"
  used beam 4 and alpha 0.6, our defaults.
- `use_cache=True` runs `Transformer.decode_step`: at each step only the new token goes through the decoder;
  the keys and values of the earlier positions come from a cache (the memory's, for cross-attention, are
  computed once). `use_cache=False` runs the whole prefix through `Transformer.decode` at every step. The two
  give the same logits (to rounding) and the same tokens; the cache turns a quadratic cost into a linear one.

Conventions, the same in both tracks:
- Outputs are token ids (B, L), L <= max_len, without the bos: each row ends with its eos and `model.pad_id`
  after it. A row that produced no eos within max_len ends without one (truncated).
- The pad token is never generated (its logit is left out of the choice); bos and eos ids are arguments, so any
  vocabulary works. |Y| counts the generated tokens, eos included.
- Inference only: the model is switched to eval mode (dropout off) for the call and switched back after.
"""

from __future__ import annotations

import numpy as np

from tfm_common.search import check_search_args, describe
from tfm_common.training import eval_mode

from .fast_decode import LeanStep, lean_fits
from .functional import log_softmax
from .kv_cache import reorder_cache
from .module import check_indices

__all__ = ["length_penalty", "greedy_decode", "beam_search", "sequence_scores"]


def length_penalty(length, alpha: float = 0.6):
    """lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016, the GNMT paper): 1 at |Y| = 1, growing with the length.
    A hypothesis is ranked by log p(Y | X) / lp(Y); alpha = 0 ranks by the log-probability itself."""
    return ((5.0 + np.asarray(length, dtype=np.float64)) / 6.0) ** alpha


# -- the two searches ---------------------------------------------------------------------------------------------


def greedy_decode(model, src: np.ndarray, bos_id: int, eos_id: int, max_len: int, use_cache: bool = True):
    """The most probable next token at every step, until every row has produced eos or `max_len` tokens.

    src (B, S) ids -> tokens (B, L), L <= max_len, without the bos; `model.pad_id` after each row's eos.
    """
    check_search_args("greedy_decode", model, bos_id, eos_id, max_len)
    with eval_mode(model):
        memory, src_mask = model.encode(src)  # once: every step reads the same memory
        B = memory.shape[0]
        tgt = np.full((B, 1), bos_id, dtype=np.int64)  # the decoder's input: bos, then every choice so far
        done = np.zeros(B, dtype=bool)
        cache = {"capacity": max_len} if use_cache else None  # room for every position, once
        for _ in range(max_len):
            logits = _next_logits(model, tgt, memory, src_mask, cache)  # (B, V)
            logits[:, model.pad_id] = -np.inf  # pad is never generated
            token = np.where(done, model.pad_id, logits.argmax(axis=-1))  # (B,); rows already done get padding
            tgt = np.concatenate([tgt, token[:, None]], axis=1)
            done |= token == eos_id
            if done.all():
                break
    return tgt[:, 1:]  # (B, L): without the bos


def beam_search(
    model,
    src: np.ndarray,
    bos_id: int,
    eos_id: int,
    max_len: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    use_cache: bool = True,
    *,
    return_scores: bool = False,
):
    """Beam search: the best output per source by log p(Y | X) / length_penalty(|Y|, alpha).

    src (B, S) ids -> tokens (B, L) as `greedy_decode`, and with return_scores=True also scores (B,) float64, each
    the length-penalized log-probability of its row (what `sequence_scores` recomputes with teacher forcing).

    The beams of all B sources run as one batch of B * beam_size rows (beam k of source b is row b * K + k). At
    each step every live beam is extended by every token; of the K * V candidates of a source, the 2K most
    probable are looked at (2K: at most K of them end in eos, one per beam, so K live ones always remain).
      - a candidate ending in eos and ranked among the first K is complete: it is scored with the length penalty
        and set aside;
      - the K best that do not end in eos are the next step's beams; their caches are gathered from their parents.
    Each source keeps its K best complete hypotheses. It is done once it has K of them and the worst scores at
    least the best live beam's log p / length_penalty(t, alpha) at the current length t. Extending a beam only
    lowers its log p, so with alpha = 0 no live beam can beat the K kept ones and the stop is exact; with alpha > 0
    the penalty grows with the length, so a longer continuation can still score higher: the rule is then a
    heuristic bound (as Hugging Face's default early_stopping=False), not a guarantee. Stopping as soon as K
    complete hypotheses exist (fairseq's rule) can end on short early-eos hypotheses far below greedy. If max_len
    comes first, the live beams count as complete (truncated, no eos). The answer is the best complete hypothesis
    by score. With beam_size=1 this is exactly greedy decoding; a larger beam can still miss the best sequence
    (the search is not exhaustive).
    """
    K = check_search_args("beam_search", model, bos_id, eos_id, max_len, beam_size=beam_size, alpha=alpha)
    with eval_mode(model):
        memory, src_mask = model.encode(src)
        B, V = memory.shape[0], model.tgt_vocab_size
        if B == 0:  # an empty batch: what greedy_decode returns for it, (0, 1)
            empty = np.zeros((0, 1), dtype=np.int64)
            return (empty, np.zeros(0)) if return_scores else empty
        memory, src_mask = np.repeat(memory, K, axis=0), np.repeat(src_mask, K, axis=0)  # (B*K, S, d): per beam
        tgt = np.full((B * K, 1), bos_id, dtype=np.int64)
        alive = np.full((B, K), -np.inf)  # log p of each beam's prefix: one live beam at first (the others would
        alive[:, 0] = 0.0  # be copies of it), the rest -inf, never chosen while a finite candidate is left
        complete = [[] for _ in range(B)]  # per source: (score, tokens) of its complete hypotheses
        done = np.zeros(B, dtype=bool)
        cache = {"capacity": max_len} if use_cache else None  # room for every position, once
        for t in range(1, max_len + 1):  # t = the length of the candidates
            logp = log_softmax(_next_logits(model, tgt, memory, src_mask, cache))  # (B*K, V)
            logp[:, model.pad_id] = -np.inf
            cand = (alive.reshape(B * K, 1) + logp).reshape(B, K * V)  # every beam extended by every token
            top = np.argsort(-cand, axis=1, kind="stable")[:, : 2 * K]  # (B, 2K): the best, best first
            top_logp = np.take_along_axis(cand, top, axis=1)
            beam, token = top // V, top % V  # which beam, extended by which token
            is_eos = token == eos_id
            for b, r in zip(*np.nonzero(is_eos[:, :K] & np.isfinite(top_logp[:, :K])), strict=True):
                if not done[b]:
                    tokens = [*tgt[b * K + beam[b, r], 1:].tolist(), eos_id]
                    complete[b].append((float(top_logp[b, r] / length_penalty(t, alpha)), tokens))
                    complete[b] = sorted(complete[b], key=lambda h: -h[0])[:K]  # the K best (stable)
            live = np.argsort(is_eos, axis=1, kind="stable")[:, :K]  # (B, K): the best K not ending in eos
            beam, token, alive = (np.take_along_axis(a, live, axis=1) for a in (beam, token, top_logp))
            rows = (np.arange(B)[:, None] * K + beam).reshape(-1)  # (B*K,): the row each new beam continues
            tgt = np.concatenate([tgt[rows], token.reshape(-1, 1)], axis=1)
            if cache is not None:
                cache = reorder_cache(cache, rows)
            # done: K complete hypotheses, the worst of them at least the best live beam's score now
            best_live = alive.max(axis=1) / length_penalty(t, alpha)
            for b in range(B):
                if len(complete[b]) >= K and complete[b][-1][0] >= best_live[b]:
                    done[b] = True
            if done.all():
                break
        for b in range(B):  # max_len reached: live beams count as complete, as they are
            if not done[b]:
                for k in np.flatnonzero(np.isfinite(alive[b])):
                    score = float(alive[b, k] / length_penalty(max_len, alpha))
                    complete[b].append((score, tgt[b * K + k, 1:].tolist()))
    best = [max(c, key=lambda hyp: hyp[0]) for c in complete]  # the first of equal scores
    out = np.full((B, max(len(toks) for _, toks in best)), model.pad_id, dtype=np.int64)
    for b, (_, toks) in enumerate(best):
        out[b, : len(toks)] = toks
    return (out, np.array([s for s, _ in best])) if return_scores else out


def sequence_scores(model, src: np.ndarray, tokens: np.ndarray, bos_id: int, eos_id: int, alpha: float = 0.6):
    """The score beam search ranks by, recomputed with teacher forcing: log p(Y | X) / length_penalty(|Y|, alpha)
    for each row of `tokens` (B, L) (decoder outputs, without the bos), counting the tokens up to and including
    the first eos (all the non-pad tokens if there is none). Returns (B,) float64."""
    check_search_args("sequence_scores", model, bos_id, eos_id)
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"sequence_scores: tokens expected a (B, L) integer array, got {describe(tokens, np.ndarray)}")
    check_indices("sequence_scores: tokens", tokens, model.tgt_vocab_size)  # every column, the last one too
    with eval_mode(model):
        tgt_in = np.concatenate([np.full((len(tokens), 1), bos_id, dtype=tokens.dtype), tokens[:, :-1]], axis=1)
        logp = log_softmax(model(src, tgt_in))  # (B, L, V)
    token_logp = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0].astype(np.float64)  # (B, L)
    before_eos = np.cumsum(tokens == eos_id, axis=1) - (tokens == eos_id) == 0  # up to and including the 1st eos
    counted = before_eos & (tokens != model.pad_id)
    return np.where(counted, token_logp, 0.0).sum(axis=1) / length_penalty(counted.sum(axis=1), alpha)


def _next_logits(model, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray, cache: dict | None) -> np.ndarray:
    """The logits (B, V) of the token after `tgt` (B, T): the last token through the cache, or all of `tgt`.
    With the cache, the lean step (fast_decode.py) runs the model when it can (decided at the first step, kept in
    the cache), `Transformer.decode_step` otherwise: the same logits to rounding."""
    if cache is None:
        return model.decode(tgt, memory, src_mask)[:, -1]  # the whole prefix again
    if "lean" not in cache:
        cache["lean"] = LeanStep(model) if lean_fits(model, tgt, src_mask, cache) else None
    if cache["lean"] is not None:
        return cache["lean"](tgt[:, -1], memory, src_mask, cache)  # (B, V)
    return model.decode_step(tgt[:, -1:], memory, src_mask, cache)[:, -1]  # the new token only
