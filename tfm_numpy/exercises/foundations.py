"""Graded exercises of Part I (chapters 1-4): the layers everything else is built from.

The pattern every exercise module follows: a `grade_<name>(g)` function that draws seeded inputs, calls the attempt
through the grader (`g.run`), computes the expected values with the library, and compares (`g.compare`,
`g.backward`); then an `Exercise` entry naming the chapter and the signature the skeleton in the chapter shows.
"""

from __future__ import annotations

import numpy as np

from ..functional import log_softmax
from ..layers import GELU, Embedding, LayerNorm, Linear
from ..loss import CrossEntropyLoss
from .grading import MISSING, Exercise, Grader, central_differences

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


def _gradients32(g: Grader, check: str, got, expected: dict, *, tol: float = 1e-5) -> bool:
    """`g.gradients` for a float32 case, after asking that every gradient comes back in float32."""
    if got is not MISSING:
        for name, v in zip(expected, got if isinstance(got, tuple | list) else (got,), strict=False):
            if isinstance(v, np.ndarray) and v.dtype != np.float32:
                return g.record(f"{check}: {name}", False, f"dtype {v.dtype}, expected float32 (the inputs' dtype)")
    return g.gradients(check, got, expected, tol=tol)


# --- chapter 2: GELU (exact, with erf) and the embedding's backward ---------------------------------------------

_GELU_CASES = (
    ("a vector", (7,), 2.0),
    ("3-D input (B, T, d)", (2, 3, 4), 2.0),
    ("length 1", (1, 1, 5), 2.0),
    ("wide range, |x| up to 8", (4, 40), 3.0),
)
_GELU_HINT = "GELU(x) = x Phi(x) with the exact Phi(x) = (1 + erf(x / sqrt 2)) / 2 (not the tanh or sigmoid form)"
_GELU_GRAD_HINT = "dGELU/dx = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi); the product rule needs both terms"


def _gelu_input(rng, shape, scale, dtype=np.float64):
    x = scale * rng.standard_normal(shape)
    return np.clip(x, -8, 8).astype(dtype)


def grade_gelu_forward(g: Grader) -> None:
    rng = np.random.default_rng(201)
    for label, shape, scale in _GELU_CASES:
        x = _gelu_input(rng, shape, scale)
        g.compare(label, g.run(label, x, hint=_GELU_HINT), GELU()(x), tol=1e-12, hint=_GELU_HINT)
    x = _gelu_input(rng, (2, 3, 4), 2.0, np.float32)
    hint = "float32 in, float32 out: a NumPy float64 scalar such as np.sqrt(2 * np.pi) makes the result float64"
    g.compare("float32", g.run("float32", x, hint=hint), GELU()(x), tol=1e-5, dtype=np.float32, hint=hint)


