"""Cross-entropy, NumPy track: log-softmax, label smoothing, ignored positions, and the fused backward."""

from __future__ import annotations

import math

import numpy as np

from tfm_common.validate import check_size

from .functional import log_softmax
from .module import Module, check_grad, check_indices, check_input, check_probability

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(Module):
    """Mean cross-entropy over the positions whose target is not `ignore_index`, as
    `torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ...)`.

    logits (..., V) float, classes on the LAST axis (torch's F.cross_entropy wants them at dim 1);
    targets (...) integer class ids in [0, V), or `ignore_index`.

    Label smoothing eps (torch's convention): the target distribution is
        q = (1 - eps) * onehot(target) + eps / V        (eps/V on every class, the true one included)
    and the loss at one position is -sum_v q_v log p_v = (1 - eps) * nll + eps * mean_v(-log p_v).

    Backward (fused): dL/dlogits = (softmax(logits) - q) / n_valid at kept positions, 0 at ignored
    ones; the softmax Jacobian is never formed, because it cancels against the log.

    If every position is ignored, n_valid = 0: torch returns nan (0/0); we return a loss of 0 and a
    zero gradient instead, so that an all-padding batch cannot poison training with nan.
    """

    _kept_inputs = ()  # the cache holds log-probabilities and a new target array: no copy of (B, T, V) logits needed

    def __init__(self, ignore_index: int | None = None, label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index = check_size("CrossEntropyLoss", "ignore_index", ignore_index, -math.inf, allow_none=True)
        self.label_smoothing = check_probability("CrossEntropyLoss", "label_smoothing", label_smoothing, True)

    def _check_forward(self, logits, targets) -> None:
        check_input("CrossEntropyLoss: logits", logits)
        if not isinstance(targets, np.ndarray) or targets.shape != logits.shape[:-1]:
            got = targets.shape if isinstance(targets, np.ndarray) else type(targets).__name__
            raise ValueError(
                f"CrossEntropyLoss: targets expected shape {logits.shape[:-1]} (logits without V), got {got}"
            )
        check_indices("CrossEntropyLoss: targets", targets, logits.shape[-1], ignore=self.ignore_index)

    def forward(self, logits: np.ndarray, targets: np.ndarray) -> np.floating:
        V, eps, dt = logits.shape[-1], self.label_smoothing, logits.dtype
        z = logits.reshape(-1, V)  # (N, V)
        t = targets.reshape(-1)  # (N,)
        valid = np.ones(t.shape, dtype=bool) if self.ignore_index is None else t != self.ignore_index  # (N,)
        t = np.where(valid, t, 0)  # any class id at ignored positions: their loss is masked below
        logp = log_softmax(z)  # (N, V)
        nll = -logp[np.arange(t.size), t]  # (N,) -log p_target
        per_pos = (1 - eps) * nll - eps * logp.mean(axis=-1) if eps else nll  # (N,)
        n_valid = max(int(valid.sum()), 1)  # all ignored: loss 0 (see the class docstring)
        self._cache = (logp, t, valid, n_valid, logits.shape)
        return dt.type(np.where(valid, per_pos, 0).sum() / dt.type(n_valid))

    def backward(self, grad_out=1.0) -> np.ndarray:
        """dL/dlogits, shaped like the logits; `grad_out` is dLoss_total/dloss (a scalar), 1 by default."""
        logp, t, valid, n_valid, shape = self._saved()
        eps, V, dt = self.label_smoothing, shape[-1], logp.dtype
        d = np.exp(logp)  # (N, V) softmax
        d[np.arange(t.size), t] -= 1 - eps  # - (1 - eps) onehot
        if eps:
            d -= eps / V  # - eps / V everywhere
        d *= (valid * dt.type(grad_out / n_valid))[:, None]  # 0 at ignored rows, 1/n_valid (times grad_out) at the rest
        return d.reshape(shape)

    def _check_backward(self, grad_out=1.0) -> None:
        if np.ndim(grad_out) != 0:
            raise ValueError(f"CrossEntropyLoss.backward: grad_out expected a scalar, got shape {np.shape(grad_out)}")
        if isinstance(grad_out, np.ndarray):
            check_grad("CrossEntropyLoss", grad_out, (), self._cache[0].dtype)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}"
