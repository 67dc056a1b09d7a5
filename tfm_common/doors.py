"""What a call from outside the library is checked for, for the 2017 model's layers, stacks and Transformer: the
rules once, for both tracks.

Each track's Module runs a module's `_check_<method>` (`_check_forward`, `_check_decode`, ...) at the outermost
call only (see tfm_numpy.module, "the door"); the calls a model makes to its own layers are not checked again. So
a layer's door must refuse everything its inner calls used to refuse: a mask handed to `EncoderLayer` is checked
here against its attention's scores, as MultiHeadAttention would have. The mixins below hold those rules; the
track supplies its array checks as static methods: `_check_float` (its check_input), `_check_mask` (the masks'
check) and, for the Transformer, `_check_ids` (its check_indices). Shapes are read through `.shape`, which arrays
and tensors share.

The layers', stacks' and Transformer's constructors are written here once too: the track supplies its building blocks
as `_parts` (`check_dtype`, `as_rng`, `make_attention`, `PositionwiseFeedForward`, `LayerNorm`, `Dropout`,
`ModuleList`; for the Transformer its embeddings, stacks and initializers), and `own_init` gives each class its own
copy with the track's default dtype.
"""

from __future__ import annotations

import math

from .attention import cached_positions
from .config import FF_ACTIVATIONS, transformer_options
from .pitfalls import check_layer_pitfalls
from .validate import check_choice, check_decode_cache, check_flag, check_size, check_sizes

__all__ = ["LayerDoor", "EncoderLayerDoor", "DecoderLayerDoor", "StackDoor", "TransformerDoor"]


class LayerDoor:
    """An encoder or decoder layer's options and checks: `dropout_place="after_norm"` (chapter 16a) builds the
    variant class `_after_norm` (whose residual dropout follows the LayerNorm) instead of the paper's layer."""

    _after_norm: type | None = None

    def __new__(cls, *args, dropout_place: str = "sublayer", **kwargs):
        return super().__new__(cls._after_norm if dropout_place == "after_norm" and cls._after_norm else cls)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        *,
        score_scale: str = "d_k",
        head_projection: str = "full",
        dropout_place: str = "sublayer",
        ff_dropout: bool = True,
        rng=None,
        dtype=None,
    ):
        """self_attn (and the decoder's cross_attn), ff, and per sublayer one LayerNorm (norm1, ...) and one
        residual Dropout (dropout1, ...), registered in that order.

        `dropout` goes to four places: the residual dropouts (the paper, section 5.4), and two that the paper's text
        does not name but its code (tensor2tensor), torch.nn.TransformerEncoderLayer and the Annotated Transformer
        have: the attention weights (every attention's own `dropout`) and the feed-forward's hidden units
        (`ff_dropout=True`). Chapter 16a measures both."""
        super().__init__()
        check_sizes(self._owner, d_model=d_model, n_heads=n_heads, d_ff=d_ff)
        check_choice(self._owner, "activation", activation, FF_ACTIVATIONS)
        self._options(self._owner, norm_first, dropout_place, ff_dropout)
        parts = self._parts
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        attn = dict(score_scale=score_scale, rng=rng, dtype=dt)  # `dropout` on the weights: tensor2tensor's
        self.self_attn = parts.make_attention(head_projection, d_model, n_heads, dropout, **attn)
        if self._cross:  # the decoder's attention to the encoder's output
            self.cross_attn = parts.make_attention(head_projection, d_model, n_heads, dropout, **attn)
        ff_p = dropout if self.ff_dropout else 0.0  # ff_dropout=False (chapter 16a): none on the hidden units
        self.ff = parts.PositionwiseFeedForward(d_model, d_ff, ff_p, activation, rng=rng, dtype=dt)
        n_sublayers = 3 if self._cross else 2
        for i in range(1, n_sublayers + 1):
            setattr(self, f"norm{i}", parts.LayerNorm(d_model, dtype=dt))
        for i in range(1, n_sublayers + 1):  # on sublayer i's output, before the residual sum
            setattr(self, f"dropout{i}", parts.Dropout(dropout, rng=rng))

    def _options(self, owner: str, norm_first, dropout_place, ff_dropout) -> None:
        self.norm_first = check_flag(owner, "norm_first", norm_first)
        self.dropout_place, self.ff_dropout = check_layer_pitfalls(owner, norm_first, dropout_place, ff_dropout)

    def extra_repr(self) -> str:
        opts = {"dropout_place": (self.dropout_place, "sublayer"), "ff_dropout": (self.ff_dropout, True)}
        return f"norm_first={self.norm_first}" + "".join(f", {k}={v!r}" for k, (v, d) in opts.items() if v != d)

    def _check_x(self, name: str, x) -> None:
        """A (B, T, d_model) float array or tensor of the parameters' dtype (read off the layer's norm1)."""
        self._check_float(name, x, ndim_min=3, last_dim=self.norm1.normalized_shape[0], dtype=self.norm1.weight.dtype)
        if len(x.shape) != 3:
            raise ValueError(f"{name}: expected shape (B, T, d_model), got {tuple(x.shape)}")

    def _check_attention_mask(self, attn, mask, batch: int, n_queries: int, n_keys: int) -> None:
        """A mask handed to the layer: boolean, broadcasting to its attention's scores (B, H, Tq, Tk)."""
        if mask is not None:
            self._check_mask(mask, (batch, attn.n_heads, n_queries, n_keys))


