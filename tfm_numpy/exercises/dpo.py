"""Graded exercises of chapter 22d (DPO): see foundations.py for the pattern.

`sequence_logps` (the log-probability of each response, prompt and padding masked), `dpo_loss_forward` (the mean
DPO loss) and `dpo_loss_backward` (its gradients with respect to the policy's log-probabilities).
"""

from __future__ import annotations

import numpy as np

from ..dpo import dpo_loss, dpo_loss_backward, sequence_logps
from .grading import Exercise, Grader, central_differences

__all__ = ["EXERCISES"]

CHAPTER = "22d_dpo"


# --- sequence log-probabilities --------------------------------------------------------------------------------------

SEQ_HINT = ("sum over the positions where mask is True of log_softmax(logits)[b, t, targets[b, t]]; the prompt and "
            "the padding add nothing")  # fmt: skip


def _seq_case(rng, B, T, V, dtype=np.float64, scale=2.0):
    logits = (scale * rng.standard_normal((B, T, V))).astype(dtype)
    targets = rng.integers(0, V, (B, T))
    mask = np.zeros((B, T), dtype=bool)
    for b in range(B):  # a prompt, then the response, then padding: each row its own lengths
        start = int(rng.integers(0, T))
        mask[b, start : int(rng.integers(start + 1, T + 1))] = True
    return logits, targets, mask


def grade_sequence_logps(g: Grader) -> None:
    rng = np.random.default_rng(2201)
    cases = (
        ("B = 3, T = 6, V = 7 (prompt and padding masked)", 3, 6, 7),
        ("B = 1, T = 1 (a one-token response)", 1, 1, 5),
        ("B = 4, T = 9, V = 3", 4, 9, 3),
    )
    for label, B, T, V in cases:
        logits, targets, mask = _seq_case(rng, B, T, V)
        g.compare(label, g.run(label, logits, targets, mask, hint=SEQ_HINT), sequence_logps(logits, targets, mask),
                  tol=1e-10, hint=SEQ_HINT)  # fmt: skip
    label = "whole rows masked in (no prompt, no padding)"
    logits, targets, _ = _seq_case(rng, 2, 5, 4)
    full = np.ones((2, 5), dtype=bool)
    g.compare(label, g.run(label, logits, targets, full), sequence_logps(logits, targets, full), tol=1e-10,
              hint=SEQ_HINT)  # fmt: skip
    label = "large logits (about 1e3)"
    logits, targets, mask = _seq_case(rng, 2, 5, 6, scale=20.0)
    logits += 1000.0  # the same probabilities: softmax ignores a shift of a row; exp(1000) overflows
    with np.errstate(all="ignore"):
        got = g.run(label, logits, targets, mask)
    g.compare(label, got, sequence_logps(logits, targets, mask), tol=1e-10,
              hint="exp overflowed: log-softmax subtracts each row's max before exp (chapter 4)")  # fmt: skip
    label = "float32"
    logits, targets, mask = _seq_case(rng, 3, 6, 7, dtype=np.float32)
    g.compare(label, g.run(label, logits, targets, mask), sequence_logps(logits, targets, mask), tol=1e-5,
              dtype=np.float32)  # fmt: skip


# --- the DPO loss ----------------------------------------------------------------------------------------------------

LOSS_HINT = ("z = beta ((pc - rc) - (pr - rr)) per pair, loss = mean over the pairs of -log sigmoid(z); the "
             "reference's log-probabilities are subtracted from the policy's")  # fmt: skip
BACKWARD_HINTS = {
    "d_policy_chosen": "dL/dpc = -beta sigmoid(-z) * grad_loss / B (the mean's 1/B, and sigmoid of MINUS z)",
    "d_policy_rejected": "dL/dpr = +beta sigmoid(-z) * grad_loss / B, the negative of dL/dpc",
}


def _logps(rng, B, dtype=np.float64, scale=3.0):
    return tuple((-scale * rng.random(B) - 0.1).astype(dtype) for _ in range(4))


def _huge(dtype=np.float64):
    """Margins of -1000 and +1000 at beta = 0.5: exp(1000) overflows."""
    pc = np.array([-1.0, -2001.0, -3.0], dtype)
    pr = np.array([-2001.0, -1.0, -2.0], dtype)
    zero = np.zeros(3, dtype)
    return pc, pr, zero, zero


