"""Chapter 22b's recipe for fine-tuning a classifier on the snippet task (`tfm_common.snippets`), once, in either
track (`tfm_numpy` or `tfm_torch`, the module: both have `make_adam`, `CrossEntropyLoss`, `classifier_train_step`
and `predict_classes` with the same signatures), so that every model of the chapter (and chapter 22c's adapters)
is trained the same way:

- `snippet_ids(snippets, bpe, length, pad_id, cls_id=None, sep_id=None)`: the token ids (N, length), right-padded;
  with `cls_id` / `sep_id`, [CLS] text [SEP] as the BERT was pretrained on.
- `finetune(model, track, ids, labels, steps=..., ...)`: Adam (betas 0.9, 0.999), lm_recipe's `warmup_decay`
  schedule, gradient clipping at 1, mini-batches drawn as shuffled epochs by np.random.default_rng(seed) (the same
  batches in either track and for every model given the same seed), the accuracy on an evaluation set every
  `eval_every` steps (eval mode; training mode restored). Returns a `FinetuneRun`.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from .baselines import accuracy
from .bpe import ByteBPE
from .lm_recipe import warmup_decay
from .snippets import Snippets, encode_snippets
from .training import with_door
from .validate import check_real, check_size

__all__ = ["FinetuneRun", "snippet_ids", "epoch_batches", "finetune"]


class FinetuneRun(NamedTuple):
    losses: np.ndarray  # (steps,) the training loss of each step (before its update)
    eval_steps: np.ndarray  # (k,) the steps after which the evaluation set was scored (0: before training)
    eval_accuracy: np.ndarray  # (k,) the accuracy there


def snippet_ids(snippets: Snippets, bpe: ByteBPE, length: int, pad_id: int, cls_id: int | None = None,
                sep_id: int | None = None) -> np.ndarray:  # fmt: skip
    """(N, length) int64: each snippet's BPE ids, cut to fit, right-padded with `pad_id`; [CLS] first and [SEP]
    after the text when their ids are given."""
    if not isinstance(snippets, Snippets) or not isinstance(bpe, ByteBPE):
        raise TypeError(f"snippet_ids: expected Snippets and a ByteBPE, got {type(snippets).__name__} and "
                        f"{type(bpe).__name__}")  # fmt: skip
    prefix = () if cls_id is None else (cls_id,)
    suffix = () if sep_id is None else (sep_id,)
    return encode_snippets(snippets.texts, bpe.encode, length, pad_id=pad_id, prefix=prefix, suffix=suffix)


def epoch_batches(n: int, batch_size: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """`steps` index arrays of `batch_size` rows of n: shuffled epochs (each row once per epoch; a batch that would
    cross an epoch's end starts the next epoch instead)."""
    n, batch_size, steps = (check_size("epoch_batches", a, v) for a, v in (("n", n), ("batch_size", batch_size),
                                                                            ("steps", steps)))  # fmt: skip
    if batch_size > n:
        raise ValueError(f"epoch_batches: batch_size={batch_size} is more than the n={n} rows")
    out, order, at = [], rng.permutation(n), 0
    for _ in range(steps):
        if at + batch_size > n:
            order, at = rng.permutation(n), 0
        out.append(order[at : at + batch_size])
        at += batch_size
    return out


def finetune(model, track: ModuleType, ids: np.ndarray, labels: np.ndarray, *, steps: int, batch_size: int,
             peak: float, warmup: int, seed: int, eval_ids: np.ndarray | None = None,
             eval_labels: np.ndarray | None = None, eval_every: int | None = None,
             clip_norm: float = 1.0) -> FinetuneRun:  # fmt: skip
    """Train the classifier `model` (of `track`) on `ids` (N, T) and `labels` (N,) for `steps` steps, scoring
    (eval_ids, eval_labels) before training and every `eval_every` steps (and after the last)."""
    optimizer = track.make_adam(model, betas=(0.9, 0.999), eps=1e-8)
    loss_fn, rng = track.CrossEntropyLoss(), np.random.default_rng(seed)
    losses, eval_steps, eval_acc = [], [], []

    def score(step: int) -> None:
        if eval_ids is not None and (step % eval_every == 0 or step == steps):
            eval_steps.append(step)
            eval_acc.append(accuracy(track.predict_classes(model, eval_ids), eval_labels).value)

    score(0)
    for step, rows in enumerate(epoch_batches(len(ids), batch_size, steps, rng), start=1):
        lr = warmup_decay(step, steps, peak, warmup)  # linear warm-up to peak, then linear decay to 0
        result = track.classifier_train_step(model, ids[rows], labels[rows], optimizer, loss_fn, lr, clip_norm)
        losses.append(result.loss)
        score(step)
    return FinetuneRun(np.array(losses), np.array(eval_steps), np.array(eval_acc))


def _check_finetune(model, track, ids, labels, *, steps, batch_size, peak, warmup, seed, eval_ids, eval_labels,
                    eval_every, clip_norm) -> None:  # fmt: skip
    check_size("finetune", "steps", steps)
    check_size("finetune", "warmup", warmup)
    check_real("finetune", "peak", peak, low=0.0)
    if (eval_ids is None) != (eval_labels is None) or (eval_ids is None) != (eval_every is None):
        raise ValueError("finetune: give eval_ids, eval_labels and eval_every together, or none of them")
    if eval_every is not None:
        check_size("finetune", "eval_every", eval_every)


finetune = with_door(finetune, _check_finetune)  # the arguments checked before the printed loop runs
