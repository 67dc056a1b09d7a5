"""Wrong attempts at the exercises of Part I: each fails with a message that points at the mistake."""

from __future__ import annotations

import warnings

import numpy as np
from helpers_exercises import fails, solution

import tfm_numpy as tnp
from tfm_numpy.exercises import check

# --- linear_forward ------------------------------------------------------------------------------------------------


def test_linear_forward_transposed_weight():
    fails("linear_forward", lambda x, W, b: x @ W + b, "raised ValueError", "W of shape (out, in)")


def test_linear_forward_missing_bias():
    fails("linear_forward", lambda x, W, b: x @ W.T, "off by", "y = x W^T + b")


def test_linear_forward_float32_upcast():
    fails("linear_forward", lambda x, W, b: x.astype(np.float64) @ W.T + b, "dtype float64, expected float32")


def test_linear_forward_only_2d():
    fails("linear_forward", lambda x, W, b: np.einsum("ni,oi->no", x, W) + b, "3-D input (B, T, in)")


# --- linear_backward -----------------------------------------------------------------------------------------------


def _flat(dy, x):
    return dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])


def test_linear_backward_bias_mean():
    def attempt(dy, x, W):
        dy2, x2 = _flat(dy, x)
        return dy @ W, dy2.T @ x2, dy2.mean(axis=0)

    fails("linear_backward", attempt, "db: off by", "db sums dy over every leading axis")


def test_linear_backward_dW_transposed():
    def attempt(dy, x, W):
        dy2, x2 = _flat(dy, x)
        return dy @ W, x2.T @ dy2, dy2.sum(axis=0)

    fails("linear_backward", attempt, "dW: shape (4, 5), expected (5, 4)")


def test_linear_backward_sums_only_the_first_axis():
    def attempt(dy, x, W):  # right for (N, in), wrong for (B, T, in)
        return dy @ W, np.tensordot(dy, x, axes=(0, 0)).reshape(-1, x.shape[-1])[: W.shape[0]], dy.sum(axis=0)

    result = fails("linear_backward", attempt, "3-D input (B, T, in)")
    assert not result.failed("2-D input (N, in)")


def test_linear_backward_dx_uses_transpose():
    def attempt(dy, x, W):
        dy2, x2 = _flat(dy, x)
        return dy @ W.T, dy2.T @ x2, dy2.sum(axis=0)

    fails("linear_backward", attempt, "raised ValueError")


def test_linear_solution_is_the_chapter_one():
    assert check("linear_backward", solution("linear_backward"), quiet=True).passed


# --- gelu_forward / gelu_backward (chapter 2) ----------------------------------------------------------------------

_S2 = 1 / np.sqrt(2.0)


def _cdf(x):
    return 0.5 * (1 + tnp.erf(x * _S2))


def _pdf(x):
    return np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)  # np.sqrt(2 * np.pi) is a NumPy float64 scalar


def _tanh_cdf(x):
    return 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_gelu_forward_tanh_approximation():
    result = fails("gelu_forward", lambda x: x * _tanh_cdf(x), "off by", "not the tanh or sigmoid form")
    assert result.failed("wide range, |x| up to 8")


def test_gelu_forward_sigmoid_approximation():
    fails("gelu_forward", lambda x: x / (1 + np.exp(-1.702 * x)), "3-D input (B, T, d): off by", "exact Phi(x)")


def test_gelu_forward_erf_without_the_sqrt2():
    fails("gelu_forward", lambda x: x * 0.5 * (1 + tnp.erf(x)), "a vector: off by", "erf(x / sqrt 2)")


def test_gelu_forward_float32_upcast():
    def attempt(x):  # right numbers, but a float64 scalar turns the float32 result into float64
        return x * _cdf(x) * np.sqrt(np.float64(1.0))

    result = fails("gelu_forward", attempt, "float32: dtype float64, expected float32")
    assert len(result.failures) == 1


def test_gelu_backward_missing_the_pdf_term():
    fails("gelu_backward", lambda dy, x: dy * _cdf(x), "dx: off by", "the product rule needs both terms")


