"""Graded exercises of Part II (chapters 5-7): scaled dot-product attention with a mask, forward and backward; the
split into heads and the merge back; the sinusoidal table. See foundations.py for the pattern.

The expected values come from the library: `scaled_dot_product_attention` and its backward (chapter 5), the
`_split` and `_merge` of `MultiHeadAttention` (chapter 6), `sinusoidal_positional_encoding` (chapter 7).
"""

from __future__ import annotations

import numpy as np

from ..attention import MultiHeadAttention, scaled_dot_product_attention, scaled_dot_product_attention_backward
from ..masks import causal_mask, decoder_mask, padding_mask
from ..positional import sinusoidal_positional_encoding
from .grading import MISSING, Exercise, Finding, Grader, central_differences

__all__ = ["EXERCISES"]


def _hinted(g: Grader, start: int, hints: dict) -> None:
    """Append the hint of its part ("check: dq" -> hints["dq"]) to every failed finding from `start` on that lacks
    it: `Grader.compare` gives no hint with a NaN or a wrong shape, where a reader needs it most (a wrong dtype
    needs none: the message says it all)."""
    for i, f in enumerate(g.result.findings[start:], start):
        hint = hints.get(f.check.rsplit(": ", 1)[-1], "")
        if not f.passed and hint and hint not in f.detail and not f.detail.startswith("dtype "):
            g.result.findings[i] = Finding(f.check, False, f"{f.detail}. {hint}")


def _compare(g: Grader, check: str, got, expected, *, tol: float, dtype=None, hint: str = "") -> bool:
    """`g.compare`, with the hint also after a NaN, a wrong shape or a wrong dtype."""
    start = len(g.result.findings)
    ok = g.compare(check, got, expected, tol=tol, dtype=dtype, hint=hint)
    _hinted(g, start, {check.rsplit(": ", 1)[-1]: hint})
    return ok


def _tuple(g: Grader, check: str, got, expected: dict, *, tol: float, dtype=None, hints: dict | None = None) -> bool:
    """A returned tuple (in the order of `expected`'s names) against the library, each with its dtype when given;
    one finding for the whole case when every part passes (as `Grader.gradients`, which checks no dtype)."""
    if got is MISSING:
        return False
    names = list(expected)
    if not isinstance(got, tuple | list) or len(got) != len(names):
        n = len(got) if isinstance(got, tuple | list) else 1
        return g.record(check, False, f"returned {n} value(s), expected {len(names)}: {', '.join(names)}")
    hints, start = hints or {}, len(g.result.findings)
    ok = [
        g.compare(f"{check}: {name}", a, expected[name], tol=tol, dtype=dtype, hint=hints.get(name, ""))
        for name, a in zip(names, got, strict=True)
    ]
    _hinted(g, start, hints)
    if all(ok):
        shapes = ", ".join(f"{name} {np.shape(a)}" for name, a in zip(names, got, strict=True))
        g.result.findings[-len(names) :] = [Finding(check, True, f"{shapes} within {tol:.0e} of the library")]
    return all(ok)


# --- chapter 5: scaled dot-product attention ----------------------------------------------------------------------

_RIGHT_PADDED = np.array([[3, 4, 5, 0, 0], [3, 4, 5, 6, 7]])  # sequence 0: 3 tokens, 2 pads (pad id 0)
_LEFT_PADDED = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])  # under the decoder mask its first 2 queries see nothing
_EMPTY_ROW = "a query with nothing to attend to gets zero weights and a zero output (the library's choice), not NaN"
_MASK_HINT = "mask True = may attend, False = hidden (the opposite of torch.nn.MultiheadAttention's boolean masks)"
_BACKWARD_HINT = "dv = P^T dout and dP = dout v^T: with Tq != Tk a product in the wrong order does not fit"
_FORWARD_HINT = "out = softmax(q k^T / sqrt(d_k)) v, softmax over the keys, masked keys (mask False) weight 0"


def _attention_cases():
    """(label, leading dims, Tq, Tk, mask, hint): every case of chapter 5, d_k = 8, d_v = 5 (all sizes differ)."""
    return (
        ("no mask, Tq=4 != Tk=6", (2, 3), 4, 6, None, "the scores are q k^T / sqrt(d_k), shape (..., Tq, Tk)"),
        ("padding mask (B, 1, 1, Tk)", (2, 3), 5, 5, padding_mask(_RIGHT_PADDED, 0), _MASK_HINT),
        ("causal mask (1, 1, T, T)", (2, 3), 5, 5, causal_mask(5), _MASK_HINT),
        ("fully masked rows (decoder mask, left padding)", (2, 3), 5, 5, decoder_mask(_LEFT_PADDED, 0), _EMPTY_ROW),
        ("length 1 (Tq = Tk = 1)", (2, 3), 1, 1, None, ""),
        ("3-D inputs (B, T, d), no head axis", (2,), 4, 6, None, "swap the LAST two axes of k: any leading dims"),
    )


