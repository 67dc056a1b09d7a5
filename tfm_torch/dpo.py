"""Direct preference optimization, PyTorch track: the twin of tfm_numpy.dpo (same names, same arguments, the same
refusals); the backward is autograd's, the reference's log-probabilities are computed under no_grad."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tfm_common.preference import (
    DPOResult,
    DPOStepResult,
    PreferenceBatch,
    check_batch_mask,
    check_beta,
    check_dpo_shapes,
    check_mask_rows,
    check_sequence_shapes,
    reference_is_frozen,
)
from tfm_common.training import eval_mode, with_door
from tfm_common.validate import behind_door

from .module import check_indices, check_input
from .optim import apply_update, optimizer_params

__all__ = ["log_sigmoid", "sequence_logps", "dpo_loss", "dpo_train_step"]


def log_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """log sigmoid(z), stable at any finite z (torch's F.logsigmoid)."""
    return F.logsigmoid(z)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t mask[b, t] log p(targets[b, t] | logits[b, t]): each row's response log-probability (B,)."""
    picked = logits.log_softmax(-1).gather(-1, targets[..., None].long())[..., 0]  # (B, T)
    return torch.where(mask, picked, 0).sum(-1)  # (B,)


def dpo_loss(policy_logps_chosen, policy_logps_rejected, ref_logps_chosen, ref_logps_rejected, beta) -> DPOResult:
    """The DPO loss -mean log sigmoid(r_w - r_l), with the implicit rewards r = beta (logp_policy - logp_ref)."""
    chosen = beta * (policy_logps_chosen - ref_logps_chosen)  # (B,)
    rejected = beta * (policy_logps_rejected - ref_logps_rejected)  # (B,)
    margins = chosen - rejected  # (B,)
    return DPOResult(-F.logsigmoid(margins).mean(), chosen, rejected, margins)


def dpo_train_step(policy: nn.Module, reference: nn.Module, batch: PreferenceBatch, optimizer, beta: float,
                   lr: float, clip_norm=None) -> DPOStepResult:  # fmt: skip
    """One DPO update of `policy` on `batch` (rows 0..B-1 chosen, B..2B-1 rejected) against the frozen `reference`."""
    device = next(policy.parameters()).device
    x, y, mask = (torch.from_numpy(a).to(device) for a in batch)
    with torch.no_grad(), eval_mode(reference):
        ref = sequence_logps(reference(x), y, mask)  # (2B,) constants
    optimizer.zero_grad(set_to_none=False)
    logps, B = sequence_logps(policy(x), y, mask), x.shape[0] // 2  # (2B,)
    out = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], beta)
    out.loss.backward()
    norm = apply_update("dpo_train_step", optimizer, out.loss.item(), lr, clip_norm)
    return DPOStepResult(out.loss.item(), norm, out.chosen_rewards.mean().item(), out.rejected_rewards.mean().item(),
                         out.margins.mean().item(), (out.margins > 0).double().mean().item())  # fmt: skip


# -- the doors --------------------------------------------------------------------------------------------------------


def _check_logps(name: str, tensors: dict) -> None:
    for arg, a in tensors.items():
        check_input(f"{name}: {arg}", a)
    check_dpo_shapes(name, {arg: tuple(a.shape) for arg, a in tensors.items()})
    dtypes = {a.dtype for a in tensors.values()}
    if len(dtypes) > 1:
        raise TypeError(f"{name}: the log-probabilities must share one dtype, got {sorted(map(str, dtypes))}")
    for arg, a in tensors.items():
        if not torch.isfinite(a).all():
            raise ValueError(f"{name}: {arg} must be finite, got {a[~torch.isfinite(a)][0].item()}")


def _check_dpo_loss(policy_logps_chosen, policy_logps_rejected, ref_logps_chosen, ref_logps_rejected, beta) -> None:
    check_beta("dpo_loss", beta)
    logps = dict(policy_logps_chosen=policy_logps_chosen, policy_logps_rejected=policy_logps_rejected,
                 ref_logps_chosen=ref_logps_chosen, ref_logps_rejected=ref_logps_rejected)  # fmt: skip
    _check_logps("dpo_loss", logps)


def _check_sequence(logits, targets, mask, name: str = "sequence_logps") -> None:
    check_input(f"{name}: logits", logits)
    check_indices(f"{name}: targets", targets, logits.shape[-1] if logits.dim() else 0)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name}: mask expected a boolean torch.Tensor (True at response tokens), "
                        f"got {getattr(mask, 'dtype', type(mask).__name__)}")  # fmt: skip
    check_sequence_shapes(name, tuple(logits.shape), tuple(targets.shape), tuple(mask.shape))
    check_mask_rows(name, mask.sum(-1).cpu().numpy())
    if not torch.isfinite(logits).all():
        raise ValueError(f"{name}: logits must be finite, got {logits[~torch.isfinite(logits)][0].item()}")


def _check_dpo_step(policy, reference, batch, optimizer, beta, lr, clip_norm) -> None:
    if not isinstance(batch, PreferenceBatch):
        raise TypeError(f"dpo_train_step: batch expected a PreferenceBatch, got {type(batch).__name__}")
    if batch.tokens.shape[0] % 2:
        raise ValueError(
            f"dpo_train_step: batch needs 2B rows (B chosen, then B rejected), got {batch.tokens.shape[0]}"
        )
    check_beta("dpo_train_step", beta)
    reference_is_frozen("dpo_train_step", policy.parameters(), reference.parameters(), optimizer_params(optimizer))
    for arg in ("tokens", "targets"):
        check_indices(f"dpo_train_step: {arg}", torch.from_numpy(getattr(batch, arg)), policy.vocab_size)
    check_batch_mask("dpo_train_step", batch.tokens.shape, batch.mask)


log_sigmoid = behind_door(log_sigmoid, lambda z: check_input("log_sigmoid", z))
sequence_logps = behind_door(sequence_logps, _check_sequence)
dpo_loss = behind_door(dpo_loss, _check_dpo_loss)
dpo_train_step = with_door(dpo_train_step, _check_dpo_step)
