"""The graded exercises: the grader never raises on a wrong attempt, every exercise stands in its chapter with a
skeleton, a check cell and a hidden worked solution, and the stored outputs show the skeleton's friendly failure
and the solution's pass. Each exercise's wrong attempts are tested in tests/test_exercises_<part>.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_exercises import CHAPTERS, defines, exercise_cells, skeleton, solution

from tfm_numpy.exercises import EXERCISES, check
from tfm_numpy.exercises.grading import Exercise, Grader, grade

NAMES = sorted(EXERCISES)


def test_enough_exercises():
    assert len(EXERCISES) >= 14, sorted(EXERCISES)


@pytest.mark.parametrize("name", NAMES)
def test_worked_solution_passes(name):
    result = check(name, solution(name), quiet=True)
    assert result.passed, result.report()


@pytest.mark.parametrize("name", NAMES)
def test_skeleton_is_not_written(name):
    result = check(name, skeleton(name), quiet=True)
    assert result.not_written and not result.passed
    assert "not written yet" in result.report()


@pytest.mark.parametrize("name", NAMES)
def test_chapter_has_the_three_cells(name):
    chapter = EXERCISES[name].chapter
    for tag in ("exercise-skeleton", "exercise-solution"):
        assert any(name in defines(src) for src in exercise_cells(chapter, tag)), (chapter, tag, name)
    assert any(f'check("{name}", {name})' in src for src in exercise_cells(chapter, "exercise-check")), name
    assert all("NotImplementedError" in src for src in exercise_cells(chapter, "exercise-skeleton"))


def _stored_text(chapter: str, tag: str) -> str:
    nb = json.loads((CHAPTERS / f"{chapter}.ipynb").read_text())
    cells = [c for c in nb["cells"] if tag in c.get("metadata", {}).get("tags", [])]
    return "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []))


@pytest.mark.parametrize("name", NAMES)
def test_stored_outputs_show_the_failure_then_the_pass(name):
    chapter = EXERCISES[name].chapter
    assert f"{name}: not written yet" in _stored_text(chapter, "exercise-check")
    solved = _stored_text(chapter, "exercise-solution")
    assert f"{name}: all " in solved and "FAIL" not in solved


def test_solution_cells_are_hidden():
    for chapter in {e.chapter for e in EXERCISES.values()}:
        nb = json.loads((CHAPTERS / f"{chapter}.ipynb").read_text())
        for c in nb["cells"]:
            tags = c.get("metadata", {}).get("tags", [])
            if "exercise-solution" in tags:
                assert "hide-cell" in tags, chapter


# --- the grader itself -------------------------------------------------------------------------------------------


def _toy(grade_fn):
    return Exercise("toy", "01_method", "toy(x) -> y", grade_fn)


def _grade_double(g: Grader):
    x = np.arange(6.0).reshape(2, 3)
    g.compare("double", g.run("double", x), 2 * x, tol=1e-12)


@pytest.mark.parametrize(
    "attempt, text",
    [
        (lambda x: 2 * x + 1e-3, "off by 0.001 at index ("),
        (lambda x: (2 * x).T, "shape (3, 2), expected (2, 3)"),
        (lambda x: [list(r) for r in 2 * x], "expected a NumPy array, got list"),
        (lambda x: np.where(x > 4, np.nan, 2 * x), "nan at index (1, 2)"),
        (lambda x: 1 / 0, "raised ZeroDivisionError"),
        (lambda x: (2 * x).astype(np.float32) + 1, "off by 1"),
    ],
)
def test_grader_reports_instead_of_raising(attempt, text):
    result = grade(_toy(_grade_double), attempt)
    assert not result.passed and result.failed(text), result.report()


def test_grader_passes_and_refuses_non_callables():
    assert grade(_toy(_grade_double), lambda x: 2 * x).passed
    result = grade(_toy(_grade_double), 3)
    assert not result.passed and result.failed("expected a function or class, got int")


def test_attempt_cannot_write_into_the_reference():
    def grade_fn(g: Grader):
        x = np.ones(3)
        g.run("writes", x)
        g.require("input kept", bool((x == 1).all()), "kept", "changed")

    def writes(x):
        x[...] = 0
        return x

    assert grade(_toy(grade_fn), writes).passed


def test_dtype_is_checked_when_asked():
    def grade_fn(g: Grader):
        x = np.ones(3, np.float32)
        g.compare("float32", g.run("float32", x), x, tol=1e-6, dtype=np.float32)

    assert grade(_toy(grade_fn), lambda x: x).passed
    result = grade(_toy(grade_fn), lambda x: x.astype(np.float64))
    assert result.failed("dtype float64, expected float32")


def test_refusal_checks():
    def grade_fn(g: Grader):
        g.refuses("odd size", 3, expected="names the odd size")

    def accepts(n):
        return n

    def refuses(n):
        raise ValueError(f"odd size {n}")

    def wrong_error(n):
        raise KeyError(n)

    assert grade(_toy(grade_fn), refuses).passed
    assert grade(_toy(grade_fn), accepts).failed("accepted it silently")
    assert grade(_toy(grade_fn), wrong_error).failed("raised KeyError")


def test_unknown_exercise_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown exercise 'linear_forwrd'.*linear_forward"):
        check("linear_forwrd", lambda x: x)


def test_check_prints_the_report(capsys):
    result = check("linear_forward", lambda x, W, b: x @ W.T + b)
    out = capsys.readouterr().out
    assert result.passed and out.startswith("linear_forward: all 4 checks passed")
