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

import torch
from torch import nn

from tfm_common.schedules import noam_lr
from tfm_common.training import check_adam_eps, check_distinct_params, check_finite_step, check_moment, steps_taken
from tfm_common.validate import check_adam_args, check_real

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
    """`opt.lr` (get: the one lr of every param group; set: all of them) and `opt.step_count`, as tfm_numpy's; and
    what tfm_numpy's Adam refuses and torch lets through: eps = 0, a parameter given twice (torch only warns), and
    a state_dict of the other optimizer (Adam's into AdamW, or back) or with non-finite moments."""

    def __init__(self, params, **hyper):
        name = type(self).__name__
        check_adam_eps(name, hyper["eps"])
        if not torch.is_tensor(params):  # one tensor: torch's own TypeError
            params = [_group_copy(g) if isinstance(g, dict) else g for g in params]
            check_distinct_params(name, [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])])
        super().__init__(params, **hyper)

    def load_state_dict(self, state_dict: dict) -> None:
        _check_adam_state(type(self).__name__, self, state_dict)
        super().load_state_dict(state_dict)

    @property
    def lr(self) -> float:
        lrs = {float(g["lr"]) for g in self.param_groups}
        if len(lrs) != 1:
            raise ValueError(f"{type(self).__name__}.lr: the param groups have different learning rates {sorted(lrs)}")
        return lrs.pop()

    @lr.setter
    def lr(self, value: float) -> None:
        check_real(type(self).__name__, "lr", value, 0.0, nonfinite=ValueError)  # named as tfm_numpy's
        set_lr(self, value)

    @property
    def step_count(self) -> int:
        return steps_taken(self)


def _group_copy(group: dict) -> dict:
    """A param group with its "params" as a list (a generator read once here would be empty for torch)."""
    params = group.get("params", [])
    return {**group, "params": [params] if torch.is_tensor(params) else list(params)}


def _decoupled(groups) -> bool:
    return any(bool(g.get("decoupled_weight_decay", False)) for g in groups if isinstance(g, dict))


def _check_adam_state(owner: str, optimizer, state_dict) -> None:
    """Before torch's load_state_dict changes anything: the state of the same kind of optimizer (torch would load
    AdamW's decoupled_weight_decay=True into an Adam, which would then take AdamW steps; tfm_numpy's .npz refuses),
    and finite moments, exp_avg_sq >= 0 (as tfm_numpy's). The structure itself is torch's to check."""
    name = f"{owner}.load_state_dict"
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return
    stored = "AdamW" if _decoupled(state_dict["param_groups"]) else "Adam"
    own = "AdamW" if _decoupled(optimizer.param_groups) else "Adam"
    if stored != own:
        raise ValueError(f"{name}: state_dict holds {stored} state, the optimizer is {own}")
    for g in state_dict["param_groups"]:
        if isinstance(g, dict) and isinstance(g.get("eps"), float | int):
            check_adam_eps(name, g["eps"])
    states = state_dict.get("state")
    for i, st in states.items() if isinstance(states, dict) else ():
        for part in ("exp_avg", "exp_avg_sq"):
            t = st.get(part) if isinstance(st, dict) else None
            if torch.is_tensor(t) and (t.is_floating_point() or t.is_complex()):
                negative = part == "exp_avg_sq" and bool((t < 0).any())
                check_moment(name, part, i, bool(torch.isfinite(t).all()), negative)


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
    lr = check_real("set_lr", "lr", lr, 0.0, nonfinite=ValueError)  # as tfm_numpy's: TypeError for a non-number
    for group in optimizer.param_groups:
        group["lr"] = float(lr)


def clip_grad_norm(params, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm)`: scale the gradients in place so that their global L2
    norm is at most `max_norm` (each multiplied by min(max_norm / (total + 1e-6), 1)); return the norm before."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    params = [params] if torch.is_tensor(params) else list(params)
    check_distinct_params("clip_grad_norm", params)  # torch would count a repeated one twice in the norm
    max_norm = check_real("clip_grad_norm", "max_norm", max_norm, 0.0, nonfinite=ValueError)  # inf too, as NumPy
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
