"""Training, PyTorch track: the same names and arguments as tfm_numpy.train, and the same step, with autograd's
`loss.backward()` for the backward by hand.

Batches are the NumPy `Batch`es of `tfm_common.data` (both tracks train on the very same ones); they become
tensors here, on the model's device. `train` and `evaluate` hand this track's pieces to the loop and the
evaluation of `tfm_common.training`. The library never changes torch's global settings: set
`torch.set_num_threads` yourself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

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
)
from tfm_common.validate import check_size

from .checkpoint import save_checkpoint
from .decoding import greedy_decode
from .functional import log_softmax
from .loss import CrossEntropyLoss
from .optim import apply_update, optimizer_params
from .parallel import train_step_accumulated

__all__ = ["History", "StepResult", "Evaluation", "train_step", "train", "evaluate", "lm_train_step", "lm_eval_loss"]


def train_step(
    model: nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    loss_fn: CrossEntropyLoss,
    lr: float,
    clip_norm: float | None = None,
) -> StepResult:
    """One update of `model` on `batch` with learning rate `lr`; returns (loss before the update, gradient norm
    before clipping). The model should be in training mode (dropout on), as `train` sets it."""
    check_step("train_step", model.parameters(), optimizer_params(optimizer), batch=batch)
    device = next(model.parameters()).device
    src, tgt_in, tgt_out = (torch.from_numpy(a).to(device) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    model.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)  # (B, T, V)
    loss = loss_fn(logits, tgt_out)  # mean over the batch's non-pad target tokens
    loss.backward()  # autograd: every parameter's .grad
    norm = apply_update("train_step", optimizer, loss.item(), lr, clip_norm)  # norm, clipping, lr, Adam's step
    return StepResult(loss.item(), norm)


def _decode(model: nn.Module, src: np.ndarray, max_len: int, use_cache: bool) -> np.ndarray:
    src = torch.from_numpy(src).to(next(model.parameters()).device)
    return greedy_decode(model, src, BOS_ID, EOS_ID, max_len, use_cache=use_cache).cpu().numpy()


# `train` is the loop `tfm_common.training.fit`, `evaluate` is `evaluate_pairs`, with this track's pieces
TRACK = Track(nn.Module, "torch.nn.Module", torch.optim.Optimizer, "torch.optim.Optimizer", train_step,
              train_step_accumulated, CrossEntropyLoss, save_checkpoint, _decode)  # fmt: skip
train, evaluate = track_functions(TRACK)


# -- the language model (chapter 17b) -----------------------------------------------------------------------------


def lm_train_step(model: nn.Module, x, y, optimizer: torch.optim.Optimizer, loss_fn, lr: float, clip_norm=None):
    """One update on windows x (B, T) and next tokens y (B, T) (NumPy arrays or tensors; a nested list is refused,
    as in tfm_numpy, and so is an empty batch), as tfm_numpy's.
    Returns (loss before the update, gradient norm before clipping)."""
    check_lm_windows("lm_train_step", x, y, (np.ndarray, torch.Tensor), "a numpy.ndarray or torch.Tensor")
    check_step("lm_train_step", model.parameters(), optimizer_params(optimizer))
    device = next(model.parameters()).device
    x, y = (torch.as_tensor(a).to(device) for a in (x, y))
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    norm = apply_update("lm_train_step", optimizer, loss.item(), lr, clip_norm)  # norm, clipping, lr, the step
    return StepResult(loss.item(), norm)


@torch.no_grad()
def lm_eval_loss(model: nn.Module, ids, block_size: int, batch_size: int = 32) -> tuple[float, np.ndarray]:
    """Mean next-token loss (nats) over consecutive windows of a token array, as tfm_numpy's; returns (loss, the
    targets scored (n_windows, block_size) as a NumPy array). `ids` are checked as there."""
    ids, block_size = check_lm_ids("lm_eval_loss", ids, block_size, getattr(model, "vocab_size", None))
    n = (len(ids) - 1) // block_size
    x, y = ids[: n * block_size].reshape(n, block_size), ids[1 : n * block_size + 1].reshape(n, block_size)
    device, total = next(model.parameters()).device, 0.0
    with eval_mode(model):
        for i in range(0, n, check_size("lm_eval_loss", "batch_size", batch_size)):
            xb, yb = (torch.from_numpy(a[i : i + batch_size]).to(device) for a in (x, y))
            logp = log_softmax(model(xb))  # (b, T, V)
            total -= logp.gather(-1, yb[..., None]).double().sum().item()
    return total / y.size, y
