"""Images for the vision chapters, shared by both tracks: the digits data set, its fixed split and a confidence
interval for an accuracy (the vision models' constructor rules are in `tfm_common.config`).

The data: scikit-learn's `load_digits`, 1,797 real 8x8 handwritten digits (grey levels 0..16) that ship inside
the package (no download). `load_digits_split` makes one fixed stratified split into training, validation and
test sets: for each class separately, a seeded permutation puts the first `round(test_fraction * n_class)` of its
images in the test set, the next `round(val_fraction * n_class)` in the validation set and the rest in the
training set, so all three have the class proportions of the whole. The test set depends only on the seed and
`test_fraction` (a validation set is carved out of what would otherwise be training images). The validation set
is for choices (configurations, ablations, exercises); the test set reports the chosen model once. Pixels are
scaled to [0, 1] (divided by 16); images are `(B, 1, 8, 8)`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .validate import check_real, check_seed, check_size

__all__ = [
    "DigitsSplit",
    "load_digits_split",
    "upsample_nearest",
    "wilson_interval",
]


class DigitsSplit:
    """x_train (N, 1, 8, 8) float, y_train (N,) int64, x_val, y_val, x_test, y_test: the arrays of one fixed split
    (x_val has no rows when the split was made with val_fraction=0)."""

    def __init__(self, x_train, y_train, x_val, y_val, x_test, y_test, dtype):
        self.x_train, self.y_train = x_train.astype(dtype), y_train.astype(np.int64)
        self.x_val, self.y_val = x_val.astype(dtype), y_val.astype(np.int64)
        self.x_test, self.y_test = x_test.astype(dtype), y_test.astype(np.int64)

    def __repr__(self) -> str:
        return (f"DigitsSplit(train={len(self.y_train)}, val={len(self.y_val)}, test={len(self.y_test)}, "
                f"image={self.x_train.shape[1:]})")  # fmt: skip


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images (1797, 1, 8, 8) in [0, 1] and labels, read once per process (read-only copies)."""
    from sklearn.datasets import load_digits  # imported here: only the vision chapters need scikit-learn

    digits = load_digits()
    x = digits.images.astype(np.float64)[:, None] / 16.0
    y = digits.target.astype(np.int64)
    x.flags.writeable = y.flags.writeable = False
    return x, y


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.25, val_fraction: float = 0.0, dtype=np.float32
) -> DigitsSplit:
    """The digits in one stratified split (see the module docstring); the same seed gives the same split.

    Both fractions are of the whole data set: test_fraction in (0, 1), val_fraction in [0, 1), their sum below 1.
    """
    seed = check_seed("load_digits_split", seed)
    test_fraction = check_real("load_digits_split", "test_fraction", test_fraction, 0.0, 1.0)
    val_fraction = check_real("load_digits_split", "val_fraction", val_fraction, 0.0, 1.0)
    if not 0 < test_fraction < 1:
        raise ValueError(f"load_digits_split: test_fraction must be in (0, 1), got {test_fraction!r}")
    if not 0 <= val_fraction < 1 - test_fraction:
        raise ValueError(f"load_digits_split: val_fraction must be in [0, 1 - test_fraction) = [0, "
                         f"{1 - test_fraction:g}), got {val_fraction!r}")  # fmt: skip
    x, y = _digits()
    rng = np.random.default_rng(seed)
    part = np.zeros(len(y), dtype=np.int8)  # 0 training, 1 validation, 2 test
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))  # this class's images in a seeded order
        n_test, n_val = round(test_fraction * len(idx)), round(val_fraction * len(idx))
        part[idx[:n_test]] = 2
        part[idx[n_test : n_test + n_val]] = 1
    train, val, test = (part == 0), (part == 1), (part == 2)
    return DigitsSplit(x[train], y[train], x[val], y[val], x[test], y[test], dtype)


def upsample_nearest(images: np.ndarray, factor: int) -> np.ndarray:
    """(B, C, H, W) -> (B, C, factor H, factor W), every pixel repeated in a factor x factor block."""
    factor = check_size("upsample_nearest", "factor", factor)
    return images.repeat(factor, axis=-2).repeat(factor, axis=-1)


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a proportion correct / n (z = 1.96: 95%); unlike the normal approximation
    p +- z sqrt(p (1 - p) / n) it stays inside [0, 1] and does not collapse to a point at p = 1."""
    n = check_size("wilson_interval", "n", n)
    correct = check_size("wilson_interval", "correct", correct, minimum=0)
    if correct > n:
        raise ValueError(f"wilson_interval: correct must be <= n={n}, got {correct}")
    p, z2 = correct / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return center - half, center + half
