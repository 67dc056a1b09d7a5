"""Metrics on decoded outputs, shared by both tracks: exact-sequence accuracy and corpus BLEU (with sacrebleu).

Both compare what the model *generated* (greedy or beam search, reading its own predictions) with the
references, never teacher-forced predictions: a model can predict every next token of a reference well and
still go astray once it reads its own mistakes.

BLEU (Papineni et al., 2002) is the geometric mean of the 1- to 4-gram precisions of the hypotheses against the
references, times a brevity penalty, on a 0-100 scale. `corpus_bleu` is sacrebleu's (Post, 2018), which fixes
the tokenization so that scores are comparable: the n-grams are counted on tokens made by `tokenize`,

    "13a"   (sacrebleu's default, the WMT standard) words: splits at spaces and around punctuation;
    "char"  characters (spaces dropped): for character-level outputs such as German number words, where a
            whole output is often one word ("einundzwanzig");
    "none"  the strings split at spaces as they are (for outputs that are already tokenized).

Counts are summed over the whole corpus before the precisions are taken, so a corpus whose outputs all have
fewer than four tokens has no 4-grams at all and scores 0 with any words, even when every output is right
(e.g. "twenty one" against "twenty one" under "13a"): score such data with tokenize="char", or use exact match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .validate import check_int, check_real

__all__ = ["exact_match", "corpus_bleu", "wilson_interval"]


def exact_match(hyps: Sequence, refs: Sequence) -> float:
    """The fraction of hypotheses equal to their reference, in [0, 1] (exact-sequence accuracy).

    Items are strings (decoded texts) or token sequences (lists, tuples, 1-D arrays or tensors of ids, padding
    already stripped): a sequence counts only if every token is right and the length is the same.
    """
    hyps, refs = _check_pairs("exact_match", hyps, refs)
    return sum(_as_key(h) == _as_key(r) for h, r in zip(hyps, refs, strict=True)) / len(hyps)


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a") -> float:
    """Corpus BLEU on a 0-100 scale, `sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize).score`, with one
    reference per hypothesis. See the module docstring for `tokenize` ("13a" words, "char" characters)."""
    import sacrebleu  # here: the libraries need only NumPy; sacrebleu comes with the book's extras

    hyps, refs = _check_pairs("corpus_bleu", hyps, refs)
    for arg, texts in (("hyps", hyps), ("refs", refs)):
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"corpus_bleu: {arg} must be strings (decoded texts), got {type(texts[bad]).__name__} "
                            f"at index {bad}")  # fmt: skip
    return float(sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize).score)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (Wilson, 1927) for a proportion: `successes` right out of `n` -> (low, high).

    Unlike p +- z sqrt(p (1 - p) / n), it stays inside [0, 1] and is not empty at 0 or n successes: with p = k / n,

        centre = (p + z^2 / 2n) / (1 + z^2 / n),   half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2).

    z = 1.96 gives the 95% interval. Accuracy on a test set of n examples is such a proportion.
    """
    k, n = check_int("wilson_interval", "successes", successes), check_int("wilson_interval", "n", n)
    z = check_real("wilson_interval", "z", z, low=0.0)
    if z == 0:
        raise ValueError("wilson_interval: z must be > 0 (1.96 for 95%), got 0")
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval: need n >= 1 and 0 <= successes <= n, got successes={k}, n={n}")
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _check_pairs(name: str, hyps, refs) -> tuple[list, list]:
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError(f"{name}: hyps and refs must be sequences of outputs (one per example), not one string")
    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ValueError(f"{name}: hyps and refs must pair up, got {len(hyps)} hypotheses and {len(refs)} references")
    if not hyps:
        raise ValueError(f"{name}: no hypotheses (an empty corpus has no score)")
    return hyps, refs


def _as_key(x):
    """A comparable form: strings as they are, token sequences (lists, arrays, tensors) as tuples of ints."""
    if isinstance(x, str):
        return x
    if hasattr(x, "tolist"):  # numpy arrays and torch tensors
        x = x.tolist()
    return tuple(x)
