"""Graded exercises of chapter 22c (LoRA): the adapted layer's backward, and merging the door back into one weight.

Expected values come from the library: `tfm_numpy.LoRALinear` holding the reader's arrays (its hand-written backward,
witnessed by central differences of its forward) and its `merge()`.
"""

from __future__ import annotations

import numpy as np

from ..layers import Linear
from ..lora import LoRALinear
from .grading import Exercise, Grader, central_differences

__all__ = ["EXERCISES"]


def _lora(W: np.ndarray, b: np.ndarray, A: np.ndarray, B: np.ndarray, alpha: float) -> LoRALinear:
    """The library's LoRALinear holding base weight W (out, in), bias b, A (rank, in), B (out, rank)."""
    base = Linear(W.shape[1], W.shape[0], dtype=W.dtype)
    base.weight.data[...], base.bias.data[...] = W, b
    layer = LoRALinear(base, A.shape[0], alpha)
    layer.lora_A.data[...], layer.lora_B.data[...] = A, B
    return layer


def _inputs(rng, shape, d_out, rank, dtype=np.float64):
    d_in = shape[-1]
    x = rng.standard_normal(shape)
    W, b = rng.standard_normal((d_out, d_in)), rng.standard_normal(d_out)
    A, B = rng.standard_normal((rank, d_in)), rng.standard_normal((d_out, rank))  # B non-zero: dA is not zero
    return tuple(a.astype(dtype) for a in (x, W, b, A, B))


_CASES = (
    ("2-D input (N, in), rank 2", (4, 6), 5, 2, 4.0),
    ("3-D input (B, T, in), rank 3", (2, 3, 6), 7, 3, 6.0),
    ("length 1, rank 1", (1, 1, 6), 5, 1, 16.0),
)
_HINTS = {
    "dx": "dx = dy W + s (dy B) A: the input gets the base's path and the door's, s = alpha / rank",
    "dA": "dA = s (dy B)^T x with s = alpha / rank, summed over every leading axis, shape (rank, in)",
    "dB": "dB = s dy^T (x A^T), shape (out, rank): the door's output h = x A^T is B's input",
}


def grade_lora_backward(g: Grader) -> None:
    rng = np.random.default_rng(2201)
    for label, shape, d_out, rank, alpha in _CASES:
        x, W, b, A, B = _inputs(rng, shape, d_out, rank)
        layer = _lora(W, b, A, B, alpha)
        dy = rng.standard_normal((*shape[:-1], d_out))
        layer(x)
        dx = layer.backward(dy)
        library = {"dx": dx, "dA": layer.lora_A.grad, "dB": layer.lora_B.grad}
        f = lambda x, A, B, W=W, b=b, alpha=alpha: _lora(W, b, A, B, alpha)(x)  # noqa: E731
        numeric = central_differences(f, {"x": x, "A": A, "B": B}, dy)
        numeric = {"dx": numeric["x"], "dA": numeric["A"], "dB": numeric["B"]}
        got = g.run(label, dy, x, W, A, B, alpha / rank, hint="return (dx, dA, dB)")
        g.backward(label, got, library, numeric, hints=_HINTS)
    x, W, b, A, B = _inputs(rng, (2, 3, 6), 5, 2, np.float32)
    layer = _lora(W, b, A, B, 4.0)
    dy = rng.standard_normal((2, 3, 5)).astype(np.float32)
    layer(x)
    dx = layer.backward(dy)
    got = g.run("float32", dy, x, W, A, B, 2.0)
    g.gradients("float32", got, {"dx": dx, "dA": layer.lora_A.grad, "dB": layer.lora_B.grad}, tol=1e-5,
                dtype=np.float32, hints=_HINTS)  # fmt: skip


_MERGE_HINT = "W' = W + (alpha / rank) B A: B (out, rank) times A (rank, in), scaled by alpha over the rank"


def grade_lora_merge(g: Grader) -> None:
    rng = np.random.default_rng(2202)
    for label, shape, d_out, rank, alpha in (*_CASES, ("rank 4, alpha 4 (scale 1)", (3, 6), 5, 4, 4.0)):
        x, W, b, A, B = _inputs(rng, shape, d_out, rank)
        expected = _lora(W, b, A, B, alpha).merge().weight.data
        got = g.run(label, W, A, B, alpha, rank, hint=_MERGE_HINT)
        g.compare(label, got, expected, tol=1e-12, hint=_MERGE_HINT)
    x, W, b, A, B = _inputs(rng, (3, 6), 5, 2, np.float32)
    expected = _lora(W, b, A, B, 8.0).merge().weight.data
    g.compare("float32", g.run("float32", W, A, B, 8.0, 2), expected, tol=1e-5, dtype=np.float32, hint=_MERGE_HINT)


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "lora_backward",
        "22c_lora",
        "lora_backward(dy, x, W, A, B, scaling) -> (dx, dA, dB): x (..., in), W (out, in), A (rank, in), "
        "B (out, rank), dy (..., out), scaling = alpha / rank; dx (..., in), dA (rank, in), dB (out, rank)",
        grade_lora_backward,
    ),
    Exercise(
        "lora_merge",
        "22c_lora",
        "lora_merge(W, A, B, alpha, rank) -> W_merged: W (out, in), A (rank, in), B (out, rank); W_merged (out, in)",
        grade_lora_merge,
    ),
)
