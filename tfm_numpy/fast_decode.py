"""The lean step of the NumPy searches: what `Transformer.decode_step` computes for one new token per row, without
its bookkeeping. `greedy_decode` and `beam_search` (decoding.py) run their cached steps through it when `lean_fits`
says it computes what decode_step would (to rounding); decode_step otherwise.

decode_step checks every module's inputs, copies the caller's arrays, works on (B, T, d) for any T and runs three
Linear calls for q, k, v: for one new token of a small model that bookkeeping sets the time of a step
(benchmarks/bench.py, section "decode"). The searches' inputs are their own, checked once, so `LeanStep` runs the
same arithmetic without it: q, k, v from ONE matmul with weights stacked once per search (the state_dict is
unchanged), the memory's keys and values projected once, the new ones written straight into the cache's buffers
(layout (B, H, T, dk), so `reorder_cache` and decode_step read it as before), activations feature-major (d, B).
What it does not cover takes `decode_step`: training mode, tiled attention, the shared head projections of chapter
16a, a cache that concatenates, a source row that is all padding.
"""

from __future__ import annotations

import math

import numpy as np

from .attention import MultiHeadAttention
from .encoder_decoder import DecoderLayer, DropoutAfterNormDecoderLayer
from .kv_cache import append_position
from .positional import sinusoidal_positional_encoding
from .sublayers import PositionwiseFeedForward
from .transformer import Transformer

__all__ = ["lean_fits", "LeanStep"]


def lean_fits(model, tgt: np.ndarray, src_mask: np.ndarray, cache: dict) -> bool:
    """Whether the lean step computes what `model.decode_step` would, to rounding (at the first step of a search)."""
    if not isinstance(model, Transformer) or type(model).decode_step is not Transformer.decode_step:
        return False
    layers = list(model.decoder.layers)
    attns = [a for layer in layers for a in (layer.self_attn, layer.cross_attn)]
    return (
        not any(m.training for _, m in model.named_modules())  # dropout off: the searches run in eval mode
        # the after-norm variant computes the same in eval mode (its dropout is the identity)
        and all(type(layer) in (DecoderLayer, DropoutAfterNormDecoderLayer) for layer in layers)
        and all(type(layer.ff) is PositionwiseFeedForward for layer in layers)
        and all(type(a) is MultiHeadAttention and a.attn_impl == "explicit" for a in attns)
        and cache.get("preallocate", True)
        and "layers" not in cache  # a fresh cache
        and bool((tgt[:, -1] != model.pad_id).all())  # the first position can be attended to: no empty row ...
        and bool(src_mask.any(axis=-1).all())  # ... in the self-attention, nor in the cross-attention
    )


