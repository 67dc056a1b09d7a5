"""Graded exercises of Parts V-VIII (chapters 15-24): see foundations.py for the pattern.

Chapter 15b: flash attention's online softmax (`online_softmax_attention`). Chapter 18: RMSNorm forward and
backward (`rms_norm_forward`, `rms_norm_backward`) and rotary position embedding (`rope_forward`, `rope_backward`).
Chapter 17b: the nucleus of top-p sampling (`top_p_filter`). Chapter 19a: cutting images into patches (`patchify`).
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from tfm_common.sampling import nucleus

from ..attention import scaled_dot_product_attention
from ..flash import flash_attention
from ..modern import RMSNorm, apply_rope, rope_angles
from ..vit import patchify
from .grading import MISSING, Exercise, Grader, central_differences

__all__ = ["EXERCISES"]


# --- chapter 15b: the online softmax ---------------------------------------------------------------------------------

ONLINE_HINTS = {
    "out": "when the running max rises, rescale BOTH the running sum l and the running output acc by "
    "exp(m_old - m_new), and divide acc by l at the end",
    "lse": "lse = m + log(l): the log of the sum of exp(scores), with the running max m added back",
}


def _attention_inputs(rng, lead, tq, tk, dk=4, dv=5, dtype=np.float64, scale=1.0):
    q = rng.standard_normal((*lead, tq, dk)) * scale
    k = rng.standard_normal((*lead, tk, dk)) * scale
    v = rng.standard_normal((*lead, tk, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _exact(q, k, v):
    """The library's attention: the output of the explicit softmax (chapter 5), the lse of the tiled one."""
    return {"out": scaled_dot_product_attention(q, k, v)[0], "lse": flash_attention(q, k, v)[1]}


def grade_online_softmax_attention(g: Grader) -> None:
    rng = np.random.default_rng(1501)
    cases = (
        ("block_size 4 divides T = 12", (), 12, 12, 4),
        ("block_size 5 does not divide T = 12", (), 12, 12, 5),
        ("block_size 1", (), 7, 7, 1),
        ("block_size 32, more than T = 12", (), 12, 12, 32),
        ("leading dims (2, 3, T, d), block_size 3", (2, 3), 10, 10, 3),
        ("Tq = 4 queries, Tk = 9 keys, block_size 2", (2,), 4, 9, 2),
        ("T = 1", (1,), 1, 1, 2),
    )
    for label, lead, tq, tk, block in cases:
        q, k, v = _attention_inputs(rng, lead, tq, tk)
        g.gradients(label, g.run(label, q, k, v, block, hint=ONLINE_HINTS["out"]), _exact(q, k, v), tol=1e-10,
                 hints=ONLINE_HINTS)  # fmt: skip
    label = "large scores (about 1e3), block_size 3"
    q, k, v = _attention_inputs(rng, (2,), 12, 12, scale=30.0)  # scores q.k / 2 of about 1e3: exp(1e3) = inf
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # an overflow is a finding, not a warning
        got = g.run(label, q, k, v, 3)
    hints = {name: "exp overflowed: subtract the running max m before every exp" for name in ("out", "lse")}
    g.gradients(label, got, _exact(q, k, v), tol=1e-10, hints=hints)
    label = "float32, block_size 5"
    q, k, v = _attention_inputs(rng, (2,), 12, 12, dtype=np.float32)
    g.gradients(label, g.run(label, q, k, v, 5), _exact(q, k, v), tol=1e-5, dtype=np.float32, hints=ONLINE_HINTS)
    _grade_memory(g, rng)


def _grade_memory(g: Grader, rng) -> None:
    """Tq = Tk = 2048 and block_size 64: the peak memory stays below half of one (Tq, Tk) float64 array (32 MiB)."""
    label = "no (Tq, Tk) array: T = 2048, block_size 64"
    q, k, v = _attention_inputs(rng, (), 2048, 2048, dk=8, dv=8)
    full = q.shape[-2] * k.shape[-2] * q.itemsize  # bytes of one (Tq, Tk) array
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        got = g.run(label, q, k, v, 64)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
    if got is MISSING:
        return
    g.require(
        label,
        peak < full / 2,
        f"peak memory below half of one (Tq, Tk) array ({full / 2**20:.0f} MiB)",
        f"peak memory {peak / 2**20:.1f} MiB, one (Tq, Tk) array is {full / 2**20:.0f} MiB: walk the keys in blocks "
        "and keep only one (Tq, block_size) tile of scores at a time",
    )


