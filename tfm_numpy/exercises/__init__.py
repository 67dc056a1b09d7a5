"""Exercises that grade themselves: `check(name, attempt)` runs the book's checks on the reader's own code.

    from tfm_numpy.exercises import check
    result = check("layer_norm_forward", layer_norm_forward)   # prints a short report, returns a CheckResult

The checks compare the attempt with the library (forward, and every gradient of a backward, with central
differences as an independent witness), try edge cases (a fully masked row, length 1, float32) and inputs that must
be refused. A wrong attempt never raises: it gives failed findings that say what, by how much and where.
`EXERCISES` maps every exercise's name to its chapter, signature and checks.
"""

from __future__ import annotations

from . import attention, bert, beyond, dpo, expert_parallel, finetune, foundations, lora, model, model_parallel, moe
from .grading import CheckResult, Exercise, grade

__all__ = ["EXERCISES", "check", "CheckResult", "Exercise"]

MODULES = (
    foundations,
    attention,
    model,
    beyond,
    model_parallel,
    moe,
    expert_parallel,
    bert,
    finetune,
    lora,
    dpo,
)
EXERCISES: dict[str, Exercise] = {e.name: e for module in MODULES for e in module.EXERCISES}


def check(name: str, attempt, *, quiet: bool = False) -> CheckResult:
    """Grade `attempt` (a function or class, as the exercise asks) against the exercise `name`; print the report.

    Raises only when `name` is not an exercise (a typo in the notebook, not a wrong attempt).
    """
    if name not in EXERCISES:
        known = ", ".join(sorted(EXERCISES))
        raise ValueError(f"check: unknown exercise {name!r}; the exercises are: {known}")
    result = grade(EXERCISES[name], attempt)
    if not quiet:
        print(result.report())
    return result
