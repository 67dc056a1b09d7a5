"""Graded exercises of Part I (chapters 1-4): the layers everything else is built from.

The pattern every exercise module follows: a `grade_<name>(g)` function that draws seeded inputs, calls the attempt
through the grader (`g.run`), computes the expected values with the library, and compares (`g.compare`,
`g.backward`); then an `Exercise` entry naming the chapter and the signature the skeleton in the chapter shows.
"""

from __future__ import annotations

import numpy as np

from ..layers import Linear
from .grading import Exercise, Grader, central_differences

__all__ = ["EXERCISES"]


def _linear(W: np.ndarray, b: np.ndarray) -> Linear:
    """The library's Linear holding the given weight (out, in) and bias (out,)."""
    layer = Linear(W.shape[1], W.shape[0], dtype=W.dtype)
    layer.weight.data[...], layer.bias.data[...] = W, b
    return layer


def _linear_inputs(rng, shape, n_out, dtype=np.float64):
    x = rng.standard_normal(shape).astype(dtype)
    W = rng.standard_normal((n_out, shape[-1])).astype(dtype)  # (out, in): torch's layout
    return x, W, rng.standard_normal(n_out).astype(dtype)


def grade_linear_forward(g: Grader) -> None:
    rng = np.random.default_rng(101)
    for label, shape in (("2-D input (N, in)", (3, 4)), ("3-D input (B, T, in)", (2, 3, 4)), ("length 1", (1, 1, 4))):
        x, W, b = _linear_inputs(rng, shape, 5)
        hint = "y = x W^T + b, with W of shape (out, in)"
        g.compare(label, g.run(label, x, W, b, hint=hint), _linear(W, b)(x), tol=1e-12, hint=hint)
    x, W, b = _linear_inputs(rng, (2, 3, 4), 5, np.float32)
    y = g.run("float32", x, W, b)
    g.compare("float32", y, _linear(W, b)(x), tol=1e-5, dtype=np.float32)


def grade_linear_backward(g: Grader) -> None:
    rng = np.random.default_rng(102)
    for label, shape in (("2-D input (N, in)", (3, 4)), ("3-D input (B, T, in)", (2, 3, 4))):
        x, W, b = _linear_inputs(rng, shape, 5)
        layer = _linear(W, b)
        dy = rng.standard_normal(layer(x).shape)
        dx = layer.backward(dy)
        library = {"dx": dx, "dW": layer.weight.grad, "db": layer.bias.grad}
        numeric = central_differences(lambda x, W, b: _linear(W, b)(x), {"x": x, "W": W, "b": b}, dy)
        numeric = {"dx": numeric["x"], "dW": numeric["W"], "db": numeric["b"]}
        hints = {"dW": "dW sums dy^T x over every leading axis", "db": "db sums dy over every leading axis"}
        g.backward(label, g.run(label, dy, x, W), library, numeric, hints=hints)
    x, W, b = _linear_inputs(rng, (2, 3, 4), 5, np.float32)
    layer = _linear(W, b)
    dy = rng.standard_normal((2, 3, 5)).astype(np.float32)
    layer(x)
    dx = layer.backward(dy)
    got = g.run("float32", dy, x, W)
    g.gradients("float32", got, {"dx": dx, "dW": layer.weight.grad, "db": layer.bias.grad}, tol=1e-5)


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "linear_forward",
        "01_method",
        "linear_forward(x, W, b) -> y: x (..., in), W (out, in), b (out,)",
        grade_linear_forward,
    ),
    Exercise(
        "linear_backward",
        "01_method",
        "linear_backward(dy, x, W) -> (dx, dW, db): dy (..., out)",
        grade_linear_backward,
    ),
)
