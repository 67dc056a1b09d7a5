"""Graded exercise of chapter 22a (Part X): BERT's 80/10/10 corruption rule given its random draws (`mask_rule`),
checked against tfm_common.mlm.mask_rule. See foundations.py for the pattern."""

from __future__ import annotations

import numpy as np

from tfm_common.mlm import IGNORE_INDEX
from tfm_common.mlm import mask_rule as library_mask_rule

from .grading import Exercise, Grader

__all__ = ["EXERCISES"]

V, PAD, CLS, SEP, MASK = 40, 36, 37, 38, 39
SPECIALS = (PAD, CLS, SEP, MASK)

HINTS = {
    "inputs": "a position is chosen only where u_choose < p AND its id is not special; a chosen one becomes mask_id "
    "where u_fate < 0.8, random_ids where 0.8 <= u_fate < 0.9, and keeps its id where u_fate >= 0.9",
    "targets": f"targets hold the original id at the chosen positions and IGNORE_INDEX = {IGNORE_INDEX} everywhere "
    "else (the loss skips them)",
}


def _draws(rng, shape, p_special=0.2):
    """ids with some special tokens among them, the two uniforms and the replacements, all of one shape."""
    ids = rng.integers(0, 36, shape)
    special = rng.random(shape) < p_special
    ids = np.where(special, rng.choice(SPECIALS, shape), ids)
    return ids, rng.random(shape), rng.random(shape), rng.integers(0, 36, shape)


def _expected(ids, u_choose, u_fate, random_ids, p):
    out = library_mask_rule(ids, u_choose, u_fate, random_ids, mask_id=MASK, special_ids=SPECIALS, p=p)
    return {"inputs": out.inputs, "targets": out.targets}


def _case(g: Grader, label, ids, u_choose, u_fate, random_ids, p, hints=None):
    got = g.run(label, ids, u_choose, u_fate, random_ids, MASK, SPECIALS, p, hint=HINTS["inputs"])
    g.gradients(label, got, _expected(ids, u_choose, u_fate, random_ids, p), tol=1e-12, hints=hints or HINTS)


def grade_mask_rule(g: Grader) -> None:
    rng = np.random.default_rng(2201)
    _case(g, "one sequence (T,) = (30,), p = 0.15", *_draws(rng, (30,)), 0.15)
    _case(g, "a batch (B, T) = (4, 25), p = 0.5", *_draws(rng, (4, 25)), 0.5)
    _case(g, "length 1: (B, T) = (3, 1), p = 0.9", *_draws(rng, (3, 1), p_special=0.0), 0.9)
    ids = np.array([5, 6, 7, 8, 9, 10, 11])  # the boundaries of each interval, no special token
    u_choose = np.array([0.0, 0.3, 0.3, 0.3, 0.3, 0.2999, 0.1])
    u_fate = np.array([0.5, 0.7999, 0.8, 0.8999, 0.9, 0.95, 0.85])
    boundary = ("u_choose = p is NOT chosen (u_choose < p); u_fate = 0.8 is a random token and u_fate = 0.9 is kept: "
                "the intervals are [0, 0.8), [0.8, 0.9), [0.9, 1)")  # fmt: skip
    hints = {"inputs": boundary, "targets": HINTS["targets"]}
    _case(g, "the boundaries: u_choose = p, u_fate = 0.8 and 0.9", ids, u_choose, u_fate, ids + 20, 0.3, hints)
    ids = np.array([[CLS, 3, 4, SEP, PAD, PAD]])
    hint = "special tokens ([CLS], [SEP], [PAD], [MASK]) are never chosen, however small u_choose is there"
    _case(g, "special tokens with u_choose = 0", ids, np.zeros(ids.shape), np.full(ids.shape, 0.5),
          np.full(ids.shape, 9), 0.15, {"inputs": hint, "targets": hint})  # fmt: skip


EXERCISES = (
    Exercise(
        "mask_rule",
        "22a_bert",
        "mask_rule(ids, u_choose, u_fate, random_ids, mask_id, special_ids, p) -> (inputs, targets): every array the "
        "shape of ids",
        grade_mask_rule,
    ),
)
