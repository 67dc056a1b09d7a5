"""How the numbers that steer training change from step to step, the same in both tracks (pure Python floats):

- `noam_lr`: the warm-up schedule of the learning rate of "Attention Is All You Need";
- `cooldown_scale`: the factor that brings the lr of a run's last steps down linearly;
- `LossScaler`: the dynamic loss scale of mixed precision (Micikevicius et al., 2018).

`tfm_numpy.noam_lr` and `tfm_torch.noam_lr` (and `LossScaler`) are these very objects.
"""

from __future__ import annotations

import math
import numbers

from .validate import check_real, check_size

__all__ = ["noam_lr", "cooldown_scale", "check_cooldown", "LossScaler"]


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The learning rate of "Attention Is All You Need" (Vaswani et al., 2017, section 5.3, equation 3):

        lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

    It rises linearly for `warmup` steps, peaks at step = warmup with d_model^-0.5 * warmup^-0.5, then decays as
    step^-0.5. `step` counts updates from 1 (the number of the update about to be made, as Adam's t); step 0
    is an error, not a silent lr of 0. Pure Python math: both tracks use this one function.
    """
    step, d_model, warmup, factor = _check_noam_args(step, d_model, warmup, factor)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def _check_noam_args(step, d_model, warmup, factor) -> tuple[int, int, int, float]:
    step = check_size("noam_lr", "step", step, minimum=-math.inf)
    if step < 1:
        raise ValueError(f"noam_lr: step counts from 1 (the first update), got {step}")
    d_model, warmup = check_size("noam_lr", "d_model", d_model), check_size("noam_lr", "warmup", warmup)
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor > 0 or math.isinf(factor):
        raise ValueError(f"noam_lr: factor must be a positive finite float, got {factor!r}")
    return step, d_model, warmup, float(factor)


def check_cooldown(name: str, cooldown, total: int | None) -> int:
    """`cooldown` checked against the number of steps of the call (which must be known if cooldown > 0)."""
    cooldown = check_size(name, "cooldown", cooldown, minimum=0)
    if cooldown and total is None:
        raise ValueError(
            f"{name}: cooldown={cooldown} needs the number of steps in advance: pass steps, or epochs with a list "
            "of batches (not a callable)"
        )
    if cooldown > (total or 0):
        raise ValueError(f"{name}: cooldown={cooldown} is longer than the {total} steps of this call")
    return cooldown


def cooldown_scale(k: int, total: int | None, cooldown: int) -> float:
    """The factor on the scheduled lr at the k-th step of a call of `total` steps (k = 1 .. total): 1, then over
    the last `cooldown` steps (total - k + 1) / cooldown, down to 1 / cooldown at the last step."""
    if not cooldown:
        return 1.0
    return min(1.0, (total - k + 1) / cooldown)


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al., 2018), the rule of `torch.amp.GradScaler` (its
    `torch._amp_update_scale_`): multiply the loss by `scale` before backward so that small gradients survive in
    float16; divide the gradients by it after. If any gradient overflowed (inf or nan), skip the step and multiply
    the scale by `backoff`; after `growth_interval` steps in a row without overflow, multiply it by `growth`.
    It holds Python floats only: the same object serves both tracks."""

    def __init__(self, init_scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 2000):  # fmt: skip
        self.scale = check_real("LossScaler", "init_scale", init_scale, 0.0)
        if not self.scale > 0:  # a scale of 0 makes every gradient 0 / 0 = nan: every step skipped, forever
            raise ValueError(f"LossScaler: init_scale must be > 0, got {init_scale!r}")
        self.growth = check_real("LossScaler", "growth", growth, 1.0)
        self.backoff = check_real("LossScaler", "backoff", backoff, 0.0, 1.0)
        if not 0 < self.backoff < 1:  # 1: an overflow would never lower the scale; 0: it would set it to 0
            raise ValueError(f"LossScaler: backoff must be in (0, 1), got {backoff!r}")
        self.growth_interval = check_size("LossScaler", "growth_interval", growth_interval)
        self.good_steps = 0  # steps since the last overflow or growth
        self.overflows = 0  # steps skipped so far

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