def grade_gelu_backward(g: Grader) -> None:
    rng = np.random.default_rng(202)
    for label, shape, scale in _GELU_CASES:
        x = _gelu_input(rng, shape, scale)
        dy = rng.standard_normal(shape)
        layer = GELU()
        layer(x)
        library = {"dx": layer.backward(dy)}
        numeric = {"dx": central_differences(lambda x: GELU()(x), {"x": x}, dy)["x"]}
        g.backward(label, g.run(label, dy, x, hint=_GELU_GRAD_HINT), library, numeric, hints={"dx": _GELU_GRAD_HINT})
    x = _gelu_input(rng, (2, 3, 4), 2.0, np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    layer = GELU()
    layer(x)
    _gradients32(g, "float32", g.run("float32", dy, x), {"dx": layer.backward(dy)})


def _embedding(W: np.ndarray, padding_idx=None) -> Embedding:
    """The library's Embedding holding the table W (V, D)."""
    layer = Embedding(W.shape[0], W.shape[1], padding_idx=padding_idx, dtype=W.dtype)
    layer.weight.data[...] = W
    return layer


def grade_embedding_backward(g: Grader) -> None:
    rng = np.random.default_rng(203)
    V, D = 7, 3
    repeat = "repeated ids must add up: `dW[ids] += dy` keeps one row per id, np.add.at(dW, ids, dy) adds them all"
    cases = (
        ("ids (N,), each id once", np.array([3, 0, 6, 1]), None),
        ("ids (B, T) with repeated ids", np.array([[2, 5, 2, 2, 0], [5, 1, 2, 6, 6]]), None),
        ("length 1", np.array([[4]]), None),
    )
    for label, ids, pad in cases:
        W = rng.standard_normal((V, D))
        dy = rng.standard_normal((*ids.shape, D))
        layer = _embedding(W, pad)
        layer(ids)
        layer.backward(dy)
        numeric = {"dW": central_differences(lambda W, ids=ids: _embedding(W)(ids), {"W": W}, dy)["W"]}
        got = g.run(label, dy, ids, V, hint=repeat)
        g.backward(label, got, {"dW": layer.weight.grad}, numeric, hints={"dW": repeat})
    ids = np.array([[4, 2, 2, 0, 0], [0, 4, 1, 0, 4]])  # 0 is the padding id, and occurs often
    W = rng.standard_normal((V, D))
    dy = rng.standard_normal((*ids.shape, D))
    layer = _embedding(W, padding_idx=0)
    layer(ids)
    layer.backward(dy)
    hint = "the row of padding_idx gets no gradient: leave it zero"
    got = g.run("padding_idx=0", dy, ids, V, padding_idx=0, hint=hint)
    g.compare("padding_idx=0", got, layer.weight.grad, tol=1e-12, hint=hint)
    dy = dy.astype(np.float32)
    layer = _embedding(W.astype(np.float32))
    layer(ids)
    layer.backward(dy)
    got = g.run("float32", dy, ids, V)
    g.compare("float32", got, layer.weight.grad, tol=1e-5, dtype=np.float32, hint="dW in dy's dtype")


# --- chapter 3: layer normalization -----------------------------------------------------------------------------

_LN_CASES = (
    ("2-D input (N, D)", (4, 8), 0.0, 1.0),
    ("3-D input (B, T, D)", (2, 3, 16), 0.0, 1.0),
    ("length 1", (1, 1, 8), 0.0, 1.0),
    ("one feature (D = 1)", (3, 1), 0.0, 1.0),
    ("rows of std 1e-3, where eps matters", (3, 8), 0.0, 1e-3),
    ("rows of mean 1e5", (3, 16), 1e5, 1.0),
)
_LN_HINTS = {
    "one feature (D = 1)": "the variance divides by D (biased), not D - 1: with D = 1 the output is beta",
    "rows of std 1e-3, where eps matters": "eps goes inside the square root: (x - mu) / sqrt(var + eps)",
    "rows of mean 1e5": "var = mean((x - mu)^2): mean(x^2) - mu^2 cancels catastrophically at large means",
}
_LN_HINT = "y = (x - mu) / sqrt(var + eps) * gamma + beta over the last axis, var biased (divide by D)"


def _layer_norm(gamma: np.ndarray, beta: np.ndarray, eps: float) -> LayerNorm:
    """The library's LayerNorm over the last axis holding gamma and beta (D,)."""
    layer = LayerNorm(gamma.shape[0], eps=eps, dtype=gamma.dtype)
    layer.weight.data[...], layer.bias.data[...] = gamma, beta
    return layer


def _ln_inputs(rng, shape, mean, std, dtype=np.float64):
    x = (mean + std * rng.standard_normal(shape)).astype(dtype)
    gamma = (1 + 0.5 * rng.standard_normal(shape[-1])).astype(dtype)
    return x, gamma, rng.standard_normal(shape[-1]).astype(dtype)


def grade_layer_norm_forward(g: Grader) -> None:
    rng = np.random.default_rng(301)
    for label, shape, mean, std in _LN_CASES:
        x, gamma, beta = _ln_inputs(rng, shape, mean, std)
        hint = _LN_HINTS.get(label, _LN_HINT)
        got = g.run(label, x, gamma, beta, hint=hint)
        g.compare(label, got, _layer_norm(gamma, beta, 1e-5)(x), tol=1e-10, hint=hint)
    x, gamma, beta = _ln_inputs(rng, (2, 3, 8), 0.0, 1.0)
    got = g.run("eps=0.1, given", x, gamma, beta, eps=0.1)
    g.compare("eps=0.1, given", got, _layer_norm(gamma, beta, 0.1)(x), tol=1e-10, hint="use the eps argument")
    x, gamma, beta = _ln_inputs(rng, (2, 3, 16), 0.0, 1.0, np.float32)
    got = g.run("float32", x, gamma, beta)
    g.compare("float32", got, _layer_norm(gamma, beta, 1e-5)(x), tol=1e-5, dtype=np.float32)


def grade_layer_norm_backward(g: Grader) -> None:
    rng = np.random.default_rng(302)
    hints = {
        "dx": "dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy gamma: "
        "both the mean term and the xhat term",
        "dgamma": "dgamma = sum of dy * xhat over every leading axis (xhat, not x)",
        "dbeta": "dbeta = sum of dy over every leading axis",
    }
    for label, shape, mean, std in _LN_CASES[:5]:  # mean 1e5: central differences lose their digits there
        x, gamma, beta = _ln_inputs(rng, shape, mean, std)
        dy = rng.standard_normal(shape)
        layer = _layer_norm(gamma, beta, 1e-5)
        layer(x)
        library = {"dx": layer.backward(dy), "dgamma": layer.weight.grad, "dbeta": layer.bias.grad}
        f = lambda x, gamma, beta: _layer_norm(gamma, beta, 1e-5)(x)  # noqa: E731
        numeric = central_differences(f, {"x": x, "gamma": gamma, "beta": beta}, dy)
        numeric = {"dx": numeric["x"], "dgamma": numeric["gamma"], "dbeta": numeric["beta"]}
        got = g.run(label, dy, x, gamma, hint=_LN_HINTS.get(label, ""))
        g.backward(label, got, library, numeric, hints=hints)
    x, gamma, beta = _ln_inputs(rng, (2, 3, 16), 0.0, 1.0, np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    layer = _layer_norm(gamma, beta, 1e-5)
    layer(x)
    dx = layer.backward(dy)
    got = g.run("float32", dy, x, gamma)
    _gradients32(g, "float32", got, {"dx": dx, "dgamma": layer.weight.grad, "dbeta": layer.bias.grad})


# --- chapter 4: log-softmax and cross-entropy -------------------------------------------------------------------

_AXIS_HINT = "log p = (x - m) - log sum exp(x - m) over the LAST axis, m the row's max"
_SHIFT_HINT = "subtract the row's max before exp: exp(1000) overflows to inf"


def grade_log_softmax(g: Grader) -> None:
    rng = np.random.default_rng(401)
    cases = (
        ("2-D input (N, V)", 2 * rng.standard_normal((4, 6)), _AXIS_HINT),
        ("3-D input (B, T, V)", 2 * rng.standard_normal((2, 3, 5)), _AXIS_HINT),
        ("length 1", 2 * rng.standard_normal((1, 1, 5)), _AXIS_HINT),
        ("large logits (about 1000)", 1000 + 3 * rng.standard_normal((3, 5)), _SHIFT_HINT),
        ("large negative logits (about -1000)", -1000 + 3 * rng.standard_normal((3, 5)), _SHIFT_HINT),
        (
            "a probability that underflows",
            np.array([[0.0, -800.0, 1.0], [-50.0, 0.0, -1000.0]]),
            "log p = (x - m) - log sum exp(x - m), never log(softmax(x)): log(0) = -inf",
        ),
    )
    for label, x, hint in cases:
        g.compare(label, g.run(label, x, hint=hint), log_softmax(x), tol=1e-12, hint=hint)
    x = (2 * rng.standard_normal((2, 3, 5))).astype(np.float32)
    g.compare("float32", g.run("float32", x), log_softmax(x), tol=1e-5, dtype=np.float32)


def _cross_entropy(logits, targets, ignore_index):
    """(loss, dlogits) of the library's CrossEntropyLoss."""
    ce = CrossEntropyLoss(ignore_index=ignore_index)
    loss = ce(logits, targets)
    return loss, ce.backward()


def _grade_loss_and_grad(g: Grader, label, logits, targets, ignore_index, *, hint="", numeric=True, dtype=None):
    kwargs = {} if ignore_index == -100 else {"ignore_index": ignore_index}
    got = g.run(label, logits, targets, hint=hint, **kwargs)
    if got is MISSING:
        return
    if not isinstance(got, tuple | list) or len(got) != 2:
        g.record(label, False, "expected a pair (loss, dlogits)")
        return
    loss, dlogits = _cross_entropy(logits, targets, ignore_index)
    count = "the mean over the positions whose target is not ignore_index: divide by their count"
    tol = 1e-10 if dtype is None else 1e-5
    g.compare(f"{label}: loss", got[0], loss, tol=tol, hint=hint or count)
    grad_hint = hint or "dlogits = (softmax(logits) - onehot(targets)) / n_valid, 0 at ignored positions"
    if not numeric:
        g.compare(
            f"{label}: dlogits", got[1], dlogits, tol=1e-10 if dtype is None else 1e-5, dtype=dtype, hint=grad_hint
        )
        return
    f = lambda logits: CrossEntropyLoss(ignore_index=ignore_index)(logits, targets)  # noqa: E731
    num = central_differences(f, {"logits": logits}, np.float64(1.0))["logits"]
    g.backward(f"{label}", got[1], {"dlogits": dlogits}, {"dlogits": num}, tol=1e-10, hints={"dlogits": grad_hint})


def grade_softmax_cross_entropy(g: Grader) -> None:
    rng = np.random.default_rng(402)
    logits = 2 * rng.standard_normal((6, 5))
    _grade_loss_and_grad(g, "2-D logits (N, V)", logits, rng.integers(0, 5, 6), -100)
    logits = 2 * rng.standard_normal((2, 4, 5))
    targets = np.array([[1, 4, 0, -100], [3, -100, -100, -100]])  # two padded sequences
    _grade_loss_and_grad(g, "3-D logits (B, T, V), padding ignored", logits, targets, -100)
    logits = 2 * rng.standard_normal((3, 2, 5))
    targets = np.array([[2, 0], [4, 0], [1, 3]])
    _grade_loss_and_grad(g, "ignore_index=0, given", logits, targets, 0)
    _grade_loss_and_grad(g, "length 1", 2 * rng.standard_normal((1, 1, 5)), np.array([[3]]), -100)
    logits = 1000 + 3 * rng.standard_normal((2, 3, 5))
    targets = rng.integers(0, 5, (2, 3))
    _grade_loss_and_grad(g, "large logits (about 1000)", logits, targets, -100, hint=_SHIFT_HINT)
    logits = 2 * rng.standard_normal((2, 3, 5))
    targets = np.full((2, 3), -100)
    hint = "every position ignored: the library returns loss 0 and a zero gradient (divide by max(n_valid, 1))"
    _grade_loss_and_grad(g, "every position ignored", logits, targets, -100, hint=hint, numeric=False)
    logits = (2 * rng.standard_normal((2, 3, 5))).astype(np.float32)
    targets = np.array([[0, 4, 2], [1, -100, 3]])
    _grade_loss_and_grad(g, "float32", logits, targets, -100, numeric=False, dtype=np.float32)


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
    Exercise(
        "gelu_forward",
        "02_embeddings_activations_dropout",
        "gelu_forward(x) -> y: the exact GELU x Phi(x), elementwise, in x's dtype",
        grade_gelu_forward,
    ),
    Exercise(
        "gelu_backward",
        "02_embeddings_activations_dropout",
        "gelu_backward(dy, x) -> dx: dy and dx shaped like x",
        grade_gelu_backward,
    ),
    Exercise(
        "embedding_backward",
        "02_embeddings_activations_dropout",
        "embedding_backward(dy, ids, num_embeddings, padding_idx=None) -> dW: ids (...), dy (..., D), dW (V, D)",
        grade_embedding_backward,
    ),
    Exercise(
        "layer_norm_forward",
        "03_layer_norm",
        "layer_norm_forward(x, gamma, beta, eps=1e-5) -> y: x (..., D), gamma and beta (D,)",
        grade_layer_norm_forward,
    ),
    Exercise(
        "layer_norm_backward",
        "03_layer_norm",
        "layer_norm_backward(dy, x, gamma, eps=1e-5) -> (dx, dgamma, dbeta): dy (..., D)",
        grade_layer_norm_backward,
    ),
    Exercise(
        "log_softmax",
        "04_softmax_cross_entropy",
        "log_softmax(x) -> log p: over the last axis, x (..., V), stable at any logits",
        grade_log_softmax,
    ),
    Exercise(
        "softmax_cross_entropy",
        "04_softmax_cross_entropy",
        "softmax_cross_entropy(logits, targets, ignore_index=-100) -> (loss, dlogits): logits (..., V), targets (...)",
        grade_softmax_cross_entropy,
    ),
)
