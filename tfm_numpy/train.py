"""Training, NumPy track: one step by hand (forward, loss, backward, then `apply_update`: clipping and Adam), for
the encoder-decoder (`train_step`) and the language model (`lm_train_step`); `train` and `evaluate` hand this
track's pieces to the loop and the evaluation of `tfm_common.training`. `tfm_torch.train` has the same names.

One step, with the learning rate of the warm-up schedule (`noam_lr`) at that step:

    logits = model(src, tgt_in)                      (B, T, V)   teacher forcing: tgt_in = [BOS] + y
    loss   = CrossEntropyLoss(logits, tgt_out)       mean over the non-pad target tokens, label-smoothed
    model.backward(loss_fn.backward())               dL/dlogits, then every parameter's .grad
    clip_grad_norm(params, clip_norm)                optional: the global gradient norm at most clip_norm
    optimizer.step()                                 Adam

The same batches and the same initial weights give the same losses in both tracks (float64: equal to ~1e-12).
"""

from __future__ import annotations

import numpy as np

from tfm_common.data import BOS_ID, EOS_ID, Batch
from tfm_common.training import (
    Evaluation,
    History,
    StepResult,
    Track,
    check_lm_ids,
    check_lm_windows,
    check_step,
    eval_mode,
    track_functions,
    with_door,
)
from tfm_common.validate import check_size

from .checkpoint import save_checkpoint
from .decoding import greedy_decode
from .functional import log_softmax
from .loss import CrossEntropyLoss
from .module import Module
from .optim import Adam, apply_update
from .parallel import train_step_accumulated

__all__ = ["History", "StepResult", "Evaluation", "train_step", "train", "evaluate", "lm_train_step", "lm_eval_loss"]


def train_step(
    model: Module, batch: Batch, optimizer: Adam, loss_fn: CrossEntropyLoss, lr: float, clip_norm: float | None = None
) -> StepResult:
    """One update of `model` on `batch` with learning rate `lr`; returns (loss before the update, gradient norm
    before clipping). The model should be in training mode (dropout on), as `train` sets it."""
    check_step("train_step", model.parameters(), optimizer.params, batch=batch)
    model.zero_grad()
    logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    loss = loss_fn(logits, batch.tgt_out)  # mean over the batch's non-pad target tokens
    model.backward(loss_fn.backward())  # dL/dlogits (B, T, V) -> every parameter's .grad
    norm = apply_update("train_step", optimizer, float(loss), lr, clip_norm)  # norm, clipping, lr, Adam's step
    return StepResult(float(loss), norm)


def _decode(model: Module, src: np.ndarray, max_len: int, use_cache: bool) -> np.ndarray:
    return greedy_decode(model, src, BOS_ID, EOS_ID, max_len, use_cache=use_cache)


# `train` is the loop `tfm_common.training.fit`, `evaluate` is `evaluate_pairs`, with this track's pieces
TRACK = Track(Module, "tfm_numpy Module", Adam, "tfm_numpy Adam", train_step, train_step_accumulated,
              CrossEntropyLoss, save_checkpoint, _decode)  # fmt: skip
train, evaluate = track_functions(TRACK)


# -- the language model (chapter 17b) -----------------------------------------------------------------------------


def lm_train_step(model: Module, x, y, optimizer: Adam, loss_fn: CrossEntropyLoss, lr: float, clip_norm=None):
    """One update on a batch of windows x (B, T) and their next tokens y (B, T): the causal LM loss, mean over all
    B T positions, -1/(BT) sum log p(y[b, t] | x[b, :t + 1]). Returns (loss before the update, gradient norm
    before clipping), as `train_step` does for the encoder-decoder."""
    check_step("lm_train_step", model.parameters(), optimizer.params)
    model.zero_grad()
    loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward())  # dL/dlogits (B, T, V) -> every parameter's .grad
    norm = apply_update("lm_train_step", optimizer, float(loss), lr, clip_norm)  # norm, clipping, lr, Adam's step
    return StepResult(float(loss), norm)


def _check_lm_step(model, x, y, **_) -> None:
    check_lm_windows("lm_train_step", x, y, (np.ndarray,), "a numpy.ndarray")


lm_train_step = with_door(lm_train_step, _check_lm_step)  # the windows checked before the printed step runs


def lm_eval_loss(model: Module, ids, block_size: int, batch_size: int = 32) -> tuple[float, np.ndarray]:
    """The mean next-token loss (nats) over a token array cut into consecutive windows of block_size tokens (each
    window starts a fresh context; the tail that does not fill a window is left out), in eval mode.
    Returns (mean loss, the targets scored (n_windows, block_size)): with their byte count, bits per byte.
    `ids`: 1-D integer ids in [0, vocab_size), at least block_size + 1 of them (one window and its targets)."""
    ids, block_size = check_lm_ids("lm_eval_loss", ids, block_size, getattr(model, "vocab_size", None))
    n = (len(ids) - 1) // block_size
    x, y = ids[: n * block_size].reshape(n, block_size), ids[1 : n * block_size + 1].reshape(n, block_size)
    total = 0.0
    with eval_mode(model):
        for i in range(0, n, check_size("lm_eval_loss", "batch_size", batch_size)):
            logp = log_softmax(model(x[i : i + batch_size]))  # (b, T, V)
            total -= float(np.take_along_axis(logp, y[i : i + batch_size, :, None], axis=-1).sum(dtype=np.float64))
    return total / y.size, y