def test_gelu_backward_tanh_derivative():
    def attempt(dy, x):
        c, t = np.sqrt(2 / np.pi), 2 * _tanh_cdf(x) - 1
        return dy * ((1 + t) / 2 + x * (1 - t * t) / 2 * c * (1 + 3 * 0.044715 * x * x))

    fails("gelu_backward", attempt, "wide range, |x| up to 8: dx: off by", "Phi(x) + x phi(x)")


def test_gelu_backward_returns_the_forward():
    fails("gelu_backward", lambda dy, x: dy * x * _cdf(x), "a vector: dx: off by")


def test_gelu_backward_float32_upcast():
    result = fails("gelu_backward", lambda dy, x: dy * (_cdf(x) + x * _pdf(x)), "float32: dx: dtype float64")
    assert len(result.failures) == 1


# --- embedding_backward (chapter 2) ----------------------------------------------------------------------------------


def _embedding_grad(dy, ids, num_embeddings, padding_idx=None, *, scatter):
    dW = np.zeros((num_embeddings, dy.shape[-1]), dtype=dy.dtype)
    flat, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
    if padding_idx is not None and scatter != "no padding":
        keep = flat != padding_idx
        flat, dy2 = flat[keep], dy2[keep]
    if scatter == "fancy index":
        dW[flat] += dy2
    else:
        np.add.at(dW, flat, dy2)
    return dW


def test_embedding_backward_fancy_index_assignment():
    result = fails(
        "embedding_backward",
        lambda *a, **k: _embedding_grad(*a, **k, scatter="fancy index"),
        "ids (B, T) with repeated ids: dW: off by",
        "np.add.at(dW, ids, dy)",
    )
    assert not result.failed("each id once")


def test_embedding_backward_padding_row_gets_gradient():
    result = fails(
        "embedding_backward",
        lambda *a, **k: _embedding_grad(*a, **k, scatter="no padding"),
        "padding_idx=0: off by",
        "the row of padding_idx gets no gradient",
    )
    assert len(result.failures) == 1


def test_embedding_backward_onehot_for_2d_only():
    def attempt(dy, ids, num_embeddings, padding_idx=None):  # right for ids (N,), wrong for (B, T)
        dW = np.eye(num_embeddings, dtype=dy.dtype)[ids].T @ dy
        if padding_idx is not None:
            dW[padding_idx] = 0
        return dW

    result = fails("embedding_backward", attempt, "ids (B, T) with repeated ids: ")
    assert not result.failed("each id once")


def test_embedding_backward_float64_table():
    def attempt(dy, ids, num_embeddings, padding_idx=None):
        return _embedding_grad(dy.astype(np.float64), ids, num_embeddings, padding_idx, scatter="add.at")

    fails("embedding_backward", attempt, "float32: dtype float64, expected float32")


# --- layer_norm_forward / layer_norm_backward (chapter 3) ------------------------------------------------------------


def _ln(x, gamma, beta, eps=1e-5, *, ddof=0, eps_outside=False, one_pass=False):
    mu = x.mean(-1, keepdims=True)
    var = (x * x).mean(-1, keepdims=True) - mu * mu if one_pass else x.var(-1, ddof=ddof, keepdims=True)
    std = np.sqrt(var) + eps if eps_outside else np.sqrt(var + eps)
    return (x - mu) / std * gamma + beta


def test_layer_norm_forward_unbiased_variance():
    with warnings.catch_warnings():  # as in a notebook: D - 1 = 0 warns, and the row becomes nan
        warnings.simplefilter("ignore", RuntimeWarning)
        result = fails(
            "layer_norm_forward",
            lambda x, gamma, beta, eps=1e-5: _ln(x, gamma, beta, eps, ddof=1),
            "2-D input (N, D): off by",
            "one feature (D = 1): nan at index",
        )
    assert result.failed("variance divides by D (biased), not D - 1")