class EncoderLayerDoor(LayerDoor):
    def _check_forward(self, x, src_mask=None) -> None:
        self._check_x("EncoderLayer: x", x)
        self._check_attention_mask(self.self_attn, src_mask, x.shape[0], x.shape[1], x.shape[1])


class DecoderLayerDoor(LayerDoor):
    def _check_forward(self, x, memory, tgt_mask=None, memory_mask=None, *, cached: int = 0) -> None:
        """x (B, T, d) and memory (B, S, d); tgt_mask covers the `cached` earlier positions and the T new ones."""
        self._check_x("DecoderLayer: x", x)
        self._check_x("DecoderLayer: memory", memory)
        (B, T), S = x.shape[:2], memory.shape[1]
        if memory.shape[0] != B:
            raise ValueError(f"DecoderLayer: batch sizes differ: x {tuple(x.shape)}, memory {tuple(memory.shape)}")
        self._check_attention_mask(self.self_attn, tgt_mask, B, T, cached + T)
        self._check_attention_mask(self.cross_attn, memory_mask, B, T, S)

    def _check_forward_step(self, x, memory, cache, tgt_mask=None, memory_mask=None) -> None:
        self._check_x("DecoderLayer: x", x)
        cached = cached_positions("MultiHeadAttention", cache.get("self_attn", {}), x.shape[0])
        self._check_forward(x, memory, tgt_mask, memory_mask, cached=cached)


class StackDoor:
    """An Encoder or Decoder checks what its first layer checks; forward_step's caches, one per layer."""

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        final_norm: bool | None = None,
        *,
        rng=None,
        dtype=None,
        **layer_options,
    ):
        """n_layers layers of `_layer` (`layers.0`, ...), then `norm` if final_norm (None: as norm_first)."""
        super().__init__()
        owner, make, parts = type(self).__name__, self._layer, self._parts
        check_sizes(owner, n_layers=n_layers)
        final_norm = check_flag(owner, "final_norm", norm_first if final_norm is None else final_norm)
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.layers = parts.ModuleList(
            make(d_model, n_heads, d_ff, dropout, activation, norm_first, rng=rng, dtype=dt, **layer_options)
            for _ in range(n_layers)
        )
        self.norm = parts.LayerNorm(d_model, dtype=dt) if final_norm else None

    def _check_forward(self, *args, **kwargs) -> None:
        self.layers[0]._check_forward(*args, **kwargs)

    def _check_forward_step(self, x, memory, caches, *args, **kwargs) -> None:
        if len(caches) != len(self.layers):
            raise ValueError(f"Decoder.forward_step: expected {len(self.layers)} layer caches, got {len(caches)}")
        self.layers[0]._check_forward_step(x, memory, caches[0], *args, **kwargs)


