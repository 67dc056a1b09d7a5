"""Wrong attempts at chapter 22c's exercises (LoRA's backward, the merge): each fails with a message that points at
the mistake; the chapter's worked solutions pass."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_exercises import fails, solution

from tfm_numpy.exercises import check


def _backward(dy, x, W, A, B, scaling, *, scale_dA=True, scale_dB=True, door_in_dx=True, dB_from_x=False):
    """LoRA's backward with one of its parts switchable off: each switch is a mistake people make."""
    x2, g = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    h = x2 @ A.T
    gh = g @ B
    dB = (scaling if scale_dB else 1) * (g.T @ (x2[:, : A.shape[0]] if dB_from_x else h))
    dA = (scaling if scale_dA else 1) * (gh.T @ x2)
    dx = g @ W + (scaling * gh @ A if door_in_dx else 0)
    return dx.reshape(x.shape), dA, dB


def test_reference_attempt_and_chapter_solution_pass():
    assert check("lora_backward", _backward, quiet=True).passed
    assert check("lora_backward", solution("lora_backward"), quiet=True).passed
    assert check("lora_merge", solution("lora_merge"), quiet=True).passed


@pytest.mark.parametrize(
    "mistake,texts",
    [
        (dict(scale_dA=False), ("dA", "s = alpha / rank")),  # the scale forgotten on one gradient
        (dict(scale_dB=False), ("dB", "x A^T")),
        (dict(door_in_dx=False), ("dx", "the base's path and the door's")),  # only the frozen path back to x
        (dict(dB_from_x=True), ("dB", "B's input")),  # B's input is h = x A^T, not x
    ],
)
def test_lora_backward_mistakes(mistake, texts):
    fails("lora_backward", lambda *a: _backward(*a, **mistake), *texts)


def test_lora_backward_without_the_leading_axes_fails():
    def no_reshape(dy, x, W, A, B, scaling):  # works for (N, in) only: 3-D input sums over one axis too few
        h = x @ A.T
        return dy @ W + scaling * (dy @ B) @ A, scaling * (dy @ B).T @ x, scaling * dy.T @ h

    fails("lora_backward", no_reshape, "3-D input")


def test_lora_backward_float64_in_float32_case_fails():
    fails("lora_backward", lambda *a: tuple(g.astype(np.float64) for g in _backward(*a)), "float32")


@pytest.mark.parametrize(
    "attempt,text",
    [
        (lambda W, A, B, alpha, rank: W + alpha * (B @ A), "scaled by alpha over the rank"),  # the scaling bug
        (lambda W, A, B, alpha, rank: W + (rank / alpha) * (B @ A), "scaled by alpha over the rank"),
        (lambda W, A, B, alpha, rank: W + (alpha / rank) * (A.T @ B.T), "B (out, rank) times A (rank, in)"),
        (lambda W, A, B, alpha, rank: W + B @ A, "rank 2"),  # no scale at all: right only where alpha = rank
        (lambda W, A, B, alpha, rank: (W + (alpha / rank) * (B @ A)).astype(np.float64), "float32"),
    ],
)
def test_lora_merge_mistakes(attempt, text):
    fails("lora_merge", attempt, text)


def test_no_scale_passes_only_where_alpha_equals_rank():
    result = check("lora_merge", lambda W, A, B, alpha, rank: W + B @ A, quiet=True)
    assert [f.passed for f in result.findings if f.check.startswith("rank 4, alpha 4")] == [True]