def test_layer_norm_forward_eps_outside_the_sqrt():
    result = fails(
        "layer_norm_forward",
        lambda x, gamma, beta, eps=1e-5: _ln(x, gamma, beta, eps, eps_outside=True),
        "rows of std 1e-3, where eps matters: off by",
        "eps goes inside the square root",
    )
    assert not result.failed("one feature")


def test_layer_norm_forward_one_pass_variance():
    result = fails(
        "layer_norm_forward",
        lambda x, gamma, beta, eps=1e-5: _ln(x, gamma, beta, eps, one_pass=True),
        "rows of mean 1e5: off by",
        "cancels catastrophically",
    )
    assert len(result.failures) == 1


def test_layer_norm_forward_ignores_eps_argument():
    result = fails("layer_norm_forward", lambda x, gamma, beta, eps=1e-5: _ln(x, gamma, beta), "eps=0.1, given")
    assert len(result.failures) == 1


def test_layer_norm_forward_normalizes_the_wrong_axis():
    def attempt(x, gamma, beta, eps=1e-5):
        mu, var = x.mean(0, keepdims=True), x.var(0, keepdims=True)  # statistics over the batch: batch norm
        return (x - mu) / np.sqrt(var + eps) * gamma + beta

    fails("layer_norm_forward", attempt, "2-D input (N, D): off by")


def _ln_backward(dy, x, gamma, eps=1e-5, *, mean_term=True, xhat_term=True, lead="all", dgamma_of="xhat"):
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    dxhat = dy * gamma
    dx = dxhat
    if mean_term:
        dx = dx - dxhat.mean(-1, keepdims=True)
    if xhat_term:
        dx = dx - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    axes = tuple(range(x.ndim - 1)) if lead == "all" else 0
    return rstd * dx, (dy * (xhat if dgamma_of == "xhat" else x)).sum(axes), dy.sum(axes)


def test_layer_norm_backward_missing_the_mean_term():
    fails(
        "layer_norm_backward",
        lambda dy, x, gamma, eps=1e-5: _ln_backward(dy, x, gamma, eps, mean_term=False),
        "2-D input (N, D): dx: off by",
        "both the mean term and the xhat term",
    )


def test_layer_norm_backward_missing_the_xhat_term():
    result = fails(
        "layer_norm_backward",
        lambda dy, x, gamma, eps=1e-5: _ln_backward(dy, x, gamma, eps, xhat_term=False),
        "3-D input (B, T, D): dx: off by",
    )
    assert not result.failed("dgamma") and not result.failed("one feature")  # with D = 1, xhat = 0


def test_layer_norm_backward_dgamma_summed_over_the_first_axis_only():
    result = fails(
        "layer_norm_backward",
        lambda dy, x, gamma, eps=1e-5: _ln_backward(dy, x, gamma, eps, lead="first"),
        "3-D input (B, T, D): dgamma: shape (3, 16), expected (16,)",
        "3-D input (B, T, D): dbeta: shape (3, 16), expected (16,)",
    )
    assert not result.failed("2-D input (N, D)")


def test_layer_norm_backward_dgamma_of_x_not_xhat():
    fails(
        "layer_norm_backward",
        lambda dy, x, gamma, eps=1e-5: _ln_backward(dy, x, gamma, eps, dgamma_of="x"),
        "dgamma: off by",
        "(xhat, not x)",
    )


# --- log_softmax and softmax_cross_entropy (chapter 4) ---------------------------------------------------------------


def _naive_log_softmax(x):
    e = np.exp(x)
    return np.log(e / e.sum(-1, keepdims=True))


def test_log_softmax_without_the_max_shift():
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        result = fails("log_softmax", _naive_log_softmax, "large logits (about 1000): nan at index", "subtract")
    assert not result.failed("2-D input") and not result.failed("3-D input")


