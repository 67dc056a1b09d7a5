"""Wrong attempts at chapter 20d's exercise (`expert_dispatch`): each fails with a message that points at the
mistake; the chapter's own solution passes."""

from __future__ import annotations

import numpy as np
from helpers_exercises import fails, solution

from tfm_numpy.exercises import check


def _dispatch(experts, keep, n_experts, world, *, slot_major=True, stable=True, invert=True, blocks=True,
              use_keep=True, refuse=True):  # fmt: skip
    """The bookkeeping with one of its parts switchable: each switch is a mistake people make."""
    if refuse and n_experts % world:
        raise ValueError(f"n_experts must be divisible by world, got {n_experts} and {world}")
    N, k = experts.shape
    order = (lambda a: a.T.reshape(-1)) if slot_major else (lambda a: a.reshape(-1))
    flat, kept = order(experts), order(keep if use_keep else np.ones_like(keep))
    rows = np.flatnonzero(kept)
    rows = rows[np.argsort(flat[rows], kind="stable" if stable else "quicksort")]
    inverse = np.full(N * k, -1)
    inverse[rows] = np.arange(rows.size)
    if not invert:
        inverse[: rows.size] = rows
    inverse = inverse.reshape(k, N).T if slot_major else inverse.reshape(N, k)
    tokens, slots = (rows % N, rows // N) if slot_major else (rows // k, rows % k)
    n_local = max(n_experts // world, 1)
    owner = flat[rows] // n_local if blocks else flat[rows] % world
    return tokens, slots, inverse, np.bincount(owner, minlength=world)


def test_reference_attempt_and_chapter_solution_pass():
    assert check("expert_dispatch", _dispatch, quiet=True).passed
    assert check("expert_dispatch", solution("expert_dispatch"), quiet=True).passed


def test_token_major_order():
    """Token by token (experts.reshape(-1)): a valid order, but not the router's service order."""
    result = fails("expert_dispatch", lambda *a: _dispatch(*a, slot_major=False), "top-2, 2 processes: tokens",
                   "every token's first choice")  # fmt: skip
    assert not result.failed("top-1, 4 processes")  # with one choice per token both orders agree


def test_unstable_sort():
    fails("expert_dispatch", lambda *a: _dispatch(*a, stable=False), "many ties within an expert): tokens",
          "STABLE sort")  # fmt: skip


def test_permutation_instead_of_its_inverse():
    fails("expert_dispatch", lambda *a: _dispatch(*a, invert=False), ": inverse", "not the permutation itself")


def test_round_robin_owners():
    fails("expert_dispatch", lambda *a: _dispatch(*a, blocks=False), ": send_counts", "contiguous blocks")


def test_dropped_assignments_sent():
    result = fails("expert_dispatch", lambda *a: _dispatch(*a, use_keep=False), "(some dropped): tokens", "KEPT")
    assert not result.failed("N = 10, 4 experts")  # without a capacity nothing is dropped


def test_no_refusal():
    fails("expert_dispatch", lambda *a: _dispatch(*a, refuse=False), "6 experts over 4 processes",
          "n_experts must be divisible by world")  # fmt: skip
