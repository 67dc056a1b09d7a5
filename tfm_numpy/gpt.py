"""Decoder-only, NumPy track: the GPT block, the GPT (forward and hand-written backward) and sampling with a
key/value cache.

Shapes: tokens `(B, T)` ids, activations `(B, T, d_model)`, logits `(B, T, vocab_size)`. The model predicts token
t + 1 from tokens 0 .. t: a causal mask (1, 1, T, T), no padding (training windows all have the same length).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tfm_common.config import own_init
from tfm_common.model_doors import GPTBlockDoor, GPTDoor, WindowedGPTDoor
from tfm_common.rolling_cache import EMPTY_SLOT, kept_positions, rolling_slots, window_allowed
from tfm_common.sampling import sample_next
from tfm_common.training import eval_mode

from .attention import check_attn_impl, use_attention
from .layers import Dropout, Embedding, LayerNorm, Linear
from .masks import band_mask, causal_mask
from .modern import (
    GroupedQueryAttention,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUFeedForward,
    rope_angles_at,
    swiglu_hidden_size,
)
from .module import Module, ModuleList, as_rng, check_dtype, check_indices, scale_
from .positional import LearnedPositionalEmbedding, PositionalEncoding
from .sublayers import PositionwiseFeedForward
from .transformer import xavier_uniform_

__all__ = ["GPTBlock", "GPT", "WindowedGPT"]


def make_norm(norm: str, d_model: int, dtype) -> Module:
    return LayerNorm(d_model, dtype=dtype) if norm == "layernorm" else RMSNorm(d_model, dtype=dtype)


class GPTBlock(GPTBlockDoor, Module):
    """A Pre-LN decoder block without cross-attention:

        x = x + dropout1(self_attn(norm1(x), causal mask))
        x = x + dropout2(ff(norm2(x)))

    With norm="layernorm", n_kv_heads=None, no rotary and activation "relu"/"gelu", this is chapter 8's
    EncoderLayer(norm_first=True) given a causal mask: the same submodule names, the same state_dict keys, the same
    function (a test loads one into the other). The options swap the parts: RMSNorm for LayerNorm, grouped-query
    for multi-head attention, rotary positions inside the attention, a SwiGLU feed-forward of width
    swiglu_hidden_size(d_ff) (the parameters of a d_ff-wide two-matrix one).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        *,
        norm: str = "layernorm",
        activation: str = "gelu",
        n_kv_heads: int | None = None,
        rotary: RotaryEmbedding | None = None,
        rng=None,
        dtype=np.float32,
    ):
        super().__init__()
        dt, rng = check_dtype(dtype), as_rng(rng)
        self.self_attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, dropout, rotary=rotary, rng=rng, dtype=dt)
        if activation == "swiglu":
            self.ff = SwiGLUFeedForward(d_model, swiglu_hidden_size(d_ff), dropout, rng=rng, dtype=dt)
        else:
            self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation, rng=rng, dtype=dt)
        self.norm1 = make_norm(norm, d_model, dt)
        self.norm2 = make_norm(norm, d_model, dt)
        self.dropout1 = Dropout(dropout, rng=rng)  # on each sublayer's output, before the residual sum
        self.dropout2 = Dropout(dropout, rng=rng)

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        x = x + self.dropout1(self.self_attn(self.norm1(x), mask, offset))
        return x + self.dropout2(self.ff(self.norm2(x)))  # (B, T, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        # each residual x + f(norm(x)) passes its gradient on unchanged AND through f and the norm
        dx = grad_out + self.norm2.backward(self.ff.backward(self.dropout2.backward(grad_out)))
        return dx + self.norm1.backward(self.self_attn.backward(self.dropout1.backward(dx)))

    def forward_step(self, x: np.ndarray, cache: dict, mask: np.ndarray | None = None) -> np.ndarray:
        """`forward` for new positions only, the earlier ones' keys and values in `cache` (inference only)."""
        x = x + self.dropout1(self.self_attn.forward_step(self.norm1(x), cache, mask))
        return x + self.dropout2(self.ff(self.norm2(x)))

    def forward_rolling(self, x: np.ndarray, cache: dict, mask: np.ndarray, angles, keep, slots) -> np.ndarray:
        """`forward_step` with a rolling cache (chapter 21c): see GroupedQueryAttention.forward_rolling."""
        x = x + self.dropout1(self.self_attn.forward_rolling(self.norm1(x), cache, mask, angles, keep, slots))
        return x + self.dropout2(self.ff(self.norm2(x)))


