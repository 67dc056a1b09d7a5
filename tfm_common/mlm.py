"""Masked language modelling (BERT, Devlin et al., 2019), the plumbing both tracks share: the special tokens added
to chapter 17a's byte-level BPE, BERT's 80/10/10 corruption of a batch (`mask_tokens`), and the BERT's constructor
and checks (its door), written once from the track's building blocks as `model_doors.GPTDoor` is.

Special tokens. `bert_tokenizer(bpe)` is a new ByteBPE with the same merges and pattern and four more special tokens
after its vocabulary: ids bpe.vocab_size + 0 .. 3 for "[PAD]", "[CLS]", "[SEP]", "[MASK]" (ByteBPE's own special
tokens: `encode` never produces one, so the round trip decode_bytes(encode(text)) == text is untouched, and every
id the original BPE gives a text is the same id here). `special_ids(bpe)` names them.

The corruption (`mask_tokens`): each position that is not a special token is chosen with probability p (0.15);
of the chosen, 80% become [MASK], 10% a random ordinary token, 10% stay as they were. The targets hold the
original token at the chosen positions and IGNORE_INDEX elsewhere, so `CrossEntropyLoss(ignore_index=IGNORE_INDEX)`
averages the loss over the chosen positions only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .bpe import ByteBPE
from .config import GPT_ARGS, check_gpt_config
from .sampling import check_token_window
from .validate import behind_door, check_probability

__all__ = ["BERT_SPECIALS", "IGNORE_INDEX", "BERT_ARGS", "SpecialIds", "MaskedBatch", "bert_tokenizer", "special_ids",
           "mask_tokens", "mask_rule", "FATES", "mask_fates", "check_bert_config", "BERTDoor"]  # fmt: skip

BERT_SPECIALS = (b"[PAD]", b"[CLS]", b"[SEP]", b"[MASK]")
IGNORE_INDEX = -100  # a target the loss skips (torch's default ignore_index)
# the BERT's `config`: the GPT's arguments and the padding token (not attn_impl, rng, dtype)
BERT_ARGS = GPT_ARGS + ("pad_id",)


class SpecialIds(NamedTuple):
    pad: int
    cls: int
    sep: int
    mask: int


class MaskedBatch(NamedTuple):
    inputs: np.ndarray  # (...) the corrupted ids: what the model reads
    targets: np.ndarray  # (...) the original id at chosen positions, IGNORE_INDEX elsewhere
    chosen: np.ndarray  # (...) bool: the positions the loss counts


def bert_tokenizer(bpe: ByteBPE) -> ByteBPE:
    """`bpe` with BERT's special tokens after its vocabulary (and its own special tokens): a new ByteBPE, the same
    merges, pattern and merge counts, so every text encodes to the same ids as with `bpe`."""
    if not isinstance(bpe, ByteBPE):
        raise TypeError(f"bert_tokenizer: bpe expected a ByteBPE, got {type(bpe).__name__}")
    clash = [name for name in BERT_SPECIALS if name in bpe.specials]
    if clash:
        raise ValueError(f"bert_tokenizer: bpe already has the special tokens {clash}")
    out = ByteBPE(bpe.merges, bpe.pattern, bpe.specials + BERT_SPECIALS)
    out.merge_counts = list(bpe.merge_counts)
    return out


def special_ids(bpe: ByteBPE) -> SpecialIds:
    """The ids of [PAD], [CLS], [SEP] and [MASK] in a tokenizer from `bert_tokenizer`."""
    return SpecialIds(*(bpe.special_id(name) for name in BERT_SPECIALS))


def mask_tokens(ids, *, mask_id: int, vocab_size: int, special_ids, p: float = 0.15, rng) -> MaskedBatch:
    """BERT's corruption of integer token ids (any shape): (inputs, targets, chosen).

    Each position whose id is not in `special_ids` (nor `mask_id`) is chosen with probability p; a chosen position
    becomes `mask_id` with probability 0.8, a random token (uniform over the ids in [0, vocab_size) that are not
    special) with probability 0.1, and keeps its id with probability 0.1. The draws have the shape of `ids`, whatever
    its values, so one seed gives one corruption in any track."""
    ids, specials, p = _check_mask_tokens(ids, mask_id, vocab_size, special_ids, p, rng)
    ordinary = np.setdiff1d(np.arange(vocab_size), specials)  # the tokens a random replacement draws from
    u_choose, u_fate = rng.random(ids.shape), rng.random(ids.shape)
    random_ids = ordinary[rng.integers(0, len(ordinary), ids.shape)]
    return mask_rule(ids, u_choose, u_fate, random_ids, mask_id=mask_id, special_ids=specials, p=p)


def mask_rule(ids, u_choose, u_fate, random_ids, *, mask_id: int, special_ids, p: float = 0.15) -> MaskedBatch:
    """The 80/10/10 rule given its random draws (arrays of the shape of `ids`): u_choose and u_fate uniform in
    [0, 1), random_ids the replacements. A position is chosen where u_choose < p and its id is not special; a
    chosen one becomes mask_id where u_fate < 0.8, random_ids where 0.8 <= u_fate < 0.9, and stays otherwise."""
    chosen = (u_choose < p) & ~np.isin(ids, special_ids)  # (...) bool: the positions the loss counts
    inputs = np.where(chosen & (u_fate < 0.8), mask_id, ids)  # 80%: [MASK]
    inputs = np.where(chosen & (u_fate >= 0.8) & (u_fate < 0.9), random_ids, inputs)  # 10% random, 10% unchanged
    targets = np.where(chosen, ids, IGNORE_INDEX)  # the original token where chosen, ignored elsewhere
    return MaskedBatch(inputs, targets, chosen)


def _check_mask_rule(ids, u_choose, u_fate, random_ids, *, mask_id, special_ids, p=0.15) -> None:
    for arg, a in (("ids", ids), ("u_choose", u_choose), ("u_fate", u_fate), ("random_ids", random_ids)):
        if not isinstance(a, np.ndarray) or a.shape != np.shape(ids):
            got = f"shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"mask_rule: {arg} expected a numpy array of the shape of ids {np.shape(ids)}, got {got}")
    check_probability("mask_rule", "p", p, allow_one=True)


mask_rule = behind_door(mask_rule, _check_mask_rule)  # the printed body stays the rule


FATES = ("not chosen", "[MASK]", "random", "kept")  # what mask_fates' codes 0 .. 3 mean


def mask_fates(ids: np.ndarray, batch: MaskedBatch, mask_id: int) -> np.ndarray:
    """What `mask_tokens` did at each position of `ids`, as codes into FATES: 0 not chosen, 1 replaced by [MASK],
    2 replaced by another token, 3 chosen and kept (a random draw that hit the original token counts as kept: the
    model reads the true token either way)."""
    ids = np.asarray(ids)
    if ids.shape != batch.inputs.shape:
        raise ValueError(f"mask_fates: ids expected the batch's shape {batch.inputs.shape}, got {ids.shape}")
    replaced = np.where(batch.inputs == mask_id, 1, np.where(batch.inputs == ids, 3, 2))
    return np.where(batch.chosen, replaced, 0)


def _check_mask_tokens(ids, mask_id, vocab_size, special_ids, p, rng):
    owner = "mask_tokens"
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        got = f"dtype {ids.dtype}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise TypeError(f"{owner}: ids expected a numpy integer array of token ids, got {got}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 2:
        raise ValueError(f"{owner}: vocab_size must be an int >= 2, got {vocab_size!r}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{owner}: ids must be in [0, {vocab_size}), got values in [{ids.min()}, {ids.max()}]")
    if isinstance(mask_id, bool) or not isinstance(mask_id, (int, np.integer)) or not 0 <= mask_id < vocab_size:
        raise ValueError(f"{owner}: mask_id must be an int in [0, {vocab_size}), got {mask_id!r}")
    try:
        specials = np.array(list(special_ids))
    except TypeError:
        raise TypeError(f"{owner}: special_ids expected a sequence of ints, got {type(special_ids).__name__}") from None
    if specials.size and (specials.dtype.kind not in "iu" or specials.min() < 0 or specials.max() >= vocab_size):
        raise ValueError(f"{owner}: special_ids must be ints in [0, {vocab_size}), got {list(special_ids)!r:.80}")
    specials = np.union1d(specials.astype(np.int64), [mask_id])  # [MASK] is never a target, whatever the caller says
    if len(specials) >= vocab_size:
        raise ValueError(f"{owner}: every id in [0, {vocab_size}) is special: nothing to mask or draw")
    p = check_probability(owner, "p", p, allow_one=True)
    if p == 0:
        raise ValueError(f"{owner}: p must be in (0, 1], got {p!r} (nothing would be predicted)")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"{owner}: rng expected a numpy.random.Generator, got {type(rng).__name__}")
    return ids, specials, p


def check_bert_config(owner: str, c: dict) -> dict:
    """The BERT's constructor arguments: the GPT's rules (chapter 17b) and pad_id None or a token id."""
    c = {**check_gpt_config(owner, {k: c[k] for k in GPT_ARGS}), "pad_id": c["pad_id"]}
    pad, n = c["pad_id"], c["vocab_size"]
    if pad is not None:
        if isinstance(pad, (bool, np.bool_)) or not isinstance(pad, (int, np.integer)) or not 0 <= pad < n:
            raise ValueError(f"{owner}: pad_id must be None or an int in [0, {n}) (a token id), got {pad!r}")
        c["pad_id"] = int(pad)
    return c


class BERTDoor:
    """The BERT's constructor (from the track's `_parts`), its checks of token ids, its repr and attention weights."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        max_len: int,
        dropout: float = 0.1,
        *,
        norm: str = "layernorm",
        positional: str = "learned",
        activation: str = "gelu",
        n_kv_heads: int | None = None,
        tie_output: bool = True,
        pad_id: int | None = None,
        rng=None,
        dtype=None,
    ):
        """embed, pos (None for rope), dropout, layers (n_layers GPTBlocks, one RotaryEmbedding shared for rope),
        norm, then the MLM head: head_dense (d -> d), head_act (GELU), head_norm, output_projection (d -> V, with a
        bias; its weight tied to the embedding by default). Initialized as the GPT (see GPT's docstring); the head's
        dense matrix Xavier-uniform, the output bias zero."""
        super().__init__()
        self.config = c = check_bert_config("BERT", {k: v for k, v in locals().items() if k in BERT_ARGS})
        self.vocab_size, self.d_model, self.max_len, self.pad_id = c["vocab_size"], d_model, max_len, c["pad_id"]
        parts = self._parts
        dt, rng = parts.check_dtype(dtype), parts.as_rng(rng)
        self.embed = parts.Embedding(self.vocab_size, d_model, rng=rng, dtype=dt)
        parts.scale_(self.embed.weight, d_model**-0.5)  # N(0, 1) -> N(0, 1/d_model)
        if positional == "learned":
            self.pos = parts.LearnedPositionalEmbedding(max_len, d_model, rng=rng, dtype=dt)
        elif positional == "sinusoidal":
            self.pos = parts.PositionalEncoding(d_model, max_len, dtype=dt)
        else:
            self.pos = None  # rope: the positions live in the attention
        self.dropout = parts.Dropout(c["dropout"], rng=rng)
        rotary = parts.RotaryEmbedding(d_model // n_heads, max_len, dtype=dt) if positional == "rope" else None
        block = dict(norm=norm, activation=activation, n_kv_heads=c["n_kv_heads"], rotary=rotary, rng=rng, dtype=dt)
        self.layers = parts.ModuleList(parts.GPTBlock(d_model, n_heads, d_ff, c["dropout"], **block)
                                       for _ in range(n_layers))  # fmt: skip
        self.norm = parts.make_norm(norm, d_model, dt)
        self.head_dense = parts.Linear(d_model, d_model, rng=rng, dtype=dt)
        self.head_act = parts.GELU()
        self.head_norm = parts.make_norm(norm, d_model, dt)
        self.output_projection = parts.Linear(d_model, self.vocab_size, rng=rng, dtype=dt)  # (V, d) and (V,)
        parts.scale_(self.output_projection.bias, 0.0)
        if c["tie_output"]:
            self.output_projection.weight = self.embed.weight  # one Parameter: logits = h @ E^T + b
            # tfm_numpy's modules list a re-assigned parameter last: re-assign the bias too, so that both tracks list
            # output_projection.weight, then .bias (torch keeps a re-assigned parameter's place)
            self.output_projection.bias = self.output_projection.bias
        else:
            parts.xavier_uniform_(self.output_projection.weight, rng)
        for _, p in self.layers.named_parameters():
            if p.data.ndim == 2:
                parts.xavier_uniform_(p, rng)
        parts.xavier_uniform_(self.head_dense.weight, rng)

    def _check_forward(self, tokens) -> None:
        self._check_ids("BERT: tokens", tokens, self.vocab_size)
        check_token_window("BERT", tuple(tokens.shape), 0, self.max_len)

    _check_encode = _check_forward

    def attention_weights(self) -> list:
        """[(B, H, T, T) per layer]: the last forward's self-attention weights."""
        return [layer.self_attn.attn_weights for layer in self.layers]

    def extra_repr(self) -> str:
        c = self.config
        return ", ".join(f"{k}={c[k]!r}" for k in ("norm", "positional", "activation", "n_kv_heads", "tie_output",
                                                    "pad_id"))  # fmt: skip
