"""Wrong attempts at the exercises of Part II (chapters 5-7): each fails with a message that points at the mistake."""

from __future__ import annotations

import math

import numpy as np
from helpers_exercises import fails, solution

from tfm_numpy.exercises import check


def _t(a):
    return np.swapaxes(a, -1, -2)


def _softmax(scores, mask, fill=None):
    """A max-shifted softmax over the last axis with masked scores set to `fill` (the common recipe), or, with no
    fill, the library's convention: masked keys weigh 0 and a row with nothing to attend to is all zeros."""
    if fill is not None:
        scores = np.where(mask, scores, fill) if mask is not None else scores
        with np.errstate(invalid="ignore"):
            e = np.exp(scores - scores.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)
    allowed = np.ones(scores.shape, bool) if mask is None else np.broadcast_to(mask, scores.shape)
    row_max = np.where(allowed, scores, -np.inf).max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, scores, row_max) - row_max), 0.0)
    return e / np.maximum(e.sum(axis=-1, keepdims=True), 1e-300)


def _attention(q, k, v, mask=None, *, fill=None, scale=True):
    w = _softmax(q @ _t(k) / (math.sqrt(q.shape[-1]) if scale else 1.0), mask, fill)
    return w @ v, w


def _sdpa_backward(dout, q, k, v, w, *, subtract=True):
    dv = _t(w) @ dout
    dw = dout @ _t(v)
    ds = w * (dw - (dw * w).sum(axis=-1, keepdims=True)) if subtract else w * dw
    ds = ds / math.sqrt(q.shape[-1])
    return ds @ k, _t(ds) @ q, dv


# --- attention_forward ---------------------------------------------------------------------------------------------


def test_attention_forward_without_the_scale():
    result = fails(
        "attention_forward", lambda q, k, v, mask=None: _attention(q, k, v, mask, scale=False), "no mask, Tq=4 != Tk=6"
    )
    assert result.failed("q k^T / sqrt(d_k)")


def test_attention_forward_ignores_the_mask():
    result = fails("attention_forward", lambda q, k, v, mask=None: _attention(q, k, v), "padding mask (B, 1, 1, Tk)")
    assert result.failed("mask True = may attend, False = hidden") and result.failed("causal mask (1, 1, T, T)")
    assert not result.failed("no mask")


def test_attention_forward_mask_with_the_opposite_meaning():
    # torch.nn.MultiheadAttention's boolean mask: True = may NOT attend
    result = fails(
        "attention_forward", lambda q, k, v, mask=None: _attention(q, k, v, None if mask is None else ~mask),
        "padding mask (B, 1, 1, Tk)", "causal mask (1, 1, T, T)", "the opposite of torch.nn.MultiheadAttention",
    )  # fmt: skip
    assert not result.failed("no mask")


def test_attention_forward_inf_fill_gives_nan_on_an_empty_row():
    result = fails(
        "attention_forward",
        lambda q, k, v, mask=None: _attention(q, k, v, mask, fill=-np.inf),
        "fully masked rows (decoder mask, left padding): output: nan at index",
        "not NaN",
    )
    assert len(result.failures) == 2  # output and weights of that case, nothing else
    assert not result.failed("padding mask") and not result.failed("causal mask")


def test_attention_forward_large_fill_makes_an_empty_row_uniform():
    def attempt(q, k, v, mask=None):
        return _attention(q, k, v, mask, fill=-1e9)

    result = fails("attention_forward", attempt, "fully masked rows (decoder mask, left padding): output: off by")
    assert len(result.failures) == 2


def test_attention_forward_without_the_max_shift_overflows_on_large_scores():
    def attempt(q, k, v, mask=None):
        e = np.exp(q @ _t(k) / math.sqrt(q.shape[-1]))
        if mask is not None:
            e = e * mask
        w = e / np.maximum(e.sum(axis=-1, keepdims=True), 1e-300)
        return w @ v, w

    result = fails("attention_forward", attempt, "large scores (q, k times 30)", "subtract each row's maximum")
    assert all(f.check.startswith("large scores") for f in result.failures)


def test_attention_forward_float32_becomes_float64():
    def attempt(q, k, v, mask=None):  # np.sqrt(d_k) is a float64 NumPy scalar: float32 / float64 -> float64
        w = _softmax(q @ _t(k) / np.sqrt(q.shape[-1]), mask)
        return w @ v, w

    result = fails("attention_forward", attempt, "float32, padding mask: output: dtype float64, expected float32")
    assert not result.failed("no mask")


def test_attention_forward_only_four_dims():
    def attempt(q, k, v, mask=None):  # k.transpose(0, 1, 3, 2): right for (B, H, T, d) only
        w = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), mask)
        return w @ v, w

    fails("attention_forward", attempt, "3-D inputs (B, T, d), no head axis: raised ValueError")


