"""Graded exercises of chapter 22b (fine-tuning): see foundations.py for the pattern.

`pool_last_forward(h, tokens, pad_id)`: the hidden state of each row's last token that is not padding, what
`SequenceClassifier(pool="last")` hands its head; `pool_last_backward(d_pooled, h, tokens, pad_id)`: its gradient
with respect to h. Both are graded against the library (`tfm_numpy.classify.last_positions`, `pool_at`,
`pool_at_backward`) and central differences.
"""

from __future__ import annotations

import numpy as np

from ..classify import last_positions, pool_at, pool_at_backward
from .grading import Exercise, Grader, central_differences

__all__ = ["EXERCISES"]

POOL_HINT = (
    "read each row at ITS last token that is not pad_id (the largest t with tokens[b, t] != pad_id), not at the "
    "array's last column T - 1, which holds a pad in a padded row"
)
POOL_BACKWARD_HINT = (
    "dh is zero everywhere except at (b, t_b), each row's last non-pad position, where it is d_pooled[b]: only that "
    "state was read"
)
PAD = 0


def _tokens(rng, lengths, T, vocab=20):
    """Right-padded token rows: row b has lengths[b] tokens in 1 .. vocab - 1, then PAD."""
    tokens = rng.integers(1, vocab, (len(lengths), T))
    for b, n in enumerate(lengths):
        tokens[b, n:] = PAD
    return tokens


def _cases(rng):
    """(label, h, tokens, pad_id): padded and full rows, T = 1, leading rows of one length, another pad id."""
    d = 5
    cases = []
    for label, lengths, T in (
        ("rows of 6, 3 and 1 tokens, padded to T = 6", (6, 3, 1), 6),
        ("no padding: every row full (T = 4)", (4, 4), 4),
        ("T = 1", (1, 1, 1), 1),
        ("one row, 2 tokens and 5 pads", (2,), 7),
    ):
        tokens = _tokens(rng, lengths, T)
        cases.append((label, rng.standard_normal((len(lengths), T, d)), tokens, PAD))
    tokens = _tokens(rng, (3, 5), 5)
    tokens = np.where(tokens == PAD, 1, np.where(tokens == 1, 0, tokens))  # ids 0 and 1 swapped: padding is 1
    cases.append(("pad_id = 1 (not 0), and 0 is an ordinary token here", rng.standard_normal((2, 5, d)), tokens, 1))
    return cases


def _library_forward(h, tokens, pad_id):
    return pool_at(h, last_positions(tokens, pad_id))


def grade_pool_last_forward(g: Grader) -> None:
    rng = np.random.default_rng(2201)
    for label, h, tokens, pad_id in _cases(rng):
        got = g.run(label, h, tokens, pad_id, hint=POOL_HINT)
        g.compare(label, got, _library_forward(h, tokens, pad_id), tol=1e-12, hint=POOL_HINT)
    h, tokens = rng.standard_normal((3, 6, 4)).astype(np.float32), _tokens(rng, (2, 6, 4), 6)
    got = g.run("float32", h, tokens, PAD)
    g.compare("float32", got, _library_forward(h, tokens, PAD), tol=1e-7, dtype=np.float32)
    h, tokens = rng.standard_normal((2, 4, 3)), _tokens(rng, (3, 0), 4)
    g.refuses("a row that is all padding", h, tokens, PAD, expected="says which row has no token that is not pad_id")


def grade_pool_last_backward(g: Grader) -> None:
    rng = np.random.default_rng(2202)
    for label, h, tokens, pad_id in _cases(rng):
        d_pooled = rng.standard_normal((h.shape[0], h.shape[2]))
        library = {"dh": pool_at_backward(d_pooled, h.shape, last_positions(tokens, pad_id))}
        numeric = central_differences(lambda h, t=tokens, p=pad_id: _library_forward(h, t, p), {"h": h}, d_pooled)
        got = g.run(label, d_pooled, h, tokens, pad_id, hint=POOL_BACKWARD_HINT)
        g.backward(label, got, library, {"dh": numeric["h"]}, hints={"dh": POOL_BACKWARD_HINT})
    h, tokens = rng.standard_normal((3, 6, 4)).astype(np.float32), _tokens(rng, (2, 6, 4), 6)
    d_pooled = rng.standard_normal((3, 4)).astype(np.float32)
    got = g.run("float32", d_pooled, h, tokens, PAD)
    expected = {"dh": pool_at_backward(d_pooled, h.shape, last_positions(tokens, PAD))}
    g.gradients("float32", got, expected, tol=1e-7, dtype=np.float32, hints={"dh": POOL_BACKWARD_HINT})


EXERCISES = (
    Exercise(
        "pool_last_forward",
        "22b_fine_tuning",
        "pool_last_forward(h, tokens, pad_id) -> pooled: h (B, T, d), tokens (B, T) int, right-padded with pad_id; "
        "pooled (B, d), each row's hidden state at its last token that is not pad_id",
        grade_pool_last_forward,
    ),
    Exercise(
        "pool_last_backward",
        "22b_fine_tuning",
        "pool_last_backward(d_pooled, h, tokens, pad_id) -> dh: d_pooled (B, d), h (B, T, d), tokens (B, T); "
        "dh (B, T, d)",
        grade_pool_last_backward,
    ),
)