class LeanStep:
    """The decoder's arithmetic for one new token per row, inference only: `step(token (B,), memory (B, S, d),
    src_mask (B, 1, 1, S), cache)` -> logits (B, V), what `decode_step(token[:, None], ...)[:, -1]` returns, with
    the cache filled the same way. Built at the first step of a search, for that search (see the module docstring).

    Inside, the activations are feature-major, x (d, B), a column per row of the batch, and every projection is
    W @ x with W as the Linear stores it, (d_out, d_in): with a handful of rows OpenBLAS is faster at W @ x than at
    x @ W^T (its kernels fill whole register tiles along the long side). The biases and the LayerNorms' weights are
    repeated to (d_out, B) at the first step: adding a whole matrix is cheaper for NumPy than broadcasting a column.
    Only the rounding differs from decode_step's (tests/test_lean_step.py)."""

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
                "qkv": _stacked_weights(sa, ("q_proj", "k_proj", "v_proj"), bias),  # (3d, d): q, k, v in one matmul
                "q": _stacked_weights(ca, ("q_proj",), bias),  # the cross-attention's queries
                "kv": _stacked_weights(ca, ("k_proj", "v_proj"), None),  # the memory's keys and values, once
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
        keep = append_position(cache, "keep", real[:, None, None, None], 3, t0)  # (B, 1, 1, T)
        self.padded = self.padded or (m.tgt_padding_mask and not real.all())
        masked_keys = ~keep if self.padded else None  # padded target keys, once there are any (the causal mask: none)
        y = m.tgt_embed.weight.data[token]  # (B, d): one row per new token
        if m._in_scale is not None:
            y *= m._in_scale
        y += self.positions[t0]
        x = y.T  # (d, B): feature-major from here on
        if self.embed_norm is not None:
            x = self._norm(self.embed_norm, x)
        src_masked_keys = ~src_mask if self.src_padded else None  # (B, 1, 1, S)
        for i, layer in enumerate(self.layers):
            x = self._layer(self.w[i], layer, x, memory, cache["layers"][i], masked_keys, src_masked_keys, t0)
        if self.final_norm is not None:
            x = self._norm(self.final_norm, x)
        logits = m.output_projection.weight.data @ x  # (V, B): the new position only
        if m._out_scale is not None:
            logits *= logits.dtype.type(m._out_scale)
        cache["length"] = t0 + 1
        return logits.T  # (B, V), a view

    def _layer(self, w, layer, x, memory, cache, masked_keys, src_masked_keys, t0):
        """DecoderLayer.forward_step in eval mode (dropout is the identity), x (d, B)."""
        sa, ca, norm = layer.self_attn, layer.cross_attn, self._norm
        if layer.norm_first:
            x = x + self._self_attn(w, sa, norm(w["norm1"], x), cache["self_attn"], masked_keys, t0)
            x = x + self._cross_attn(w, ca, norm(w["norm2"], x), memory, cache["cross_attn"], src_masked_keys)
            return x + self._ffn(w, layer.ff, norm(w["norm3"], x))
        x = norm(w["norm1"], x + self._self_attn(w, sa, x, cache["self_attn"], masked_keys, t0))
        x = norm(w["norm2"], x + self._cross_attn(w, ca, x, memory, cache["cross_attn"], src_masked_keys))
        return norm(w["norm3"], x + self._ffn(w, layer.ff, x))

    def _self_attn(self, w, attn, x, cache, masked_keys, t0):
        H, dk, B = attn.n_heads, attn.d_head, x.shape[1]
        qkv = np.ascontiguousarray(_affine(w["qkv"], x).T).reshape(B, 3, H, 1, dk)  # each head's q, k, v (1, dk)
        k = append_position(cache, "k", qkv[:, 1], 2, t0)  # (B, H, T, dk), written into the buffer
        v = append_position(cache, "v", qkv[:, 2], 2, t0)
        return _affine(w["sa_out"], _attend(qkv[:, 0], k, v, masked_keys))

    def _cross_attn(self, w, attn, x, memory, cache, src_masked_keys):
        H, dk, B = attn.n_heads, attn.d_head, x.shape[1]
        if "k" not in cache:  # the first step: the memory's keys and values (B, H, S, dk), for every later step
            S, (wkv, bkv) = memory.shape[1], w["kv"]
            kv = memory.reshape(B * S, H * dk) @ wkv.T
            if bkv is not None:
                kv += bkv
            kv = kv.reshape(B, S, 2, H, dk).transpose(2, 0, 3, 1, 4)
            cache["k"], cache["v"] = np.ascontiguousarray(kv[0]), np.ascontiguousarray(kv[1])
        q = np.ascontiguousarray(_affine(w["q"], x).T).reshape(B, H, 1, dk)
        return _affine(w["ca_out"], _attend(q, cache["k"], cache["v"], src_masked_keys))

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
        return lin.weight.data, self(None if lin.bias is None else lin.bias.data)  # (d_out, d_in), (d_out, B)

    def norm(self, ln) -> tuple[np.ndarray, np.ndarray, float]:
        return self(ln.weight.data), self(ln.bias.data), ln.eps


def _stacked_weights(attn, names: tuple[str, ...], bias) -> tuple[np.ndarray, np.ndarray | None]:
    """The projections `names` of `attn` stacked: one (n * d_out, d_in) matrix and one bias, the bias repeated by
    `bias` (a _Repeat, or None: a plain vector). The query projection comes out times 1/sqrt(dk) (and
    score_scale's 1/sqrt(H)): the scores need no scaling after."""
    projs = [getattr(attn, n) for n in names]
    scale = (1.0 if attn.q_scale is None else attn.q_scale) / math.sqrt(attn.d_head)
    scales = [scale if n == "q_proj" else 1.0 for n in names]
    w = np.concatenate([p.weight.data * c for p, c in zip(projs, scales, strict=True)], axis=0)  # (n * d, d)
    if all(p.bias is None for p in projs):
        return w, None
    zeros = np.zeros(projs[0].out_features, w.dtype)
    b = np.concatenate([zeros if p.bias is None else p.bias.data * c for p, c in zip(projs, scales, strict=True)])
    return w, b if bias is None else bias(b)


def _affine(wb: tuple[np.ndarray, np.ndarray | None], x: np.ndarray) -> np.ndarray:
    """w @ x + b for x (d_in, B), w (d_out, d_in), b (d_out, B): Linear.forward, feature-major, without its
    checks and cache."""
    w, b = wb
    y = w @ x
    if b is not None:
        y += b
    return y


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, masked_keys: np.ndarray | None) -> np.ndarray:
    """One query per row and head: q (B, H, 1, dk) already scaled, k, v (B, H, T, dk), masked_keys (B, 1, 1, T) True
    where a key may not be seen (no row hides all) -> the heads' outputs merged, (d, B): softmax(q k^T) v."""
    s = q @ k.transpose(0, 1, 3, 2)  # (B, H, 1, T): the scores
    if masked_keys is not None:
        np.copyto(s, -np.inf, where=masked_keys)
    s -= np.maximum.reduce(s, axis=-1, keepdims=True)  # exp(s - max) as in attention_weights, in place
    np.exp(s, out=s)
    ctx = s @ v  # (B, H, 1, dk): the weighted sum before normalizing,
    ctx /= np.add.reduce(s, axis=-1, keepdims=True)  # then divided by the weights' sum (dk numbers, not T)
    B, H, _, dk = q.shape
    return ctx.reshape(B, H * dk).T  # (d, B): one position: merging the heads is a reshape
