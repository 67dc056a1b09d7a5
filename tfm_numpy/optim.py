"""Optimization, NumPy track: Adam, AdamW, gradient clipping by global norm, and `apply_update`, the tail of every
step function (norm, finite check, clipping, lr, step). The paper's warm-up schedule `noam_lr` is
`tfm_common.schedules.noam_lr`, the one function of both tracks.

Adam (Kingma & Ba, 2015), as `torch.optim.Adam` computes it, for each parameter p with gradient g at step t:

    g   <- g + weight_decay * p                       (L2 penalty added to the gradient; 0 in the paper)
    m   <- beta1 m + (1 - beta1) g                    first moment (running mean of g)
    v   <- beta2 v + (1 - beta2) g^2                  second moment (running mean of g^2)
    p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The two factors 1 / (1 - beta^t) correct the bias of m and v towards their zero start ("bias correction").
The defaults are the paper's (Vaswani et al., 2017, section 5.3): betas = (0.9, 0.98), eps = 1e-9.

AdamW (Loshchilov & Hutter, 2019), as `torch.optim.AdamW` computes it, decouples the weight decay from the
gradient: no penalty is added to g (so it never enters m and v, nor is it divided by sqrt(v)); instead, before
the Adam update above,

    p   <- p * (1 - lr * weight_decay)                (shrink every weight by the same fraction)

Everything is updated in place and in the parameters' dtype (float32 stays float32).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from tfm_common.schedules import noam_lr
from tfm_common.training import check_adam_eps, check_distinct_params, check_finite_step, check_moment
from tfm_common.validate import check_adam_args, check_real

from .module import Module, Parameter

__all__ = [
    "Adam",
    "AdamW",
    "make_adam",
    "make_adamw",
    "set_lr",
    "noam_lr",
    "grad_norm",
    "clip_grad_norm",
    "apply_update",
]


def _param_list(params, name: str) -> list[Parameter]:
    """A list of distinct Parameters from a Module, a list of Parameters or `model.parameters()`."""
    if isinstance(params, Module):
        params = params.parameters()
    if isinstance(params, Parameter):
        raise TypeError(f"{name}: params expected an iterable of Parameters, got one Parameter (wrap it in a list)")
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise TypeError(f"{name}: params[{i}] expected a tfm_numpy Parameter, got {type(p).__name__}")
    check_distinct_params(name, params)
    return params


class Adam:
    """Adam over a list of Parameters, matching `torch.optim.Adam` step for step.

    `lr` may be changed between steps (a schedule sets it: `opt.lr = noam_lr(...)`). `step_count` is the
    number of steps taken (t of the formula, 1 at the first step). `state_dict()` / `load_state_dict()` carry
    the step count, the hyperparameters and the moments `exp_avg` (m) and `exp_avg_sq` (v), named as torch does.
    """

    decoupled = False  # weight decay as an L2 penalty in the gradient (AdamW: True, and its own `_decayed_grad`)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.0):
        name = type(self).__name__
        self.params = _param_list(params, name)
        if not self.params:
            raise ValueError(f"{name}: params is empty: nothing to optimize")
        self.lr, self.betas, self.eps, self.weight_decay = check_adam_args(name, lr, betas, eps, weight_decay)
        check_adam_eps(name, self.eps)
        self.step_count = 0
        self.exp_avg = [np.zeros_like(p.data) for p in self.params]
        self.exp_avg_sq = [np.zeros_like(p.data) for p in self.params]
        self._buf: np.ndarray | None = None  # scratch space for `step`, allocated at the first step

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = check_real(type(self).__name__, "lr", value, 0.0, nonfinite=ValueError)

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """One update of every parameter from its `.grad`, in place. A parameter whose `.grad` is None (torch's
        idiom for "no gradient", e.g. a frozen weight) is skipped, as torch skips it: its value and moments stay.
        The step count t is the optimizer's, shared by all parameters (torch counts per parameter; the two agree
        unless a parameter's gradient is None at some steps and not at others)."""
        self._check_grads()  # every parameter, before any changes
        self.step_count += 1
        t = self.step_count
        beta1, beta2 = self.betas
        step_size = self.lr / (1 - beta1**t)  # lr with the first moment's bias correction
        bias_correction2_sqrt = (1 - beta2**t) ** 0.5
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            if p.grad is None:
                continue
            g = self._decayed_grad(p)  # Adam: g + weight_decay * p, an L2 penalty that goes through m and v
            # The same formulas, written with out= and in-place operators into one scratch array `tmp`: no new
            # arrays per step (for a large model each would be as big as the parameter). Python floats keep float32.
            tmp = self._scratch(p.data)
            _lerp_(m, g, 1 - beta1, tmp)  # m = beta1 m + (1 - beta1) g, computed as torch's lerp_
            v *= beta2
            np.multiply(g, 1 - beta2, out=tmp)
            tmp *= g
            v += tmp  # v = beta2 v + (1 - beta2) g^2
            np.sqrt(v, out=tmp)
            tmp /= bias_correction2_sqrt
            tmp += self.eps  # tmp = denom = sqrt(v) / sqrt(1 - beta2^t) + eps
            np.divide(m, tmp, out=tmp)
            tmp *= step_size
            p.data -= tmp  # p = p - step_size * m / denom

    def _decayed_grad(self, p: Parameter) -> np.ndarray:
        """The gradient that Adam normalizes: with weight decay as an L2 penalty, g + weight_decay * p."""
        return p.grad + self.weight_decay * p.data if self.weight_decay != 0 else p.grad

    def _check_grads(self) -> None:
        name = type(self).__name__
        for i, p in enumerate(self.params):  # check every parameter before changing any
            if p.grad is None:
                continue
            if not isinstance(p.grad, np.ndarray):
                raise TypeError(
                    f"{name}.step: params[{i}].grad expected a numpy.ndarray or None, got {type(p.grad).__name__}"
                )
            if p.grad.shape != p.data.shape or p.grad.dtype != p.data.dtype:
                raise ValueError(
                    f"{name}.step: params[{i}] has data {p.data.shape} {p.data.dtype} but grad {p.grad.shape} "
                    f"{p.grad.dtype} (was the model converted after the optimizer was made?)"
                )
            if self.exp_avg[i].dtype != p.data.dtype:
                raise ValueError(
                    f"{name}.step: params[{i}] is {p.data.dtype} but its moments are {self.exp_avg[i].dtype}: "
                    "make the optimizer after converting the model (astype/double/float)"
                )

    def _scratch(self, like: np.ndarray) -> np.ndarray:
        """A scratch array shaped like `like`: a view of one flat buffer, as large as the largest parameter."""
        buf = self._buf
        if buf is None or buf.dtype != like.dtype or buf.size < like.size:
            buf = np.empty(max(p.data.size for p in self.params), dtype=like.dtype)
            self._buf = buf
        return buf[: like.size].reshape(like.shape)

    def state_dict(self) -> dict:
        """Copies: {"step", "lr", "betas", "eps", "weight_decay", "exp_avg": [arrays], "exp_avg_sq": [arrays]}."""
        return {
            "step": self.step_count,
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "exp_avg": [m.copy() for m in self.exp_avg],
            "exp_avg_sq": [v.copy() for v in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` (hyperparameters included, as torch does); all checked before any change."""
        name = f"{type(self).__name__}.load_state_dict"
        keys = {"step", "lr", "betas", "eps", "weight_decay", "exp_avg", "exp_avg_sq"}
        if not isinstance(state, dict) or set(state) != keys:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise KeyError(f"{name}: expected keys {sorted(keys)}, got {got}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"{name}: step expected an int >= 0, got {step!r}")
        moments = {}
        for part in ("exp_avg", "exp_avg_sq"):
            arrays = [np.asarray(a) for a in state[part]]
            if len(arrays) != len(self.params):
                raise ValueError(f"{name}: {part}: {len(arrays)} arrays, the optimizer has {len(self.params)} params")
            for i, (a, p) in enumerate(zip(arrays, self.params, strict=True)):
                if a.shape != p.data.shape:
                    raise ValueError(f"{name}: {part}[{i}] expected shape {p.data.shape}, got {a.shape}")
                _check_moment(name, part, i, a)
            moments[part] = [a.astype(p.data.dtype, copy=True) for a, p in zip(arrays, self.params, strict=True)]
        hyper = check_adam_args(name, state["lr"], state["betas"], state["eps"], state["weight_decay"])
        check_adam_eps(name, hyper[2])
        self.lr, self.betas, self.eps, self.weight_decay = hyper
        self.step_count = int(step)
        self.exp_avg, self.exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lr={self.lr:g}, betas={self.betas}, eps={self.eps:g}, "
            f"weight_decay={self.weight_decay:g}, params={len(self.params)}, step_count={self.step_count})"
        )


def _check_moment(name: str, part: str, i: int, a: np.ndarray) -> None:
    """A stored moment: numbers (a string or object array is refused), finite, exp_avg_sq never negative."""
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)) or a.dtype == np.bool_:
        raise TypeError(f"{name}: {part}[{i}] expected an array of floats, got dtype {a.dtype}")
    check_moment(name, part, i, bool(np.isfinite(a).all()), part == "exp_avg_sq" and bool((a < 0).any()))


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter, 2019) over a list of Parameters, matching `torch.optim.AdamW` step for step.

    The same constructor, attributes and `state_dict()` as `Adam`; only the weight decay differs: each step first
    multiplies every weight by (1 - lr * weight_decay), and the gradient Adam normalizes is the loss's alone.
    The default weight_decay is torch's, 0.01 (with 0, AdamW is Adam). The other defaults are the paper's, as Adam.
    """

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _decayed_grad(self, p: Parameter) -> np.ndarray:
        if self.weight_decay != 0:
            p.data *= 1 - self.lr * self.weight_decay  # decoupled: shrink the weight, leave the gradient alone
        return p.grad


def _lerp_(start: np.ndarray, end: np.ndarray, weight: float, tmp: np.ndarray) -> None:
    """start += weight * (end - start) in place, with the two formulas of torch.lerp (exact at both ends);
    `tmp` is scratch space of start's shape."""
    np.subtract(end, start, out=tmp)
    if abs(weight) < 0.5:
        tmp *= weight
        start += tmp
    else:
        tmp *= 1 - weight
        np.subtract(end, tmp, out=start)


def make_adam(model: Module, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.0):
    """`Adam(model.parameters(), ...)`: the same call in both tracks."""
    return Adam(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def make_adamw(model: Module, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.01):
    """`AdamW(model.parameters(), ...)`: the same call in both tracks."""
    return AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def set_lr(optimizer: Adam, lr: float) -> None:
    """Set the learning rate for the next step (the torch track sets every param group's "lr")."""
    check_real("set_lr", "lr", lr, 0.0, nonfinite=ValueError)  # the words of the torch track's set_lr
    optimizer.lr = lr


def clip_grad_norm(params: Iterable[Parameter], max_norm: float) -> float:
    """Scale every gradient in place so that their global L2 norm is at most `max_norm`; return the norm before.

    As `torch.nn.utils.clip_grad_norm_`: total = ||(||g_1||, ..., ||g_n||)||_2 (the norm of all gradients seen
    as one vector); each g is multiplied by min(max_norm / (total + 1e-6), 1). Below the threshold the
    gradients are untouched.
    """
    params, max_norm = _check_clip(params, max_norm)  # the parameters that have a gradient (None: none, as torch)
    norms = np.array([np.sqrt(np.sum(p.grad * p.grad)) for p in params])
    total = float(np.sqrt(np.sum(norms * norms)))
    coef = max_norm / (total + 1e-6)
    if not coef >= 1.0:  # scales down, and spreads a nan norm to the gradients as torch does
        for p in params:
            p.grad *= coef
    return total


def _check_clip(params, max_norm) -> tuple[list[Parameter], float]:
    params = [p for p in _param_list(params, "clip_grad_norm") if p.grad is not None]
    return params, check_real("clip_grad_norm", "max_norm", max_norm, 0.0, nonfinite=ValueError)


def grad_norm(params) -> float:
    """The global L2 norm of the gradients, ||(||g_1||, ..., ||g_n||)||_2, as `clip_grad_norm` measures it."""
    params = params.parameters() if isinstance(params, Module) else list(params)
    norms = np.array([np.sqrt(np.sum(p.grad * p.grad)) for p in params if p.grad is not None])
    return float(np.sqrt(np.sum(norms * norms)))


def apply_update(name: str, optimizer: Adam, loss: float, lr: float, clip_norm: float | None) -> float:
    """The tail of every step function (`name` is the caller's, for the error): the gradient norm, refused if it or
    the loss is not finite (before anything changes: clipping, the lr, Adam's state and step count), the clipping
    to `clip_norm` (None: none), the lr, Adam's step. Returns the gradient norm before clipping."""
    params = optimizer.params
    norm = grad_norm(params)
    check_finite_step(name, loss, norm)
    if clip_norm is not None:
        norm = clip_grad_norm(params, clip_norm)  # the same norm, measured as it clips
    set_lr(optimizer, lr)
    optimizer.step()
    return norm
