"""Direct preference optimization (Rafailov et al., 2023), NumPy track: the log-probability of a response under a
model, the DPO loss, both with their backward written by hand, and one training step (chapter 22d).

    logp(y | x) = sum over response positions t of log softmax(logits[t])[y_t]        (prompt and padding masked)
    z           = beta * ((logp_pi(y_w) - logp_ref(y_w)) - (logp_pi(y_l) - logp_ref(y_l)))
    L           = -mean log sigmoid(z)

Shapes: logits (B, T, V), targets and mask (B, T); the four log-probability arrays (B,), one per pair.
`tfm_torch.dpo` has the same names; its backward is autograd's.
"""

from __future__ import annotations

import numpy as np

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

from .functional import log_softmax
from .module import Module, check_indices, check_input
from .optim import Adam, apply_update

__all__ = ["log_sigmoid", "sequence_logps", "sequence_logps_backward", "dpo_loss", "dpo_loss_backward",
           "dpo_train_step"]  # fmt: skip


def log_sigmoid(z: np.ndarray) -> np.ndarray:
    """log sigmoid(z) = -log(1 + exp(-z)) = min(z, 0) - log1p(exp(-|z|)): never exp of a large positive number,
    so finite for every finite z (the naive form overflows at z = -800 in float64, -90 in float32)."""
    return np.minimum(z, 0) - np.log1p(np.exp(-np.abs(z)))


def sequence_logps(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sum_t mask[b, t] log p(targets[b, t] | logits[b, t]): each row's response log-probability (B,)."""
    logp = log_softmax(logits)  # (B, T, V)
    picked = np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # (B, T) log p of each target
    return np.where(mask, picked, 0).sum(axis=-1)  # (B,): the prompt and the padding add nothing


def sequence_logps_backward(grad: np.ndarray, logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """dL/dlogits (B, T, V) from dL/dlogp (B,): at a kept position, g_b (onehot(target) - softmax(logits)); 0 at
    the prompt and the padding."""
    d = -np.exp(log_softmax(logits))  # (B, T, V) -softmax
    np.put_along_axis(d, targets[..., None], np.take_along_axis(d, targets[..., None], axis=-1) + 1, axis=-1)
    return d * (mask * grad[:, None])[..., None]


def dpo_loss(policy_logps_chosen, policy_logps_rejected, ref_logps_chosen, ref_logps_rejected, beta) -> DPOResult:
    """The DPO loss -mean log sigmoid(r_w - r_l), with the implicit rewards r = beta (logp_policy - logp_ref)."""
    chosen = beta * (policy_logps_chosen - ref_logps_chosen)  # (B,)
    rejected = beta * (policy_logps_rejected - ref_logps_rejected)  # (B,)
    margins = chosen - rejected  # (B,)
    return DPOResult(-log_sigmoid(margins).mean(), chosen, rejected, margins)


def dpo_loss_backward(grad_loss, policy_logps_chosen, policy_logps_rejected, ref_logps_chosen, ref_logps_rejected,
                      beta) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(dL/dpolicy_logps_chosen, dL/dpolicy_logps_rejected), each (B,). d/dz -log sigmoid(z) = -sigmoid(-z), so
    dL/dlogp_w = -beta sigmoid(-z) / B = -dL/dlogp_l: large while the pair is ranked wrong, small once it is right.
    The reference's log-probabilities are constants: the reference is frozen, it gets no gradient."""
    margins = beta * ((policy_logps_chosen - ref_logps_chosen) - (policy_logps_rejected - ref_logps_rejected))
    weight = np.exp(log_sigmoid(-margins))  # (B,) sigmoid(-z), stable at any z
    d_chosen = -grad_loss * beta * weight / margins.shape[0]
    return d_chosen, -d_chosen


def dpo_train_step(policy: Module, reference: Module, batch: PreferenceBatch, optimizer: Adam, beta: float,
                   lr: float, clip_norm=None) -> DPOStepResult:  # fmt: skip
    """One DPO update of `policy` on `batch` (rows 0..B-1 chosen, B..2B-1 rejected) against the frozen `reference`."""
    x, y, mask = batch
    with eval_mode(reference):  # the reference first: its forward must not overwrite the policy's cache
        ref = sequence_logps(reference(x), y, mask)  # (2B,) constants
    policy.zero_grad()
    logits = policy(x)  # (2B, T, V)
    logps, B = sequence_logps(logits, y, mask), x.shape[0] // 2  # (2B,)
    out = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], beta)
    d_chosen, d_rejected = dpo_loss_backward(1.0, logps[:B], logps[B:], ref[:B], ref[B:], beta)
    policy.backward(sequence_logps_backward(np.concatenate([d_chosen, d_rejected]), logits, y, mask))
    norm = apply_update("dpo_train_step", optimizer, float(out.loss), lr, clip_norm)
    return DPOStepResult(float(out.loss), norm, float(out.chosen_rewards.mean()), float(out.rejected_rewards.mean()),
                         float(out.margins.mean()), float((out.margins > 0).mean()))  # fmt: skip