def test_log_softmax_as_log_of_softmax():
    def attempt(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return np.log(e / e.sum(-1, keepdims=True))

    with np.errstate(divide="ignore"):
        result = fails("log_softmax", attempt, "a probability that underflows: ", "never log(softmax(x))")
    assert len(result.failures) == 1


def test_log_softmax_over_the_wrong_axis():
    def attempt(x):
        z = x - x.max(0, keepdims=True)
        return z - np.log(np.exp(z).sum(0, keepdims=True))

    fails("log_softmax", attempt, "2-D input (N, V): off by", "over the LAST axis")


def test_log_softmax_float32_upcast():
    def attempt(x):
        z = x.astype(np.float64) - x.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    fails("log_softmax", attempt, "float32: dtype float64, expected float32")


def _ce(logits, targets, ignore_index=-100, *, shift=True, count="valid", grad_div=True, onehot_shift=0, pad_grad=0):
    V = logits.shape[-1]
    z, t = logits.reshape(-1, V), targets.reshape(-1)
    valid = t != ignore_index
    t = np.where(valid, t, 0)
    n = {"valid": max(int(valid.sum()), 1), "all": t.size}[count]
    z = z - z.max(-1, keepdims=True) if shift else z
    e = np.exp(z)
    p = e / e.sum(-1, keepdims=True)
    logp = np.log(p) if not shift else z - np.log(e.sum(-1, keepdims=True))
    loss = -np.where(valid, logp[np.arange(t.size), t], 0).sum() / n
    d = p - np.eye(V, dtype=logits.dtype)[(t + onehot_shift) % V]
    d = d * np.where(valid, 1, pad_grad)[:, None].astype(logits.dtype)
    return loss, (d / n if grad_div else d).reshape(logits.shape)


def test_cross_entropy_without_the_max_shift():
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        result = fails(
            "softmax_cross_entropy",
            lambda *a, **k: _ce(*a, **k, shift=False),
            "large logits (about 1000): loss: nan at index ()",
            "subtract the row's max",
        )
    assert {f.check.split(":")[0] for f in result.failures} == {"large logits (about 1000)"}


def test_cross_entropy_mean_over_all_tokens():
    result = fails(
        "softmax_cross_entropy",
        lambda *a, **k: _ce(*a, **k, count="all"),
        "3-D logits (B, T, V), padding ignored: loss: off by",
        "divide by their count",
    )
    assert not result.failed("2-D logits (N, V)")


def test_cross_entropy_gradient_not_divided_by_the_count():
    result = fails(
        "softmax_cross_entropy",
        lambda *a, **k: _ce(*a, **k, grad_div=False),
        "2-D logits (N, V): dlogits: off by",
        "/ n_valid",
    )
    assert not result.failed("loss")


def test_cross_entropy_onehot_off_by_one():
    fails("softmax_cross_entropy", lambda *a, **k: _ce(*a, **k, onehot_shift=1), "dlogits: off by")


def test_cross_entropy_gradient_at_ignored_positions():
    result = fails(
        "softmax_cross_entropy",
        lambda *a, **k: _ce(*a, **k, pad_grad=1),
        "3-D logits (B, T, V), padding ignored: dlogits: off by",
        "0 at ignored positions",
    )
    assert not result.failed("2-D logits (N, V)")


def test_cross_entropy_all_ignored_gives_nan():
    def attempt(logits, targets, ignore_index=-100):  # divides by n_valid = 0 when every position is ignored
        valid = targets != ignore_index
        if not valid.any():
            return np.float64(np.nan), np.full(logits.shape, np.nan)
        return _ce(logits, targets, ignore_index)

    result = fails("softmax_cross_entropy", attempt, "every position ignored: loss: nan", "max(n_valid, 1)")
    assert len(result.failures) == 2


def test_cross_entropy_hardcoded_ignore_index():
    result = fails(
        "softmax_cross_entropy",
        lambda logits, targets, ignore_index=-100: _ce(logits, targets),
        "ignore_index=0, given",
    )
    assert {f.check.split(":")[0] for f in result.failures} == {"ignore_index=0, given"}


def test_part_one_solutions_are_the_chapters_ones():
    for name in ("gelu_backward", "embedding_backward", "layer_norm_backward", "softmax_cross_entropy"):
        assert check(name, solution(name), quiet=True).passed, name
