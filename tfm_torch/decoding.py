"""Decoding, PyTorch track: the functions, arguments and conventions of tfm_numpy.decoding (see its docstring), under
`torch.no_grad()`. Tokens are int64 tensors on the model's device; the same weights give the NumPy track's tokens."""

from __future__ import annotations

import math

import torch

from tfm_common.search import check_search_args, describe
from tfm_common.training import eval_mode

from .functional import log_softmax
from .kv_cache import reorder_cache
from .module import check_indices

__all__ = ["length_penalty", "greedy_decode", "beam_search", "sequence_scores"]


def length_penalty(length, alpha: float = 0.6):
    """lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016); a tensor of lengths gives a float64 tensor."""
    if isinstance(length, torch.Tensor):
        return ((5.0 + length.to(torch.float64)) / 6.0) ** alpha
    return ((5.0 + length) / 6.0) ** alpha


# -- the two searches ---------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_decode(model, src: torch.Tensor, bos_id: int, eos_id: int, max_len: int, use_cache: bool = True):
    """Greedy search as tfm_numpy.greedy_decode: src (B, S) ids -> tokens (B, L), without the bos."""
    check_search_args("greedy_decode", model, bos_id, eos_id, max_len)
    with eval_mode(model):
        memory, src_mask = model.encode(src)  # once: every step reads the same memory
        B = memory.shape[0]
        tgt = torch.full((B, 1), bos_id, dtype=torch.long, device=memory.device)  # bos, then every choice so far
        done = torch.zeros(B, dtype=torch.bool, device=memory.device)
        cache = {"capacity": max_len} if use_cache else None  # room for every position, once
        for _ in range(max_len):
            logits = _next_logits(model, tgt, memory, src_mask, cache)  # (B, V)
            logits[:, model.pad_id] = -math.inf  # pad is never generated
            token = torch.where(done, model.pad_id, logits.argmax(dim=-1))  # (B,); rows already done get padding
            tgt = torch.cat([tgt, token[:, None]], dim=1)
            done |= token == eos_id
            if done.all():
                break
    return tgt[:, 1:]  # (B, L): without the bos


