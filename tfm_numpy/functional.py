"""Stateless functions, NumPy track: softmax and log-softmax with their backward, and erf.

Every function keeps the dtype of its input: float32 in, float32 out.
"""

from __future__ import annotations

import math

import numpy as np

from .module import check_input

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "erf"]


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """p_i = exp(x_i - m) / sum_j exp(x_j - m), with m = max_j x_j along `axis`.

    Shifting by the max changes nothing mathematically (the exp(-m) cancels) but keeps every
    exponent <= 0: no overflow at logits of 1e4, and the largest term is exactly exp(0) = 1,
    so the sum is >= 1 and never underflows to 0. (A row that is all -inf gives nan, as in torch.)
    """
    check_input("softmax", x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """log p_i = (x_i - m) - log sum_j exp(x_j - m): the log-sum-exp trick, never log(softmax(x)).

    log(softmax(x)) would give log(0) = -inf wherever p underflows; this form stays finite.
    """
    check_input("log_softmax", x)
    z = x - x.max(axis=axis, keepdims=True)  # a new array: ours to change in place
    z -= np.log(np.exp(z).sum(axis=axis, keepdims=True))  # in place: one array of x's size fewer (logits are big)
    return z


def softmax_backward(p: np.ndarray, grad_p: np.ndarray, axis: int = -1) -> np.ndarray:
    """dL/dx from p = softmax(x) and dL/dp, without forming the Jacobian.

    The Jacobian is dp_i/dx_j = p_i (delta_ij - p_j), so
        dL/dx_j = sum_i g_i p_i (delta_ij - p_j) = p_j (g_j - sum_i g_i p_i):
    one elementwise product and one sum along `axis`, O(n) instead of O(n^2).
    """
    return p * (grad_p - (grad_p * p).sum(axis=axis, keepdims=True))


def log_softmax_backward(logp: np.ndarray, grad_logp: np.ndarray, axis: int = -1) -> np.ndarray:
    """dL/dx from logp = log_softmax(x) and dL/dlogp: d logp_i / dx_j = delta_ij - p_j, so
    dL/dx_j = g_j - p_j sum_i g_i."""
    return grad_logp - np.exp(logp) * grad_logp.sum(axis=axis, keepdims=True)


# -- erf ----------------------------------------------------------------------------------
# NumPy has no erf (SciPy does, but it is not a dependency), and calling math.erf element by
# element is slow. We use piecewise Taylor polynomials instead:
#   erf(c + t) = erf(c) + 2/sqrt(pi) exp(-c^2) sum_{n>=0} (-1)^n H_n(c) t^(n+1) / (n+1)!
# because d^n/dx^n exp(-x^2) = (-1)^n H_n(x) exp(-x^2) (physicists' Hermite polynomials,
# H_{n+1} = 2x H_n - 2n H_{n-1}). Centers c are 0, 1/8, 2/8, ..., 6, so |t| <= 1/16 and 12
# terms reach float64 rounding (measured against math.erf: max relative error < 1e-15).
# Beyond |x| = 6, erf(x) rounds to +-1 in float64. The table is built once, at import.
_ERF_STEP = 0.125
_ERF_TERMS = 11  # polynomial degree in t
_ERF_MAX = 6.0


def _erf_table() -> np.ndarray:
    centers = np.arange(0.0, _ERF_MAX + _ERF_STEP, _ERF_STEP)
    table = np.zeros((centers.size, _ERF_TERMS + 1))  # (n_centers, degree + 1): coefficient of t^k
    for j, c in enumerate(centers):
        table[j, 0] = math.erf(c)
        h_prev, h, factorial = 0.0, 1.0, 1.0  # H_{n-1}(c), H_n(c), (n+1)!
        for n in range(_ERF_TERMS):
            factorial *= n + 1
            table[j, n + 1] = 2 / math.sqrt(math.pi) * math.exp(-c * c) * (-1) ** n * h / factorial
            h_prev, h = h, 2 * c * h - 2 * n * h_prev
    return table


_ERF_TABLE = _erf_table()


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, to float64 accuracy; the result has x's dtype."""
    check_input("erf", x, ndim_min=0)
    a = np.minimum(np.abs(x.astype(np.float64)), _ERF_MAX)  # erf is odd: work on |x|
    idx = np.rint(np.nan_to_num(a) / _ERF_STEP).astype(np.intp)  # nearest center
    t = a - idx * _ERF_STEP  # |t| <= STEP / 2
    coef = _ERF_TABLE[idx]  # (..., degree + 1)
    acc = coef[..., -1].copy()
    for k in range(_ERF_TERMS - 1, -1, -1):  # Horner: ((c_K t + c_{K-1}) t + ...) t + c_0
        acc *= t
        acc += coef[..., k]
    return np.copysign(acc, x).astype(x.dtype, copy=False)