def test_attention_forward_returns_only_the_output():
    fails("attention_forward", lambda q, k, v, mask=None: _attention(q, k, v, mask)[0], "returned 1 value")


# --- attention_backward --------------------------------------------------------------------------------------------


def _safe_weights(q, k, mask):
    """The library's convention, for the backward attempts below: an empty row has zero weights."""
    return _softmax(q @ _t(k) / math.sqrt(q.shape[-1]), mask)


def test_attention_backward_missing_the_subtraction_term():
    def attempt(dout, q, k, v, mask=None):
        return _sdpa_backward(dout, q, k, v, _safe_weights(q, k, mask), subtract=False)

    result = fails("attention_backward", attempt, "no mask, Tq=4 != Tk=6: dq: off by", "rowsum(dP * P)")
    assert result.failed("dk: off by") and not result.failed("dv")


def test_attention_backward_dk_transposed():
    def attempt(dout, q, k, v, mask=None):
        dq, dk, dv = _sdpa_backward(dout, q, k, v, _safe_weights(q, k, mask))
        return dq, _t(dk), dv  # q^T dS: (..., d_k, Tk)

    fails("attention_backward", attempt, "dk: shape (2, 3, 8, 6), expected (2, 3, 6, 8)", "shaped like k")


def test_attention_backward_without_the_scale():
    def attempt(dout, q, k, v, mask=None):
        dq, dk, dv = _sdpa_backward(dout, q, k, v, _safe_weights(q, k, mask))
        s = math.sqrt(q.shape[-1])
        return dq * s, dk * s, dv

    result = fails("attention_backward", attempt, "dq: off by", "dk: off by")
    assert not result.failed("dv")


def test_attention_backward_dv_without_the_transpose():
    def attempt(dout, q, k, v, mask=None):
        dq, dk, _ = _sdpa_backward(dout, q, k, v, _safe_weights(q, k, mask))
        return dq, dk, _safe_weights(q, k, mask) @ dout  # P dO instead of P^T dO: runs when Tq = Tk

    result = fails("attention_backward", attempt, "padding mask (B, 1, 1, Tk): dv: off by", "dv = P^T dout")
    assert result.failed("no mask, Tq=4 != Tk=6: raised ValueError")  # P dO does not fit when Tq != Tk


def test_attention_backward_nan_on_an_empty_row():
    def attempt(dout, q, k, v, mask=None):  # recomputes the weights with a -inf fill
        return _sdpa_backward(dout, q, k, v, _attention(q, k, v, mask, fill=-np.inf)[1])

    result = fails("attention_backward", attempt, "fully masked rows (decoder mask, left padding): dq: nan", "not NaN")
    assert all(f.check.startswith("fully masked rows") for f in result.failures)


def test_attention_solutions_are_the_chapter_ones():
    assert check("attention_forward", solution("attention_forward"), quiet=True).passed
    assert check("attention_backward", solution("attention_backward"), quiet=True).passed


# --- split_heads / merge_heads -------------------------------------------------------------------------------------


