"""Optimization, PyTorch track: the same names as tfm_numpy.optim, on top of torch.optim.

- `Adam`: `torch.optim.Adam` with the paper's defaults (betas = (0.9, 0.98), eps = 1e-9, Vaswani et al., 2017,
  section 5.3) and, as the NumPy `Adam`, an `lr` you can set between steps and a `step_count`.
- `noam_lr`: the warm-up schedule, the very same pure-Python function as in the NumPy track.
- `clip_grad_norm`: `torch.nn.utils.clip_grad_norm_`, returning a Python float as the NumPy track does.
- `AdamW`: `torch.optim.AdamW` (decoupled weight decay, Loshchilov & Hutter, 2019) with the same constructor and
  the same `lr` / `step_count` as our `Adam`; weight_decay defaults to torch's 0.01.
- `make_adam(model, ...)`, `make_adamw(model, ...)`, `set_lr(optimizer, lr)`: so that a training loop reads the
  same in both tracks.

torch's own scheduler `LambdaLR` multiplies a base lr and calls its function with 0 first; with `noam_lr`
(which counts steps from 1) set lr=1.0 and use `LambdaLR(opt, lambda s: noam_lr(s + 1, d_model, warmup))`.
Setting `opt.lr = noam_lr(step, ...)` before each step, as the NumPy track does, gives the same numbers.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from tfm_common.validate import check_adam_args

__all__ = ["Adam", "AdamW", "make_adam", "make_adamw", "set_lr", "noam_lr", "clip_grad_norm"]


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
        """The number of steps taken (torch keeps one counter per parameter; they agree unless a parameter
        had no gradient at some step)."""
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        return max(steps, default=0)


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


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The learning rate of "Attention Is All You Need" (Vaswani et al., 2017, section 5.3, equation 3):

        lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

    It rises linearly for `warmup` steps, peaks at step = warmup with d_model^-0.5 * warmup^-0.5, then decays as
    step^-0.5. `step` counts updates from 1 (the number of the update about to be made, as Adam's t); step 0
    is an error, not a silent lr of 0. Pure Python math: the NumPy track has the identical function.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"noam_lr: step expected an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"noam_lr: step counts from 1 (the first update), got {step}")
    for arg, value in (("d_model", d_model), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"noam_lr: {arg} expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"noam_lr: {arg} must be >= 1, got {value}")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor > 0 or math.isinf(factor):
        raise ValueError(f"noam_lr: factor must be a positive finite float, got {factor!r}")
    step, d_model, warmup = int(step), int(d_model), int(warmup)
    return float(factor) * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def clip_grad_norm(params, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm)`: scale the gradients in place so that their global L2
    norm is at most `max_norm` (each multiplied by min(max_norm / (total + 1e-6), 1)); return the norm before."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a float >= 0, got {max_norm!r}")
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
