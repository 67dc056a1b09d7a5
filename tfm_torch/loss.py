"""Cross-entropy, PyTorch track: the same class, arguments and conventions as tfm_numpy.loss.

Written out from log_softmax (not F.cross_entropy) to mirror the NumPy track; the tests compare it
with F.cross_entropy. Autograd does the backward.
"""

from __future__ import annotations

import math

import torch

from tfm_common.validate import check_probability, check_size

from .functional import log_softmax
from .module import Module, autocast_dtype, check_indices, check_input

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(Module):
    """As tfm_numpy.CrossEntropyLoss: logits (..., V) (classes on the LAST axis), targets (...) integer, label
    smoothing in torch's convention; all positions ignored: loss 0 and zero gradient (F.cross_entropy: nan)."""

    def __init__(self, ignore_index: int | None = None, label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index = check_size("CrossEntropyLoss", "ignore_index", ignore_index, -math.inf, allow_none=True)
        self.label_smoothing = check_probability("CrossEntropyLoss", "label_smoothing", label_smoothing, True)

    def _check_forward(self, logits, targets) -> None:
        check_input("CrossEntropyLoss: logits", logits)
        if not isinstance(targets, torch.Tensor) or targets.shape != logits.shape[:-1]:
            got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            expected = tuple(logits.shape[:-1])
            raise ValueError(f"CrossEntropyLoss: targets expected shape {expected} (logits without V), got {got}")

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        eps = self.label_smoothing
        targets = check_indices("CrossEntropyLoss: targets", targets, logits.shape[-1], ignore=self.ignore_index)
        valid = (
            torch.ones_like(targets, dtype=torch.bool) if self.ignore_index is None else targets != self.ignore_index
        )
        t = torch.where(valid, targets, 0).long()  # (...,) any class at ignored positions: masked below
        if autocast_dtype(logits):  # bfloat16/float16 logits under torch.autocast: the loss in float32
            logits = logits.float()
        logp = log_softmax(logits)  # (..., V)
        nll = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)  # (...,)
        per_pos = (1 - eps) * nll - eps * logp.mean(dim=-1) if eps else nll
        n_valid = valid.sum().clamp(min=1)  # all ignored: loss 0
        return torch.where(valid, per_pos, 0).sum() / n_valid

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}"
