"""tfm_common.baselines: the majority class, bag-of-bytes and byte n-gram logistic regressions run, learn what they
can see and are deterministic; accuracy with its Wilson interval; bad input refused."""

import numpy as np
import pytest

from tfm_common.baselines import Accuracy, accuracy, bag_of_bytes, bag_of_ngrams, byte_counts, majority_class
from tfm_common.metrics import wilson_interval
from tfm_common.snippets import stdlib_snippets

# two classes a bag of bytes tells apart (digits against letters), and one only the order of bytes tells apart
DIGITS = [bytes(str(n * 7919 % 10**6), "ascii") + b" x" for n in range(40)]
LETTERS = [bytes("".join(chr(97 + (n * k) % 26) for k in range(6)), "ascii") for n in range(1, 41)]


def test_majority_class_and_accuracy():
    assert majority_class(np.array([2, 0, 2, 1, 0])) == 0  # a tie: the smallest label
    assert majority_class(np.array([1, 1, 0])) == 1
    acc = accuracy(np.array([1, 1, 0, 2]), np.array([1, 0, 0, 2]))
    assert acc == Accuracy(3, 4) and acc.value == 0.75 and acc.interval == wilson_interval(3, 4)
    assert str(acc) == "75.0% [30.1%, 95.4%]"


def test_bag_of_bytes_learns_which_bytes_a_text_uses():
    texts, labels = DIGITS + LETTERS, np.array([0] * 40 + [1] * 40)
    model = bag_of_bytes(texts, labels)
    assert accuracy(model.predict([b"12345 x", b"qwerty"]), np.array([0, 1])).correct == 2
    assert byte_counts([b"aab"])[0, ord("a")] == 2 and byte_counts([b"aab"]).shape == (1, 256)


def test_a_bag_of_bytes_cannot_see_order_and_ngrams_can():
    """Two classes with the same bytes in another order: "ab" repeated against "ba" repeated (the same counts up to
    the ends): bytes alone score near chance, byte pairs do not."""
    ab = [b"ab" * (n % 5 + 3) for n in range(40)]
    ba = [b"b" + b"ab" * (n % 5 + 2) + b"a" for n in range(40)]  # the same counts, other pairs
    texts, labels = ab + ba, np.array([0] * 40 + [1] * 40)
    assert accuracy(bag_of_bytes(texts, labels).predict(texts), labels).value <= 0.6
    assert accuracy(bag_of_ngrams(texts, labels, ngram=(2, 2)).predict(texts), labels).value == 1.0


def test_baselines_run_on_the_snippets_and_are_deterministic():
    train, val = stdlib_snippets("train").sample(600, seed=0), stdlib_snippets("val").sample(300, seed=0)
    a = bag_of_bytes(train.texts, train.labels).predict(val.texts)
    b = bag_of_bytes(train.texts, train.labels).predict(val.texts)
    assert np.array_equal(a, b)
    chance = accuracy(np.full(len(val), majority_class(train.labels)), val.labels)
    assert accuracy(a, val.labels).value > chance.value + 0.05  # better than the majority class


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: accuracy([1, 2], [1]), ValueError, "two non-empty 1-D arrays of one length"),
        (lambda: majority_class([]), ValueError, "non-empty 1-D array"),
        (lambda: bag_of_bytes(["text"], [0]), TypeError, "texts expected a sequence of bytes"),
        (lambda: bag_of_bytes([b"a", b"b"], [0]), ValueError, "labels expected 2 integer class ids"),
        (lambda: bag_of_bytes([b"a", b"b"], [0, 0]), ValueError, "nothing to learn"),
        (lambda: bag_of_bytes([b"a", b"b"], [0, 1], C=0), ValueError, "C must be > 0"),
        (lambda: bag_of_ngrams([b"a", b"b"], [0, 1], ngram=(3, 1)), ValueError, "low <= high"),
        (lambda: bag_of_ngrams([b"a", b"b"], [0, 1], ngram=(0, 1)), ValueError, r"ngram\[0\] must be"),
        (lambda: byte_counts(b"abc"), TypeError, "sequence of bytes"),
    ],
)
def test_refusals(call, error, match):
    with pytest.raises(error, match=match):
        call()
