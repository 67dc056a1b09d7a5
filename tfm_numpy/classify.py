"""A classifier on top of a pretrained model, NumPy track (chapter 22b): a linear head on the hidden state of one
position, trained end to end (fine-tuning) with the backbone's own hand-written backward.

    h      = backbone.encode(tokens)          (B, T, d)   the hidden states after the final norm
    at     = pool_positions(tokens, ...)      (B,)        the position read in each row: 0, or the last non-pad
    pooled = h[b, at[b]]                      (B, d)
    logits = pooled W^T + b                   (B, K)

Backward: the head's, then dL/dh is zero everywhere but at (b, at[b]), where it is dL/dpooled; the backbone's
`encode_backward` takes it from there. `classifier_train_step` is one update (cross-entropy over the batch, Adam),
as `lm_train_step` is for the language model; `predict_classes` the argmax, in eval mode.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tfm_common.classify import SequenceClassifierDoor, check_class_batch
from tfm_common.config import own_init
from tfm_common.training import StepResult, check_step, eval_mode, with_door
from tfm_common.validate import check_choice, check_size

from .layers import Linear
from .loss import CrossEntropyLoss
from .module import Module, as_rng
from .optim import Adam, apply_update

__all__ = ["SequenceClassifier", "last_positions", "pool_positions", "pool_at", "pool_at_backward",
           "classifier_train_step", "predict_classes"]  # fmt: skip


def last_positions(tokens: np.ndarray, pad_id: int | None) -> np.ndarray:
    """(B,) int64: the position of each row's last token that is not `pad_id` (T - 1 everywhere if pad_id is None).
    Where the row ends, not where the array ends: a right-padded row's last position holds a pad."""
    B, T = tokens.shape
    if pad_id is None:
        return np.full(B, T - 1, dtype=np.int64)
    return np.where(tokens != pad_id, np.arange(T), -1).max(axis=1)  # (B,): the largest non-pad index


def pool_positions(tokens: np.ndarray, pool: str, pad_id: int | None) -> np.ndarray:
    """(B,) int64: the position a classifier reads in each row, 0 for pool="first", else `last_positions`."""
    check_choice("pool_positions", "pool", pool, ("first", "last"))
    return np.zeros(len(tokens), dtype=np.int64) if pool == "first" else last_positions(tokens, pad_id)


def pool_at(h: np.ndarray, at: np.ndarray) -> np.ndarray:
    """(B, T, d), (B,) -> (B, d): row b's hidden state at position at[b]."""
    return h[np.arange(len(at)), at]


def pool_at_backward(d_pooled: np.ndarray, h_shape: tuple[int, ...], at: np.ndarray) -> np.ndarray:
    """dL/dh (B, T, d) from dL/dpooled (B, d): the gradient goes back where the state was read, zero elsewhere."""
    dh = np.zeros(h_shape, dtype=d_pooled.dtype)
    dh[np.arange(len(at)), at] = d_pooled
    return dh


class SequenceClassifier(SequenceClassifierDoor, Module):
    """`SequenceClassifier(backbone, n_classes, *, pool="first" | "last", pad_id=None, rng=None)`: a linear head
    on one position's hidden state of `backbone` (a GPT or a BERT: anything with `encode` and `encode_backward`).
    `model(tokens (B, T))` -> logits (B, n_classes); `model.backward(dlogits)` fills every parameter's `.grad`, the
    backbone's included. state_dict keys: "backbone.*", "head.weight", "head.bias". See tfm_common.classify for
    pool, pad_id and the padding rule (rows right-padded)."""

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        h = self.backbone.encode(tokens)  # (B, T, d)
        at = pool_positions(tokens, self.pool, self.pad_id)  # (B,): 0, or each row's last non-pad token
        self._cache = (h.shape, at)
        return self.head(pool_at(h, at))  # (B, d) -> (B, K)

    def backward(self, grad_logits: np.ndarray) -> None:
        h_shape, at = self._saved()
        d_pooled = self.head.backward(grad_logits)  # (B, d)
        self.backbone.encode_backward(pool_at_backward(d_pooled, h_shape, at))  # (B, T, d), zero but at `at`


SequenceClassifier._parts = SimpleNamespace(
    Module=Module, Linear=Linear, as_rng=as_rng, dtype_of=lambda m: m.param_dtype, to_numpy=np.asarray
)
own_init(SequenceClassifier)  # a wrong argument is refused in the name of SequenceClassifier, not of its door


def classifier_train_step(model: Module, tokens, labels, optimizer: Adam, loss_fn: CrossEntropyLoss, lr: float,
                          clip_norm=None) -> StepResult:  # fmt: skip
    """One update on token ids (B, T) and their classes (B,): the cross-entropy, mean over the B rows, then Adam.
    Returns (loss before the update, gradient norm before clipping), as `lm_train_step`."""
    check_step("classifier_train_step", model.parameters(), optimizer.params)
    model.zero_grad()
    loss = loss_fn(model(tokens), labels)  # logits (B, K) against labels (B,)
    model.backward(loss_fn.backward())  # dL/dlogits -> every parameter's .grad, the backbone's too
    norm = apply_update("classifier_train_step", optimizer, float(loss), lr, clip_norm)
    return StepResult(float(loss), norm)


def _check_classifier_step(model, tokens, labels, **_) -> None:
    n_classes = getattr(model, "n_classes", None) or np.iinfo(np.int64).max
    check_class_batch("classifier_train_step", tokens, labels, n_classes, (np.ndarray,), "a numpy.ndarray", np.asarray)


classifier_train_step = with_door(classifier_train_step, _check_classifier_step)


def predict_classes(model: Module, tokens: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """(N,) int64: the argmax class of each row of `tokens` (N, T), in eval mode, `batch_size` rows at a time."""
    batch_size = check_size("predict_classes", "batch_size", batch_size)
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 2:
        raise TypeError(f"predict_classes: tokens expected a (N, T) numpy.ndarray of ids, got "
                        f"{getattr(tokens, 'shape', type(tokens).__name__)}")  # fmt: skip
    with eval_mode(model):
        parts = [model(tokens[i : i + batch_size]).argmax(axis=-1) for i in range(0, len(tokens), batch_size)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
