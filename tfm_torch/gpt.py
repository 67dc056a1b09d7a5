"""Decoder-only, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.gpt (the GPT block, the
GPT, sampling with a key/value cache); autograd does the backward."""

from __future__ import annotations

import math

import torch
from torch import nn

from tfm_common.gpt_config import as_numpy_rng, check_gpt_config, check_sampling, sample_next
from tfm_common.training import eval_mode
from tfm_common.validate import check_size

from .attention import check_attention, use_attention
from .layers import Dropout, Embedding, LayerNorm, Linear
from .masks import causal_mask
from .modern import GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLUFeedForward, swiglu_hidden_size
from .module import Module, as_generator, check_dtype, check_indices
from .positional import LearnedPositionalEmbedding, PositionalEncoding, sinusoidal_positional_encoding
from .sublayers import PositionwiseFeedForward
from .transformer import to_reference_state_dict, xavier_uniform_

__all__ = ["GPTBlock", "GPT", "ReferenceGPT", "to_torch_nn_gpt"]


def make_norm(norm: str, d_model: int, dtype) -> nn.Module:
    return LayerNorm(d_model, dtype=dtype) if norm == "layernorm" else RMSNorm(d_model, dtype=dtype)


class GPTBlock(Module):
    """x = x + dropout1(self_attn(norm1(x))); x = x + dropout2(ff(norm2(x))) (twin of tfm_numpy's)."""

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
        dtype=None,
    ):
        super().__init__()
        dt, g = check_dtype(dtype), as_generator(rng)
        self.self_attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, dropout, rotary=rotary, rng=g, dtype=dt)
        if activation == "swiglu":
            self.ff = SwiGLUFeedForward(d_model, swiglu_hidden_size(d_ff), dropout, rng=g, dtype=dt)
        else:
            self.ff = PositionwiseFeedForward(d_model, d_ff, dropout, activation, rng=g, dtype=dt)
        self.norm1 = make_norm(norm, d_model, dt)
        self.norm2 = make_norm(norm, d_model, dt)
        self.dropout1 = Dropout(dropout, rng=g)
        self.dropout2 = Dropout(dropout, rng=g)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        x = x + self.dropout1(self.self_attn(self.norm1(x), mask, offset))
        return x + self.dropout2(self.ff(self.norm2(x)))

    def forward_step(self, x: torch.Tensor, cache: dict, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout1(self.self_attn.forward_step(self.norm1(x), cache, mask))
        return x + self.dropout2(self.ff(self.norm2(x)))


class GPT(Module):
    """The decoder-only Transformer, twin of tfm_numpy.GPT (see its docstring for the options and initialization).
    `model(tokens)` (B, T) -> logits (B, T, vocab_size). A tied weight is one nn.Parameter under two names."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        max_len: int,
        dropout: float = 0.0,
        *,
        norm: str = "layernorm",
        positional: str = "learned",
        activation: str = "gelu",
        n_kv_heads: int | None = None,
        tie_output: bool = True,
        attention: str = "explicit",
        block_size: int = 64,
        rng=None,
        dtype=None,
    ):
        super().__init__()
        self.config = c = check_gpt_config("GPT", {k: v for k, v in locals().items() if k in _ARGS})
        attention, block_size = check_attention("GPT", attention, block_size)  # refused before anything is built
        self.vocab_size, self.d_model, self.max_len = c["vocab_size"], c["d_model"], c["max_len"]
        dt, g = check_dtype(dtype), as_generator(rng)
        self.embed = Embedding(self.vocab_size, self.d_model, rng=g, dtype=dt)
        with torch.no_grad():
            self.embed.weight.mul_(self.d_model**-0.5)  # N(0, 1) -> N(0, 1/d_model)
        if positional == "learned":
            self.pos = LearnedPositionalEmbedding(self.max_len, self.d_model, rng=g, dtype=dt)
        elif positional == "sinusoidal":
            self.pos = PositionalEncoding(self.d_model, self.max_len, dtype=dt)
        else:
            self.pos = None
        self.dropout = Dropout(c["dropout"], rng=g)
        rotary = RotaryEmbedding(d_model // n_heads, self.max_len, dtype=dt) if positional == "rope" else None
        block = dict(norm=norm, activation=activation, n_kv_heads=c["n_kv_heads"], rotary=rotary, rng=g, dtype=dt)
        self.layers = nn.ModuleList(GPTBlock(d_model, n_heads, d_ff, c["dropout"], **block) for _ in range(n_layers))
        self.norm = make_norm(norm, d_model, dt)
        self.output_projection = Linear(d_model, self.vocab_size, bias=False, rng=g, dtype=dt)
        if c["tie_output"]:
            self.output_projection.weight = self.embed.weight
        else:
            xavier_uniform_(self.output_projection.weight, g)
        for _, p in self.layers.named_parameters():
            if p.dim() == 2:
                xavier_uniform_(p, g)
        use_attention(self, attention, block_size)  # how every block computes its heads (not a weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = self._check_tokens("tokens", tokens, 0)
        x = self._embed(tokens, 0)
        mask = causal_mask(T, device=tokens.device)
        for layer in self.layers:
            x = layer(x, mask)
        return self.output_projection(self.norm(x))  # (B, T, V)

    def _embed(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d_model)
        if self.pos is not None:
            x = self.pos(x, offset)
        return self.dropout(x)

    def forward_step(self, tokens: torch.Tensor, cache: dict) -> torch.Tensor:
        """The logits (B, Tn, V) of new tokens given the cache of the earlier calls (layout of tfm_numpy's)."""
        t0 = cache.get("length", 0)
        Tn = self._check_tokens("tokens", tokens, t0)
        mask = torch.ones(Tn, t0 + Tn, dtype=torch.bool, device=tokens.device).tril(t0)[None, None]
        x = self._embed(tokens, t0)
        layers = cache.setdefault("layers", [{} for _ in self.layers])
        for layer, layer_cache in zip(self.layers, layers, strict=True):
            x = layer.forward_step(x, layer_cache, mask)
        cache["length"] = t0 + Tn
        return self.output_projection(self.norm(x))

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens: int, temperature: float = 1.0, top_k=None, rng=None, use_cache=True):
        """The prompt (B, T0) followed by max_new_tokens sampled tokens, as tfm_numpy.GPT.generate. `rng` is a
        numpy Generator or an int seed, as there: the uniforms come from NumPy in both tracks (the last position's
        logits, B x V numbers per step, are handed to tfm_common's sampler in float64), hence the same tokens."""
        T0 = self._check_tokens("tokens", tokens, 0)
        n = check_size("GPT.generate", "max_new_tokens", max_new_tokens, minimum=0)
        temperature, top_k = check_sampling("GPT.generate", temperature, top_k, self.vocab_size)
        if T0 + n - 1 > self.max_len:
            raise ValueError(f"GPT.generate: a prompt of {T0} tokens and max_new_tokens={n} need {T0 + n - 1} "
                             f"positions, more than max_len={self.max_len}")  # fmt: skip
        gen = as_numpy_rng("GPT.generate", rng)
        out = tokens.to(torch.long)
        with eval_mode(self):
            cache = {} if use_cache else None
            for i in range(n):
                if cache is None:
                    logits = self.forward(out)[:, -1]
                else:
                    logits = self.forward_step(out if i == 0 else out[:, -1:], cache)[:, -1]
                nxt = sample_next(logits.double().cpu().numpy(), temperature, top_k, gen)
                out = torch.cat([out, torch.from_numpy(nxt).to(out.device)[:, None]], dim=1)
        return out

    def _check_tokens(self, arg: str, tokens, offset: int) -> int:
        check_indices(f"GPT: {arg}", tokens, self.vocab_size)
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"GPT: {arg} expected shape (B, T) with T >= 1, got {tuple(tokens.shape)}")
        T = tokens.shape[1]
        if offset + T > self.max_len:
            start = f" after {offset} cached positions" if offset else ""
            raise ValueError(f"GPT: {arg} has length {T}{start}, more than max_len={self.max_len}")
        return T

    def attention_weights(self) -> list[torch.Tensor]:
        """[(B, H, T, T) per layer]: the last forward's self-attention weights (detached)."""
        return [layer.self_attn.attn_weights for layer in self.layers]

    def extra_repr(self) -> str:
        c = self.config
        return ", ".join(f"{k}={c[k]!r}" for k in ("norm", "positional", "activation", "n_kv_heads", "tie_output"))


