"""Gradient checking, NumPy track: hand-written backward against central differences, in float64.

The test: pick a random fixed projection w (shaped like the module's output) and the scalar
L = sum(w * out). Backward with grad_out = w gives the analytic dL/d(input) and dL/d(param);
central differences (L(x + h) - L(x - h)) / 2h, one entry at a time, give the numeric ones.
A random w (not ones) makes every output entry matter with a different weight, so a gradient
that is wrong only for some entries, or summed in the wrong order, cannot cancel out.

Why float64: the numeric derivative has truncation error ~h^2 |f'''| / 6 and rounding error
~u |L| / h, with u the unit roundoff. In chapter 1's experiment, in float64 (u ~ 1e-16), the two
balance near h ~ 1e-5 at ~1e-11 relative; the default h = 1e-6 sits on the rounding side, at
~1e-10 (truncation alone would be below 1e-13 there), far below the tests' threshold of 1e-7. In
float32 (u ~ 6e-8) the best possible is ~1e-5, and h = 1e-6 is off by ~10%: that would hide real
bugs. So float32 is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tfm_common.validate import decreed_zero_rows as _decreed_zero_rows

from .module import Module

__all__ = ["rel_error", "numeric_grad", "grad_check"]

_SALT = 0x67726164  # "grad"


def rel_error(a, b) -> float:
    """max|a - b| / max(max|a|, max|b|): the largest difference relative to the largest entry.

    One number for a whole array, measured against its scale, so entries that are ~0 in both
    arrays (where an elementwise relative error would be 0/0) cannot blow it up. 0 when both are
    all zeros. Below ~1e-7 in float64 means "agrees up to finite-difference noise".
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ, {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    scale = max(np.abs(a).max(), np.abs(b).max())
    return float(np.abs(a - b).max() / scale) if scale > 0 else 0.0


def numeric_grad(f: Callable[[np.ndarray], float], x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar f at x: df/dx_i ~ (f(x + h e_i) - f(x - h e_i)) / 2h.

    `x` (float64) is perturbed in place, one entry at a time, and restored; `f(x)` may ignore its
    argument and read `x` through a closure (a module's parameter, say).
    """
    _check_perturbable(x, h)
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)  # views: writing flat[i] writes x
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        f_plus = float(f(x))
        flat[i] = old - h
        f_minus = float(f(x))
        flat[i] = old
        gflat[i] = (f_plus - f_minus) / (2 * h)
    return grad


def _check_perturbable(x, h: float) -> None:
    """numeric_grad's x: float64 (float32 is too coarse for h), and written through by a flat view."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float64:
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise TypeError(f"numeric_grad: x expected a float64 array (float32 is too coarse for h={h}), got {got}")
    if not np.shares_memory(x.reshape(-1), x):
        raise ValueError("numeric_grad: x must be contiguous (it is perturbed in place through a flat view)")


def _is_float(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.kind == "f"


def grad_check(
    module: Module, inputs, *, forward_kwargs: dict | None = None, h: float = 1e-6, seed: int = 0, loss_weights=None
) -> dict[str, float]:
    """Relative error (see `rel_error`) between backward and central differences, for every float input
    ("input0", "input1", ... by position in `inputs`) and every parameter (by its `named_parameters` name).

    inputs: one array or a tuple; float arrays are checked, anything else (token ids, masks) is
    passed through untouched, as is `forward_kwargs`. Float inputs are copied first, so passing the
    same array twice (self-attention's q = k = v) checks each argument separately.
    `module.backward(w)` must return the input gradient (one array) or a tuple with one entry per
    float input, in order; None where there is none. The forward must be deterministic: call
    `module.eval()` or give dropout a fixed mask. Everything must be float64 (`module.double()`).
    The row `padding_idx` of an Embedding's weight is left out: its gradient is zero by decree
    (torch's convention), not by calculus, so central differences disagree with it on purpose.
    """
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    kwargs = forward_kwargs or {}
    _require_float64(module, inputs)
    xs = [x.copy() if _is_float(x) else x for x in inputs]
    float_pos = [i for i, x in enumerate(xs) if _is_float(x)]
    out = module(*xs, **kwargs)
    # w comes from a stream of its own (seed + salt): never equal to data the caller drew with the same seed
    w_rng = np.random.default_rng([seed, _SALT])
    w = w_rng.standard_normal(np.shape(out)) if loss_weights is None else np.asarray(loss_weights, np.float64)

    def loss(_=None) -> float:
        return float(np.sum(w * module(*xs, **kwargs)))

    # analytic: one forward, one backward with grad_out = dL/dout = w
    module.zero_grad()
    loss()
    analytic_in = _input_grads(module.backward(w), len(xs), float_pos)
    errors = {}
    for i, grad in zip(float_pos, analytic_in, strict=True):
        if grad is not None:
            errors[f"input{i}"] = rel_error(grad, numeric_grad(loss, xs[i], h))
    skip = _decreed_zero_rows(module)
    for name, p in module.named_parameters():
        analytic, numeric = p.grad.copy(), numeric_grad(loss, p.data, h)
        if name in skip:
            analytic[skip[name]] = numeric[skip[name]] = 0
        errors[name] = rel_error(analytic, numeric)
    module.zero_grad()
    return errors


def _require_float64(module: Module, inputs: tuple) -> None:
    for name, p in module.named_parameters():
        if p.data.dtype != np.float64:
            raise TypeError(f"grad_check: parameter '{name}' is {p.data.dtype}; call module.double() first (float64)")
    for i, x in enumerate(inputs):
        if _is_float(x) and x.dtype != np.float64:
            raise TypeError(f"grad_check: input{i} is {x.dtype}; gradient checks need float64 inputs")


def _input_grads(grads, n_inputs: int, float_pos: list[int]) -> tuple:
    """Backward's return value as one gradient per float input (a tuple over all inputs is accepted too)."""
    if not float_pos:
        return ()
    grads = grads if isinstance(grads, tuple) else (grads,)
    if len(grads) == n_inputs:
        return tuple(grads[i] for i in float_pos)
    if len(grads) != len(float_pos):
        raise ValueError(f"grad_check: backward returned {len(grads)} gradient(s) for {len(float_pos)} float input(s)")
    return grads
