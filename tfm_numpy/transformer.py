"""The full encoder-decoder Transformer ("Attention Is All You Need", Vaswani et al., 2017), NumPy track.

    src (B, S) ids -> embed * sqrt(d_model) + positions -> dropout -> Encoder -> memory (B, S, d)
    tgt_in (B, T) ids -> embed * sqrt(d_model) + positions -> dropout -> Decoder(memory) -> Linear -> logits (B, T, V)

Masks are built inside from `pad_id` (True = may attend): the source padding mask `(B, 1, 1, S)` for the
encoder's self-attention and the decoder's cross-attention, and the target's causal-and-padding mask
`(B, 1, T, T)` for the decoder's self-attention.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tfm_common.config import own_init
from tfm_common.doors import TransformerDoor

from .attention import check_attn_impl, use_attention
from .encoder_decoder import Decoder, Encoder
from .kv_cache import cache_append
from .layers import Dropout, Embedding, LayerNorm, Linear
from .masks import causal_mask, check_mask, decoder_mask, padding_mask
from .module import Module, Parameter, as_rng, check_dtype, check_grad, check_indices, check_input, scale_
from .positional import LearnedPositionalEmbedding, PositionalEncoding

__all__ = ["xavier_uniform_", "Transformer"]


def xavier_uniform_(p: Parameter, rng=None) -> Parameter:
    """Glorot and Bengio (2010), in place: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)) for a
    (fan_out, fan_in) matrix, so that activations and gradients keep their variance through the layer.
    What `torch.nn.init.xavier_uniform_` does (for 2-D weights)."""
    if p.data.ndim != 2:
        raise ValueError(f"xavier_uniform_: expected a matrix, got shape {p.shape}")
    fan_out, fan_in = p.shape
    a = math.sqrt(6.0 / (fan_in + fan_out))
    p.data[...] = as_rng(rng).uniform(-a, a, p.shape)  # drawn in float64, stored in p's dtype
    return p


class Transformer(TransformerDoor, Module):
    """The encoder-decoder Transformer. `model(src, tgt_in)` -> logits (B, T, tgt_vocab_size).

    Options (the variants met in the wild):
      norm_first        False: Post-LN, as in the paper; True: Pre-LN (see `encoder_decoder`).
      final_norm        a LayerNorm after each stack; None: as norm_first (torch.nn.Transformer always has one).
      positional        "sinusoidal" (the paper's fixed table) or "learned" (a trained table, one per side).
      share_embeddings  source and target use one embedding matrix (the paper: a shared source-target
                        vocabulary); needs src_vocab_size == tgt_vocab_size.
      tie_output        the output projection's weight IS the target embedding matrix (the paper, section 3.4:
                        "we share the same weight matrix between the two embedding layers and the pre-softmax
                        linear transformation", after Press and Wolf, 2017).
      attn_impl         "explicit" (the weights formed, inspectable) or "flash" (tiled, `flash_attention`, in
                        tiles of `tile_size`): the same model to rounding; see `MultiHeadAttention`. Not part of
                        the configuration (no weight depends on it); `use_attention(model, ...)` switches it later.
    Options that reproduce choices of popular code, measured in chapter 16a (keyword-only; the defaults are the
    paper's, except two that come from tensor2tensor, not the paper's text: `ff_dropout=True` and dropout on the
    attention weights; defaults change nothing and are left out of `config`; see tfm_common.pitfalls):
      score_scale, head_projection, dropout_place, ff_dropout   passed to every layer (see `encoder_decoder`)
      embed_scale       "embedding": embeddings N(0, 1/d_model) times sqrt(d_model) (the paper); "logits": the same
                        embeddings unscaled, the logits times d_model^-0.5 instead; "none": N(0, 1) embeddings, no
                        scale anywhere (torch.nn.Embedding's default)
      embed_norm        one more LayerNorm (`src_embed_norm`, `tgt_embed_norm`) after dropout(embedding + positions)
      tgt_padding_mask  False: the decoder's self-attention mask is causal only (padded target keys stay visible)
    A tied matrix is one Parameter object used in two (or three) places: each use adds its gradient into the
    same `.grad`, so the tied weight gets the sum of all uses, with no extra code.

    Embeddings are multiplied by sqrt(d_model) (section 3.4). The output projection has no bias (tied or not;
    the paper does not mention one, and this makes tying the only difference between the two settings).

    Initialization (with `rng`): every matrix of the encoder and decoder stacks, and an untied output
    projection, Xavier-uniform (as torch.nn.Transformer and the Annotated Transformer do); biases keep
    their layer's default, LayerNorms start at 1 and 0. Token embeddings are N(0, 1/d_model), as in
    tensor2tensor and fairseq: times sqrt(d_model) they have unit variance, the scale of the positional
    encodings they are added to, whatever the vocabulary size (Xavier would make them shrink with it).
    The padding row starts at zero and its lookups add no gradient (torch's padding_idx rule); with tie_output the
    output projection's use (the logit of the pad token) still does, so the row moves in training. That is harmless:
    padded positions are masked as keys and ignored by the loss. A learned positional table is N(0, 1).

    `encode(src)` and `decode(tgt_in, memory, src_mask)` run the two halves (decoding calls them separately);
    `backward(dlogits)` after a forward fills every parameter's `.grad` (see `grads()`), and
    `decode_backward` / `encode_backward` are the two halves of it. Every module caches its last forward only:
    backward belongs to the most recent encode / decode.
    """

    # -- the two halves ---------------------------------------------------------------------------------------
    def encode(self, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """src (B, S) ids -> (memory (B, S, d), src_mask (B, 1, 1, S), True at real tokens)."""
        src_mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        x = self._embed(src, self.src_embed, self.src_pos, self.src_dropout, self.src_embed_norm)  # (B, S, d)
        return self.encoder(x, src_mask), src_mask

    def decode(self, tgt_in: np.ndarray, memory: np.ndarray, src_mask: np.ndarray) -> np.ndarray:
        """tgt_in (B, T) ids, memory (B, S, d), src_mask (B, 1, 1, S) -> logits (B, T, tgt_vocab_size)."""
        tgt_mask = self._tgt_mask(tgt_in)  # (B, 1, T, T): causal and not padding
        y = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm)  # (B, T, d)
        y = self.decoder(y, memory, tgt_mask, src_mask)  # (B, T, d)
        logits = self._logits(y)  # (B, T, V)
        self._cache = (logits.shape, logits.dtype)  # decode_backward may follow, once
        return logits

    def decode_step(self, tgt_new: np.ndarray, memory: np.ndarray, src_mask: np.ndarray, cache: dict) -> np.ndarray:
        """Incremental decoding (inference only): the logits of the new target tokens `tgt_new` (B, Tn), usually
        Tn = 1, the last token, given the `cache` of every earlier call (a dict, empty at the first call; filled
        here). Equal to `decode(all tokens so far, ...)[:, -Tn:]`, at the cost of the new positions only:

            cache["capacity"] the most positions it will hold (set it before the first call; default max_len):
                              the target side's buffers are allocated once at that size and written in place
            cache["preallocate"] False: grow by concatenation instead (every step copies every position), to compare
            cache["length"]   the number of target positions seen so far (the offset of the new ones)
            cache["keep"]     (B, 1, 1, T) the padding mask of every target position so far
            cache["layers"]   one dict per decoder layer: self_attn {"k", "v"} (B, H, T, dk), appended at each
                              step (views of the buffers "k_buf", "v_buf", see `cache_append`); cross_attn
                              {"k", "v"} (B, H, S, dk), the memory's, computed at the first step
        """
        t0, Tn = cache.get("length", 0), tgt_new.shape[1]
        cap = min(cache.setdefault("capacity", self.max_len), self.max_len)  # positions to make room for, once
        keep = cache_append(cache, "keep", padding_mask(tgt_new, self.pad_id), axis=3)  # (B, 1, 1, T), in place
        causal = np.tri(Tn, t0 + Tn, t0, dtype=bool)  # (Tn, T): new i sees 0 .. t0 + i
        tgt_mask = keep & causal if self.tgt_padding_mask else causal[None, None]  # (B, 1, Tn, T)
        y = self._embed(tgt_new, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm, t0)  # (B, Tn, d)
        room = {"capacity": cap, "preallocate": cache.get("preallocate", True)}
        layers = cache.setdefault("layers", [{"self_attn": dict(room)} for _ in self.decoder.layers])
        y = self.decoder.forward_step(y, memory, layers, tgt_mask, src_mask)  # (B, Tn, d)
        cache["length"] = t0 + Tn
        self._cache = None  # inference only: a backward after this is an error
        return self._logits(y)  # (B, Tn, V)

    def forward(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)  # (B, T, V)

    # -- backward: the same path in reverse ---------------------------------------------------------------------
    def decode_backward(self, grad_logits: np.ndarray) -> np.ndarray:
        """Backward of the last `decode`: fills the decoder side's gradients, returns dL/dmemory (B, S, d)."""
        self._saved()
        if self._out_scale is not None:
            grad_logits = grad_logits * grad_logits.dtype.type(self._out_scale)
        dy = self.output_projection.backward(grad_logits)  # (B, T, d); adds into the tied weight's grad
        dy, d_memory = self.decoder.backward(dy)
        self._embed_backward(dy, self.tgt_embed, self.tgt_pos, self.tgt_dropout, self.tgt_embed_norm)
        return d_memory

    def encode_backward(self, grad_memory: np.ndarray) -> None:
        """Backward of the last `encode`, from dL/dmemory (B, S, d)."""
        dx = self.encoder.backward(grad_memory)
        self._embed_backward(dx, self.src_embed, self.src_pos, self.src_dropout, self.src_embed_norm)

    def backward(self, grad_logits: np.ndarray) -> None:
        """After `forward`: add dL/dparam into every parameter's grad. Token ids have no gradient: returns None."""
        self.encode_backward(self.decode_backward(grad_logits))

    # -- embeddings ---------------------------------------------------------------------------------------------
    def _embed(self, tokens: np.ndarray, embed: Embedding, pos: Module, drop: Dropout, norm, offset: int = 0):
        x = embed(tokens)  # (B, T, d)
        if self._in_scale is not None:
            x = x * self._in_scale  # times sqrt(d_model); the python float keeps float32 float32
        x = drop(pos(x, offset))  # + positions, then dropout (section 5.4: "to the sums of the embeddings and ...")
        return x if norm is None else norm(x)  # embed_norm=True: one more LayerNorm before the first layer

    def _embed_backward(self, grad_out: np.ndarray, embed: Embedding, pos: Module, drop: Dropout, norm) -> None:
        if norm is not None:
            grad_out = norm.backward(grad_out)
        dx = pos.backward(drop.backward(grad_out))
        embed.backward(dx if self._in_scale is None else dx * self._in_scale)

    def _logits(self, y: np.ndarray) -> np.ndarray:
        logits = self.output_projection(y)  # (B, T, V)
        return logits if self._out_scale is None else logits * logits.dtype.type(self._out_scale)

    def _tgt_mask(self, tgt_in: np.ndarray) -> np.ndarray:
        """Causal and not padding (B, 1, T, T); causal only (1, 1, T, T) with tgt_padding_mask=False."""
        return decoder_mask(tgt_in, self.pad_id) if self.tgt_padding_mask else causal_mask(tgt_in.shape[1])

    # -- the door: a caller's arguments, checked before anything changes (the rules: tfm_common.doors) ---------
    _check_ids, _check_float = staticmethod(check_indices), staticmethod(check_input)  # see tfm_common.doors
    _check_mask = staticmethod(check_mask)
    _cacheless_backwards = ("encode_backward",)  # its grad_out is checked against the encoder's last output

    def _check_encode_backward(self, grad_memory=None, *args, **kwargs) -> None:
        spec = self.encoder.__dict__.get("_outputs", {}).get("forward")
        if spec is not None:
            check_grad("Transformer", grad_memory, *spec, method="encode_backward")

    # -- inspection -------------------------------------------------------------------------------------------
    def attention_weights(self) -> dict[str, list[np.ndarray]]:
        """The last forward's attention weights, one (B, H, Tq, Tk) array per layer:
        {"encoder": self-attention (S, S), "decoder": masked self-attention (T, T), "cross": (T, S)}."""
        return {
            "encoder": self.encoder.attention_weights(),
            "decoder": self.decoder.attention_weights("self"),
            "cross": self.decoder.attention_weights("cross"),
        }

    def extra_repr(self) -> str:
        c = self.config
        return ", ".join(f"{k}={c[k]!r}" for k in ("norm_first", "positional", "share_embeddings", "tie_output"))


# the building blocks of the constructor written in tfm_common.doors (TransformerDoor.__init__)
Transformer._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_rng, check_attn_impl=check_attn_impl, use_attention=use_attention,
    Embedding=Embedding, scale_=scale_, PositionalEncoding=PositionalEncoding,
    LearnedPositionalEmbedding=LearnedPositionalEmbedding, Dropout=Dropout, LayerNorm=LayerNorm, Encoder=Encoder,
    Decoder=Decoder, Linear=Linear, xavier_uniform_=xavier_uniform_,
)  # fmt: skip
# a wrong argument is refused in the name of the Transformer, not of its door; tfm_numpy's default dtype
own_init(Transformer, dtype=np.float32)
