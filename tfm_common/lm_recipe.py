"""Chapter 17b's recipe for a small GPT on the standard-library corpus, once, for the chapters that start from a
trained model (Part IX, serving): the tokenizer, the training loop with its schedule, and bits per byte.

The track is an argument (`tfm_numpy` or `tfm_torch`, the module): both have `make_adam`, `CrossEntropyLoss` and
`lm_train_step` with the same signatures, so the loop is written once and runs in either.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import NamedTuple

import numpy as np

from .bpe import ByteBPE
from .corpus import sample_batch, stdlib_corpus

__all__ = ["Tokens", "stdlib_tokens", "warmup_decay", "train_lm", "bits_per_byte"]


class Tokens(NamedTuple):
    bpe: ByteBPE
    train: np.ndarray  # (N_train,) int64 ids of the whole train split
    val: np.ndarray  # (N_val,) int64 ids of the validation split


def stdlib_tokens(vocab_size: int = 512, train_bytes: int = 300_000) -> Tokens:
    """Chapter 17b's tokenizer (trained on the first `train_bytes` of the train split) and both splits encoded."""
    train_text, val_text = stdlib_corpus("train"), stdlib_corpus("val")
    bpe = ByteBPE.train(train_text.data[:train_bytes], vocab_size=vocab_size)
    encode = lambda text: np.array(bpe.encode(text.data), dtype=np.int64)  # noqa: E731
    return Tokens(bpe, encode(train_text), encode(val_text))


def warmup_decay(step: int, steps: int, peak: float, warmup: int) -> float:
    """Chapter 17b's learning rate at step 1, 2, ..., steps: linear warm-up to `peak`, then linear decay to 0."""
    return peak * min(step / warmup, (steps - step + 1) / (steps - warmup + 1))


def train_lm(model, track: ModuleType, ids: np.ndarray, *, steps: int, batch_size: int, block_size: int,
             peak: float, warmup: int, seed: int, clip_norm: float = 1.0) -> np.ndarray:  # fmt: skip
    """Train `model` (of `track`) on random windows of `ids` with Adam (betas 0.9, 0.95) and `warmup_decay`;
    returns the training losses (steps,). The windows come from np.random.default_rng(seed): the same batches in
    either track."""
    optimizer = track.make_adam(model, betas=(0.9, 0.95), eps=1e-8)
    loss_fn, rng, losses = track.CrossEntropyLoss(), np.random.default_rng(seed), []
    for step in range(1, steps + 1):
        xb, yb = sample_batch(ids, batch_size, block_size, rng)
        lr = warmup_decay(step, steps, peak, warmup)
        losses.append(track.lm_train_step(model, xb, yb, optimizer, loss_fn, lr, clip_norm=clip_norm).loss)
    return np.array(losses)


def bits_per_byte(mean_nats: float, targets: np.ndarray, bpe: ByteBPE) -> float:
    """Mean nats per token over `targets` (any shape of ids) as bits per byte of the text they decode to."""
    n_bytes = len(bpe.decode_bytes(np.asarray(targets).reshape(-1).tolist()))
    return mean_nats * np.asarray(targets).size / math.log(2) / n_bytes
