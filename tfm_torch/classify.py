"""A classifier on top of a pretrained model, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.classify (see its docstring); autograd does the backward."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from tfm_common.classify import SequenceClassifierDoor, check_class_batch
from tfm_common.config import own_init
from tfm_common.training import StepResult, check_step, eval_mode
from tfm_common.validate import check_choice, check_size

from .layers import Linear
from .module import Module, as_generator
from .optim import apply_update, optimizer_params

__all__ = ["SequenceClassifier", "last_positions", "pool_positions", "pool_at", "classifier_train_step",
           "predict_classes"]  # fmt: skip


def last_positions(tokens: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """(B,) int64: the position of each row's last token that is not `pad_id` (T - 1 everywhere if None)."""
    B, T = tokens.shape
    if pad_id is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=tokens.device)
    index = torch.arange(T, device=tokens.device).expand(B, T)
    return torch.where(tokens != pad_id, index, -1).amax(dim=1)  # (B,): the largest non-pad index


def pool_positions(tokens: torch.Tensor, pool: str, pad_id: int | None) -> torch.Tensor:
    """(B,) int64: 0 for pool="first", else `last_positions` (as tfm_numpy's)."""
    check_choice("pool_positions", "pool", pool, ("first", "last"))
    if pool == "first":
        return torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    return last_positions(tokens, pad_id)


def pool_at(h: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """(B, T, d), (B,) -> (B, d): row b's hidden state at position at[b]."""
    return h[torch.arange(len(at), device=h.device), at]


def _to_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class SequenceClassifier(SequenceClassifierDoor, Module):
    """A linear head on one position's hidden state of `backbone`, twin of tfm_numpy.SequenceClassifier."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.backbone.encode(tokens)  # (B, T, d)
        at = pool_positions(tokens, self.pool, self.pad_id)  # (B,)
        return self.head(pool_at(h, at))  # (B, K)


SequenceClassifier._parts = SimpleNamespace(
    Module=nn.Module, Linear=Linear, as_rng=as_generator, dtype_of=lambda m: next(m.parameters()).dtype,
    to_numpy=_to_numpy,
)  # fmt: skip
own_init(SequenceClassifier)


def classifier_train_step(model: nn.Module, tokens, labels, optimizer: torch.optim.Optimizer, loss_fn, lr: float,
                          clip_norm=None) -> StepResult:  # fmt: skip
    """One update on token ids (B, T) and classes (B,) (NumPy arrays or tensors), as tfm_numpy's."""
    n_classes = getattr(model, "n_classes", None) or np.iinfo(np.int64).max
    check_class_batch("classifier_train_step", tokens, labels, n_classes, (np.ndarray, torch.Tensor),
                      "a numpy.ndarray or torch.Tensor", _to_numpy)  # fmt: skip
    check_step("classifier_train_step", model.parameters(), optimizer_params(optimizer))
    device = next(model.parameters()).device
    tokens, labels = (torch.as_tensor(a).to(device) for a in (tokens, labels))
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(tokens), labels)
    loss.backward()
    norm = apply_update("classifier_train_step", optimizer, loss.item(), lr, clip_norm)
    return StepResult(loss.item(), norm)


@torch.no_grad()
def predict_classes(model: nn.Module, tokens, batch_size: int = 256) -> np.ndarray:
    """(N,) int64 NumPy: the argmax class of each row of `tokens` (N, T), in eval mode, as tfm_numpy's."""
    batch_size = check_size("predict_classes", "batch_size", batch_size)
    if not isinstance(tokens, (np.ndarray, torch.Tensor)) or tokens.ndim != 2:
        raise TypeError(f"predict_classes: tokens expected a (N, T) numpy.ndarray of ids, got "
                        f"{getattr(tokens, 'shape', type(tokens).__name__)}")  # fmt: skip
    device, tokens = next(model.parameters()).device, torch.as_tensor(tokens)
    with eval_mode(model):
        parts = [model(tokens[i : i + batch_size].to(device)).argmax(dim=-1).cpu()
                 for i in range(0, len(tokens), batch_size)]  # fmt: skip
    return torch.cat(parts).numpy().astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
