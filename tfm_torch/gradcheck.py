"""Gradient checking, PyTorch track: autograd against central differences, in float64.

The same test and the same table as tfm_numpy.gradcheck: L = sum(w * out) with a fixed random w;
autograd gives dL/d(input) and dL/d(param), central differences the numeric ones. (torch ships its
own, torch.autograd.gradcheck; this one returns the relative errors so both tracks print alike.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tfm_common.validate import decreed_zero_rows as _decreed_zero_rows

__all__ = ["rel_error", "numeric_grad", "grad_check"]

_SALT = 0x67726164  # "grad"


def rel_error(a, b) -> float:
    """max|a - b| / max(max|a|, max|b|), 0 when both are all zeros (as tfm_numpy.rel_error)."""
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    scale = max(a.abs().max().item(), b.abs().max().item())
    return (a - b).abs().max().item() / scale if scale > 0 else 0.0


@torch.no_grad()
def numeric_grad(f: Callable[[torch.Tensor], float], x: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    """Central differences of the scalar f at x (float64, perturbed in place one entry at a time, restored)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float64:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"numeric_grad: x expected a float64 tensor (float32 is too coarse for h={h}), got {got}")
    if not x.is_contiguous():
        raise ValueError("numeric_grad: x must be contiguous (it is perturbed in place through a flat view)")
    grad, flat = torch.zeros_like(x), x.view(-1)
    for i in range(flat.numel()):
        old = flat[i].item()
        flat[i] = old + h
        f_plus = float(f(x))
        flat[i] = old - h
        f_minus = float(f(x))
        flat[i] = old
        grad.view(-1)[i] = (f_plus - f_minus) / (2 * h)
    return grad


def grad_check(
    module: nn.Module, inputs, *, forward_kwargs: dict | None = None, h: float = 1e-6, seed: int = 0, loss_weights=None
) -> dict[str, float]:
    """{"input0": err, ..., param name: err}: autograd vs central differences (see tfm_numpy.grad_check).

    Float inputs are cloned (so q = k = v are checked separately); others pass through. float64 only.
    An Embedding's padding row is left out (its zero gradient is a convention, not a derivative).
    """
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    kwargs = forward_kwargs or {}
    for name, p in module.named_parameters():
        if p.dtype != torch.float64:
            raise TypeError(f"grad_check: parameter '{name}' is {p.dtype}; call module.double() first (float64)")
    xs = [x.detach().clone().requires_grad_(True) if _is_float(x) else x for x in inputs]
    for i, x in enumerate(xs):
        if _is_float(x) and x.dtype != torch.float64:
            raise TypeError(f"grad_check: input{i} is {x.dtype}; gradient checks need float64 inputs")
    out = module(*xs, **kwargs)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + _SALT)  # a stream of its own, not the data's
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64) if loss_weights is None else loss_weights
    module.zero_grad(set_to_none=True)
    (w * out).sum().backward()  # analytic, by autograd

    def loss(_=None) -> float:
        with torch.no_grad():
            return (w * module(*xs, **kwargs)).sum().item()

    errors = {}
    for i, x in enumerate(xs):
        if _is_float(x):
            analytic = x.grad if x.grad is not None else torch.zeros_like(x)
            errors[f"input{i}"] = rel_error(analytic, numeric_grad(loss, x.detach(), h))
    skip = _decreed_zero_rows(module)
    for name, p in module.named_parameters():
        analytic = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        numeric = numeric_grad(loss, p.detach(), h)
        if name in skip:
            analytic[skip[name]] = numeric[skip[name]] = 0
        errors[name] = rel_error(analytic, numeric)
    module.zero_grad(set_to_none=True)
    return errors


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
