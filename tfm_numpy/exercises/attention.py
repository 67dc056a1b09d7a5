"""Graded exercises of attention: see foundations.py for the pattern."""

from __future__ import annotations

from .grading import Exercise

__all__ = ["EXERCISES"]

EXERCISES: tuple[Exercise, ...] = ()
