"""Grading a reader's attempt: the machinery every "your turn" exercise shares.

An exercise's `grade(g)` calls the reader's code through the grader `g` (`g.run`), compares what comes back with
the library (`g.compare`, `g.gradients`) and asks for refusals (`g.refuses`). The grader never lets the reader's
mistake escape as an exception: a raised error, a wrong shape, a NaN or a wrong number each becomes one failed
finding in plain words (which check, by how much, at which index), and the checks that depend on it are skipped.

A skeleton that still raises `NotImplementedError` stops the grading at once with one friendly line: the reader has
not written it yet, and a list of twenty failures would say nothing more.

Passing findings print tolerances, not measured errors: a stored notebook output must read the same on every CPU,
and 2e-16 on one machine is 7e-16 on another. Failing findings print the numbers; they are the reader's, not stored.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..gradcheck import numeric_grad

__all__ = [
    "Finding",
    "CheckResult",
    "Exercise",
    "Grader",
    "NotWritten",
    "MISSING",
    "grade",
    "central_differences",
    "num",
]


class NotWritten(Exception):
    """The attempt still raises NotImplementedError: the grading stops here (never reaches the reader)."""


class _Missing:
    """What `Grader.run` returns when the attempt raised: every later comparison with it is skipped."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass(frozen=True)
class Finding:
    """One check: a short label ("forward, float64"), whether it passed, and what was seen, in plain words."""

    check: str
    passed: bool
    detail: str


@dataclass
class CheckResult:
    """Everything one `check` call found. `passed` is True only when every check ran and passed."""

    exercise: str
    findings: list[Finding] = field(default_factory=list)
    not_written: bool = False

    @property
    def passed(self) -> bool:
        return not self.not_written and bool(self.findings) and all(f.passed for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.passed]

    def failed(self, text: str) -> bool:
        """True when a failed finding's line ("label: detail") contains `text` (the tests of wrong attempts ask)."""
        return any(text in f"{f.check}: {f.detail}" for f in self.failures)

    def report(self) -> str:
        if self.not_written:
            return (
                f"{self.exercise}: not written yet (the skeleton still raises NotImplementedError).\n"
                "  Replace the `raise` with your code, run that cell, then run this one again."
            )
        n, bad = len(self.findings), len(self.failures)
        head = f"{self.exercise}: all {n} checks passed" if bad == 0 else f"{self.exercise}: {bad} of {n} checks failed"
        lines = [head] + [f"  {'ok  ' if f.passed else 'FAIL'}  {f.check}: {f.detail}" for f in self.findings]
        return "\n".join(lines)

    def __repr__(self) -> str:
        state = "not written" if self.not_written else f"{len(self.failures)} of {len(self.findings)} failed"
        return f"CheckResult({self.exercise!r}, passed={self.passed}, {state})"


@dataclass(frozen=True)
class Exercise:
    """A graded exercise: its name, the chapter that asks for it, what to write, and how to grade it."""

    name: str
    chapter: str
    signature: str
    grade: Callable[[Grader], None]


def num(x) -> str:
    """A number for a failure message: 3 significant digits."""
    return f"{float(x):.3g}"


def _distinct(a, b) -> tuple[str, str]:
    """Two different numbers printed with the fewest significant digits (3 at least) that tell them apart."""
    for digits in range(3, 18):
        sa, sb = f"{float(a):.{digits}g}", f"{float(b):.{digits}g}"
        if sa != sb:
            return sa, sb
    return sa, sb


def _raised(e: Exception) -> str:
    """An exception as one short line: its type and the start of its message."""
    msg = " ".join(str(e).split())
    return f"raised {type(e).__name__}: {msg[:117] + '...' if len(msg) > 120 else msg}"


def _shape(a) -> str:
    """An array's shape for a report: "a scalar" for shape ()."""
    return str(np.shape(a)) if np.ndim(a) else "a scalar"


def _where(index: tuple) -> str:
    return "(" + ", ".join(str(int(i)) for i in index) + ")" if len(index) != 1 else f"({int(index[0])},)"


