"""The full encoder-decoder Transformer, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.transformer; autograd does the backward.

Also here (torch only, so tfm_numpy never imports torch): the conversion between our model and
`torch.nn.Transformer` plus embeddings and an output layer (`ReferenceTransformer`), to check us against the
reference implementation PyTorch ships: `to_torch_nn_transformer(model)` and `from_torch_nn_transformer(ref)`.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from torch import nn

from tfm_common.doors import TransformerDoor
from tfm_common.pitfalls import LAYER_PITFALLS, MODEL_PITFALLS, check_model_pitfalls
from tfm_common.validate import check_flag, check_probability, check_size, check_sizes

from .attention import _check_mask as check_mask
from .attention import causal_mask, check_attention, decoder_mask, padding_mask, use_attention
from .decoding import cache_append
from .encoder_decoder import Decoder, Encoder, _Counted
from .layers import Dropout, Embedding, LayerNorm, Linear
from .module import as_generator, check_dtype, check_indices, check_input
from .positional import LearnedPositionalEmbedding, PositionalEncoding, sinusoidal_positional_encoding
from .sublayers import check_activation

__all__ = [
    "POSITIONAL",
    "xavier_uniform_",
    "Transformer",
    "ReferenceTransformer",
    "to_reference_state_dict",
    "from_reference_state_dict",
    "to_torch_nn_transformer",
    "from_torch_nn_transformer",
]

POSITIONAL = ("sinusoidal", "learned")


@torch.no_grad()
def xavier_uniform_(p: torch.Tensor, rng=None) -> torch.Tensor:
    """In place: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) for a (fan_out, fan_in) matrix (Glorot and Bengio,
    2010), drawn from an explicit generator; what torch.nn.init.xavier_uniform_ does for 2-D weights."""
    if p.dim() != 2:
        raise ValueError(f"xavier_uniform_: expected a matrix, got shape {tuple(p.shape)}")
    fan_out, fan_in = p.shape
    a = math.sqrt(6.0 / (fan_in + fan_out))
    return p.uniform_(-a, a, generator=as_generator(rng))


class Transformer(TransformerDoor, _Counted):
    """The encoder-decoder Transformer, twin of tfm_numpy.Transformer (see its docstring for the options, the
    weight sharing and the initialization). `model(src, tgt_in)` -> logits (B, T, tgt_vocab_size).

    Tied weights are one nn.Parameter registered under two (or three) names: autograd adds the gradients of
    every use into its one `.grad`; `named_parameters()` and `num_parameters()` list it once, `state_dict()`
    under each name.
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
        attention: str = "explicit",
        tile_size: int = 64,
        score_scale: str = "d_k",
        head_projection: str = "full",
        dropout_place: str = "sublayer",
        ff_dropout: bool = True,
        embed_scale: str = "embedding",
        embed_norm: bool = False,
        tgt_padding_mask: bool = True,
        rng=None,
        dtype=None,
    ):
        super().__init__()
        pitfalls = dict(score_scale=score_scale, head_projection=head_projection, dropout_place=dropout_place,
                        ff_dropout=ff_dropout, embed_scale=embed_scale, embed_norm=embed_norm,
                        tgt_padding_mask=tgt_padding_mask)  # fmt: skip
        self.config = _check_config(
            "Transformer",
            dict(
                src_vocab_size=src_vocab_size,
                tgt_vocab_size=tgt_vocab_size,
                d_model=d_model,
                n_heads=n_heads,
                d_ff=d_ff,
                n_layers=n_layers,
                dropout=dropout,
                max_len=max_len,
                norm_first=norm_first,
                positional=positional,
                share_embeddings=share_embeddings,
                tie_output=tie_output,
                pad_id=pad_id,
                activation=activation,
                final_norm=final_norm,
            ),
        )
        # the pitfall options (chapter 16a) join the configuration only where they differ from the paper's
        self.config.update(check_model_pitfalls("Transformer", self.config["norm_first"], pitfalls))
        c = self.config  # the checked arguments, sizes as Python ints (JSON-able: checkpoints record them)
        opts = {**MODEL_PITFALLS, **c}
        layer_opts = {k: opts[k] for k in LAYER_PITFALLS if opts[k] != LAYER_PITFALLS[k]}
        embed_scale, self.tgt_padding_mask = opts["embed_scale"], opts["tgt_padding_mask"]
        self._in_scale = math.sqrt(c["d_model"]) if embed_scale == "embedding" else None  # times the embeddings
        self._out_scale = c["d_model"] ** -0.5 if embed_scale == "logits" else None  # times the logits
        d_model, n_heads, d_ff, n_layers, max_len, pad_id = (c[k] for k in ("d_model", "n_heads", "d_ff", "n_layers",
                                                                            "max_len", "pad_id"))  # fmt: skip
        src_vocab_size, tgt_vocab_size = c["src_vocab_size"], c["tgt_vocab_size"]
        attention, tile_size = check_attention(
            "Transformer", attention, check_size("Transformer", "tile_size", tile_size)
        )
        self.d_model, self.max_len, self.pad_id = d_model, max_len, pad_id
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        dt, gen = check_dtype(dtype), as_generator(rng)
        stack = (n_layers, d_model, n_heads, d_ff, dropout, activation, norm_first, final_norm)

        self.src_embed = Embedding(src_vocab_size, d_model, padding_idx=pad_id, rng=gen, dtype=dt)
        self.tgt_embed = Embedding(tgt_vocab_size, d_model, padding_idx=pad_id, rng=gen, dtype=dt)
        with torch.no_grad():
            for emb in (self.src_embed, self.tgt_embed):
                if embed_scale != "none":  # "none" keeps N(0, 1), torch.nn.Embedding's default
                    emb.weight.mul_(d_model**-0.5)  # N(0, 1) -> N(0, 1/d_model); the padding row stays 0
        if share_embeddings:
            self.tgt_embed.weight = self.src_embed.weight  # one Parameter, two lookups
        self.src_pos = self._make_positional(positional, gen, dt)
        self.tgt_pos = self._make_positional(positional, gen, dt)
        self.src_dropout = Dropout(dropout, rng=gen)
        self.tgt_dropout = Dropout(dropout, rng=gen)
        self.src_embed_norm = LayerNorm(d_model, dtype=dt) if opts["embed_norm"] else None  # after the dropout
        self.tgt_embed_norm = LayerNorm(d_model, dtype=dt) if opts["embed_norm"] else None
        self.encoder = Encoder(*stack, rng=gen, dtype=dt, **layer_opts)
        self.decoder = Decoder(*stack, rng=gen, dtype=dt, **layer_opts)
        self.output_projection = Linear(d_model, tgt_vocab_size, bias=False, rng=gen, dtype=dt)  # (V, d)
        if tie_output:
            self.output_projection.weight = self.tgt_embed.weight  # logits = y @ E^T
        else:
            xavier_uniform_(self.output_projection.weight, gen)
        for p in [*self.encoder.parameters(), *self.decoder.parameters()]:
            if p.dim() == 2:
                xavier_uniform_(p, gen)
        use_attention(self, attention, tile_size)  # how every attention computes its heads (not a weight)

    def _make_positional(self, positional: str, gen, dt) -> nn.Module:
        if positional == "sinusoidal":  # no parameters; its own dropout unused (p=0): ours follows the sum
            return PositionalEncoding(self.d_model, self.max_len, dropout=0.0, dtype=dt)
        return LearnedPositionalEmbedding(self.max_len, self.d_model, rng=gen, dtype=dt)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) ids -> (memory (B, S, d), src_mask (B, 1, 1, S), True at real tokens)."""
        src_mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        x = self._embed(src, self.src_embed, self.src_pos, self.src_dropout, self.src_embed_norm)  # (B, S, d)
        return self.encoder(x, src_mask), src_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """tgt_in (B, T) ids, memory (B, S, d), src_mask (B, 1, 1, S) -> logits (B, T, tgt_vocab_size)."""
        tgt_mask = self._tgt_mask(tgt_in)  # (B, 1, T, T): causal and not padding
        y = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm)  # (B, T, d)
        y = self.decoder(y, memory, tgt_mask, src_mask)  # (B, T, d)
        return self._logits(y)  # (B, T, V)

    def decode_step(self, tgt_new: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: dict):
        """Incremental decoding (inference): the logits (B, Tn, V) of the new target tokens `tgt_new` (B, Tn) given
        the `cache` of the earlier calls (a dict, empty at first, filled here; the layout of tfm_numpy's: the target
        side's keys, values and padding mask in buffers of cache["capacity"] positions, written in place)."""
        t0, Tn = cache.get("length", 0), tgt_new.shape[1]
        cap = min(cache.setdefault("capacity", self.max_len), self.max_len)  # positions to make room for, once
        keep = cache_append(cache, "keep", padding_mask(tgt_new, self.pad_id), axis=3)  # (B, 1, 1, T), in place
        causal = torch.ones(Tn, t0 + Tn, dtype=torch.bool, device=tgt_new.device).tril(t0)  # new i sees 0 .. t0 + i
        tgt_mask = keep & causal if self.tgt_padding_mask else causal  # (B, 1, Tn, T), or (Tn, T): causal only
        y = self._embed(tgt_new, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm, t0)  # (B, Tn, d)
        room = {"capacity": cap, "preallocate": cache.get("preallocate", True)}
        layers = cache.setdefault("layers", [{"self_attn": dict(room)} for _ in self.decoder.layers])
        y = self.decoder.forward_step(y, memory, layers, tgt_mask, src_mask)  # (B, Tn, d)
        cache["length"] = t0 + Tn
        return self._logits(y)  # (B, Tn, V)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)  # (B, T, V)

    def _embed(self, tokens: torch.Tensor, embed: Embedding, pos: nn.Module, drop: Dropout, norm, offset: int = 0):
        x = embed(tokens)  # (B, T, d)
        if self._in_scale is not None:
            x = x * self._in_scale
        x = drop(pos(x, offset))
        return x if norm is None else norm(x)  # embed_norm=True: one more LayerNorm before the first layer

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        logits = self.output_projection(y)  # (B, T, V)
        return logits if self._out_scale is None else logits * self._out_scale

    def _tgt_mask(self, tgt_in: torch.Tensor) -> torch.Tensor:
        """Causal and not padding (B, 1, T, T); causal only (1, 1, T, T) with tgt_padding_mask=False."""
        if self.tgt_padding_mask:
            return decoder_mask(tgt_in, self.pad_id)
        return causal_mask(tgt_in.shape[1], tgt_in.device)

    _check_ids, _check_float = staticmethod(check_indices), staticmethod(check_input)  # see tfm_common.doors
    _check_mask = staticmethod(check_mask)

    # -- inspection -------------------------------------------------------------------------------------------
    def attention_weights(self) -> dict[str, list[torch.Tensor]]:
        """{"encoder": [(B, H, S, S)], "decoder": [(B, H, T, T)], "cross": [(B, H, T, S)]}, one per layer."""
        return {
            "encoder": self.encoder.attention_weights(),
            "decoder": self.decoder.attention_weights("self"),
            "cross": self.decoder.attention_weights("cross"),
        }

    def extra_repr(self) -> str:
        c = self.config
        return ", ".join(f"{k}={c[k]!r}" for k in ("norm_first", "positional", "share_embeddings", "tie_output"))


def _check_config(owner: str, c: dict) -> dict:
    """Validate the constructor's arguments before anything is allocated (as tfm_numpy's)."""
    c = dict(c)
    c.update(check_sizes(owner, **{k: c[k] for k in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads",
                                                         "d_ff", "n_layers", "max_len")}))  # fmt: skip
    if c["d_model"] % c["n_heads"]:
        raise ValueError(f"{owner}: d_model={c['d_model']} must be divisible by n_heads={c['n_heads']}")
    if c["positional"] not in POSITIONAL:
        raise ValueError(f"{owner}: positional must be one of {POSITIONAL}, got {c['positional']!r}")
    if c["positional"] == "sinusoidal" and c["d_model"] % 2:
        raise ValueError(f"{owner}: sinusoidal positions need an even d_model, got d_model={c['d_model']}")
    c["dropout"] = check_probability(owner, "dropout", c["dropout"], allow_one=False)
    check_activation(owner, c["activation"])
    for arg in ("norm_first", "share_embeddings", "tie_output"):
        c[arg] = check_flag(owner, arg, c[arg])
    if c["final_norm"] is not None:
        c["final_norm"] = check_flag(owner, "final_norm", c["final_norm"])
    if c["share_embeddings"] and c["src_vocab_size"] != c["tgt_vocab_size"]:
        raise ValueError(
            f"{owner}: share_embeddings=True needs one vocabulary, got src_vocab_size={c['src_vocab_size']} "
            f"and tgt_vocab_size={c['tgt_vocab_size']}"
        )
    pad, n = c["pad_id"], min(c["src_vocab_size"], c["tgt_vocab_size"])
    if isinstance(pad, (bool, np.bool_)) or not isinstance(pad, (int, np.integer)) or not 0 <= pad < n:
        raise ValueError(f"{owner}: pad_id must be an int in [0, {n}) (a token of both vocabularies), got {pad!r}")
    c["pad_id"] = int(pad)
    return c


# -- torch.nn.Transformer, the reference ------------------------------------------------------------------------


class ReferenceTransformer(_Counted):
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
        c = self.config = _check_config("ReferenceTransformer", {k: args[k] for k in _ARGS})
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


_ARGS = (
    "src_vocab_size",
    "tgt_vocab_size",
    "d_model",
    "n_heads",
    "d_ff",
    "n_layers",
    "dropout",
    "max_len",
    "norm_first",
    "positional",
    "share_embeddings",
    "tie_output",
    "pad_id",
    "activation",
    "final_norm",
)


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
    odd = sorted(set(model.config) - set(_ARGS))
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