# --- chapter 18: RMSNorm ---------------------------------------------------------------------------------------------


def _rms(gamma: np.ndarray, eps: float) -> RMSNorm:
    """The library's RMSNorm holding the weight `gamma` (d,)."""
    layer = RMSNorm(gamma.shape[0], eps=eps, dtype=gamma.dtype)
    layer.weight.data[...] = gamma
    return layer


def _rms_cases(rng):
    """(label, x, gamma, eps): random rows, leading dims, length 1, a constant row, small inputs where eps matters."""
    d = 8
    gamma = 1 + 0.3 * rng.standard_normal(d)  # away from 1, so that a dropped gamma shows
    const = rng.standard_normal((3, d))
    const[1] = 3.0  # a constant row: LayerNorm would give 0 there, RMSNorm gives gamma * 3 / sqrt(9 + eps)
    return (
        ("2-D input (N, d)", rng.standard_normal((3, d)), gamma, 1e-6),
        ("3-D input (B, T, d)", rng.standard_normal((2, 3, d)), gamma, 1e-6),
        ("length 1", rng.standard_normal((1, 1, d)), gamma, 1e-6),
        ("a constant row (x = 3 everywhere)", const, gamma, 1e-6),
        ("small inputs (|x| about 1e-2), eps = 1e-4", 1e-2 * rng.standard_normal((2, 3, d)), gamma, 1e-4),
    )


RMS_HINT = "y = gamma * x / sqrt(mean(x^2) + eps) over the last axis; no mean is subtracted"
RMS_HINTS = {
    "a constant row": "RMSNorm does not subtract the mean (that is LayerNorm): a constant row keeps its value, scaled "
    "to root mean square 1",
    "small inputs": "eps goes inside the square root: 1 / sqrt(mean(x^2) + eps)",
}


def _rms_hint(label: str) -> str:
    return next((h for key, h in RMS_HINTS.items() if label.startswith(key)), RMS_HINT)


def grade_rms_norm_forward(g: Grader) -> None:
    rng = np.random.default_rng(1801)
    for label, x, gamma, eps in _rms_cases(rng):
        hint = _rms_hint(label)
        got = g.run(label, x, gamma, eps, hint=hint)
        g.compare(label, got, _rms(gamma, eps)(x), tol=1e-12, hint=hint)
    x, gamma = rng.standard_normal((2, 3, 8)).astype(np.float32), (1 + 0.3 * rng.standard_normal(8)).astype(np.float32)
    g.compare("float32", g.run("float32", x, gamma, 1e-6), _rms(gamma, 1e-6)(x), tol=1e-5, dtype=np.float32)


RMS_BACKWARD_HINTS = {
    "dx": "with dxhat = dy * gamma and xhat = x * rrms: dx = rrms * (dxhat - xhat * mean(dxhat * xhat)), "
    "the projection term and no mean term",
    "dgamma": "dgamma sums dy * xhat over every leading axis",
}


def _rms_library_backward(dy, x, gamma, eps):
    layer = _rms(gamma, eps)
    layer(x)
    dx = layer.backward(dy)
    return {"dx": dx, "dgamma": layer.weight.grad}