_ARGS = ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_len", "dropout", "norm", "positional",
         "activation", "n_kv_heads", "tie_output")  # fmt: skip


# -- a GPT from torch.nn's own layers: what a user would build, the reference of the benchmark ---------------------


class ReferenceGPT(Module):
    """The 2017-style GPT (LayerNorm, learned or sinusoidal positions, ReLU or GELU, one key/value head per query
    head) built from torch's layers: nn.Embedding, nn.TransformerEncoder of nn.TransformerEncoderLayer(norm_first=
    True) with its final nn.LayerNorm, and a causal mask; the output layer tied or not as in `GPT`. Build it with
    `to_torch_nn_gpt(model)`, which copies the weights. forward(tokens) (B, T) -> logits (B, T, V)."""

    def __init__(self, config: dict, dtype=None):
        super().__init__()
        c, dt = check_gpt_config("ReferenceGPT", dict(config)), check_dtype(dtype)
        unsupported = {k: c[k] for k, ok in _REFERENCE_OK.items() if not ok(c[k])}
        if c["n_kv_heads"] not in (None, c["n_heads"]):  # torch.nn's attention: one key/value head per query head
            unsupported["n_kv_heads"] = c["n_kv_heads"]
        if unsupported:
            raise ValueError(f"ReferenceGPT: torch.nn's layers cannot build {unsupported} (only LayerNorm, learned "
                             "or sinusoidal positions, relu/gelu and n_kv_heads = n_heads)")  # fmt: skip
        self.config, d = c, c["d_model"]
        layer = nn.TransformerEncoderLayer(d, c["n_heads"], c["d_ff"], c["dropout"], c["activation"],
                                           batch_first=True, norm_first=True, dtype=dt)  # fmt: skip
        with torch.random.fork_rng(devices=[]):  # the weights are overwritten: leave the caller's stream alone
            self.embed = nn.Embedding(c["vocab_size"], d, dtype=dt)
            if c["positional"] == "learned":
                self.pos = nn.Embedding(c["max_len"], d, dtype=dt)
            else:
                self.register_buffer("pe", sinusoidal_positional_encoding(c["max_len"], d, dt), persistent=False)
            norm = nn.LayerNorm(d, dtype=dt)
            self.encoder = nn.TransformerEncoder(layer, c["n_layers"], norm=norm, enable_nested_tensor=False)
            self.output_projection = nn.Linear(d, c["vocab_size"], bias=False, dtype=dt)
        if c["tie_output"]:
            self.output_projection.weight = self.embed.weight
        self.dropout = nn.Dropout(c["dropout"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        table = self.pos.weight[:T] if self.config["positional"] == "learned" else self.pe[:T]  # (T, d)
        x = self.dropout(self.embed(tokens) * math.sqrt(self.config["d_model"]) + table)  # (B, T, d)
        future = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)  # True = may NOT attend (torch's)
        return self.output_projection(self.encoder(x, mask=future, is_causal=True))  # (B, T, V)


_REFERENCE_OK = {
    "norm": lambda v: v == "layernorm",
    "positional": lambda v: v in ("learned", "sinusoidal"),
    "activation": lambda v: v in ("relu", "gelu"),
}


def to_torch_nn_gpt(model: GPT) -> ReferenceGPT:
    """Our torch GPT's weights in a ReferenceGPT (same dtype and mode). Keys: layers.i.* and norm.* go under
    encoder., the q, k, v projections are stacked into in_proj_weight (3d, d), ff.linear1 -> linear1."""
    ref = ReferenceGPT(model.config, dtype=model.embed.weight.dtype)
    state = {(f"encoder.{k}" if k.startswith(("layers.", "norm.")) else k): v for k, v in model.state_dict().items()}
    mapped = {k.removeprefix("transformer."): v for k, v in to_reference_state_dict(state).items()}
    ref.load_state_dict(mapped)
    return ref.train(model.training)
