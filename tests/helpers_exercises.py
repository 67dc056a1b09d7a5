"""The book's worked solutions, read from the chapters: the tests of wrong attempts grade the chapter's own solution
too, so the solution a reader opens is the one that is tested (no copy in the tests that can drift)."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
from pathlib import Path

from tfm_numpy.exercises import EXERCISES, check

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def exercise_cells(chapter: str, tag: str) -> list[str]:
    """The sources of the chapter's code cells tagged `tag` (exercise-skeleton, exercise-check, exercise-solution)."""
    nb = json.loads((CHAPTERS / f"{chapter}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if tag in c.get("metadata", {}).get("tags", [])]


def defines(source: str) -> set[str]:
    """The names a cell defines at its top level (functions and classes)."""
    return {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef | ast.ClassDef)}


@functools.cache
def _namespace(chapter: str, tag: str) -> dict:
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):  # the cells' own check calls print their reports
        for source in exercise_cells(chapter, tag):
            exec(compile(source, f"{chapter}:{tag}", "exec"), ns)  # noqa: S102 - the book's own cell
    return ns


def solution(name: str):
    """The worked solution of exercise `name`, defined by its chapter's exercise-solution cell."""
    return _namespace(EXERCISES[name].chapter, "exercise-solution")[name]


def skeleton(name: str):
    """The skeleton of exercise `name`, as the reader finds it."""
    return _namespace(EXERCISES[name].chapter, "exercise-skeleton")[name]


def fails(name: str, attempt, *texts: str):
    """Grade a wrong attempt: it must fail, and some failed line must contain each of `texts`."""
    result = check(name, attempt, quiet=True)
    assert not result.passed, result.report()
    for text in texts:
        assert result.failed(text), (text, result.report())
    return result
