"""tfm_common.alignment: the spans of the reordered units and tens in German number words."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from tfm_common.alignment import (  # noqa: E402
    Span,
    plot_reordering,
    read_number,
    reorder_attention,
    reorder_spans,
    span_attention,
)
from tfm_common.data import number_to_words  # noqa: E402


def spelled(n):
    words = number_to_words(n)
    return [(s.group, s.role, words[s.start : s.end], str(n)[s.digit]) for s in reorder_spans(n)]


def test_both_pairs_of_a_six_digit_number():
    assert spelled(654321) == [
        ("thousands", "unit", "vier", "4"),
        ("thousands", "tens", "fünfzig", "5"),
        ("units", "unit", "ein", "1"),
        ("units", "tens", "zwanzig", "2"),
    ]


@pytest.mark.parametrize(
    "n, expected",
    [
        (21, [("units", "unit", "ein", "1"), ("units", "tens", "zwanzig", "2")]),
        (71000, [("thousands", "unit", "ein", "1"), ("thousands", "tens", "siebzig", "7")]),
        (1234, [("units", "unit", "vier", "4"), ("units", "tens", "dreißig", "3")]),
        (99, [("units", "unit", "neun", "9"), ("units", "tens", "neunzig", "9")]),
    ],
)
def test_one_pair(n, expected):
    assert spelled(n) == expected


@pytest.mark.parametrize("n", [0, 1, 9, 10, 15, 19, 20, 30, 100, 1000, 100000, 110, 119000, 990990, 13013])
def test_no_pair_without_units_and_tens_twenty_or_more(n):
    assert reorder_spans(n) == []


def test_every_span_spells_its_digit_on_many_numbers():
    # reorder_spans checks each span against num2words itself; here, the count of pairs is right as well
    for n in np.random.default_rng(0).choice(1_000_000, 3000, replace=False):
        n = int(n)
        pairs = sum(p // 10 >= 2 and p % 10 != 0 for p in (n % 100, (n // 1000) % 100))
        assert len(reorder_spans(n)) == 2 * pairs


def test_words_are_checked():
    assert reorder_spans(21, "einundzwanzig") == reorder_spans(21)
    with pytest.raises(ValueError, match="not the German words of 21"):
        reorder_spans(21, "zweiundzwanzig")
    with pytest.raises(ValueError, match=r"\[0, 999999\]"):
        reorder_spans(1_000_000)
    with pytest.raises(TypeError, match="expected an int"):
        reorder_spans("21")


def test_span_attention_reads_the_rows_of_the_span():
    # "einundzwanzig" from "21": rows 0-2 write "ein" (digit 1 at position 1), rows 6-12 "zwanzig" (digit 2 at 0)
    unit, tens = reorder_spans(21)
    w = np.zeros((14, 3))  # 13 characters + <eos>; source "2", "1", <eos>
    w[0:3, 1], w[0:3, 0] = 0.9, 0.1
    w[6:13, 0], w[6:13, 1] = 0.6, 0.3
    assert span_attention(w, unit) == pytest.approx((0.9, 0.1))
    assert span_attention(w, tens) == pytest.approx((0.6, 0.3))
    with pytest.raises(ValueError, match="do not cover"):
        span_attention(w[:5], tens)
    with pytest.raises(ValueError, match="do not cover"):
        span_attention(np.zeros(14), Span("units", "unit", 0, 3, 1))


def test_reorder_attention_collects_every_span_per_layer_and_head():
    pairs = [("21", "einundzwanzig"), ("15", "fünfzehn"), ("654321", number_to_words(654321))]
    g = np.random.default_rng(0)
    weights = [g.random((3, 2, 60, 7)) for _ in range(2)]  # 2 layers, 2 heads
    out = reorder_attention(weights, pairs)
    assert sorted(out) == [(0, "tens"), (0, "unit"), (1, "tens"), (1, "unit")]
    assert out[0, "unit"].shape == (3, 2, 2)  # one span in "21", none in "15", two in "654321"
    span = reorder_spans(654321)[2]  # the units pair's unit word, "ein"
    assert span.role == "unit"
    for h in range(2):
        assert tuple(out[1, "unit"][2, h]) == pytest.approx(span_attention(weights[1][2, h], span))
    head_mean = out[1, "unit"][2].mean(axis=0)
    assert tuple(head_mean) == pytest.approx(span_attention(weights[1][2].mean(axis=0), span))
    with pytest.raises(ValueError, match="expected"):
        reorder_attention([weights[0][:2]], pairs)


def test_plot_reordering_boxes_each_span_at_its_digit():
    words = number_to_words(654321)
    maps = np.random.default_rng(0).random((2, len(words) + 1, 7))
    fig = plot_reordering(maps, "654321", words, titles=["layer 0", "layer 1"])
    panels = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["layer 0", "layer 1"]
    for ax in panels:
        assert np.array_equal(ax.images[0].get_array(), maps[panels.index(ax)])  # queries (text) down, digits across
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("source (keys)", "output (queries)")
        boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
        spans = reorder_spans(654321)
        assert [(b.get_x() + 0.5, b.get_y() + 0.5, b.get_height()) for b in boxes] == [
            (s.digit, s.start, s.end - s.start) for s in spans
        ]
        assert [t.get_text() for t in ax.get_xticklabels()] == [*"654321", "<eos>"]
        assert [t.get_text() for t in ax.get_yticklabels()] == [*words, "<eos>"]
    with pytest.raises(ValueError, match=r"expected maps of shape \(L, 58, 7\)"):
        plot_reordering(maps[:, :-1], "654321", words)
    with pytest.raises(ValueError, match="expected 2 titles"):
        plot_reordering(maps, "654321", words, titles=["one"])


def test_read_number_inverts_number_to_words():
    edges = [0, 1, 11, 21, 100, 101, 999, 1000, 1001, 10000, 21021, 100000, 101101, 999999]
    sample = np.random.default_rng(1).choice(1_000_000, 2000, replace=False).tolist()
    for n in edges + sample:
        assert read_number(number_to_words(n)) == n


@pytest.mark.parametrize(
    "words",
    ["", "sec", "einstausend", "nulltausend", "tausend", "eintausendnull", "achthunderttausendsiebzigtaundsiebzig",
     "zweiundzwanzigtausendtausend", "einundzwanzig "],
)  # fmt: skip
def test_read_number_rejects_what_no_number_spells(words):
    assert read_number(words) is None


def test_read_number_reads_a_wrong_but_well_formed_output():
    assert read_number("vierzigtausenddreizehn") == 40013
    with pytest.raises(TypeError, match="expected a str"):
        read_number(40013)
