"""Decoding, NumPy track: greedy search, beam search with a length penalty, and the key/value cache behind both.

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

import math
import numbers
from contextlib import contextmanager

import numpy as np

from .functional import log_softmax
from .module import check_indices
from .positional import sinusoidal_positional_encoding

__all__ = ["length_penalty", "greedy_decode", "beam_search", "sequence_scores", "reorder_cache", "cache_append"]


def length_penalty(length, alpha: float = 0.6):
    """lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016, the GNMT paper): 1 at |Y| = 1, growing with the length.
    A hypothesis is ranked by log p(Y | X) / lp(Y); alpha = 0 ranks by the log-probability itself."""
    return ((5.0 + np.asarray(length, dtype=np.float64)) / 6.0) ** alpha


# -- the two searches ---------------------------------------------------------------------------------------------


def greedy_decode(model, src: np.ndarray, bos_id: int, eos_id: int, max_len: int, use_cache: bool = True):
    """The most probable next token at every step, until every row has produced eos or `max_len` tokens.

    src (B, S) ids -> tokens (B, L), L <= max_len, without the bos; `model.pad_id` after each row's eos.
    """
    _check_args("greedy_decode", model, bos_id, eos_id, max_len)
    with _eval_mode(model):
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
    _check_args("beam_search", model, bos_id, eos_id, max_len)
    K = _check_int("beam_search", "beam_size", beam_size)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha < math.inf:
        raise ValueError(f"beam_search: alpha must be a float >= 0, got {alpha!r}")
    with _eval_mode(model):
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
    _check_args("sequence_scores", model, bos_id, eos_id)
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"sequence_scores: tokens expected a (B, L) integer array, got {_describe(tokens)}")
    check_indices("sequence_scores: tokens", tokens, model.tgt_vocab_size)  # every column, the last one too
    with _eval_mode(model):
        tgt_in = np.concatenate([np.full((len(tokens), 1), bos_id, dtype=tokens.dtype), tokens[:, :-1]], axis=1)
        logp = log_softmax(model(src, tgt_in))  # (B, L, V)
    token_logp = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0].astype(np.float64)  # (B, L)
    before_eos = np.cumsum(tokens == eos_id, axis=1) - (tokens == eos_id) == 0  # up to and including the 1st eos
    counted = before_eos & (tokens != model.pad_id)
    return np.where(counted, token_logp, 0.0).sum(axis=1) / length_penalty(counted.sum(axis=1), alpha)


# -- the cache ------------------------------------------------------------------------------------------------------


def cache_append(cache: dict, name: str, new: np.ndarray, axis: int) -> np.ndarray:
    """Append `new` to cache[name] along `axis` without copying what is there: returns the grown cache[name].

    The positions live in a buffer, cache[name + "_buf"], allocated once with room for cache["capacity"] positions
    (the longest sequence the decoding will reach); each step writes its new positions in place, and cache[name]
    is a view of the part written so far. Growing by concatenation instead copies every earlier position at every
    step: quadratic in the length. (Past the capacity the buffer is reallocated at twice the size, so a cache
    without one still costs amortized O(1) copies per position.) cache["preallocate"] = False does exactly that
    concatenation instead, for comparison (chapter 15b, benchmarks/bench.py).
    """
    old, buf = cache.get(name), cache.get(name + "_buf")
    if not cache.get("preallocate", True):  # the quadratic way, kept to measure the difference: copy all, each step
        cache[name] = new if old is None else np.concatenate([old, new], axis=axis)
        return cache[name]
    t0 = 0 if old is None else old.shape[axis]
    t1 = t0 + new.shape[axis]
    if buf is None or buf.shape[axis] < t1:
        shape = list(new.shape)
        shape[axis] = max(t1, cache.get("capacity", 0), 2 * t0)
        buf = np.empty(shape, dtype=new.dtype)  # not touched until written: room costs no time
        if t0:
            buf[_span(axis, 0, t0)] = old
        cache[name + "_buf"] = buf
    buf[_span(axis, t0, t1)] = new
    cache[name] = buf[_span(axis, 0, t1)]  # a view: no copy
    return cache[name]


def _span(axis: int, start: int, stop: int) -> tuple:
    """The index of positions start:stop along `axis` (every other axis whole)."""
    return (slice(None),) * axis + (slice(start, stop),)


def reorder_cache(cache: dict, rows: np.ndarray) -> dict:
    """The cache of `Transformer.decode_step` for the batch rows `rows` (repeats allowed), in that order: after a
    beam search step, new beam i continues the prefix of row rows[i], so it needs that row's keys and values.
    (The cross-attention's memory keys and values are gathered too; within a source they are the same rows.)
    A preallocated buffer (see `cache_append`) is gathered into a new one of the same capacity, copying only the
    positions written so far."""
    if isinstance(cache, list):
        return [reorder_cache(v, rows) for v in cache]
    if not isinstance(cache, dict):
        return cache[rows] if isinstance(cache, np.ndarray) else cache  # arrays are batch-first; the length stays
    out = {}
    for key, value in cache.items():
        buf = cache.get(key + "_buf")
        if key.endswith("_buf") and key[:-4] in cache:
            continue  # handled with its view
        if buf is None:
            out[key] = reorder_cache(value, rows)
            continue
        used = tuple(slice(0, n) for n in value.shape[1:])  # the written part of the buffer
        new_buf = np.empty((len(rows), *buf.shape[1:]), dtype=buf.dtype)
        new_buf[(slice(None), *used)] = value[rows]
        out[key + "_buf"], out[key] = new_buf, new_buf[(slice(None), *used)]
    return out


def _next_logits(model, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray, cache: dict | None) -> np.ndarray:
    """The logits (B, V) of the token after `tgt` (B, T): the last token through the cache, or all of `tgt`.
    With the cache, the lean step below runs the model when it can (decided at the first step, kept in the cache),
    `Transformer.decode_step` otherwise: the same logits to rounding."""
    if cache is None:
        return model.decode(tgt, memory, src_mask)[:, -1]  # the whole prefix again
    if "lean" not in cache:
        cache["lean"] = _LeanStep(model) if _lean_fits(model, tgt, src_mask, cache) else None
    if cache["lean"] is not None:
        return cache["lean"](tgt[:, -1], memory, src_mask, cache)  # (B, V)
    return model.decode_step(tgt[:, -1:], memory, src_mask, cache)[:, -1]  # the new token only


# -- the lean step of the two searches ------------------------------------------------------------------------------
#
# `Transformer.decode_step` is written to be read and to be safe anywhere: every module checks its inputs, the
# outermost call copies the caller's arrays, every layer works on (B, T, d) for any T, and the three projections of
# the self-attention are three Linear calls. For one new token of a small model that bookkeeping, not the
# arithmetic, sets the time of a cached step (benchmarks/bench.py, section "decode"). The two searches feed the
# model inputs they made themselves, checked once at the start, so they run the same arithmetic through `_LeanStep`:
# one token per row, no checks or copies per token, q, k and v of the new token from ONE matmul with the weights
# concatenated once per search (not parameters: the state_dict is unchanged), the memory's keys and values
# projected once, the new keys and values written straight into the cache's buffers, the activations feature-major
# (d, B) so that every projection is W @ x (see the class). The cache keeps its layout (B, H, T, dk), so
# `reorder_cache` (beam search) and `decode_step` read it as before, and the logits are decode_step's to rounding
# (tests/test_lean_step.py). What it does not cover takes `decode_step`: training mode, tiled attention, the
# shared head projections of chapter 16a, a cache that concatenates, a source row that is all padding.


def _lean_fits(model, tgt: np.ndarray, src_mask: np.ndarray, cache: dict) -> bool:
    """Whether the lean step computes what `model.decode_step` would, to rounding (at the first step of a search)."""
    from .attention import MultiHeadAttention  # here, not at the top: both modules import this one
    from .encoder_decoder import DecoderLayer, DropoutAfterNormDecoderLayer
    from .sublayers import PositionwiseFeedForward
    from .transformer import Transformer

    if not isinstance(model, Transformer) or type(model).decode_step is not Transformer.decode_step:
        return False
    layers = list(model.decoder.layers)
    attns = [a for layer in layers for a in (layer.self_attn, layer.cross_attn)]
    return (
        not any(m.training for _, m in model.named_modules())  # dropout off: the searches run in eval mode
        and all(type(layer) in (DecoderLayer, DropoutAfterNormDecoderLayer) for layer in layers)  # eval: the same
        and all(type(layer.ff) is PositionwiseFeedForward for layer in layers)
        and all(type(a) is MultiHeadAttention and a.attention == "explicit" for a in attns)
        and cache.get("preallocate", True)
        and "layers" not in cache  # a fresh cache
        and bool((tgt[:, -1] != model.pad_id).all())  # the first position can be attended to: no empty row ...
        and bool(src_mask.any(axis=-1).all())  # ... in the self-attention, nor in the cross-attention
    )


class _LeanStep:
    """The decoder's arithmetic for one new token per row, inference only: `step(token (B,), memory (B, S, d),
    src_mask (B, 1, 1, S), cache)` -> logits (B, V), what `decode_step(token[:, None], ...)[:, -1]` returns, with
    the cache filled the same way. Built at the first step of a search, for that search (see above).

    Inside, the activations are feature-major, x (d, B), a column per row of the batch, and every projection is
    W @ x with W as the Linear stores it, (d_out, d_in): with a handful of rows OpenBLAS is faster at W @ x than at
    x @ W^T (its kernels fill whole register tiles along the long side; the (V, d) @ (d, B) logits take about half
    the time). The biases and the LayerNorms' weights are repeated to (d_out, B) at the first step: adding a whole
    matrix is several times cheaper for NumPy than broadcasting a column over 8 columns. Only the rounding differs
    from decode_step's (tests/test_lean_step.py). With batch 8 (benchmarks/bench.py, section "decode", 1 BLAS
    thread) the step measured about 1.2x faster than with row-major activations and x @ W^T."""

    def __init__(self, model):
        self.model, self.layers = model, list(model.decoder.layers)
        pos, dt = model.tgt_pos, model.tgt_embed.weight.dtype
        self.mean_of = np.full((1, model.d_model), 1 / model.d_model, dtype=dt)  # mean_of @ x: each column's mean
        if hasattr(pos, "pe"):  # the sinusoidal table, in the model's dtype (as PositionalEncoding rebuilds it)
            same = pos.pe.dtype == dt
            self.positions = pos.pe if same else sinusoidal_positional_encoding(pos.max_len, pos.d_model, dtype=dt)
        else:  # a learned table
            self.positions = pos.weight.data  # (max_len, d)

    def _prepare(self, B: int) -> None:
        """The weights of the search in the form the step uses, for B rows (the searches keep B fixed)."""
        m, bias, self.B = self.model, _Repeat(B), B
        self.w = []
        for layer in self.layers:
            sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
            w = {
                "qkv": _fused(sa, ("q_proj", "k_proj", "v_proj"), bias),  # (3d, d): q, k and v in one matmul
                "q": _fused(ca, ("q_proj",), bias),  # the cross-attention's queries
                "kv": _fused(ca, ("k_proj", "v_proj"), None),  # the memory's keys and values, once
                "sa_out": bias.linear(sa.out_proj),
                "ca_out": bias.linear(ca.out_proj),
                "ff1": bias.linear(ff.linear1),
                "ff2": bias.linear(ff.linear2),
            }
            w.update({f"norm{j}": bias.norm(getattr(layer, f"norm{j}")) for j in (1, 2, 3)})
            self.w.append(w)
        self.embed_norm = None if m.tgt_embed_norm is None else bias.norm(m.tgt_embed_norm)
        self.final_norm = None if m.decoder.norm is None else bias.norm(m.decoder.norm)

    def __call__(self, token: np.ndarray, memory: np.ndarray, src_mask: np.ndarray, cache: dict) -> np.ndarray:
        m, t0 = self.model, cache.get("length", 0)
        if t0 == 0:  # room for every position, as decode_step makes it; the searches pass the same mask each step
            cap = min(cache.setdefault("capacity", m.max_len), m.max_len)
            cache["layers"] = [{"self_attn": {"capacity": cap}, "cross_attn": {}} for _ in self.layers]
            self.src_padded, self.padded = not src_mask.all(), False
        if t0 == 0 or len(token) != self.B:  # a new search, or reorder_cache changed the number of rows
            self._prepare(len(token))
        real = token != m.pad_id  # (B,): False for the padding fed to the rows already done
        keep = _append_one(cache, "keep", real[:, None, None, None], 3, t0)  # (B, 1, 1, T)
        self.padded = self.padded or (m.tgt_padding_mask and not real.all())
        hidden = ~keep if self.padded else None  # padded target keys, once there are any (the causal mask: none)
        y = m.tgt_embed.weight.data[token]  # (B, d): one row per new token
        if m._in_scale is not None:
            y *= m._in_scale
        y += self.positions[t0]
        x = y.T  # (d, B): feature-major from here on
        if self.embed_norm is not None:
            x = self._norm(self.embed_norm, x)
        src_hidden = ~src_mask if self.src_padded else None  # (B, 1, 1, S)
        for i, layer in enumerate(self.layers):
            x = self._layer(self.w[i], layer, x, memory, cache["layers"][i], hidden, src_hidden, t0)
        if self.final_norm is not None:
            x = self._norm(self.final_norm, x)
        logits = m.output_projection.weight.data @ x  # (V, B): the new position only
        if m._out_scale is not None:
            logits *= logits.dtype.type(m._out_scale)
        cache["length"] = t0 + 1
        return logits.T  # (B, V), a view

    def _layer(self, w, layer, x, memory, cache, hidden, src_hidden, t0):
        """DecoderLayer.forward_step in eval mode (dropout is the identity), x (d, B)."""
        sa, ca, norm = layer.self_attn, layer.cross_attn, self._norm
        if layer.norm_first:
            x = x + self._self_attn(w, sa, norm(w["norm1"], x), cache["self_attn"], hidden, t0)
            x = x + self._cross_attn(w, ca, norm(w["norm2"], x), memory, cache["cross_attn"], src_hidden)
            return x + self._ffn(w, layer.ff, norm(w["norm3"], x))
        x = norm(w["norm1"], x + self._self_attn(w, sa, x, cache["self_attn"], hidden, t0))
        x = norm(w["norm2"], x + self._cross_attn(w, ca, x, memory, cache["cross_attn"], src_hidden))
        return norm(w["norm3"], x + self._ffn(w, layer.ff, x))

    def _self_attn(self, w, attn, x, cache, hidden, t0):
        H, dk, B = attn.n_heads, attn.d_head, x.shape[1]
        qkv = np.ascontiguousarray(_affine(w["qkv"], x).T).reshape(B, 3, H, 1, dk)  # each head's q, k, v (1, dk)
        k = _write_one(cache, "k", qkv[:, 1], t0)  # (B, H, T, dk), written into the buffer
        v = _write_one(cache, "v", qkv[:, 2], t0)
        return _affine(w["sa_out"], _attend(qkv[:, 0], k, v, hidden))

    def _cross_attn(self, w, attn, x, memory, cache, src_hidden):
        H, dk, B = attn.n_heads, attn.d_head, x.shape[1]
        if "k" not in cache:  # the first step: the memory's keys and values (B, H, S, dk), for every later step
            S, (wkv, bkv) = memory.shape[1], w["kv"]
            kv = memory.reshape(B * S, H * dk) @ wkv.T
            if bkv is not None:
                kv += bkv
            kv = kv.reshape(B, S, 2, H, dk).transpose(2, 0, 3, 1, 4)
            cache["k"], cache["v"] = np.ascontiguousarray(kv[0]), np.ascontiguousarray(kv[1])
        q = np.ascontiguousarray(_affine(w["q"], x).T).reshape(B, H, 1, dk)
        return _affine(w["ca_out"], _attend(q, cache["k"], cache["v"], src_hidden))

    @staticmethod
    def _ffn(w, ff, x: np.ndarray) -> np.ndarray:
        """PositionwiseFeedForward.forward in eval mode, x (d, B)."""
        h = _affine(w["ff1"], x)  # (d_ff, B)
        if ff.activation_name == "relu":
            np.maximum(h, 0, out=h)
        else:
            h = ff.activation(h)
        return _affine(w["ff2"], h)

    def _norm(self, wb, x: np.ndarray) -> np.ndarray:
        """LayerNorm.forward over the features of x (d, B), without its checks and cache; the two means (of x, then
        of the squared deviations) as products with a row of 1/d, cheaper than NumPy's reductions on a few columns."""
        weight, bias, eps = wb
        xc = x - self.mean_of @ x  # (d, B) - (1, B)
        var = self.mean_of @ np.square(xc)  # biased variance (1, B)
        var += eps
        xc /= np.sqrt(var, out=var)
        xc *= weight  # (d, B), repeated
        xc += bias
        return xc


class _Repeat:
    """Biases and LayerNorm parameters repeated over the B columns of the feature-major step."""

    def __init__(self, B: int):
        self.B = B

    def __call__(self, b: np.ndarray | None) -> np.ndarray | None:
        return None if b is None else np.repeat(b[:, None], self.B, axis=1)  # (n,) -> (n, B)

    def linear(self, lin) -> tuple[np.ndarray, np.ndarray | None]:
        return lin.weight.data, self(_data(lin.bias))  # (d_out, d_in), (d_out, B)

    def norm(self, ln) -> tuple[np.ndarray, np.ndarray, float]:
        return self(ln.weight.data), self(ln.bias.data), ln.eps


def _fused(attn, names: tuple[str, ...], bias) -> tuple[np.ndarray, np.ndarray | None]:
    """The projections `names` of `attn` stacked: one (n * d_out, d_in) matrix and one bias, the bias repeated by
    `bias` (a _Repeat, or None: a plain vector). The query projection comes out times 1/sqrt(dk) (and
    score_scale's 1/sqrt(H)): the scores need no scaling after."""
    projs = [getattr(attn, n) for n in names]
    scale = (1.0 if attn._q_scale is None else attn._q_scale) / math.sqrt(attn.d_head)
    scales = [scale if n == "q_proj" else 1.0 for n in names]
    w = np.concatenate([p.weight.data * c for p, c in zip(projs, scales, strict=True)], axis=0)  # (n * d, d)
    if all(p.bias is None for p in projs):
        return w, None
    zeros = np.zeros(projs[0].out_features, w.dtype)
    b = np.concatenate([zeros if p.bias is None else p.bias.data * c for p, c in zip(projs, scales, strict=True)])
    return w, b if bias is None else bias(b)


def _data(p):
    return None if p is None else p.data


def _affine(wb: tuple[np.ndarray, np.ndarray | None], x: np.ndarray) -> np.ndarray:
    """w @ x + b for x (d_in, B), w (d_out, d_in), b (d_out, B): Linear.forward, feature-major, without its
    checks and cache."""
    w, b = wb
    y = w @ x
    if b is not None:
        y += b
    return y


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, hidden: np.ndarray | None) -> np.ndarray:
    """One query per row and head: q (B, H, 1, dk) already scaled, k, v (B, H, T, dk), hidden (B, 1, 1, T) True
    where a key may not be seen (no row hides all) -> the heads' outputs merged, (d, B): softmax(q k^T) v."""
    s = q @ k.transpose(0, 1, 3, 2)  # (B, H, 1, T): the scores
    if hidden is not None:
        np.copyto(s, -np.inf, where=hidden)
    s -= np.maximum.reduce(s, axis=-1, keepdims=True)  # exp(s - max) as in attention_weights, in place
    np.exp(s, out=s)
    ctx = s @ v  # (B, H, 1, dk): the weighted sum before normalizing,
    ctx /= np.add.reduce(s, axis=-1, keepdims=True)  # then divided by the weights' sum (dk numbers, not T)
    B, H, _, dk = q.shape
    return ctx.reshape(B, H * dk).T  # (d, B): one position: merging the heads is a reshape


def _write_one(cache: dict, name: str, new: np.ndarray, t0: int) -> np.ndarray:
    """The keys (or values) new (B, H, 1, dk) of position t0 written into cache[name + "_buf"] (B, H, capacity,
    dk), cache[name] the view of positions 0..t0: `cache_append` without its checks when the buffer has room."""
    buf, old = cache.get(name + "_buf"), cache.get(name)
    if buf is None or buf.shape[2] <= t0 or old.shape[2] != t0:
        return cache_append(cache, name, new, 2)
    buf[:, :, t0 : t0 + 1] = new
    view = cache[name] = buf[:, :, : t0 + 1]
    return view


def _append_one(cache: dict, name: str, new: np.ndarray, axis: int, t0: int) -> np.ndarray:
    """`cache_append` of one position t0 when its buffer has room (the usual case: a write and a view, no checks);
    `cache_append` itself otherwise (the first step allocates the buffer)."""
    buf, old = cache.get(name + "_buf"), cache.get(name)
    if buf is None or buf.shape[axis] <= t0 or old is None or old.shape[axis] != t0:
        return cache_append(cache, name, new, axis)
    buf[_span(axis, t0, t0 + 1)] = new
    cache[name] = buf[_span(axis, 0, t0 + 1)]
    return cache[name]


# -- checks -------------------------------------------------------------------------------------------------------


@contextmanager
def _eval_mode(model):
    """Dropout off for the duration (decoding is deterministic), the caller's mode restored after. The searches'
    forwards overwrite the modules' caches, so the model's own is cleared after: a backward after a search is an
    error ("before forward"), not the gradient of the search's last eval forward (as after GPT.generate)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
        model._cache = None


def _check_int(name: str, arg: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: {arg} must be an int >= {low}, got {value!r}")
    return int(value)


def _describe(x) -> str:
    return f"shape {x.shape}, dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__


def _check_args(name: str, model, bos_id, eos_id, max_len=None) -> None:
    """Special ids are tokens of the target vocabulary other than pad; max_len fits the model's positions."""
    V, pad = model.tgt_vocab_size, model.pad_id
    for arg, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < V:
            raise ValueError(f"{name}: {arg} must be a token id in [0, {V}) (the target vocabulary), got {value!r}")
        if value == pad:
            raise ValueError(f"{name}: {arg}={value} is the model's pad_id: padding is masked, it cannot be {arg}")
    if max_len is None:
        return
    _check_int(name, "max_len", max_len)
    if max_len > model.max_len:
        raise ValueError(
            f"{name}: max_len={max_len} exceeds the model's max_len={model.max_len} (the decoder reads bos and up "
            f"to max_len - 1 generated tokens, one position each)"
        )