def _run(g: Grader, check: str, *args, hint: str = ""):
    """`g.run` with NumPy's floating-point warnings silenced: an overflow or a NaN in the attempt is reported as a
    finding (the value is compared), not as a warning, nor as an error where warnings are errors."""
    with np.errstate(all="ignore"):
        return g.run(check, *args, hint=hint)


def _qkv(rng, lead, Tq, Tk, dtype=np.float64, d_k=8, d_v=5, scale=1.0):
    q = (scale * rng.standard_normal((*lead, Tq, d_k))).astype(dtype)
    k = (scale * rng.standard_normal((*lead, Tk, d_k))).astype(dtype)
    return q, k, rng.standard_normal((*lead, Tk, d_v)).astype(dtype)


def grade_attention_forward(g: Grader) -> None:
    rng = np.random.default_rng(501)
    for label, lead, Tq, Tk, mask, hint in _attention_cases():
        q, k, v = _qkv(rng, lead, Tq, Tk)
        out, w = scaled_dot_product_attention(q, k, v, mask)
        hint = hint or _FORWARD_HINT
        got = _run(g, label, q, k, v, mask, hint=hint)
        _tuple(g, label, got, {"output": out, "weights": w}, tol=1e-12, hints={"output": hint, "weights": hint})
    label = "large scores (q, k times 30)"
    q, k, v = _qkv(rng, (2, 3), 4, 6, scale=30.0)
    out, w = scaled_dot_product_attention(q, k, v)
    hint = "subtract each row's maximum score before exp (exp overflows past 709)"
    got = _run(g, label, q, k, v, None, hint=hint)
    _tuple(g, label, got, {"output": out, "weights": w}, tol=1e-12, hints={"output": hint, "weights": hint})
    label = "float32, padding mask"
    q, k, v = _qkv(rng, (2, 3), 5, 5, np.float32)
    mask = padding_mask(_RIGHT_PADDED, 0)
    out, w = scaled_dot_product_attention(q, k, v, mask)
    got = _run(g, label, q, k, v, mask)
    _tuple(g, label, got, {"output": out, "weights": w}, tol=1e-5, dtype=np.float32)


def grade_attention_backward(g: Grader) -> None:
    rng = np.random.default_rng(502)
    hints = {
        "dq": "dq = dS k / sqrt(d_k) with dS = P * (dP - rowsum(dP * P)), dP = dout v^T",
        "dk": "dk = dS^T q / sqrt(d_k), shaped like k (..., Tk, d_k)",
        "dv": "dv = P^T dout, shaped like v (..., Tk, d_v)",
    }
    for label, lead, Tq, Tk, mask, hint in _attention_cases():
        if label.startswith("3-D"):  # the forward's check of leading dims is enough
            continue
        q, k, v = _qkv(rng, lead, Tq, Tk)
        out, w = scaled_dot_product_attention(q, k, v, mask)
        dout = rng.standard_normal(out.shape)
        dq, dk, dv = scaled_dot_product_attention_backward(dout, q, k, v, w)
        numeric = central_differences(
            lambda q, k, v, mask=mask: scaled_dot_product_attention(q, k, v, mask)[0], {"q": q, "k": k, "v": v}, dout
        )
        numeric = {"dq": numeric["q"], "dk": numeric["k"], "dv": numeric["v"]}
        case_hints = {name: f"{h}; {hint}" if hint == _EMPTY_ROW else h for name, h in hints.items()}
        run_hint = hint if hint in (_EMPTY_ROW, _MASK_HINT) else _BACKWARD_HINT
        got, start = _run(g, label, dout, q, k, v, mask, hint=run_hint), len(g.result.findings)
        g.backward(label, got, {"dq": dq, "dk": dk, "dv": dv}, numeric, hints=case_hints)
        _hinted(g, start, case_hints)
    label = "float32, padding mask"
    q, k, v = _qkv(rng, (2, 3), 5, 5, np.float32)
    mask = padding_mask(_RIGHT_PADDED, 0)
    out, w = scaled_dot_product_attention(q, k, v, mask)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = scaled_dot_product_attention_backward(dout, q, k, v, w)
    got = _run(g, label, dout, q, k, v, mask)
    _tuple(g, label, got, {"dq": dq, "dk": dk, "dv": dv}, tol=1e-5, dtype=np.float32, hints=hints)


# --- chapter 6: the split into heads and the merge ----------------------------------------------------------------

_SPLIT_HINT = (
    "reshape to (B, T, H, D/H), then transpose to (B, H, T, D/H): a bare reshape to (B, H, T, D/H) mixes tokens"
)
_MERGE_HINT = "transpose to (B, T, H, d), then reshape to (B, T, H*d): a bare reshape mixes tokens"


def _mha(d_model: int, n_heads: int, dtype) -> MultiHeadAttention:
    return MultiHeadAttention(d_model, n_heads, rng=0, dtype=dtype)


