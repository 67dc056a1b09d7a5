"""Stateless functions, PyTorch track: the same names and arguments as tfm_numpy.functional.

Autograd differentiates these; `softmax_backward` and `log_softmax_backward` are kept to show
(and test) that the one-line formulas of the NumPy track are what autograd computes.
"""

from __future__ import annotations

import torch

from .module import check_input

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "erf"]


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """exp(x - max) / sum exp(x - max) along `axis` (the max is detached: the shift cancels exactly)."""
    check_input("softmax", x)
    e = torch.exp(x - x.amax(dim=axis, keepdim=True).detach())
    return e / e.sum(dim=axis, keepdim=True)


def log_softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """(x - max) - log sum exp(x - max) along `axis`."""
    check_input("log_softmax", x)
    z = x - x.amax(dim=axis, keepdim=True).detach()
    return z - torch.log(torch.exp(z).sum(dim=axis, keepdim=True))


def softmax_backward(p: torch.Tensor, grad_p: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """dL/dx = p * (dL/dp - sum(dL/dp * p)), as tfm_numpy.softmax_backward."""
    return p * (grad_p - (grad_p * p).sum(dim=axis, keepdim=True))


def log_softmax_backward(logp: torch.Tensor, grad_logp: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """dL/dx = dL/dlogp - exp(logp) * sum(dL/dlogp), as tfm_numpy.log_softmax_backward."""
    return grad_logp - torch.exp(logp) * grad_logp.sum(dim=axis, keepdim=True)


def erf(x: torch.Tensor) -> torch.Tensor:
    """The error function, elementwise (torch has one built in)."""
    check_input("erf", x, ndim_min=0)
    return torch.erf(x)
