"""Plumbing of gradient accumulation shared by both tracks (`tfm_numpy.parallel`, `tfm_torch.parallel`): splitting
a batch into micro-batches, and the weight of each micro-batch's loss."""

from __future__ import annotations

import numpy as np

from .data import PAD_ID, Batch
from .validate import check_choice, check_size

__all__ = ["NORMALIZE", "split_batch", "micro_weights", "check_micro_batches"]

NORMALIZE = ("tokens", "micro_batches")


def split_batch(batch: Batch, k: int) -> list[Batch]:
    """Split `batch` by rows into `k` micro-batches (sizes differ by at most one), each trimmed of the columns that
    are padding in all of its rows: what a loader would have built for the smaller batches."""
    if not isinstance(batch, Batch):
        raise TypeError(f"split_batch: batch expected a tfm_common.data.Batch, got {type(batch).__name__}")
    k = check_size("split_batch", "k", k)
    if k > len(batch):
        raise ValueError(f"split_batch: k expected at most the batch size {len(batch)}, got {k}")
    out = []
    for rows in np.array_split(np.arange(len(batch)), k):
        src, tgt_in, tgt_out = batch.src[rows], batch.tgt_in[rows], batch.tgt_out[rows]
        s = _used_columns(src != PAD_ID)
        t = _used_columns(tgt_out != PAD_ID)
        out.append(Batch(src[:, :s], tgt_in[:, :t], tgt_out[:, :t], int((tgt_out != PAD_ID).sum())))
    return out


def _used_columns(not_pad: np.ndarray) -> int:
    cols = np.flatnonzero(not_pad.any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 1


def check_micro_batches(name: str, micro_batches) -> list[Batch]:
    micro_batches = list(micro_batches) if isinstance(micro_batches, (list, tuple)) else None
    if not micro_batches or not all(isinstance(b, Batch) for b in micro_batches):
        raise TypeError(f"{name}: micro_batches expected a non-empty list of tfm_common.data.Batch")
    return micro_batches


def micro_weights(micro_batches: list[Batch], normalize: str) -> list[float]:
    """The weight of each micro-batch's mean loss: n_i / N ("tokens", exact) or 1/k ("micro_batches", the common
    mistake: exact only when every micro-batch holds the same number of tokens)."""
    check_choice("micro_weights", "normalize", normalize, NORMALIZE)
    if normalize == "micro_batches":
        return [1.0 / len(micro_batches)] * len(micro_batches)
    total = max(sum(b.n_tokens for b in micro_batches), 1)
    return [b.n_tokens / total for b in micro_batches]