class GPT(GPTDoor, Module):
    """A decoder-only Transformer (Radford et al., 2018, 2019): token embedding (+ positions), n_layers GPTBlocks
    under a causal mask, a final norm, and an output projection (tied to the embedding by default).

    `model(tokens)` (B, T) -> logits (B, T, vocab_size), where logits[:, t] predict tokens[:, t + 1];
    `model.backward(dlogits)` fills every parameter's gradient. Options:
      norm        "layernorm" (GPT-2) or "rmsnorm" (Llama): in every block and at the end
      positional  "learned" (GPT-2), "sinusoidal" (the 2017 table) or "rope" (rotary, inside the attention)
      activation  "gelu" (GPT-2; the exact form), "relu", or "swiglu" (Llama; width swiglu_hidden_size(d_ff))
      n_kv_heads  key/value heads for grouped-query attention (None: n_heads; 1: multi-query)
      tie_output  the output projection's weight IS the token embedding (GPT-2 does this)
      attn_impl   "explicit" (weights kept for plotting) or "flash" (tiled, chapter 15b, in tiles of tile_size
                  positions); tfm_torch also "sdpa". Not a weight and not in `config`: `use_attention(model, ...)`
                  switches it later
      window      None (full causal attention) or w >= 1: GPT(..., window=w, sinks=s) builds a WindowedGPT
                  (sliding-window attention and a rolling cache, chapter 21c); in `config` only when set
    Every option combination has one set of state_dict keys, in both tracks.

    Initialization (with `rng`), as chapter 10's Transformer: token embeddings N(0, 1/d_model), multiplied by
    sqrt(d_model) in the forward (unit variance, the scale of the positions added to them); every matrix of the
    blocks and an untied output projection Xavier-uniform; biases as their Linear; norms at weight 1 (bias 0).
    Both tracks draw the same *kind* of weights, not the same numbers: load one's state_dict into the other.

    `forward_step(tokens, cache)` runs new tokens only, reading earlier keys and values from `cache`;
    `generate(...)` samples with it.
    """

    _check_ids = staticmethod(check_indices)  # see tfm_common.model_doors

    # -- forward and backward --------------------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray) -> np.ndarray:
        x = self._embed(tokens, 0)  # (B, T, d)
        mask = causal_mask(tokens.shape[1])  # (1, 1, T, T)
        for layer in self.layers:
            x = layer(x, mask)
        self._cache = x.shape  # a forward to differentiate (forward_step leaves none)
        return self.output_projection(self.norm(x))  # (B, T, V)

    def backward(self, grad_logits: np.ndarray) -> None:
        """After `forward`: add dL/dparam into every parameter's grad (a tied weight gets both uses)."""
        self._saved()  # once per forward
        dx = self.norm.backward(self.output_projection.backward(grad_logits))  # (B, T, d)
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        dx = self.dropout.backward(dx)
        if self.pos is not None:
            dx = self.pos.backward(dx)
        self.embed.backward(dx * math.sqrt(self.d_model))

    # -- hidden states, for a head of another task (chapter 22b) ---------------------------------------------------
    def encode(self, tokens: np.ndarray) -> np.ndarray:
        """The hidden states (B, T, d_model) after the final norm: `forward` without the output projection. Row t
        has read tokens 0 .. t only (causal), so padding AFTER a row's last token changes nothing before it."""
        x = self._embed(tokens, 0)  # (B, T, d)
        mask = self._encode_mask(tokens.shape[1])  # causal (1, 1, T, T); a WindowedGPT's band
        for layer in self.layers:
            x = layer(x, mask)
        self._cache = x.shape
        return self.norm(x)  # (B, T, d)

    def encode_backward(self, grad_hidden: np.ndarray) -> None:
        """After `encode`: add dL/dparam into every parameter's grad, from dL/dhidden (B, T, d_model)."""
        self._saved()
        dx = self.norm.backward(grad_hidden)  # (B, T, d); the output projection was not used
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        dx = self.dropout.backward(dx)
        if self.pos is not None:
            dx = self.pos.backward(dx)
        self.embed.backward(dx * math.sqrt(self.d_model))

    def _encode_mask(self, T: int) -> np.ndarray:
        return causal_mask(T)  # (1, 1, T, T)

    def _check_encode(self, tokens) -> None:
        self._check_tokens(tokens, 0)

    def _embed(self, tokens: np.ndarray, offset: int) -> np.ndarray:
        x = self.embed(tokens) * math.sqrt(self.d_model)  # (B, T, d); the python float keeps float32 float32
        if self.pos is not None:
            x = self.pos(x, offset)
        return self.dropout(x)

    # -- incremental decoding --------------------------------------------------------------------------------------
    def forward_step(self, tokens: np.ndarray, cache: dict) -> np.ndarray:
        """The logits (B, Tn, V) of new tokens (B, Tn) given the `cache` of every earlier call (a dict, empty at the
        first; filled here): equal to `forward(all tokens so far)[:, -Tn:]` at the cost of the new ones only.
        cache["length"] counts the positions so far; cache["layers"][i] holds layer i's keys and values
        (B, n_kv_heads, length, d_head). Inference only: a backward after this is an error."""
        t0, Tn = cache.get("length", 0), tokens.shape[1]
        mask = np.tri(Tn, t0 + Tn, t0, dtype=bool)[None, None]  # (1, 1, Tn, t0 + Tn): new i sees 0 .. t0 + i
        x = self._embed(tokens, t0)
        layers = cache.setdefault("layers", [{} for _ in self.layers])
        for layer, layer_cache in zip(self.layers, layers, strict=True):
            x = layer.forward_step(x, layer_cache, mask)
        cache["length"] = t0 + Tn
        self._cache = None
        return self.output_projection(self.norm(x))

    def generate(
        self,
        tokens,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k=None,
        rng=None,
        use_cache=True,
        *,
        top_p=None,
        kv_dtype="float",
    ):
        """The prompt `tokens` (B, T0) followed by max_new_tokens sampled tokens: (B, T0 + max_new_tokens).

        Each new token is drawn from softmax(logits / temperature) over the top_k most probable tokens (all if
        None), then over the nucleus of those: the most probable ones whose probability first reaches top_p (in
        (0, 1]; None or 1: all). The order is that of Hugging Face's `generate`: temperature, top_k, top_p.
        temperature=0 is greedy (argmax). `rng` (a numpy Generator or int seed; None: seed 0) draws one
        uniform per row and step, in both tracks (tfm_common.sampling.sample_next), so the two tracks sample
        the same tokens from the same weights and seed. use_cache=False re-runs the whole sequence at every step
        (the same tokens, slower). kv_dtype="int8" keeps the cache's keys and values as int8 codes (`new_cache`).
        Eval mode (no dropout) for the call; the caller's mode is restored. Logits with
        no distribution (a NaN, e.g. from a NaN weight, or a row all -inf) raise FloatingPointError; +inf logits and
        a temperature too small for logits / T are taken at softmax's limits (see `sample_next`).
        """
        n, temperature, top_k, rng, top_p = self._check_generate(tokens, max_new_tokens, temperature, top_k, rng,
                                                                 use_cache, top_p, kv_dtype)  # fmt: skip
        out = tokens.astype(np.int64)
        with eval_mode(self):
            cache = self.new_cache(kv_dtype) if use_cache else None
            for i in range(n):
                if cache is None:
                    logits = self.forward(out)[:, -1]  # (B, V): the whole sequence again
                else:
                    logits = self.forward_step(out if i == 0 else out[:, -1:], cache)[:, -1]  # the new token only
                nxt = sample_next(logits, temperature, top_k, rng, top_p=top_p, name="GPT.generate")  # (B,)
                out = np.concatenate([out, nxt[:, None]], axis=1)
        self._cache = None
        return out


