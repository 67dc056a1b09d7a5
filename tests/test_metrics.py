"""tfm_common.metrics: exact-sequence accuracy and corpus BLEU (sacrebleu) on known values, and bad input."""

import numpy as np
import pytest
import torch

from tfm_common.metrics import corpus_bleu, exact_match


def test_exact_match_known_values():
    refs = ["einundzwanzig", "zwei", "hundert", "elf"]
    assert exact_match(refs, list(refs)) == 1.0
    assert exact_match(["einundzwanzig", "zwei", "hundert", "zwölf"], refs) == 0.75
    assert exact_match(["zweiundzwanzig", "drei", "", "elf "], refs) == 0.0  # near misses count as misses
    assert exact_match(("a",), ["a"]) == 1.0  # any sequences of outputs


def test_exact_match_on_token_sequences():
    """Token ids as lists, arrays or tensors: every token and the length must agree."""
    refs = [[5, 6, 2], [7, 2]]
    assert exact_match([np.array([5, 6, 2]), torch.tensor([7, 2])], refs) == 1.0
    assert exact_match([[5, 6, 2], [7, 2, 0]], refs) == 0.5  # padding left on: a different sequence
    assert exact_match([[5, 6], [7, 2]], refs) == 0.5  # a prefix is not a match


def test_bleu_known_values():
    same = ["the cat sat on the mat", "twenty one thousand three hundred and five"]
    assert corpus_bleu(same, same) == pytest.approx(100.0)
    # one word of six wrong: n-gram precisions 5/6, 3/5, 2/4, 1/3, no brevity penalty (same lengths)
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert corpus_bleu(["the cat sat on a mat"], ["the cat sat on the mat"]) == pytest.approx(expected)
    assert corpus_bleu(["a b c d"], ["e f g h"]) == 0.0


def test_bleu_short_outputs_need_characters():
    """Counts are summed over the corpus: with fewer than four words per output there are no 4-grams, and word
    BLEU is 0 even for a perfect corpus; character BLEU scores it 100."""
    refs = ["einundzwanzig", "zwei", "dreihundertelf"]
    assert corpus_bleu(refs, refs) == 0.0
    assert corpus_bleu(refs, refs, tokenize="char") == pytest.approx(100.0)
    assert 0 < corpus_bleu(["einundzwanzig", "zwei", "dreihundertzwölf"], refs, tokenize="char") < 100


@pytest.mark.parametrize("fn", [exact_match, corpus_bleu])
def test_bad_input(fn):
    with pytest.raises(ValueError, match="2 hypotheses and 1 references"):
        fn(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no hypotheses"):
        fn([], [])
    with pytest.raises(TypeError, match="not one string"):
        fn("abc", "abc")


def test_bleu_needs_strings():
    with pytest.raises(TypeError, match="hyps must be strings .* got list at index 1"):
        corpus_bleu(["a b", ["c"]], ["a b", "c"])


def test_wilson_interval_known_values_and_refusals():
    from tfm_common.metrics import wilson_interval

    # 95% Wilson interval of 8/10 (closed form worked by hand: centre 0.7167, half 0.2266)
    low, high = wilson_interval(8, 10)
    assert abs(low - 0.4902) < 1e-4 and abs(high - 0.9433) < 1e-4
    # never empty and never outside [0, 1] at the ends
    low0, high0 = wilson_interval(0, 20)
    assert low0 == 0.0 and 0.15 < high0 < 0.17
    lown, highn = wilson_interval(20, 20)
    assert highn == 1.0 and 0.83 < lown < 0.85
    # narrows as n grows
    assert wilson_interval(800, 1000)[1] - wilson_interval(800, 1000)[0] < high - low
    for bad in [(11, 10), (-1, 10), (0, 0)]:
        with pytest.raises(ValueError, match="wilson_interval"):
            wilson_interval(*bad)
    with pytest.raises(TypeError, match="successes"):
        wilson_interval(8.0, 10)
    with pytest.raises(ValueError, match="z"):
        wilson_interval(8, 10, z=0)
