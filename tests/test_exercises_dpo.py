"""Wrong attempts at the exercises of chapter 22d (DPO): each fails with a message that points at the mistake."""

from __future__ import annotations

import numpy as np
from helpers_exercises import fails

from tfm_numpy.exercises import check


def _log_softmax(logits, shift=True):
    z = logits - logits.max(axis=-1, keepdims=True) if shift else logits
    with np.errstate(all="ignore"):
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _seq(logits, targets, mask, *, shift=True, use_mask=True, offset=0, reduce="sum"):
    logp = _log_softmax(logits, shift)
    picked = np.take_along_axis(logp, np.roll(targets, offset, axis=-1)[..., None], axis=-1)[..., 0]
    kept = np.where(mask, picked, 0) if use_mask else picked
    if reduce == "mean":
        return kept.sum(axis=-1) / np.maximum(mask.sum(axis=-1), 1)
    return kept.sum(axis=-1)


def test_sequence_logps_reference_attempt_passes():
    assert check("sequence_logps", _seq, quiet=True).passed


def test_sequence_logps_without_the_mask():
    result = fails("sequence_logps", lambda lg, t, m: _seq(lg, t, m, use_mask=False),
                   "B = 3, T = 6, V = 7 (prompt and padding masked): off by",
                   "the prompt and the padding add nothing")  # fmt: skip
    assert not result.failed("whole rows masked in")  # nothing masked there: right by chance


def test_sequence_logps_mean_instead_of_sum():
    fails("sequence_logps", lambda lg, t, m: _seq(lg, t, m, reduce="mean"), "B = 4, T = 9, V = 3: off by",
          "sum over the positions")  # fmt: skip


def test_sequence_logps_targets_shifted_again():
    """The targets are already the next tokens: shifting them once more scores the wrong token."""
    fails("sequence_logps", lambda lg, t, m: _seq(lg, t, m, offset=1), "B = 3, T = 6, V = 7", "log_softmax(logits)")


def test_sequence_logps_without_the_max_shift_fails_only_on_large_logits():
    result = fails("sequence_logps", lambda lg, t, m: _seq(lg, t, m, shift=False), "large logits (about 1e3)",
                   "subtracts each row's max")  # fmt: skip
    assert len(result.failures) == 1


def _log_sigmoid(z, stable=True):
    if stable:
        return np.minimum(z, 0) - np.log1p(np.exp(-np.abs(z)))
    with np.errstate(all="ignore"):
        return np.log(1 / (1 + np.exp(-z)))


def _loss(pc, pr, rc, rr, beta, *, stable=True, use_ref=True, reduce="mean", beta_on_chosen_only=False):
    if not use_ref:
        rc = rr = 0 * pc
    chosen, rejected = beta * (pc - rc), (pr - rr) * (1 if beta_on_chosen_only else beta)
    per_pair = -_log_sigmoid(chosen - rejected, stable)
    return per_pair.mean() if reduce == "mean" else per_pair.sum()


def test_dpo_loss_forward_reference_attempt_passes():
    assert check("dpo_loss_forward", _loss, quiet=True).passed


def test_dpo_loss_forward_without_the_reference():
    fails("dpo_loss_forward", lambda *a: _loss(*a, use_ref=False), "B = 4, beta = 0.1: off by",
          "the reference's log-probabilities are subtracted")  # fmt: skip


def test_dpo_loss_forward_sum_instead_of_mean():
    result = fails("dpo_loss_forward", lambda *a: _loss(*a, reduce="sum"), "B = 7, beta = 2: off by",
                   "mean over the pairs")  # fmt: skip
    assert not result.failed("B = 1, beta = 0.5")  # one pair: the sum is the mean


def test_dpo_loss_forward_naive_log_sigmoid_overflows():
    result = fails("dpo_loss_forward", lambda *a: _loss(*a, stable=False), "margins of -1000 and +1000",
                   "log1p(exp(-|z|))")  # fmt: skip
    assert len(result.failures) == 1


def test_dpo_loss_forward_beta_on_one_side_only():
    fails("dpo_loss_forward", lambda *a: _loss(*a, beta_on_chosen_only=True), "B = 4, beta = 0.1: off by")


def _sigmoid(z):
    return np.exp(_log_sigmoid(z))


def _backward(grad_loss, pc, pr, rc, rr, beta, *, sign=-1, mean=True, use_beta=True, same_sign=False):
    z = beta * ((pc - rc) - (pr - rr))
    d = -grad_loss * (beta if use_beta else 1) * _sigmoid(sign * z) / (len(z) if mean else 1)
    return d, (d if same_sign else -d)


def test_dpo_loss_backward_reference_attempt_passes():
    assert check("dpo_loss_backward", _backward, quiet=True).passed


def test_dpo_loss_backward_sigmoid_of_z_not_minus_z():
    fails("dpo_loss_backward", lambda *a: _backward(*a, sign=1), "B = 4, beta = 0.1, grad_loss 1: d_policy_chosen",
          "sigmoid of MINUS z")  # fmt: skip


def test_dpo_loss_backward_missing_the_mean():
    result = fails("dpo_loss_backward", lambda *a: _backward(*a, mean=False), "B = 6, beta = 2, grad_loss 0.7",
                   "the mean's 1/B")  # fmt: skip
    assert not result.failed("B = 1, beta = 0.5")


def test_dpo_loss_backward_missing_beta():
    fails("dpo_loss_backward", lambda *a: _backward(*a, use_beta=False), "B = 4, beta = 0.1, grad_loss 1")


def test_dpo_loss_backward_same_sign_for_the_rejected():
    result = fails("dpo_loss_backward", lambda *a: _backward(*a, same_sign=True), "d_policy_rejected",
                   "the negative of dL/dpc")  # fmt: skip
    assert not result.failed("d_policy_chosen")