class TransformerDoor:
    """The Transformer's entry points: token ids, memory and the source mask, checked before anything changes (a
    refused decode_step leaves the cache as it was, and the search can go on)."""

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
        attn_impl: str = "explicit",
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
        """src_embed, tgt_embed (one Parameter with share_embeddings), src_pos, tgt_pos, src_dropout, tgt_dropout,
        src_embed_norm, tgt_embed_norm, encoder, decoder and output_projection, registered in that order, then
        initialized as the Transformer's docstring (tfm_numpy.Transformer) says."""
        args = locals()  # the constructor's arguments, as a dict
        super().__init__()
        # the checked arguments, sizes as Python ints (JSON-able: checkpoints record them), and the pitfall options
        self.config, opts, layer_opts = transformer_options("Transformer", args)
        c, parts = self.config, self._parts
        embed_scale, self.tgt_padding_mask = opts["embed_scale"], opts["tgt_padding_mask"]
        self._in_scale = math.sqrt(c["d_model"]) if embed_scale == "embedding" else None  # times the embeddings
        self._out_scale = c["d_model"] ** -0.5 if embed_scale == "logits" else None  # times the logits
        d_model, n_heads, d_ff, n_layers, max_len, pad_id = (c[k] for k in ("d_model", "n_heads", "d_ff", "n_layers",
                                                                            "max_len", "pad_id"))  # fmt: skip
        src_vocab_size, tgt_vocab_size = c["src_vocab_size"], c["tgt_vocab_size"]
        attn_impl, tile_size = parts.check_attn_impl(
            "Transformer", attn_impl, check_size("Transformer", "tile_size", tile_size)
        )
        self.d_model, self.max_len, self.pad_id = d_model, max_len, pad_id
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        stack = (n_layers, d_model, n_heads, d_ff, dropout, activation, norm_first, final_norm)

        self.src_embed = parts.Embedding(src_vocab_size, d_model, padding_idx=pad_id, rng=rng, dtype=dt)
        self.tgt_embed = parts.Embedding(tgt_vocab_size, d_model, padding_idx=pad_id, rng=rng, dtype=dt)
        for emb in (self.src_embed, self.tgt_embed):
            if embed_scale != "none":  # "none" keeps N(0, 1), torch.nn.Embedding's default
                parts.scale_(emb.weight, d_model**-0.5)  # N(0, 1) -> N(0, 1/d_model); the padding row stays 0
        if share_embeddings:
            self.tgt_embed.weight = self.src_embed.weight  # one Parameter, two lookups
        self.src_pos = self._make_positional(positional, rng, dt)
        self.tgt_pos = self._make_positional(positional, rng, dt)
        self.src_dropout = parts.Dropout(dropout, rng=rng)
        self.tgt_dropout = parts.Dropout(dropout, rng=rng)
        self.src_embed_norm = parts.LayerNorm(d_model, dtype=dt) if opts["embed_norm"] else None  # after the dropout
        self.tgt_embed_norm = parts.LayerNorm(d_model, dtype=dt) if opts["embed_norm"] else None
        self.encoder = parts.Encoder(*stack, rng=rng, dtype=dt, **layer_opts)
        self.decoder = parts.Decoder(*stack, rng=rng, dtype=dt, **layer_opts)
        self.output_projection = parts.Linear(d_model, tgt_vocab_size, bias=False, rng=rng, dtype=dt)  # (V, d)
        if tie_output:
            self.output_projection.weight = self.tgt_embed.weight  # (V, d) both: logits = y @ E^T
        else:
            parts.xavier_uniform_(self.output_projection.weight, rng)
        for _, p in [*self.encoder.named_parameters(), *self.decoder.named_parameters()]:
            if p.data.ndim == 2:
                parts.xavier_uniform_(p, rng)
        parts.use_attention(self, attn_impl, tile_size)  # how every attention computes its heads (not a weight)

    def _make_positional(self, positional: str, rng, dt):
        parts = self._parts
        if positional == "sinusoidal":  # no parameters; its own dropout unused (p=0): ours follows the sum
            return parts.PositionalEncoding(self.d_model, self.max_len, dropout=0.0, dtype=dt)
        return parts.LearnedPositionalEmbedding(self.max_len, self.d_model, rng=rng, dtype=dt)

    def _check_tokens(self, arg: str, tokens, vocab_size: int) -> None:
        self._check_ids(f"Transformer: {arg}", tokens, vocab_size)
        if len(tokens.shape) != 2 or tokens.shape[1] < 1:
            raise ValueError(f"Transformer: {arg} expected shape (B, T) with T >= 1, got {tuple(tokens.shape)}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"Transformer: {arg} has length {tokens.shape[1]}, more than max_len={self.max_len}")

    def _check_memory(self, method: str, memory, src_mask, B: int, Tq: int) -> None:
        """memory (B, S, d_model) of the parameters' dtype, and src_mask for the cross-attention's scores."""
        self._check_float(f"Transformer.{method}: memory", memory, ndim_min=3, dtype=self.tgt_embed.weight.dtype)
        if len(memory.shape) != 3 or memory.shape[0] != B or memory.shape[2] != self.d_model:
            got = tuple(memory.shape)
            raise ValueError(f"Transformer.{method}: memory expected shape (B={B}, S, {self.d_model}), got {got}")
        if src_mask is not None:
            self._check_mask(src_mask, (B, self.decoder.layers[0].cross_attn.n_heads, Tq, memory.shape[1]))

    def _check_encode(self, src) -> None:
        self._check_tokens("src", src, self.src_vocab_size)

    def _check_decode(self, tgt_in, memory, src_mask) -> None:
        self._check_tokens("tgt_in", tgt_in, self.tgt_vocab_size)
        self._check_memory("decode", memory, src_mask, *tgt_in.shape)

    def _check_forward(self, src, tgt_in) -> None:
        self._check_tokens("src", src, self.src_vocab_size)
        self._check_tokens("tgt_in", tgt_in, self.tgt_vocab_size)
        if src.shape[0] != tgt_in.shape[0]:  # the memory would not match tgt_in's batch
            got = (src.shape[0], src.shape[1], self.d_model)
            raise ValueError(f"Transformer.decode: memory expected shape (B={tgt_in.shape[0]}, S, {self.d_model}), "
                             f"got {got}")  # fmt: skip

    def _check_decode_step(self, tgt_new, memory, src_mask, cache) -> None:
        self._check_tokens("tgt_new", tgt_new, self.tgt_vocab_size)
        attn = self.decoder.layers[0].self_attn  # the cache must be this model's: its layers, heads and d_head
        check_decode_cache(cache, tgt_new.shape[0], len(self.decoder.layers), attn.n_heads, attn.d_head)
        t0, Tn = cache.get("length", 0), tgt_new.shape[1]
        if t0 + Tn > self.max_len:
            raise ValueError(f"Transformer.decode_step: positions up to {t0 + Tn - 1} exceed max_len={self.max_len}")
        self._check_memory("decode_step", memory, src_mask, *tgt_new.shape)