def grade_rms_norm_backward(g: Grader) -> None:
    rng = np.random.default_rng(1802)
    for label, x, gamma, eps in _rms_cases(rng):
        if label == "length 1":
            continue
        dy = rng.standard_normal(x.shape)
        library = _rms_library_backward(dy, x, gamma, eps)
        numeric = central_differences(lambda x, gamma, eps=eps: _rms(gamma, eps)(x), {"x": x, "gamma": gamma}, dy)
        numeric = {"dx": numeric["x"], "dgamma": numeric["gamma"]}
        hints = dict(RMS_BACKWARD_HINTS)
        if label.startswith("small inputs"):
            hints["dx"] = RMS_HINTS["small inputs"] + "; " + hints["dx"]
        g.backward(label, g.run(label, dy, x, gamma, eps, hint=RMS_BACKWARD_HINTS["dx"]), library, numeric,
                   hints=hints)  # fmt: skip
    x, gamma = rng.standard_normal((2, 3, 8)).astype(np.float32), (1 + 0.3 * rng.standard_normal(8)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    got = g.run("float32", dy, x, gamma, 1e-6)
    g.gradients("float32", got, _rms_library_backward(dy, x, gamma, 1e-6), tol=1e-5)


# --- chapter 18: rotary position embedding ---------------------------------------------------------------------------

ROPE_HINT = (
    "pairs are (x[..., 2i], x[..., 2i+1]) (interleaved, not the two halves), each turned as "
    "(x0 cos - x1 sin, x0 sin + x1 cos)"
)
ROPE_BACKWARD_HINT = (
    "the transpose of a rotation turns by MINUS the angle: (g0 cos + g1 sin, -g0 sin + g1 cos) on the pairs (2i, 2i+1)"
)


def _rope_inputs(rng, shape, offset, dtype=np.float64):
    """x (..., T, d) and the tables (T, d/2) of positions offset .. offset + T - 1 (position 0 alone would not turn)."""
    t, d = shape[-2:]
    cos, sin = (table[offset:] for table in rope_angles(offset + t, d, dtype=dtype))
    return rng.standard_normal(shape).astype(dtype), cos, sin


ROPE_CASES = (
    ("2-D input (T, d)", (6, 8), 0),
    ("4-D input (B, H, T, d), positions 4 to 8", (2, 3, 5, 8), 4),
    ("T = 1 at position 5", (2, 1, 8), 5),
    ("d = 2: a single pair", (5, 2), 1),
)


def grade_rope_forward(g: Grader) -> None:
    rng = np.random.default_rng(1803)
    for label, shape, offset in ROPE_CASES:
        x, cos, sin = _rope_inputs(rng, shape, offset)
        g.compare(label, g.run(label, x, cos, sin, hint=ROPE_HINT), apply_rope(x, cos, sin), tol=1e-12, hint=ROPE_HINT)
    x, cos, sin = _rope_inputs(rng, (2, 5, 8), 3, np.float32)
    g.compare("float32", g.run("float32", x, cos, sin), apply_rope(x, cos, sin), tol=1e-6, dtype=np.float32)


def grade_rope_backward(g: Grader) -> None:
    rng = np.random.default_rng(1804)
    for label, shape, offset in ROPE_CASES:
        x, cos, sin = _rope_inputs(rng, shape, offset)
        dy = rng.standard_normal(shape)
        library = {"dx": apply_rope(dy, cos, -sin)}  # the rotation by minus the angle
        numeric = {"dx": central_differences(lambda x, cos=cos, sin=sin: apply_rope(x, cos, sin), {"x": x}, dy)["x"]}
        got = g.run(label, dy, cos, sin, hint=ROPE_BACKWARD_HINT)
        g.backward(label, got, library, numeric, hints={"dx": ROPE_BACKWARD_HINT})
    x, cos, sin = _rope_inputs(rng, (2, 5, 8), 3, np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    got = g.run("float32", dy, cos, sin)
    g.compare("float32", got, apply_rope(dy, cos, -sin), tol=1e-6, dtype=np.float32)


# --- chapter 17b: top-p (nucleus) filtering ----------------------------------------------------------------------

TOP_P_HINT = (
    "sort the probabilities in decreasing order, keep the tokens up to AND including the first at which the running "
    "sum reaches top_p, set the others to 0 and renormalize"
)


def _nucleus_probs(logits: np.ndarray, top_p: float) -> np.ndarray:
    """The library's nucleus (tfm_common.sampling, what `generate` draws from), renormalized: (B, V) float64."""
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p = nucleus(p, top_p) if top_p < 1 else p
    return p / p.sum(axis=-1, keepdims=True)


def _logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64))[None, :]


def grade_top_p_filter(g: Grader) -> None:
    rng = np.random.default_rng(1701)
    cases = (
        ("random logits (3, 10), top_p 0.9", 2 * rng.standard_normal((3, 10)), 0.9, TOP_P_HINT),
        ("random logits (4, 50), top_p 0.5", 3 * rng.standard_normal((4, 50)), 0.5, TOP_P_HINT),
        (
            "probabilities (0.1, 0.4, 0.2, 0.3), top_p 0.6: keeps 0.4 and 0.3",
            _logits_of([0.1, 0.4, 0.2, 0.3]),
            0.6,
            "0.4 alone is below 0.6: the token that crosses the threshold (0.3) is kept too; and the tokens are "
            "ranked by probability, not taken in vocabulary order",
        ),
        (
            "a sure model (one token of probability 0.97), top_p 0.9",
            _logits_of([0.01, 0.97, 0.01, 0.01]),
            0.9,
            "the first token already reaches top_p: the nucleus is that token alone, with probability 1",
        ),
        (
            "ties: probabilities (0.4, 0.2, 0.2, 0.2), top_p 0.5",
            _logits_of([0.2, 0.2, 0.4, 0.2]),
            0.5,
            "tokens tied with the last one kept are kept too (here all four): the nucleus is a set of probabilities, "
            "not of ranks",
        ),
        ("top_p 1: every token", rng.standard_normal((2, 8)), 1.0, "top_p = 1 keeps every token (plain softmax)"),
        ("one row, V = 1", rng.standard_normal((1, 1)), 0.3, TOP_P_HINT),
    )
    for label, logits, top_p, hint in cases:
        got = g.run(label, logits, top_p, hint=hint)
        g.compare(label, got, _nucleus_probs(logits, top_p), tol=1e-12, hint=hint)
    logits = rng.standard_normal((2, 5))
    for top_p in (0.0, 1.5):
        g.refuses(
            f"top_p = {top_p}",
            logits,
            top_p,
            expected="says top_p must be in (0, 1]",
        )