def grade_dpo_loss_forward(g: Grader) -> None:
    rng = np.random.default_rng(2202)
    for label, B, beta in (("B = 4, beta = 0.1", 4, 0.1), ("B = 1, beta = 0.5", 1, 0.5), ("B = 7, beta = 2", 7, 2.0)):
        args = _logps(rng, B)
        g.compare(label, g.run(label, *args, beta, hint=LOSS_HINT), dpo_loss(*args, beta).loss, tol=1e-12,
                  hint=LOSS_HINT)  # fmt: skip
    label = "margins of -1000 and +1000 (beta = 0.5)"
    args = _huge()
    with np.errstate(all="ignore"):
        got = g.run(label, *args, 0.5)
    g.compare(label, got, dpo_loss(*args, 0.5).loss, tol=1e-12,
              hint="exp(-z) overflowed: write log sigmoid(z) = min(z, 0) - log1p(exp(-|z|))")  # fmt: skip
    label = "float32"
    args = _logps(rng, 5, np.float32)
    g.compare(label, g.run(label, *args, 0.3), dpo_loss(*args, 0.3).loss, tol=1e-5, dtype=np.float32)


def grade_dpo_loss_backward(g: Grader) -> None:
    rng = np.random.default_rng(2203)
    cases = (("B = 4, beta = 0.1, grad_loss 1", 4, 0.1, 1.0), ("B = 1, beta = 0.5, grad_loss 1", 1, 0.5, 1.0),
             ("B = 6, beta = 2, grad_loss 0.7", 6, 2.0, 0.7))  # fmt: skip
    for label, B, beta, grad_loss in cases:
        pc, pr, rc, rr = _logps(rng, B)
        d_c, d_r = dpo_loss_backward(grad_loss, pc, pr, rc, rr, beta)
        library = {"d_policy_chosen": d_c, "d_policy_rejected": d_r}
        numeric = central_differences(lambda pc, pr, rc, rr, beta: np.float64(dpo_loss(pc, pr, rc, rr, beta).loss),
                                      {"pc": pc, "pr": pr, "rc": rc, "rr": rr, "beta": beta},
                                      np.float64(grad_loss))  # fmt: skip
        numeric = {"d_policy_chosen": numeric["pc"], "d_policy_rejected": numeric["pr"]}
        g.backward(label, g.run(label, grad_loss, pc, pr, rc, rr, beta), library, numeric, hints=BACKWARD_HINTS)
    label = "margins of -1000 and +1000 (beta = 0.5)"
    args = _huge()
    with np.errstate(all="ignore"):
        got = g.run(label, 1.0, *args, 0.5)
    d_c, d_r = dpo_loss_backward(1.0, *args, 0.5)
    g.gradients(label, got, {"d_policy_chosen": d_c, "d_policy_rejected": d_r}, tol=1e-12, hints=BACKWARD_HINTS)
    label = "float32"
    args = _logps(rng, 5, np.float32)
    d_c, d_r = dpo_loss_backward(1.0, *args, 0.3)
    g.gradients(label, g.run(label, 1.0, *args, 0.3), {"d_policy_chosen": d_c, "d_policy_rejected": d_r}, tol=1e-5,
                dtype=np.float32, hints=BACKWARD_HINTS)  # fmt: skip


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "sequence_logps",
        CHAPTER,
        "sequence_logps(logits, targets, mask) -> logps: logits (B, T, V), targets (B, T) ints, mask (B, T) bool; "
        "logps (B,)",
        grade_sequence_logps,
    ),
    Exercise(
        "dpo_loss_forward",
        CHAPTER,
        "dpo_loss_forward(pc, pr, rc, rr, beta) -> loss: the four log-probabilities (B,), beta > 0; loss a scalar",
        grade_dpo_loss_forward,
    ),
    Exercise(
        "dpo_loss_backward",
        CHAPTER,
        "dpo_loss_backward(grad_loss, pc, pr, rc, rr, beta) -> (d_policy_chosen, d_policy_rejected): each (B,)",
        grade_dpo_loss_backward,
    ),
)
