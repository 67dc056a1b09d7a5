"""Where the units-before-tens reordering of German number words sits, character by character (NumPy only).

German says 54 as "vierundfünfzig", four-and-fifty: the word of the units digit comes *before* the word of the
tens digit, the opposite of the digits' order. A number below a million has up to two such pairs: one in its
last two digits (654321 -> ...dreihundert|ein|und|zwanzig) and one in its thousands (654321 ->
sechshundert|vier|und|fünfzig|tausend...). `reorder_spans` finds them in a number's words, with the source
position of the digit that each word spells, so that a cross-attention map can be checked against them: while
the decoder writes "vier", does it look at the digit 4 or at the digit 5?

A pair exists when its tens digit is 2..9 and its units digit is not 0 (21..99 without 30, 40, ...): 10..19 are
single words ("vierzehn"), and 20, 30, ... have no units word.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .data import number_to_words
from .plotting import plot_attention

__all__ = ["Span", "reorder_spans", "span_attention", "reorder_attention", "plot_reordering", "read_number"]


class Span(NamedTuple):
    """The characters `words[start:end]` spell the digit at source position `digit`.

    group  "units" (the last two digits) or "thousands" (the two digits before the last three)
    role   "unit" (the units word, written first) or "tens" (the tens word, written after "und")
    digit  the position of that digit in the source string of digits (0 = the leftmost digit)
    """

    group: str
    role: str
    start: int
    end: int
    digit: int


def _unit_word(u: int) -> str:
    return "ein" if u == 1 else number_to_words(u)  # "eins" alone, "ein" in "einundzwanzig"


def _pair_spans(group: str, pair: int, end: int, ones_digit: int) -> list[Span]:
    # The spans of "<unit>und<tens>" ending at character `end`; ones_digit: the source position of the units digit
    unit, tens = _unit_word(pair % 10), number_to_words(10 * (pair // 10))
    start_tens = end - len(tens)
    start_unit = start_tens - len("und") - len(unit)
    return [
        Span(group, "unit", start_unit, start_unit + len(unit), ones_digit),
        Span(group, "tens", start_tens, end, ones_digit - 1),
    ]


def _has_pair(pair: int) -> bool:
    return pair // 10 >= 2 and pair % 10 != 0


def reorder_spans(number: int, words: str | None = None) -> list[Span]:
    """The reordered (units, tens) pairs of `number` (0 <= number < 1,000,000) in its German words.

    words: the German words of `number` (computed with `number_to_words` if None); a ValueError if they are not
    its words. Returns 0, 2 or 4 spans, thousands first, each pair as (unit, tens).
    """
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        raise TypeError(f"reorder_spans: number expected an int, got {type(number).__name__}")
    number = int(number)
    if not 0 <= number < 1_000_000:
        raise ValueError(f"reorder_spans: number must be in [0, 999999], got {number}")
    expected = number_to_words(number)
    if words is None:
        words = expected
    elif words != expected:
        raise ValueError(f"reorder_spans: {words!r} are not the German words of {number} ({expected!r})")
    n_digits = len(str(number))
    spans = []
    thousands = number // 1000
    if _has_pair(thousands % 100):
        end = words.index("tausend")  # the thousands' words end right before "tausend"
        spans += _pair_spans("thousands", thousands % 100, end, n_digits - 4)
    if _has_pair(number % 100):
        spans += _pair_spans("units", number % 100, len(words), n_digits - 1)
    for s in spans:  # each span must spell its digit: a check of the layout against num2words' spelling
        digit = int(str(number)[s.digit])
        want = _unit_word(digit) if s.role == "unit" else number_to_words(10 * digit)
        if words[s.start : s.end] != want:
            raise AssertionError(f"reorder_spans: {number}: {words[s.start : s.end]!r} at {s} is not {want!r}")
    return spans


def span_attention(weights: np.ndarray, span: Span) -> tuple[float, float]:
    """(mean weight on the span's own digit, mean weight on the other digit of its pair).

    weights: (T, S) cross-attention of one output (one layer, one head or the mean of the heads), teacher-forced
    on the reference: row i is the query that predicts character i of the words (it reads character i - 1).
    """
    weights = np.asarray(weights)
    if weights.ndim != 2 or weights.shape[0] < span.end or weights.shape[1] <= max(span.digit, 1):
        raise ValueError(f"span_attention: weights of shape {weights.shape} do not cover {span}")
    partner = span.digit - 1 if span.role == "unit" else span.digit + 1
    rows = weights[span.start : span.end]
    return float(rows[:, span.digit].mean()), float(rows[:, partner].mean())


def reorder_attention(weights, pairs) -> dict[tuple[int, str], np.ndarray]:
    """Cross-attention on the reordered digits, for every (unit, tens) span of every pair, layer and head.

    weights: one (B, H, T, S) array per decoder layer (e.g. `model.decoder.attention_weights("cross")` after a
    teacher-forced forward on the pairs' references, as NumPy arrays); pairs: the B (digits, words) pairs.
    Returns {(layer, role): (n_spans, H, 2)}, role "unit" or "tens", the last axis (own digit, other digit) as
    in `span_attention`. The mean over heads equals `span_attention` of the heads' mean map.
    """
    weights = [np.asarray(w) for w in weights]
    out: dict[tuple[int, str], list] = {(layer, role): [] for layer in range(len(weights)) for role in ("unit", "tens")}
    for layer, w in enumerate(weights):
        if w.ndim != 4 or w.shape[0] != len(pairs):
            raise ValueError(f"reorder_attention: layer {layer}: expected (B={len(pairs)}, H, T, S), got {w.shape}")
        for b, (src, words) in enumerate(pairs):
            for span in reorder_spans(int(src), words):
                out[layer, span.role].append([span_attention(w[b, h], span) for h in range(w.shape[1])])
    return {k: np.array(v, dtype=np.float64).reshape(-1, weights[k[0]].shape[1], 2) for k, v in out.items()}


def plot_reordering(maps, number: str, words: str, titles=None, cell_size: float = 0.22) -> Figure:
    """Cross-attention maps of one number, one panel per map side by side, drawn by `plot_attention`.

    maps: (L, T, S), e.g. the mean of the heads for each of L decoder layers, teacher-forced on `words`:
    T = len(words) + 1 queries (the last one writes <eos>), S = len(number) + 1 keys (the digits and <eos>).
    As every attention map of the book: the written characters (queries) are the rows, the source digits (keys)
    the columns. The reordered spans of `reorder_spans` are outlined at their own digit, so a model that
    reorders puts its weight inside the boxes. Returns the Figure (matplotlib's object API).
    """
    maps = np.asarray(maps)
    T, S = len(words) + 1, len(number) + 1
    if maps.ndim != 3 or maps.shape[1:] != (T, S):
        raise ValueError(f"plot_reordering: expected maps of shape (L, {T}, {S}) for {number!r}, got {maps.shape}")
    if titles is not None and len(titles) != len(maps):
        raise ValueError(f"plot_reordering: expected {len(maps)} titles, got {len(titles)}")
    fig = plot_attention(
        maps, x_labels=[*number, "<eos>"], y_labels=[*words, "<eos>"], ncols=len(maps), cell_size=cell_size
    )
    fig.set_figwidth(len(maps) * (1.6 + 0.45 * S))  # wider columns than rows: room for the `<eos>` tick label
    spans = reorder_spans(int(number), words)
    for i, ax in enumerate(fig.axes[: len(maps)]):
        ax.set_xlabel("source (keys)")
        ax.set_ylabel("output (queries)")
        ax.tick_params(axis="x", labelrotation=0)
        ax.set_title(titles[i] if titles is not None else "")
        for span in spans:  # a box over the span's characters (rows), at its own digit (column)
            corner = (span.digit - 0.5, span.start - 0.5)
            ax.add_patch(Rectangle(corner, 1.0, span.end - span.start, fill=False, edgecolor="red", lw=2))
    return fig


@functools.cache
def _below_thousand() -> dict[str, int]:
    return {number_to_words(n): n for n in range(1000)}  # "null", "eins", ..., "neunhundertneunundneunzig"


def read_number(words: str) -> int | None:
    """The number in [0, 999999] that `words` spell in German (as `number_to_words` writes it), or None.

    For reading a model's wrong outputs: "vierzigtausenddreizehn" -> 40013 (a well-formed number, not the right
    one), "achthunderttausendsiebzigtaundsiebzig" -> None (no number is spelled so).
    """
    if not isinstance(words, str):
        raise TypeError(f"read_number: words expected a str, got {type(words).__name__}")
    table = _below_thousand()
    head, sep, tail = words.partition("tausend")
    if not sep:
        return table.get(words)
    thousands = 1 if head == "ein" else table.get(head)  # 1000 is "eintausend"; "einstausend" is no number
    rest = table.get(tail) if tail else 0
    if not thousands or head == "eins" or rest is None or tail == "null":
        return None
    return 1000 * thousands + rest
