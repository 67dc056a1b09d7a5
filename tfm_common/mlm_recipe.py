"""A recipe for a small BERT on chapter 17b's corpus (chapter 22a), in either track, from lm_recipe's pieces: the same
tokenizer (with BERT's special tokens after its 512 ids), the same schedule (`warmup_decay`), the same optimizer and
step (`make_adam`, `lm_train_step`: the step does not care that the targets are mostly IGNORE_INDEX).

A training window is [CLS] + (block_size - 2) corpus tokens + [SEP], corrupted by `mask_tokens` (15%, 80/10/10). The
windows and the corruption come from one numpy Generator, so both tracks see the same batches. The masked loss is
averaged over the chosen positions only (`CrossEntropyLoss(ignore_index=IGNORE_INDEX)`).

`mlm_eval_batches` fixes a validation set once (consecutive windows of the validation split, a seeded corruption);
`mlm_eval_loss` scores any model on it through a function from ids to logits (NumPy arrays), so one call serves
both tracks.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from .bpe import ByteBPE
from .corpus import sample_batch
from .lm_recipe import stdlib_tokens, warmup_decay
from .mlm import IGNORE_INDEX, MaskedBatch, SpecialIds, bert_tokenizer, mask_tokens, special_ids
from .validate import check_size

__all__ = ["MLMTokens", "mlm_tokens", "with_cls_sep", "mlm_batch", "train_mlm", "mlm_eval_batches", "mlm_eval_loss"]


class MLMTokens(NamedTuple):
    bpe: ByteBPE  # chapter 17b's tokenizer with [PAD], [CLS], [SEP], [MASK] after its vocabulary
    special: SpecialIds
    train: np.ndarray  # (N_train,) int64: the same ids as lm_recipe.stdlib_tokens'
    val: np.ndarray  # (N_val,) int64


def mlm_tokens(vocab_size: int = 512, train_bytes: int = 300_000) -> MLMTokens:
    """`stdlib_tokens(vocab_size, train_bytes)` with BERT's special tokens added (the model's vocabulary: +4)."""
    tokens = stdlib_tokens(vocab_size, train_bytes)
    bpe = bert_tokenizer(tokens.bpe)
    return MLMTokens(bpe, special_ids(bpe), tokens.train, tokens.val)


def with_cls_sep(windows: np.ndarray, special: SpecialIds) -> np.ndarray:
    """(B, n) token windows -> (B, n + 2): [CLS] first, [SEP] last."""
    B = windows.shape[0]
    return np.concatenate([np.full((B, 1), special.cls), windows, np.full((B, 1), special.sep)], axis=1)


def mlm_batch(ids: np.ndarray, special: SpecialIds, vocab_size: int, batch_size: int, block_size: int,
              rng: np.random.Generator, p: float = 0.15) -> MaskedBatch:  # fmt: skip
    """`batch_size` windows of `block_size` tokens ([CLS], block_size - 2 corpus tokens at random offsets, [SEP]),
    corrupted by `mask_tokens`: (inputs, targets, chosen), each (B, block_size)."""
    block_size = check_size("mlm_batch", "block_size", block_size, minimum=3)
    windows, _ = sample_batch(ids, batch_size, block_size - 2, rng)
    return mask_tokens(with_cls_sep(windows, special), mask_id=special.mask, vocab_size=vocab_size,
                       special_ids=special, p=p, rng=rng)  # fmt: skip


def train_mlm(model, track: ModuleType, ids: np.ndarray, special: SpecialIds, *, steps: int, batch_size: int,
              block_size: int, peak: float, warmup: int, seed: int, p: float = 0.15,
              clip_norm: float = 1.0) -> np.ndarray:  # fmt: skip
    """Train the BERT `model` (of `track`) on `mlm_batch`es of `ids` with Adam (betas 0.9, 0.95) and `warmup_decay`,
    as lm_recipe.train_lm trains the GPT; returns the training losses (steps,), nats per masked token."""
    optimizer = track.make_adam(model, betas=(0.9, 0.95), eps=1e-8)
    loss_fn, rng, losses = track.CrossEntropyLoss(ignore_index=IGNORE_INDEX), np.random.default_rng(seed), []
    for step in range(1, steps + 1):
        batch = mlm_batch(ids, special, model.vocab_size, batch_size, block_size, rng, p)
        lr = warmup_decay(step, steps, peak, warmup)
        losses.append(track.lm_train_step(model, batch.inputs, batch.targets, optimizer, loss_fn, lr,
                                          clip_norm=clip_norm).loss)  # fmt: skip
    return np.array(losses)


def mlm_eval_batches(ids: np.ndarray, special: SpecialIds, vocab_size: int, block_size: int, *, n_windows: int,
                     seed: int, p: float = 0.15) -> tuple[np.ndarray, MaskedBatch]:  # fmt: skip
    """A fixed validation set: the first `n_windows` consecutive windows of block_size - 2 tokens of `ids`, with
    [CLS] and [SEP], corrupted once with np.random.default_rng(seed). Returns (the clean windows (n, block_size),
    their MaskedBatch)."""
    n = check_size("mlm_eval_batches", "block_size", block_size, minimum=3) - 2
    n_windows = check_size("mlm_eval_batches", "n_windows", n_windows)
    if len(ids) < n * n_windows:
        raise ValueError(
            f"mlm_eval_batches: {n_windows} windows of {n} tokens need {n * n_windows} ids, got {len(ids)}"
        )
    clean = with_cls_sep(np.asarray(ids[: n * n_windows], dtype=np.int64).reshape(n_windows, n), special)
    masked = mask_tokens(clean, mask_id=special.mask, vocab_size=vocab_size, special_ids=special, p=p,
                         rng=np.random.default_rng(seed))  # fmt: skip
    return clean, masked


def mlm_eval_loss(logits_of, batch: MaskedBatch, batch_size: int = 32) -> tuple[float, np.ndarray]:
    """The masked loss of a model on `batch`: `logits_of(inputs)` maps (b, T) ids to (b, T, V) logits (NumPy arrays,
    eval mode is the caller's). Returns (mean nats per chosen position, the loss at every position (n, T), 0 where
    not chosen), computed in float64."""
    batch_size = check_size("mlm_eval_loss", "batch_size", batch_size)
    losses = np.zeros(batch.inputs.shape)
    for i in range(0, len(batch.inputs), batch_size):
        z = np.asarray(logits_of(batch.inputs[i : i + batch_size]), dtype=np.float64)  # (b, T, V)
        z = z - z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        target = np.where(batch.chosen[i : i + batch_size], batch.targets[i : i + batch_size], 0)
        nll = -np.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        losses[i : i + batch_size] = np.where(batch.chosen[i : i + batch_size], nll, 0.0)
    return float(losses.sum() / batch.chosen.sum()), losses