class Grader:
    """Runs one exercise's checks on one attempt and collects the findings."""

    def __init__(self, exercise: Exercise, attempt):
        self.exercise, self.attempt = exercise, attempt
        self.result = CheckResult(exercise.name)

    def record(self, check: str, passed: bool, detail: str) -> bool:
        self.result.findings.append(Finding(check, bool(passed), detail))
        return bool(passed)

    def run(self, check: str, *args, fn=None, hint: str = "", **kwargs):
        """The attempt (or `fn`, one of its methods) called on copies of the arguments, or MISSING if it raised.

        Copies, so an attempt that writes into its inputs cannot spoil the reference computed afterwards.
        `hint` follows the error message when the attempt raises.
        """
        fn = self.attempt if fn is None else fn
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore", RuntimeWarning)  # an overflow shows as inf/nan in the findings
                return fn(*args, **kwargs)
        except NotImplementedError as e:
            raise NotWritten from e
        except Exception as e:  # noqa: BLE001 - the reader's mistake becomes a finding, never an exception
            self.record(check, False, _raised(e) + (f". {hint}" if hint else ""))
            return MISSING

    def compare(self, check: str, got, expected, *, tol: float, dtype=None, hint: str = "") -> bool:
        """`got` against `expected`: type, shape, dtype (when given), finite, then the largest absolute error.

        The error is measured relative to the scale of `expected` (max |expected|, at least 1), so a tolerance
        means the same for outputs near 1 and near 1000.
        """
        if got is MISSING:
            return False
        expected = np.asarray(expected)
        if not isinstance(got, (np.ndarray, np.generic, float, int)):
            return self.record(check, False, f"expected a NumPy array, got {type(got).__name__}")
        got = np.asarray(got)
        if got.shape != expected.shape:
            detail = f"shape {got.shape}, expected {expected.shape}"
            return self.record(check, False, detail + (f". {hint}" if hint else ""))
        if dtype is not None and got.dtype != np.dtype(dtype):
            return self.record(check, False, f"dtype {got.dtype}, expected {np.dtype(dtype)}")
        if got.size == 0:
            return self.record(check, True, f"shape {got.shape}, empty as expected")
        bad = ~np.isfinite(got) & np.isfinite(expected)
        if bad.any():
            idx = np.unravel_index(np.argmax(bad), got.shape)
            detail = f"{num(got[idx])} at index {_where(idx)}, expected {num(expected[idx])}"
            return self.record(check, False, detail + (f". {hint}" if hint else ""))
        err = np.abs(got.astype(np.float64) - expected.astype(np.float64))
        err = np.where(np.isfinite(expected), err, np.where(got == expected, 0.0, np.inf))
        scale = max(1.0, float(np.abs(expected[np.isfinite(expected)]).max(initial=0.0)))
        worst = float(err.max()) / scale
        if worst <= tol:
            return self.record(check, True, f"{_shape(got)}, within {tol:.0e} of the library")
        idx = np.unravel_index(np.argmax(err), got.shape)
        shown = _distinct(got[idx], expected[idx])
        detail = f"off by {num(err[idx])} at index {_where(idx)}: got {shown[0]}, expected {shown[1]}"
        return self.record(check, False, detail + (f". {hint}" if hint else ""))

    def gradients(self, check: str, got, expected: dict, *, tol: float, hints=None, dtype=None) -> bool:
        """A backward's return value (a tuple, in the order of `expected`'s names) against the expected gradients
        only (a float32 case, `dtype=np.float32`: central differences need float64)."""
        return self.backward(check, got, expected, None, tol=tol, hints=hints, dtype=dtype)

    def backward(self, check: str, got, library: dict, numeric, *, tol: float = 1e-9, hints=None, dtype=None) -> bool:
        """A backward's gradients (a tuple in the order of `library`'s names) against the library's backward and,
        independently, against central differences of the library's forward (`numeric`, same names).

        One finding per gradient: the reader learns which input's gradient is off, by how much and where, and that
        the expected value is not only the library's word (central differences agree with it). When every gradient
        passes, one line for the whole case.
        """
        if got is MISSING:
            return False
        names = list(library)
        got = got if isinstance(got, tuple | list) else (got,)
        if len(got) != len(names):
            return self.record(check, False, f"returned {len(got)} value(s), expected {len(names)}: {', '.join(names)}")
        hints = hints or {}
        ok = [
            self._gradient(
                f"{check}: {name}", g, library[name], numeric and numeric[name], tol, hints.get(name, ""), dtype
            )  # fmt: skip
            for name, g in zip(names, got, strict=True)
        ]
        if all(ok):
            shapes = ", ".join(f"{name} {_shape(g)}" for name, g in zip(names, got, strict=True))
            witness = " and 1e-06 of central differences" if numeric else ""
            self.result.findings[-len(names) :] = [
                Finding(check, True, f"{shapes} within {tol:.0e} of the library{witness}")
            ]
        return all(ok)

    def _gradient(self, label: str, got, expected, numeric, tol: float, hint: str, dtype) -> bool:
        """One gradient against the library's and, when given, central differences: one finding either way."""
        n = len(self.result.findings)
        if not self.compare(label, got, expected, tol=tol, hint=hint, dtype=dtype) or numeric is None:
            return self.result.findings[n].passed
        agree = self.compare(label, got, numeric, tol=1e-6)
        detail = "agrees with the library's backward but not with central differences (report this)"
        self.result.findings[n:] = [Finding(label, agree, f"{_shape(got)}, within both" if agree else detail)]
        return agree

    def refuses(self, check: str, *args, expected: str, errors=(ValueError,), fn=None, **kwargs) -> bool:
        """The attempt must raise one of `errors` on these arguments; `expected` says what a clear error names."""
        fn = self.attempt if fn is None else fn
        try:
            fn(*args, **kwargs)
        except NotImplementedError as e:
            raise NotWritten from e
        except errors as e:
            return self.record(check, True, f"refused with {type(e).__name__}")
        except Exception as e:  # noqa: BLE001
            return self.record(check, False, f"{_raised(e)}; expected a ValueError that {expected}")
        return self.record(check, False, f"accepted it silently; expected a ValueError that {expected}")

    def require(self, check: str, condition: bool, passed: str, failed: str) -> bool:
        """A yes/no check stated in words."""
        return self.record(check, condition, passed if condition else failed)


def central_differences(f: Callable[..., np.ndarray], inputs: dict, grad_out: np.ndarray) -> dict:
    """d/d(input) of sum(grad_out * f(**inputs)) for every float input, by central differences (float64)."""
    inputs = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in inputs.items()}

    def loss(_=None) -> float:
        return float(np.sum(grad_out * f(**inputs)))

    return {k: numeric_grad(loss, v) for k, v in inputs.items() if isinstance(v, np.ndarray) and v.dtype == np.float64}


def grade(exercise: Exercise, attempt) -> CheckResult:
    """Run `exercise`'s checks on `attempt`; a skeleton that is not written yet gives a result with not_written."""
    g = Grader(exercise, attempt)
    if not callable(attempt):
        g.record("the attempt", False, f"expected a function or class, got {type(attempt).__name__}")
        return g.result
    try:
        exercise.grade(g)
    except NotWritten:
        g.result.not_written = True
        g.result.findings.clear()
    return g.result
