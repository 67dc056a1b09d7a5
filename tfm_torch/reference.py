"""The references built from torch.nn's own layers, and the conversion of our weights into them (torch only, so
tfm_numpy never imports torch): what a user would build, to check us against the implementation PyTorch ships.

- `ReferenceTransformer`: `torch.nn.Transformer` plus embeddings and an output layer, the encoder-decoder of
  chapter 10; `to_torch_nn_transformer(model)` and `from_torch_nn_transformer(ref)` move the weights, through
  `to_reference_state_dict` / `from_reference_state_dict` (the keys renamed, q, k, v packed into in_proj_weight).
- `ReferenceGPT`: `nn.TransformerEncoder` of `nn.TransformerEncoderLayer(norm_first=True)` under a causal mask,
  the GPT of chapter 17b that the benchmark compares with; `to_torch_nn_gpt(model)` moves the weights.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from tfm_common.config import TRANSFORMER_ARGS, check_gpt_config, check_transformer_config

from .gpt import GPT
from .module import Module, check_dtype
from .positional import sinusoidal_positional_encoding
from .transformer import Transformer

__all__ = ["ReferenceTransformer", "to_reference_state_dict", "from_reference_state_dict", "to_torch_nn_transformer",
           "from_torch_nn_transformer", "ReferenceGPT", "to_torch_nn_gpt"]  # fmt: skip


# -- torch.nn.Transformer, the reference of the encoder-decoder ------------------------------------------------------


class ReferenceTransformer(Module):
    """Our model built from torch's own layers: nn.Embedding, a positional table, nn.Transformer, nn.Linear.

    Same constructor arguments as `Transformer`; `ref.transformer` is a plain `torch.nn.Transformer`
    (batch_first=True, norm_first as ours). torch.nn.Transformer always puts a LayerNorm after each stack;
    ours has one only for Pre-LN (final_norm=None), and a LayerNorm with weight 1 and bias 0 is NOT the identity
    (it normalizes; it only looks like one at initialization, when the last layer's own LayerNorm, also at 1 and 0,
    has just normalized). So the encoder and decoder are given as `custom_encoder=nn.TransformerEncoder(...,
    norm=None)` and `custom_decoder=nn.TransformerDecoder(..., norm=None)` when ours has no final norm.

    forward(src, tgt_in) -> logits (B, T, V). Masks in torch's meaning: True = may NOT attend (the opposite of
    ours), built at this one boundary: `src == pad_id` as src_key_padding_mask and memory_key_padding_mask,
    `tgt_in == pad_id` as tgt_key_padding_mask, and the causal tgt_mask True above the diagonal.

    Quirks of torch's fast paths, avoided here: nn.TransformerEncoder(enable_nested_tensor=True) (the default)
    turns a padded batch into a nested tensor in eval mode and returns zeros at padded positions (ours computes
    them), so it is built with enable_nested_tensor=False. In eval mode without autograd, the encoder layers may
    also take a fused "fast path" (torch._transformer_encoder_layer_fwd); it computes the same function, in a
    different order of floating-point operations.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int = 512,
        n_heads: int = 8,
        d_ff: int = 2048,
        n_layers: int = 6,
        dropout: float = 0.1,
        max_len: int = 1024,
        norm_first: bool = False,
        positional: str = "sinusoidal",
        share_embeddings: bool = False,
        tie_output: bool = True,
        pad_id: int = 0,
        activation: str = "relu",
        final_norm: bool | None = None,
        *,
        dtype=None,
    ):
        args = locals()  # the constructor's arguments, as a dict
        super().__init__()
        c = self.config = check_transformer_config("ReferenceTransformer", {k: args[k] for k in TRANSFORMER_ARGS})
        dt = check_dtype(dtype)
        self.d_model, self.pad_id = d_model, pad_id
        final = norm_first if final_norm is None else final_norm
        layer_args = dict(dropout=dropout, activation=activation, batch_first=True, norm_first=norm_first, dtype=dt)
        # torch's constructors initialize from the global generator; fork it so that building a reference
        # leaves the caller's random stream untouched (the weights are overwritten by a state_dict anyway).
        with torch.random.fork_rng(devices=[]):
            self.src_embed = nn.Embedding(src_vocab_size, d_model, padding_idx=pad_id, dtype=dt)
            self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model, padding_idx=pad_id, dtype=dt)
            if share_embeddings:
                self.tgt_embed.weight = self.src_embed.weight
            if positional == "learned":  # keys src_pos.weight, tgt_pos.weight, as ours
                self.src_pos = nn.Embedding(max_len, d_model, dtype=dt)
                self.tgt_pos = nn.Embedding(max_len, d_model, dtype=dt)
            else:
                self.register_buffer("pe", sinusoidal_positional_encoding(max_len, d_model, dt), persistent=False)
            encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(d_model, n_heads, d_ff, **layer_args),
                n_layers,
                norm=nn.LayerNorm(d_model, dtype=dt) if final else None,
                enable_nested_tensor=False,
            )
            decoder = nn.TransformerDecoder(
                nn.TransformerDecoderLayer(d_model, n_heads, d_ff, **layer_args),
                n_layers,
                norm=nn.LayerNorm(d_model, dtype=dt) if final else None,
            )
            self.transformer = nn.Transformer(
                d_model, n_heads, n_layers, n_layers, d_ff, custom_encoder=encoder, custom_decoder=decoder, **layer_args
            )
            self.output_projection = nn.Linear(d_model, tgt_vocab_size, bias=False, dtype=dt)
            if tie_output:
                self.output_projection.weight = self.tgt_embed.weight
        self.dropout = nn.Dropout(dropout)  # torch's dropout: the global generator (compare with dropout off)
        self.positional, self.max_len = c["positional"], max_len

    def _embed(self, tokens: torch.Tensor, embed: nn.Embedding, pos: nn.Embedding | None) -> torch.Tensor:
        T = tokens.shape[1]
        table = self.pe[:T] if pos is None else pos.weight[:T]  # (T, d)
        return self.dropout(embed(tokens) * math.sqrt(self.d_model) + table)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        learned = self.positional == "learned"
        x = self._embed(src, self.src_embed, self.src_pos if learned else None)  # (B, S, d)
        y = self._embed(tgt_in, self.tgt_embed, self.tgt_pos if learned else None)  # (B, T, d)
        src_pad = src == self.pad_id  # (B, S): True = padding = may NOT attend (torch's meaning, not ours)
        T = tgt_in.shape[1]
        future = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).triu(1)  # (T, T): True = may NOT attend
        h = self.transformer(
            x,
            y,
            tgt_mask=future,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_in == self.pad_id,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,  # `future` is causal: said, not checked by reading its values (a torch.compile break)
        )  # (B, T, d)
        return self.output_projection(h)  # (B, T, V)


