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
    if x.ndim >= 2 and axis in (-1, x.ndim - 1) and x.size > _ROWS_BLOCK_NUMBERS:
        return _log_softmax_rows(x)
    z = x - x.max(axis=axis, keepdims=True)  # a new array: ours to change in place
    z -= np.log(np.exp(z).sum(axis=axis, keepdims=True))  # in place: one array of x's size fewer (logits are big)
    return z


_ROWS_BLOCK_NUMBERS = 1 << 16  # numbers per block of rows: 256 KiB in float32, so a block's passes stay in cache


def _log_softmax_rows(x: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis of large logits (B, T, V), a block of rows at a time: the same operations on
    every row as above (hence the same numbers, bit for bit), but the exp's scratch array is one block, reused while
    it sits in the CPU's cache, instead of a fresh array as large as the logits (64 MB for 2 K rows of 8 K words)."""
    flat = x.reshape(-1, x.shape[-1])  # (N, V)
    out = np.empty(flat.shape, x.dtype)
    rows = max(1, _ROWS_BLOCK_NUMBERS // flat.shape[1])
    for i in range(0, len(flat), rows):
        z = out[i : i + rows]  # a view: written in place
        np.subtract(flat[i : i + rows], flat[i : i + rows].max(axis=-1, keepdims=True), out=z)
        z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out.reshape(x.shape)


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


# -- the normal CDF and density in float32, fast -------------------------------------------------------------------
# The exact GELU needs Phi(x) = erfc(-x / sqrt 2) / 2 and phi(x) on every hidden unit (B T d_ff numbers per layer).
# `erf` above is accurate to float64 rounding but gathers a 12-term polynomial per element, slow enough to dominate
# a GPT training step (benchmarks/bench.py, section 7, measures it). For float32 inputs float32
# accuracy is enough, and a form without a table does it: with z = |x| / sqrt 2 and t = 3 / (3 + z) in (0, 1],
#     erfc(z) = exp(-z^2) g(t),   g(t) = erfc(z) exp(z^2) smooth on (0, 1] (g -> t / (3 sqrt pi) as z -> inf),
# and g is a polynomial of degree 10 in t: Chebyshev interpolation of g at import, from math.erfc, on z in [0, 10]
# (relative error of g below 1e-8; beyond z = 10, Phi(-|x|) < 1e-44 underflows float32 anyway). Then
#     Phi(x) = h if x < 0 else 1 - h,  h = Phi(-|x|) = exp(-z^2) g(t) / 2,   phi(x) = exp(-z^2) / sqrt(2 pi):
# one exp for both; relative accuracy in the left tail, absolute accuracy (a few float32 ulps) on the right. The
# work goes in blocks of 32 K numbers, so that the dozen passes of Horner's rule stay in the CPU's cache.
_CDF_DEGREE, _CDF_K, _CDF_ZMAX, _CDF_BLOCK = 10, 3.0, 10.0, 1 << 15


def _erfc_scaled_coefficients() -> np.ndarray:
    """Power-basis coefficients c_k of g(t) = sum_k c_k t^k (see above), float64."""
    n, t_min = _CDF_DEGREE + 1, _CDF_K / (_CDF_K + _CDF_ZMAX)
    t = t_min + (1 - t_min) * (np.cos(np.pi * (np.arange(n) + 0.5) / n) + 1) / 2  # Chebyshev nodes on [t_min, 1]
    g = np.array([math.erfc(z) * math.exp(z * z) for z in _CDF_K / t - _CDF_K])
    fit = np.polynomial.Chebyshev.fit(t, g, _CDF_DEGREE, domain=[t_min, 1])
    return fit.convert(kind=np.polynomial.Polynomial, domain=[t_min, 1], window=[t_min, 1]).coef


_CDF_COEF32 = _erfc_scaled_coefficients().astype(np.float32)


def normal_cdf_pdf_float32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Phi(x), phi(x)), the standard normal CDF and density of a float32 array, in float32 (see the note above)."""
    x = np.ascontiguousarray(x)  # so that the flat views below are views (outputs written through them)
    cdf, pdf = np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    for block in _flat_blocks(x, cdf, pdf):
        _cdf_pdf_block(*block)
    return cdf, pdf


def gelu_float32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x Phi(x), Phi(x) + x phi(x)): the exact GELU of a float32 array and its derivative, in float32.

    The numbers of `x * cdf` and `cdf + x * pdf` from `normal_cdf_pdf_float32(x)`, bit for bit, but computed a
    block at a time: Phi and phi of a block are used while they sit in the CPU's cache, never stored whole."""
    x = np.ascontiguousarray(x)
    y, dydx = np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    cdf, pdf = np.empty(_CDF_BLOCK, x.dtype), np.empty(_CDF_BLOCK, x.dtype)  # scratch, one block
    for xb, yb, db in _flat_blocks(x, y, dydx):
        c, p = cdf[: xb.size], pdf[: xb.size]
        _cdf_pdf_block(xb, c, p)
        np.multiply(xb, c, out=yb)  # y = x Phi(x)
        np.multiply(xb, p, out=db)
        db += c  # dy/dx = Phi(x) + x phi(x)
    return y, dydx


def _flat_blocks(*arrays: np.ndarray):
    """Matching blocks of _CDF_BLOCK numbers of C-contiguous arrays of one shape: flat views, written through."""
    flat = [a.reshape(-1) for a in arrays]
    for i in range(0, flat[0].size, _CDF_BLOCK):
        yield tuple(a[i : i + _CDF_BLOCK] for a in flat)


def _cdf_pdf_block(x: np.ndarray, cdf: np.ndarray, pdf: np.ndarray) -> None:
    # z capped at 14, where exp(-z^2) is already 0 in float32: no overflow in z^2, and Phi(-inf) = 0 exactly
    z = np.minimum(np.abs(x) * np.float32(1 / math.sqrt(2)), np.float32(14))
    t = np.float32(_CDF_K) / (z + np.float32(_CDF_K))
    h = t * _CDF_COEF32[-1]  # Horner, in place: ((c_K t + c_{K-1}) t + ...) t + c_0
    h += _CDF_COEF32[-2]
    for c in _CDF_COEF32[-3::-1]:
        h *= t
        h += c
    z *= z
    np.exp(np.negative(z, out=z), out=z)  # exp(-x^2 / 2)
    np.multiply(z, np.float32(1 / math.sqrt(2 * math.pi)), out=pdf)
    h *= z
    h *= np.float32(0.5)  # h = Phi(-|x|)
    # Phi(x) = h if x < 0 else 1 - h, written as arithmetic on s = [x < 0] in {0, 1}: (1 - s) + (2 s - 1) h is
    # 0 + h or 1 + (-h), the very float32 numbers of a select. A select (np.where, np.copyto(where=)) branches on
    # each number's sign, random here, so the CPU mispredicts half of them.
    s = np.less(x, 0, out=z)  # (n,) float32 0 or 1 (z is no longer needed)
    np.subtract(np.float32(1), s, out=cdf)
    s *= np.float32(2)
    s -= np.float32(1)
    h *= s
    cdf += h