# --- chapter 19a: patches as tokens ---------------------------------------------------------------------------------

PATCH_HINT = (
    "split H into (H/p, p) and W into (W/p, p), move the two grid axes to the front, then flatten: "
    "(B, C, gh, p, gw, p) -> (B, gh, gw, C, p, p) -> (B, N, C p p); a reshape alone cuts stripes, not squares"
)
PATCH_CASES = (
    ("1 channel, 8 x 8, patch 4 (the digits' shape)", (2, 1, 8, 8), 4, PATCH_HINT),
    (
        "3 channels, 8 x 8, patch 2",
        (2, 3, 8, 8),
        2,
        "each patch is flattened channel first, (C, p, p): the order of a Conv2d weight (d, C, p, p)",
    ),
    (
        "a 4 x 8 image, patch 2: a grid of 2 x 4",
        (1, 2, 4, 8),
        2,
        "patches in row-major order: left to right along a row of patches, then the next row",
    ),
    ("patch 1: every pixel a token", (2, 3, 4, 4), 1, PATCH_HINT),
    ("patch 8 = the image: one token", (2, 3, 8, 8), 8, PATCH_HINT),
)


def grade_patchify(g: Grader) -> None:
    rng = np.random.default_rng(1901)
    for label, shape, p, hint in PATCH_CASES:
        images = rng.standard_normal(shape)
        g.compare(label, g.run(label, images, p, hint=hint), patchify(images, p), tol=1e-12, hint=hint)
    images = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    g.compare("float32", g.run("float32", images, 4), patchify(images, 4), tol=1e-12, dtype=np.float32)
    g.refuses(
        "an 8 x 6 image, patch 4 (6 is not a multiple of 4)",
        rng.standard_normal((1, 1, 8, 6)),
        4,
        expected="says the patch size must divide the height and the width (no pixels silently dropped)",
    )


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "online_softmax_attention",
        "15b_flash_attention",
        "online_softmax_attention(q, k, v, block_size) -> (out, lse): q (..., Tq, dk), k (..., Tk, dk), "
        "v (..., Tk, dv); out (..., Tq, dv), lse (..., Tq)",
        grade_online_softmax_attention,
    ),
    Exercise(
        "rms_norm_forward",
        "18_since_2017",
        "rms_norm_forward(x, gamma, eps) -> y: x (..., d), gamma (d,)",
        grade_rms_norm_forward,
    ),
    Exercise(
        "rms_norm_backward",
        "18_since_2017",
        "rms_norm_backward(dy, x, gamma, eps) -> (dx, dgamma): dy and x (..., d), gamma (d,)",
        grade_rms_norm_backward,
    ),
    Exercise(
        "rope_forward",
        "18_since_2017",
        "rope_forward(x, cos, sin) -> y: x (..., T, d), cos and sin (T, d/2)",
        grade_rope_forward,
    ),
    Exercise(
        "rope_backward",
        "18_since_2017",
        "rope_backward(dy, cos, sin) -> dx: dy (..., T, d), cos and sin (T, d/2)",
        grade_rope_backward,
    ),
    Exercise(
        "top_p_filter",
        "17b_gpt",
        "top_p_filter(logits, top_p) -> probs: logits (B, V), top_p in (0, 1]; probs (B, V), 0 outside each row's "
        "nucleus, rows summing to 1",
        grade_top_p_filter,
    ),
    Exercise(
        "patchify",
        "19a_vit",
        "patchify(images, patch_size) -> patches: images (B, C, H, W) -> (B, N, C p p), N = (H/p)(W/p)",
        grade_patchify,
    ),
)