def to_reference_state_dict(state: dict) -> dict:
    """Our state_dict keys and tensors -> ReferenceTransformer's (torch.nn.Transformer's inside `transformer.`):

    encoder.layers.0.self_attn.{q,k,v}_proj.weight  -> transformer.encoder.layers.0.self_attn.in_proj_weight
                                                       (the three (d, d) matrices stacked: (3d, d), q k v)
    encoder.layers.0.ff.linear1.weight               -> transformer.encoder.layers.0.linear1.weight
    decoder.layers.0.cross_attn.*                    -> transformer.decoder.layers.0.multihead_attn.*
    encoder.norm.*, norm1.*, out_proj.*              -> the same names under transformer.
    embeddings, positions, output_projection         -> unchanged
    """
    out, packed = {}, {}
    for key, value in state.items():
        if not key.startswith(("encoder.", "decoder.")):
            out[key] = value
            continue
        key = "transformer." + key.replace(".cross_attn.", ".multihead_attn.").replace(".ff.", ".")
        m = re.fullmatch(r"(.*)\.([qkv])_proj\.(weight|bias)", key)
        if m:
            packed.setdefault((m[1], m[3]), {})[m[2]] = value
        else:
            out[key] = value
    for (prefix, kind), qkv in packed.items():
        out[f"{prefix}.in_proj_{kind}"] = torch.cat([torch.as_tensor(qkv[c]) for c in "qkv"])
    return out


def from_reference_state_dict(state: dict) -> dict:
    """The inverse of `to_reference_state_dict`: in_proj_weight (3d, d) is split into q, k, v in that order."""
    out = {}
    for key, value in state.items():
        if not key.startswith("transformer."):
            out[key] = value
            continue
        key = key.removeprefix("transformer.").replace(".multihead_attn.", ".cross_attn.")
        key = re.sub(r"\.(linear[12])\.", r".ff.\1.", key)
        m = re.fullmatch(r"(.*)\.in_proj_(weight|bias)", key)
        if m:
            for c, part in zip("qkv", torch.as_tensor(value).chunk(3), strict=True):
                out[f"{m[1]}.{c}_proj.{m[2]}"] = part
        else:
            out[key] = value
    return out


def to_torch_nn_transformer(model: Transformer) -> ReferenceTransformer:
    """Our torch model's weights in a ReferenceTransformer (torch.nn.Transformer inside), same dtype and mode."""
    odd = sorted(set(model.config) - set(TRANSFORMER_ARGS))
    if odd:
        raise ValueError(f"to_torch_nn_transformer: torch.nn.Transformer has no counterpart of the options {odd}")
    ref = ReferenceTransformer(**model.config, dtype=model.src_embed.weight.dtype)
    ref.load_state_dict(to_reference_state_dict(model.state_dict()))
    return ref.train(model.training)


def from_torch_nn_transformer(ref: ReferenceTransformer, *, rng=None) -> Transformer:
    """A ReferenceTransformer's weights in our torch model (same configuration, dtype and mode).
    `rng` only seeds the dropout masks of the new model."""
    model = Transformer(**ref.config, rng=rng, dtype=ref.src_embed.weight.dtype)
    model.load_state_dict(from_reference_state_dict(ref.state_dict()))
    return model.train(ref.training)


# -- a GPT from torch.nn's own layers: what a user would build, the reference of the benchmark ---------------------


class ReferenceGPT(Module):
    """The 2017-style GPT (LayerNorm, learned or sinusoidal positions, ReLU or GELU, one key/value head per query
    head) built from torch's layers: nn.Embedding, nn.TransformerEncoder of nn.TransformerEncoderLayer(norm_first=
    True) with its final nn.LayerNorm, and a causal mask; the output layer tied or not as in `GPT`. Build it with
    `to_torch_nn_gpt(model)`, which copies the weights. forward(tokens) (B, T) -> logits (B, T, V)."""

    def __init__(self, config: dict, dtype=None):
        super().__init__()
        c, dt = check_gpt_config("ReferenceGPT", dict(config)), check_dtype(dtype)
        unsupported = {k: c[k] for k, ok in _GPT_REFERENCE_OK.items() if not ok(c[k])}
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


_GPT_REFERENCE_OK = {
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
