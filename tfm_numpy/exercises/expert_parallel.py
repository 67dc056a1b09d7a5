"""Graded exercise of chapter 20d (expert parallelism): the dispatch bookkeeping (`expert_dispatch`), which of a
process's (token, choice) assignments go to which process, in what order, and the inverse permutation that finds
each assignment's answer when the answers come back. See foundations.py for the pattern."""

from __future__ import annotations

import numpy as np

from tfm_common.expert_parallel import dispatch_plan
from tfm_common.moe import route

from .grading import MISSING, Exercise, Grader

__all__ = ["EXERCISES"]

DISPATCH_HINTS = {
    "tokens": "the send buffer holds the KEPT assignments sorted by expert with a STABLE sort, each expert's in the "
    "order the router serves them: every token's first choice (in token order), then every second choice "
    "(flatten experts.T, not experts)",
    "slots": "slots[i] is the choice (0 .. k-1) of the assignment in row i: the same order as tokens",
    "inverse": "inverse[n, j] is the ROW of the send buffer that holds assignment (n, j) (-1 if it was dropped): "
    "the inverse of the sorting permutation, not the permutation itself",
    "send_counts": "rows per PROCESS: expert e lives on process e // (n_experts // world) (contiguous blocks)",
}

# (label, N tokens, n_experts, top_k, world, capacity: None or a factor of N k / E)
DISPATCH_CASES = [
    ("N = 10, 4 experts, top-2, 2 processes", 10, 4, 2, 2, None),
    ("N = 64, 4 experts, top-2, 2 processes (many ties within an expert)", 64, 4, 2, 2, None),
    ("N = 12, 8 experts, top-1, 4 processes", 12, 8, 1, 4, None),
    ("N = 1 (one token), 4 experts, top-2, 2 processes", 1, 4, 2, 2, None),
    ("N = 16, 4 experts, top-2, 2 processes, capacity 0.75 N k / E (some dropped)", 16, 4, 2, 2, 0.75),
]


def _routing(rng, n, e, k, capacity):
    probs = rng.dirichlet(np.full(e, 0.5), size=n)  # peaked: some experts popular
    cap = None if capacity is None else int(capacity * n * k / e)
    r = route(probs, k, cap)
    return r.experts, r.keep


def grade_expert_dispatch(g: Grader) -> None:
    rng = np.random.default_rng(2004)
    for label, n, e, k, world, capacity in DISPATCH_CASES:
        experts, keep = _routing(rng, n, e, k, capacity)
        got = g.run(label, experts, keep, e, world, hint=DISPATCH_HINTS["tokens"])
        if got is MISSING:
            continue
        if not isinstance(got, tuple | list) or len(got) != 4:
            g.record(label, False, "expected a tuple (tokens, slots, inverse, send_counts)")
            continue
        plan = dispatch_plan(experts, keep, e, world)
        expected = {
            "tokens": plan.tokens,
            "slots": plan.slots,
            "inverse": plan.inverse,
            "send_counts": plan.send_counts,
        }
        for (name, want), have in zip(expected.items(), got, strict=True):
            g.compare(f"{label}: {name}", have, want, tol=0.0, hint=DISPATCH_HINTS[name])
    experts, keep = _routing(rng, 6, 6, 2, None)
    g.refuses(
        "6 experts over 4 processes",
        experts,
        keep,
        6,
        4,
        expected="says n_experts must be divisible by world (each process holds as many experts)",
    )


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "expert_dispatch",
        "20d_expert_parallel",
        "expert_dispatch(experts, keep, n_experts, world) -> (tokens, slots, inverse, send_counts): experts (N, k) "
        "int, keep (N, k) bool; tokens and slots (R,) for the R kept assignments in send order, inverse (N, k) "
        "(-1 where dropped), send_counts (world,)",
        grade_expert_dispatch,
    ),
)
