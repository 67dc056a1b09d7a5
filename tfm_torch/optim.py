"""Optimization, PyTorch track: the same names as tfm_numpy.optim, on top of torch.optim.

`Adam` and `AdamW` are `torch.optim.Adam` and `torch.optim.AdamW` with the paper's betas and eps (Vaswani et al.,
2017, section 5.3; AdamW's weight_decay is torch's 0.01) and, as the NumPy ones, an `lr` you can set between steps
and a `step_count`. `clip_grad_norm` is `torch.nn.utils.clip_grad_norm_`, returning a Python float as the NumPy
track does; `optimizer_params(optimizer)` lists the parameters a torch optimizer updates, in order.

torch's own scheduler `LambdaLR` multiplies a base lr and calls its function with 0 first; with `noam_lr`
(which counts steps from 1) set lr=1.0 and use `LambdaLR(opt, lambda s: noam_lr(s + 1, d_model, warmup))`.
Setting `opt.lr = noam_lr(step, ...)` before each step, as the NumPy track does, gives the same numbers.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from tfm_common.schedules import noam_lr
from tfm_common.training import check_finite_step, steps_taken
from tfm_common.validate import check_adam_args

__all__ = [
    "Adam",
    "AdamW",
    "make_adam",
    "make_adamw",
    "set_lr",
    "noam_lr",
    "optimizer_params",
    "grad_norm",
    "clip_grad_norm",
    "apply_update",
]


class _LrAndSteps:
    """`opt.lr` (get: the one lr of every param group; set: all of them) and `opt.step_count`, as tfm_numpy's."""

    @property
    def lr(self) -> float:
        lrs = {float(g["lr"]) for g in self.param_groups}
        if len(lrs) != 1:
            raise ValueError(f"{type(self).__name__}.lr: the param groups have different learning rates {sorted(lrs)}")
        return lrs.pop()

    @lr.setter
    def lr(self, value: float) -> None:
        set_lr(self, value)

    @property
    def step_count(self) -> int:
        return steps_taken(self)


class Adam(_LrAndSteps, torch.optim.Adam):
    """`torch.optim.Adam` with the paper's defaults; `opt.lr = x` sets the lr of every param group."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.0):
        if isinstance(params, nn.Module):
            params = params.parameters()
        lr, betas, eps, weight_decay = check_adam_args("Adam", lr, betas, eps, weight_decay)  # as tfm_numpy.Adam
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class AdamW(_LrAndSteps, torch.optim.AdamW):
    """`torch.optim.AdamW` with the paper's betas and eps and torch's weight_decay=0.01; the same `lr` and
    `step_count` as `Adam`."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.01):
        if isinstance(params, nn.Module):
            params = params.parameters()
        lr, betas, eps, weight_decay = check_adam_args("AdamW", lr, betas, eps, weight_decay)  # as tfm_numpy.AdamW
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def make_adam(model: nn.Module, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.0):
    """`Adam(model.parameters(), ...)`: the same call in both tracks."""
    return Adam(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def make_adamw(model: nn.Module, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.01):
    """`AdamW(model.parameters(), ...)`: the same call in both tracks."""
    return AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every param group for the next step (any torch optimizer)."""
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not lr >= 0 or math.isinf(lr):
        raise ValueError(f"set_lr: lr must be a finite float >= 0, got {lr!r}")
    for group in optimizer.param_groups:
        group["lr"] = float(lr)


def clip_grad_norm(params, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm)`: scale the gradients in place so that their global L2
    norm is at most `max_norm` (each multiplied by min(max_norm / (total + 1e-6), 1)); return the norm before."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a float >= 0, got {max_norm!r}")
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters `optimizer` updates, in the order of its param groups (tfm_numpy's `optimizer.params`)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def grad_norm(params) -> float:
    """The global L2 norm of the gradients, ||(||g_1||, ..., ||g_n||)||_2, as `clip_grad_norm` measures it
    (parameters without a gradient count as zero)."""
    params = params.parameters() if isinstance(params, nn.Module) else params
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def apply_update(name: str, optimizer: torch.optim.Optimizer, loss: float, lr: float, clip_norm: float | None) -> float:
    """The tail of every step function, as tfm_numpy's: the gradient norm, refused (FloatingPointError naming
    `name`) if it or the loss is not finite, before anything changes; the clipping to `clip_norm` (None: none),
    the lr, the optimizer's step. Returns the gradient norm before clipping."""
    params = optimizer_params(optimizer)
    norm = grad_norm(params)
    check_finite_step(name, loss, norm)
    if clip_norm is not None:
        norm = clip_grad_norm(params, clip_norm)  # the same norm, measured as it clips
    set_lr(optimizer, lr)
    optimizer.step()
    return norm
