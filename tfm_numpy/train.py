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
from tfm_common.training import Evaluation, History, StepResult, check_step, eval_mode, evaluate_pairs, fit
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


def train(
    model: Module,
    batches,
    optimizer: Adam,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    warmup: int = 4000,
    factor: float = 1.0,
    d_model: int | None = None,
    lr_schedule=None,
    cooldown: int = 0,
    label_smoothing: float | None = None,
    loss_fn: CrossEntropyLoss | None = None,
    clip_norm: float | None = None,
    accumulate: int = 1,
    eval_fn=None,
    eval_every: int | None = None,
    checkpoint_path=None,
    checkpoint_every: int | None = None,
    history: History | None = None,
    progress: bool = True,
    log_every: int = 10,
    desc: str = "train",
) -> History:
    """Train `model` with `optimizer` for `steps` updates or `epochs` passes over `batches`; return the History.
    The loop is `tfm_common.training.fit` (every argument is explained there), with this track's `train_step`,
    `train_step_accumulated`, `CrossEntropyLoss` and `save_checkpoint`."""
    if not isinstance(model, Module):
        raise TypeError(f"train: model expected a tfm_numpy Module, got {type(model).__name__}")
    if not isinstance(optimizer, Adam):
        raise TypeError(f"train: optimizer expected a tfm_numpy Adam, got {type(optimizer).__name__}")
    return fit(
        model, batches, optimizer, train_step=train_step, train_step_accumulated=train_step_accumulated,
        loss_class=CrossEntropyLoss, save_checkpoint=save_checkpoint, steps_taken=lambda opt: opt.step_count,
        steps=steps, epochs=epochs, warmup=warmup, factor=factor, d_model=d_model, lr_schedule=lr_schedule,
        cooldown=cooldown, label_smoothing=label_smoothing, loss_fn=loss_fn, clip_norm=clip_norm,
        accumulate=accumulate, eval_fn=eval_fn, eval_every=eval_every, checkpoint_path=checkpoint_path,
        checkpoint_every=checkpoint_every, history=history, progress=progress, log_every=log_every, desc=desc,
    )  # fmt: skip


def evaluate(
    model: Module,
    pairs,
    src_vocab,
    tgt_vocab,
    *,
    max_len: int | None = None,
    batch_size: int = 256,
    bleu: bool = True,
    bleu_tokenize: str | None = None,
    use_cache: bool = True,
) -> Evaluation:
    """Greedy-decode the source of every (source text, reference text) pair and score the outputs: exact match
    and corpus BLEU (`tfm_common.metrics`). Never teacher-forced: the model reads its own predictions.

    bleu_tokenize: sacrebleu's tokenization; None: "char" for a char-level target vocabulary (German number
    words are mostly one word each), "13a" (words) otherwise.
    max_len: the longest output, in tokens (EOS included); None: the model's max_len. Sources are decoded in
    batches of `batch_size`, grouped by length (`tfm_common.training.evaluate_pairs`). The model is in eval mode
    (no dropout) while decoding, and is left in the mode it had before.
    """
    if not isinstance(model, Module):
        raise TypeError(f"evaluate: model expected a tfm_numpy Module, got {type(model).__name__}")

    def decode(src: np.ndarray, n: int) -> np.ndarray:
        return greedy_decode(model, src, BOS_ID, EOS_ID, n, use_cache=use_cache)

    return evaluate_pairs(
        model, decode, pairs, src_vocab, tgt_vocab, max_len=max_len, batch_size=batch_size, bleu=bleu,
        bleu_tokenize=bleu_tokenize,
    )  # fmt: skip


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


def lm_eval_loss(model: Module, ids, block_size: int, batch_size: int = 32) -> tuple[float, np.ndarray]:
    """The mean next-token loss (nats) over a token array cut into consecutive windows of block_size tokens (each
    window starts a fresh context; the tail that does not fill a window is left out), in eval mode.
    Returns (mean loss, the targets scored (n_windows, block_size)): with their byte count, bits per byte."""
    ids = np.asarray(ids, dtype=np.int64)
    n = (len(ids) - 1) // check_size("lm_eval_loss", "block_size", block_size)
    x, y = ids[: n * block_size].reshape(n, block_size), ids[1 : n * block_size + 1].reshape(n, block_size)
    total = 0.0
    with eval_mode(model):
        for i in range(0, n, check_size("lm_eval_loss", "batch_size", batch_size)):
            logp = log_softmax(model(x[i : i + batch_size]))  # (b, T, V)
            total -= float(np.take_along_axis(logp, y[i : i + batch_size, :, None], axis=-1).sum(dtype=np.float64))
    return total / y.size, y
