"""Wrong attempts at the exercises of Part I: each fails with a message that points at the mistake."""

from __future__ import annotations

import numpy as np
from helpers_exercises import solution

from tfm_numpy.exercises import check


def _fails(name, attempt, *texts):
    result = check(name, attempt, quiet=True)
    assert not result.passed, result.report()
    for text in texts:
        assert result.failed(text), (text, result.report())
    return result


# --- linear_forward ------------------------------------------------------------------------------------------------


def test_linear_forward_transposed_weight():
    _fails("linear_forward", lambda x, W, b: x @ W + b, "raised ValueError", "W of shape (out, in)")


def test_linear_forward_missing_bias():
    _fails("linear_forward", lambda x, W, b: x @ W.T, "off by", "y = x W^T + b")


def test_linear_forward_float32_upcast():
    _fails("linear_forward", lambda x, W, b: x.astype(np.float64) @ W.T + b, "dtype float64, expected float32")


def test_linear_forward_only_2d():
    _fails("linear_forward", lambda x, W, b: np.einsum("ni,oi->no", x, W) + b, "3-D input (B, T, in)")


# --- linear_backward -----------------------------------------------------------------------------------------------


def _flat(dy, x):
    return dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])


def test_linear_backward_bias_mean():
    def attempt(dy, x, W):
        dy2, x2 = _flat(dy, x)
        return dy @ W, dy2.T @ x2, dy2.mean(axis=0)

    _fails("linear_backward", attempt, "db: off by", "db sums dy over every leading axis")


def test_linear_backward_dW_transposed():
    def attempt(dy, x, W):
        dy2, x2 = _flat(dy, x)
        return dy @ W, x2.T @ dy2, dy2.sum(axis=0)

    _fails("linear_backward", attempt, "dW: shape (4, 5), expected (5, 4)")


def test_linear_backward_sums_only_the_first_axis():
    def attempt(dy, x, W):  # right for (N, in), wrong for (B, T, in)
        return dy @ W, np.tensordot(dy, x, axes=(0, 0)).reshape(-1, x.shape[-1])[: W.shape[0]], dy.sum(axis=0)

    result = _fails("linear_backward", attempt, "3-D input (B, T, in)")
    assert not result.failed("2-D input (N, in)")


def test_linear_backward_dx_uses_transpose():
    def attempt(dy, x, W):
        dy2, x2 = _flat(dy, x)
        return dy @ W.T, dy2.T @ x2, dy2.sum(axis=0)

    _fails("linear_backward", attempt, "raised ValueError")


def test_linear_solution_is_the_chapter_one():
    assert check("linear_backward", solution("linear_backward"), quiet=True).passed