@torch.no_grad()
def beam_search(
    model,
    src: torch.Tensor,
    bos_id: int,
    eos_id: int,
    max_len: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    use_cache: bool = True,
    *,
    return_scores: bool = False,
):
    """Beam search, tfm_numpy.beam_search step for step: tokens (B, L), and with return_scores=True also scores (B,)
    float64."""
    K = check_search_args("beam_search", model, bos_id, eos_id, max_len, beam_size=beam_size, alpha=alpha)
    with eval_mode(model):
        memory, src_mask = model.encode(src)
        B, V, dev = memory.shape[0], model.tgt_vocab_size, memory.device
        if B == 0:  # an empty batch: what greedy_decode returns for it, (0, 1)
            empty = torch.zeros((0, 1), dtype=torch.long, device=dev)
            return (empty, torch.zeros(0, dtype=torch.float64, device=dev)) if return_scores else empty
        memory, src_mask = memory.repeat_interleave(K, dim=0), src_mask.repeat_interleave(K, dim=0)  # (B*K, ...)
        tgt = torch.full((B * K, 1), bos_id, dtype=torch.long, device=dev)
        alive = torch.full((B, K), -math.inf, dtype=torch.float64, device=dev)  # log p of each beam's prefix:
        alive[:, 0] = 0.0  # one live beam at first (the others would be copies of it)
        complete = [[] for _ in range(B)]  # per source: (score, tokens) of its complete hypotheses
        done = [False] * B
        cache = {"capacity": max_len} if use_cache else None  # room for every position, once
        for t in range(1, max_len + 1):  # t = the length of the candidates
            logp = log_softmax(_next_logits(model, tgt, memory, src_mask, cache))  # (B*K, V)
            logp[:, model.pad_id] = -math.inf
            cand = (alive.reshape(B * K, 1) + logp).reshape(B, K * V)  # every beam extended by every token
            top_logp, top = torch.sort(cand, dim=1, descending=True, stable=True)  # stable: ties as in NumPy
            top_logp, top = top_logp[:, : 2 * K], top[:, : 2 * K]  # (B, 2K): the best, best first
            beam, token = top // V, top % V
            is_eos = token == eos_id
            for b, r in (is_eos[:, :K] & torch.isfinite(top_logp[:, :K])).nonzero().tolist():
                if not done[b]:
                    tokens = [*tgt[b * K + beam[b, r], 1:].tolist(), eos_id]
                    complete[b].append((top_logp[b, r].item() / length_penalty(t, alpha), tokens))
                    complete[b] = sorted(complete[b], key=lambda h: -h[0])[:K]  # the K best (stable)
            live = torch.sort(is_eos.to(torch.uint8), dim=1, stable=True).indices[:, :K]  # best K without eos
            beam, token, alive = (a.gather(1, live) for a in (beam, token, top_logp))
            rows = (torch.arange(B, device=dev)[:, None] * K + beam).reshape(-1)  # the row each new beam continues
            tgt = torch.cat([tgt[rows], token.reshape(-1, 1)], dim=1)
            if cache is not None:
                cache = reorder_cache(cache, rows)
            best_live = (alive.max(dim=1).values / length_penalty(t, alpha)).tolist()
            for b in range(B):  # done: K complete, the worst of them at least the best live beam's score now
                if len(complete[b]) >= K and complete[b][-1][0] >= best_live[b]:
                    done[b] = True
            if all(done):
                break
        for b in range(B):  # max_len reached: live beams count as complete, as they are
            if not done[b]:
                for k in torch.isfinite(alive[b]).nonzero()[:, 0].tolist():
                    score = alive[b, k].item() / length_penalty(max_len, alpha)
                    complete[b].append((score, tgt[b * K + k, 1:].tolist()))
    best = [max(c, key=lambda hyp: hyp[0]) for c in complete]  # the first of equal scores
    out = torch.full((B, max(len(toks) for _, toks in best)), model.pad_id, dtype=torch.long, device=dev)
    for b, (_, toks) in enumerate(best):
        out[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    scores = torch.tensor([s for s, _ in best], dtype=torch.float64)
    return (out, scores) if return_scores else out


@torch.no_grad()
def sequence_scores(model, src: torch.Tensor, tokens: torch.Tensor, bos_id: int, eos_id: int, alpha: float = 0.6):
    """log p(Y | X) / length_penalty(|Y|, alpha) of each row of `tokens` (B, L) (without the bos), teacher-forced,
    counting the tokens up to and including the first eos (all the non-pad ones if none). Returns (B,) float64."""
    check_search_args("sequence_scores", model, bos_id, eos_id)
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 2
        or tokens.dtype == torch.bool
        or (tokens.is_floating_point() or tokens.is_complex())
    ):
        raise ValueError(
            f"sequence_scores: tokens expected a (B, L) integer tensor, got {describe(tokens, torch.Tensor)}"
        )
    check_indices("sequence_scores: tokens", tokens, model.tgt_vocab_size)  # every column, the last one too
    with eval_mode(model):
        bos = torch.full((len(tokens), 1), bos_id, dtype=tokens.dtype, device=tokens.device)
        logp = log_softmax(model(src, torch.cat([bos, tokens[:, :-1]], dim=1)))  # (B, L, V)
    token_logp = logp.gather(-1, tokens[..., None].long())[..., 0].to(torch.float64)  # (B, L)
    is_eos = (tokens == eos_id).long()
    counted = (is_eos.cumsum(dim=1) - is_eos == 0) & (tokens != model.pad_id)  # up to and including the 1st eos
    return torch.where(counted, token_logp, 0.0).sum(dim=1) / length_penalty(counted.sum(dim=1), alpha)


def _next_logits(model, tgt, memory, src_mask, cache: dict | None) -> torch.Tensor:
    """The logits (B, V) of the token after `tgt` (B, T): the last token through the cache, or all of `tgt`."""
    if cache is None:
        return model.decode(tgt, memory, src_mask)[:, -1]  # the whole prefix again
    return model.decode_step(tgt[:, -1:], memory, src_mask, cache)[:, -1]  # the new token only