class WindowedGPT(WindowedGPTDoor, GPT):
    """The GPT with sliding-window attention (chapter 21c): `GPT(..., window=w, sinks=s)` builds one. The query at
    position i sees the keys i - w + 1 .. i and the first s positions ("attention sinks", Xiao et al. 2023); the same
    weights, state_dict keys and backward as the GPT (the backward is the same code: only the mask differs).

    `forward_step(tokens, cache)` keeps a rolling cache of s + w positions per layer, so memory is constant in the
    generated length, and with positional="rope" the positions may run past max_len (`generate` too): a key is
    rotated at its true position (`rope_angles_at`), and attention depends only on the offsets, all below w (or on
    a sink's). Learned and sinusoidal positions have max_len rows: past them it refuses.
    """

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        x = self._embed(tokens, 0)  # (B, T, d)
        mask = band_mask(tokens.shape[1], self.window, self.sinks)  # (1, 1, T, T): i sees i - w + 1 .. i (and sinks)
        for layer in self.layers:
            x = layer(x, mask)
        self._cache = x.shape
        return self.output_projection(self.norm(x))  # (B, T, V)

    def _encode_mask(self, T: int) -> np.ndarray:
        return band_mask(T, self.window, self.sinks)  # `encode` sees what `forward` sees

    def forward_step(self, tokens: np.ndarray, cache: dict) -> np.ndarray:
        """The logits (B, Tn, V) of new tokens (B, Tn) given the rolling `cache` (a dict, empty at the first call, or
        `new_cache("int8")`): equal to `forward(all tokens so far)[:, -Tn:]` (band mask) at the cost of the new ones.
        cache["length"] counts the positions so far, cache["slots"] (s + w,) the position each slot holds (-1:
        empty), cache["layers"][i] the keys and values (B, n_kv_heads, s + w, d_head): allocated once."""
        t0, Tn, size = cache.get("length", 0), tokens.shape[1], self.sinks + self.window
        new = np.arange(t0, t0 + Tn)  # the new positions
        slots = cache.get("slots", np.full(size, EMPTY_SLOT))  # (s + w,): the position in each slot
        keys = np.concatenate([slots, new])  # what the new queries may attend to: the slots, then themselves
        mask = window_allowed(new[:, None], keys[None, :], self.window, self.sinks)[None, None]  # (1, 1, Tn, s+w+Tn)
        keep = kept_positions(new, t0 + Tn - 1, self.window, self.sinks)  # still needed after this call
        where = rolling_slots(new[keep], self.window, self.sinks)  # and where they go
        rotary = self.layers[0].self_attn.rotary  # RoPE: the new positions' angles, computed (past max_len too)
        angles = None if rotary is None else rope_angles_at(new, rotary.d_head, rotary.base, rotary.dtype)
        x = self._embed(tokens, t0)  # learned or sinusoidal positions: read at t0 .. t0 + Tn - 1 (< max_len)
        layers = cache.setdefault("layers", [{} for _ in self.layers])
        for layer, layer_cache in zip(self.layers, layers, strict=True):
            x = layer.forward_rolling(x, layer_cache, mask, angles, keep, where)
        slots = slots.copy()
        slots[where] = new[keep]
        cache["slots"], cache["length"] = slots, t0 + Tn
        self._cache = None
        return self.output_projection(self.norm(x))


# the building blocks of the constructor written in tfm_common.model_doors (GPTDoor.__init__)
GPT._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_rng, check_attn_impl=check_attn_impl, use_attention=use_attention,
    Embedding=Embedding, scale_=scale_, LearnedPositionalEmbedding=LearnedPositionalEmbedding,
    PositionalEncoding=PositionalEncoding, Dropout=Dropout, RotaryEmbedding=RotaryEmbedding, GPTBlock=GPTBlock,
    ModuleList=ModuleList, make_norm=make_norm, Linear=Linear, xavier_uniform_=xavier_uniform_,
)  # fmt: skip
# a wrong argument is refused in the name of GPT, not of its door; tfm_numpy's default dtype
own_init(GPT, dtype=np.float32)
GPT._windowed = WindowedGPT  # what GPT(..., window=w) builds (GPTDoor.__new__)