# -- the doors: what each public function refuses before its math runs -----------------------------------------------


def _check_logps(name: str, arrays: dict) -> None:
    for arg, a in arrays.items():
        check_input(f"{name}: {arg}", a)
    check_dpo_shapes(name, {arg: a.shape for arg, a in arrays.items()})
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) > 1:
        raise TypeError(f"{name}: the log-probabilities must share one dtype, got {sorted(map(str, dtypes))}")
    for arg, a in arrays.items():
        if not np.isfinite(a).all():
            raise ValueError(f"{name}: {arg} must be finite, got {a[~np.isfinite(a)].flat[0]}")


def _check_dpo_loss(policy_logps_chosen, policy_logps_rejected, ref_logps_chosen, ref_logps_rejected, beta) -> None:
    check_beta("dpo_loss", beta)
    logps = dict(policy_logps_chosen=policy_logps_chosen, policy_logps_rejected=policy_logps_rejected,
                 ref_logps_chosen=ref_logps_chosen, ref_logps_rejected=ref_logps_rejected)  # fmt: skip
    _check_logps("dpo_loss", logps)


def _check_dpo_backward(grad_loss, *logps_and_beta) -> None:
    if np.ndim(grad_loss) != 0 or not np.isfinite(grad_loss):
        raise ValueError(f"dpo_loss_backward: grad_loss expected a finite scalar, got {grad_loss!r}")
    _check_dpo_loss(*logps_and_beta)


def _check_sequence(logits, targets, mask, name: str = "sequence_logps") -> None:
    check_input(f"{name}: logits", logits)
    check_indices(f"{name}: targets", targets, logits.shape[-1] if logits.ndim else 0)
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
        raise TypeError(f"{name}: mask expected a boolean numpy.ndarray (True at response tokens), "
                        f"got {getattr(mask, 'dtype', type(mask).__name__)}")  # fmt: skip
    check_sequence_shapes(name, logits.shape, targets.shape, mask.shape)
    check_mask_rows(name, mask.sum(axis=-1))
    if not np.isfinite(logits).all():
        raise ValueError(f"{name}: logits must be finite, got {logits[~np.isfinite(logits)].flat[0]}")


def _check_sequence_backward(grad, logits, targets, mask) -> None:
    _check_sequence(logits, targets, mask, "sequence_logps_backward")
    check_input("sequence_logps_backward: grad", grad, dtype=logits.dtype)
    if grad.shape != logits.shape[:1]:
        raise ValueError(f"sequence_logps_backward: grad expected shape {logits.shape[:1]} (one per row), "
                         f"got {grad.shape}")  # fmt: skip


def _check_dpo_step(policy, reference, batch, optimizer, beta, lr, clip_norm) -> None:
    if not isinstance(batch, PreferenceBatch):
        raise TypeError(f"dpo_train_step: batch expected a PreferenceBatch, got {type(batch).__name__}")
    if batch.tokens.shape[0] % 2:
        raise ValueError(
            f"dpo_train_step: batch needs 2B rows (B chosen, then B rejected), got {batch.tokens.shape[0]}"
        )
    check_beta("dpo_train_step", beta)
    reference_is_frozen("dpo_train_step", policy.parameters(), reference.parameters(), optimizer.params)
    check_indices("dpo_train_step: tokens", batch.tokens, policy.vocab_size)
    check_indices("dpo_train_step: targets", batch.targets, policy.vocab_size)
    check_batch_mask("dpo_train_step", batch.tokens.shape, batch.mask)


log_sigmoid = behind_door(log_sigmoid, lambda z: check_input("log_sigmoid", z))
sequence_logps = behind_door(sequence_logps, _check_sequence)
sequence_logps_backward = behind_door(sequence_logps_backward, _check_sequence_backward)
dpo_loss = behind_door(dpo_loss, _check_dpo_loss)
dpo_loss_backward = behind_door(dpo_loss_backward, _check_dpo_backward)
dpo_train_step = with_door(dpo_train_step, _check_dpo_step)