def grade_split_heads(g: Grader) -> None:
    rng = np.random.default_rng(601)
    cases = (
        ("(B, T, D) = (2, 5, 12), 3 heads", (2, 5, 12), 3),
        ("(B, T, D) = (1, 4, 8), 2 heads", (1, 4, 8), 2),
        ("one head", (2, 5, 8), 1),
        ("length 1 (T = 1), 4 heads", (2, 1, 12), 4),
    )
    for label, shape, n_heads in cases:
        x = rng.standard_normal(shape)
        expected = _mha(shape[-1], n_heads, np.float64)._split(x)
        _compare(g, label, g.run(label, x, n_heads, hint=_SPLIT_HINT), expected, tol=1e-12, hint=_SPLIT_HINT)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    expected = _mha(12, 3, np.float32)._split(x)
    _compare(g, "float32", g.run("float32", x, 3), expected, tol=1e-6, dtype=np.float32, hint=_SPLIT_HINT)
    x = rng.standard_normal((2, 5, 12))  # 12 = 5 * 2 + 2: x.reshape(B, -1, 5, 2) runs and makes 6 "positions"
    g.refuses("D = 12 with 5 heads", x, 5, expected="says D must be divisible by n_heads")


def grade_merge_heads(g: Grader) -> None:
    rng = np.random.default_rng(602)
    cases = (
        ("(B, H, T, d) = (2, 3, 5, 4)", (2, 3, 5, 4)),
        ("(B, H, T, d) = (1, 2, 4, 3)", (1, 2, 4, 3)),
        ("one head", (2, 1, 5, 8)),
        ("length 1 (T = 1), 4 heads", (2, 4, 1, 3)),
    )
    for label, shape in cases:
        x = rng.standard_normal(shape)
        B, H, T, d = shape
        expected = _mha(H * d, H, np.float64)._merge(x)
        _compare(g, label, g.run(label, x, hint=_MERGE_HINT), expected, tol=1e-12, hint=_MERGE_HINT)
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    expected = _mha(12, 3, np.float32)._merge(x)
    _compare(g, "float32", g.run("float32", x), expected, tol=1e-6, dtype=np.float32, hint=_MERGE_HINT)
    label = "inverse of the library's split"
    x = rng.standard_normal((2, 5, 12))
    _compare(g, label, g.run(label, _mha(12, 3, np.float64)._split(x)), x, tol=1e-12, hint=_MERGE_HINT)


# --- chapter 7: the sinusoidal table ------------------------------------------------------------------------------

_PE_HINT = "PE[p, 2i] = sin(p / 10000^(2i/d_model)), PE[p, 2i+1] = cos(the same angle): the pairs interleave"


def grade_sinusoidal_positions(g: Grader) -> None:
    cases = (
        ("float64, (max_len, d_model) = (50, 16)", 50, 16),
        ("float64, d_model = 2 (one pair)", 10, 2),
        ("float64, max_len = 1", 1, 8),
        ("float64, (max_len, d_model) = (100, 512)", 100, 512),
    )
    for label, max_len, d_model in cases:
        expected = sinusoidal_positional_encoding(max_len, d_model, dtype=np.float64)
        got = g.run(label, max_len, d_model, dtype=np.float64, hint=_PE_HINT)
        _compare(g, label, got, expected, tol=1e-12, dtype=np.float64, hint=_PE_HINT)
    label = "default dtype float32 (the library's), (64, 32)"
    expected = sinusoidal_positional_encoding(64, 32)
    got = g.run(label, 64, 32, hint="the default is dtype=np.float32")
    _compare(g, label, got, expected, tol=1e-5, dtype=np.float32, hint=_PE_HINT)
    g.refuses("odd d_model = 7", 10, 7, expected="says d_model must be even (the columns come in sin, cos pairs)")


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "attention_forward",
        "05_attention",
        "attention_forward(q, k, v, mask=None) -> (out, weights): q (..., Tq, d_k), k (..., Tk, d_k), "
        "v (..., Tk, d_v), mask boolean (True = may attend) broadcasting to (..., Tq, Tk)",
        grade_attention_forward,
    ),
    Exercise(
        "attention_backward",
        "05_attention",
        "attention_backward(dout, q, k, v, mask=None) -> (dq, dk, dv): dout (..., Tq, d_v)",
        grade_attention_backward,
    ),
    Exercise(
        "split_heads",
        "06_multi_head_attention",
        "split_heads(x, n_heads) -> (B, H, T, D/H): x (B, T, D); a ValueError when D % n_heads != 0",
        grade_split_heads,
    ),
    Exercise(
        "merge_heads",
        "06_multi_head_attention",
        "merge_heads(x) -> (B, T, H*d): x (B, H, T, d)",
        grade_merge_heads,
    ),
    Exercise(
        "sinusoidal_positions",
        "07_positional_encoding",
        "sinusoidal_positions(max_len, d_model, dtype=np.float32) -> PE (max_len, d_model) in dtype; "
        "a ValueError for an odd d_model",
        grade_sinusoidal_positions,
    ),
)