def _split(x, n_heads):
    B, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"D={D} is not divisible by n_heads={n_heads}")
    return x.reshape(B, T, n_heads, D // n_heads).transpose(0, 2, 1, 3)


def test_split_heads_reshape_without_transpose():
    def attempt(x, n_heads):  # chapter 6's mistake: the right shape, the wrong entries
        B, T, D = x.shape
        if D % n_heads:
            raise ValueError("D % n_heads")
        return x.reshape(B, n_heads, T, D // n_heads)

    result = fails("split_heads", attempt, "(B, T, D) = (2, 5, 12), 3 heads: off by", "a bare reshape")
    assert not result.failed("one head") and not result.failed("length 1")  # invisible with one head or one token


def test_split_heads_does_not_refuse():
    def attempt(x, n_heads):  # The Annotated Transformer's view(B, -1, h, d_k): right when D % h == 0
        B, T, D = x.shape
        return x.reshape(B, -1, n_heads, D // n_heads).transpose(0, 2, 1, 3)

    result = fails("split_heads", attempt, "D = 12 with 5 heads: accepted it silently", "divisible by n_heads")
    assert len(result.failures) == 1


def test_split_heads_wrong_transpose():
    def attempt(x, n_heads):  # (B, T, H, d) -> (B, H, d, T)
        return _split(x, n_heads).swapaxes(-1, -2)

    fails("split_heads", attempt, "shape (2, 3, 4, 5), expected (2, 3, 5, 4)")


def test_split_heads_interleaved_channels():
    def attempt(x, n_heads):  # head i owns features i, i + H, ... (chapter 6's exercise 1): another layout
        B, T, D = x.shape
        if D % n_heads:
            raise ValueError("D % n_heads")
        return x.reshape(B, T, D // n_heads, n_heads).transpose(0, 3, 1, 2)

    result = fails("split_heads", attempt, "3 heads: off by")
    assert not result.failed("one head")


def test_merge_heads_reshape_without_transpose():
    def attempt(x):
        B, H, T, d = x.shape
        return x.reshape(B, T, H * d)

    result = fails("merge_heads", attempt, "(B, H, T, d) = (2, 3, 5, 4): off by", "a bare reshape mixes tokens")
    assert result.failed("inverse of the library's split")
    assert not result.failed("one head") and not result.failed("length 1")


def test_merge_heads_wrong_axis_order():
    def attempt(x):  # (B, T, d, H): features interleaved across heads
        B, H, T, d = x.shape
        return x.transpose(0, 2, 3, 1).reshape(B, T, H * d)

    fails("merge_heads", attempt, "(B, H, T, d) = (2, 3, 5, 4): off by")


def test_merge_heads_forgets_the_reshape():
    fails("merge_heads", lambda x: x.transpose(0, 2, 1, 3), "shape (2, 5, 3, 4), expected (2, 5, 12)")


def test_merge_heads_float32_upcast():
    def attempt(x):
        B, H, T, d = x.shape
        return np.concatenate([x[:, h] for h in range(H)], axis=-1).astype(np.float64)

    result = fails("merge_heads", attempt, "float32: dtype float64, expected float32")
    assert len(result.failures) == 1


def test_split_and_merge_solutions_are_the_chapter_ones():
    assert check("split_heads", solution("split_heads"), quiet=True).passed
    assert check("merge_heads", solution("merge_heads"), quiet=True).passed


# --- sinusoidal_positions ------------------------------------------------------------------------------------------


def _table(max_len, d_model, dtype=np.float32, *, base=10000.0, two_i=True, interleave=True, refuse=True):
    if refuse and d_model % 2:
        raise ValueError(f"d_model={d_model} must be even")
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    i = np.arange(d_model // 2 + d_model % 2, dtype=np.float64)
    angle = pos / base ** ((2 * i if two_i else i) / d_model)
    sin, cos = np.sin(angle), np.cos(angle)[:, : d_model // 2]
    if not interleave:
        return np.concatenate([sin, cos], axis=-1).astype(dtype)
    pe = np.empty((max_len, d_model))
    pe[:, 0::2], pe[:, 1::2] = sin, cos
    return pe.astype(dtype)


def test_sinusoidal_positions_the_helper_is_right():
    assert check("sinusoidal_positions", _table, quiet=True).passed


def test_sinusoidal_positions_div_term_form_passes():
    def attempt(max_len, d_model, dtype=np.float32):  # the PyTorch tutorial's exp(-2i ln(10000) / d) form
        if d_model % 2:
            raise ValueError("odd d_model")
        pos = np.arange(max_len)[:, None]
        div_term = np.exp(np.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = np.zeros((max_len, d_model))
        pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div_term), np.cos(pos * div_term)
        return pe.astype(dtype)

    assert check("sinusoidal_positions", attempt, quiet=True).passed


def test_sinusoidal_positions_halves_concatenated():
    result = fails(
        "sinusoidal_positions",
        lambda max_len, d_model, dtype=np.float32: _table(max_len, d_model, dtype, interleave=False),
        "float64, (max_len, d_model) = (50, 16): off by", "the pairs interleave",
    )  # fmt: skip
    assert not result.failed("d_model = 2 (one pair)")  # one pair: both layouts are [sin, cos]


def test_sinusoidal_positions_exponent_i_instead_of_2i():
    result = fails(
        "sinusoidal_positions",
        lambda max_len, d_model, dtype=np.float32: _table(max_len, d_model, dtype, two_i=False),
        "(50, 16): off by", "10000^(2i/d_model)",
    )  # fmt: skip
    assert not result.failed("one pair")  # pair 0 has the exponent 0 either way


def test_sinusoidal_positions_base_1000():
    fails(
        "sinusoidal_positions",
        lambda max_len, d_model, dtype=np.float32: _table(max_len, d_model, dtype, base=1000.0),
        "(50, 16): off by",
    )


def test_sinusoidal_positions_odd_d_model_accepted():
    result = fails(
        "sinusoidal_positions",
        lambda max_len, d_model, dtype=np.float32: _table(max_len, d_model, dtype, refuse=False),
        "odd d_model = 7: accepted it silently", "must be even",
    )  # fmt: skip
    assert len(result.failures) == 1


def test_sinusoidal_positions_ignores_the_dtype():
    result = fails(
        "sinusoidal_positions",
        lambda max_len, d_model, dtype=np.float32: _table(max_len, d_model, np.float64),
        "default dtype float32 (the library's), (64, 32): dtype float64, expected float32",
    )  # fmt: skip
    assert len(result.failures) == 1


def test_sinusoidal_positions_solution_is_the_chapter_one():
    assert check("sinusoidal_positions", solution("sinusoidal_positions"), quiet=True).passed
