"""Baselines for a text classification task, and one way to score every classifier (chapter 22b).

A fine-tuned Transformer's accuracy means little alone: it is read against what needs no Transformer at all.

- `majority_class(train_labels)`: always predict the most frequent training class (ties: the smallest label). Its
  test accuracy is the share of that class in the test split: what a model that learned nothing scores.
- `bag_of_bytes(train_texts, train_labels)`: logistic regression (scikit-learn's, multinomial, L2) on how often
  each of the 256 byte values occurs in a text, each count standardized over the training texts. It sees which
  characters a snippet uses (quotes, brackets, indentation, capitals), not their order.
- `bag_of_ngrams(train_texts, train_labels, ngram=(1, 3))`: the same regression on TF-IDF weighted counts of the
  byte n-grams (1 to 3 bytes) that occur in at least two training texts: a strong classical baseline, as it sees
  short words and pieces of identifiers (`self._loop`, `msg[`, `Element`).
- `Accuracy` / `accuracy(predicted, labels)`: correct out of n, with the 95% Wilson interval
  (`metrics.wilson_interval`), printed as "62.3% [60.6%, 64.0%]".

Every fit is deterministic (lbfgs, no random state involved); texts are bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from .metrics import wilson_interval
from .validate import check_real, check_size

__all__ = ["Accuracy", "accuracy", "majority_class", "byte_counts", "bag_of_bytes", "bag_of_ngrams"]


class Accuracy(NamedTuple):
    correct: int
    n: int

    @property
    def value(self) -> float:
        return self.correct / self.n

    @property
    def interval(self) -> tuple[float, float]:
        """The 95% Wilson interval of the accuracy."""
        return wilson_interval(self.correct, self.n)

    def __str__(self) -> str:
        low, high = self.interval
        return f"{self.value:.1%} [{low:.1%}, {high:.1%}]"


def accuracy(predicted, labels) -> Accuracy:
    """How many of `predicted` (N,) equal `labels` (N,), out of N (both integer class ids)."""
    predicted, labels = np.asarray(predicted), np.asarray(labels)
    if predicted.ndim != 1 or predicted.shape != labels.shape or not predicted.size:
        raise ValueError(f"accuracy: predicted and labels expected two non-empty 1-D arrays of one length, got shapes "
                         f"{predicted.shape} and {labels.shape}")  # fmt: skip
    return Accuracy(int((predicted == labels).sum()), int(labels.size))


def _check_texts(owner: str, texts, labels) -> np.ndarray:
    if isinstance(texts, (str, bytes)) or not all(isinstance(t, bytes) for t in texts):
        raise TypeError(f"{owner}: texts expected a sequence of bytes (one snippet each)")
    labels = np.asarray(labels)
    if labels.shape != (len(texts),) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{owner}: labels expected {len(texts)} integer class ids (one per text), got "
                         f"{labels.dtype} {labels.shape}")  # fmt: skip
    if len(np.unique(labels)) < 2:
        raise ValueError(f"{owner}: the training labels hold {len(np.unique(labels))} class(es): nothing to learn")
    return labels


def majority_class(train_labels) -> int:
    """The most frequent label of the training set (the smallest one on a tie)."""
    labels = np.asarray(train_labels)
    if labels.ndim != 1 or not labels.size or not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise ValueError(f"majority_class: train_labels expected a non-empty 1-D array of class ids >= 0, got "
                         f"{labels.dtype} {labels.shape}")  # fmt: skip
    return int(np.bincount(labels).argmax())


def byte_counts(texts: Sequence[bytes]) -> np.ndarray:
    """(N, 256) float64: how often each byte value occurs in each text."""
    if isinstance(texts, (str, bytes)) or not all(isinstance(t, bytes) for t in texts):
        raise TypeError("byte_counts: texts expected a sequence of bytes")
    return np.stack([np.bincount(np.frombuffer(t, np.uint8), minlength=256) for t in texts]).astype(np.float64)


def bag_of_bytes(train_texts: Sequence[bytes], train_labels, *, C: float = 0.1, max_iter: int = 2000) -> Pipeline:
    """A fitted scikit-learn pipeline: byte counts -> standardized -> logistic regression (inverse regularization
    C). `.predict(texts)` gives class ids."""
    labels = _check_texts("bag_of_bytes", train_texts, train_labels)
    C = _check_C("bag_of_bytes", C)
    counts = FunctionTransformer(byte_counts)
    model = make_pipeline(counts, StandardScaler(), LogisticRegression(C=C, max_iter=check_size(
        "bag_of_bytes", "max_iter", max_iter)))  # fmt: skip
    return model.fit(list(train_texts), labels)


def _check_C(owner: str, C) -> float:
    C = check_real(owner, "C", C, low=0.0)
    if C == 0:
        raise ValueError(f"{owner}: C must be > 0 (the inverse of the regularization strength), got {C}")
    return C


def _latin1(texts: Sequence[bytes]) -> list[str]:
    return [t.decode("latin-1") for t in texts]  # one character per byte: n-grams of bytes


def bag_of_ngrams(train_texts: Sequence[bytes], train_labels, *, ngram: tuple[int, int] = (1, 3), C: float = 10.0,
                  max_iter: int = 2000) -> Pipeline:  # fmt: skip
    """A fitted pipeline: TF-IDF of byte n-grams (lengths ngram[0] .. ngram[1], sublinear counts, in at least two
    training texts) -> logistic regression. `.predict(texts)` gives class ids."""
    labels = _check_texts("bag_of_ngrams", train_texts, train_labels)
    low, high = (check_size("bag_of_ngrams", f"ngram[{i}]", n) for i, n in enumerate(ngram))
    if low > high:
        raise ValueError(f"bag_of_ngrams: ngram must be (low, high) with low <= high, got {tuple(ngram)}")
    C = _check_C("bag_of_ngrams", C)
    tfidf = TfidfVectorizer(analyzer="char", ngram_range=(low, high), sublinear_tf=True, min_df=2, lowercase=False)
    model = make_pipeline(FunctionTransformer(_latin1), tfidf, LogisticRegression(C=C, max_iter=check_size(
        "bag_of_ngrams", "max_iter", max_iter)))  # fmt: skip
    return model.fit(list(train_texts), labels)
