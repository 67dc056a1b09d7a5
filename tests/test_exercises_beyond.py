"""Wrong attempts at the exercises of Parts V-VIII (chapters 15b, 17b, 18 and 19a): each fails with a message that
points at the mistake."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers_exercises import fails, solution

import tfm_numpy as tnp
from tfm_numpy.exercises import check

# --- online_softmax_attention (chapter 15b) --------------------------------------------------------------------------


def _online(q, k, v, block_size, *, rescale_l=True, rescale_acc=True, use_max=True, last_block=True, lse_m=True):
    """The online softmax with one of its parts switchable off: each switch is a mistake people make."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = np.full((*q.shape[:-1], 1), -np.inf if use_max else 0.0, dtype=q.dtype)
    l = np.zeros_like(m)
    acc = np.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    stop = k.shape[-2] if last_block else k.shape[-2] - k.shape[-2] % block_size
    for start in range(0, stop, block_size):
        k_j, v_j = k[..., start : start + block_size, :], v[..., start : start + block_size, :]
        s = (q @ np.swapaxes(k_j, -1, -2)) * scale
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True)) if use_max else m
        p = np.exp(s - m_new)
        alpha = np.exp(m - m_new)
        l = (alpha if rescale_l else 1) * l + p.sum(axis=-1, keepdims=True)
        acc = (alpha if rescale_acc else 1) * acc + p @ v_j
        m = m_new
    return acc / l, ((m if lse_m else 0) + np.log(l))[..., 0]


def test_online_softmax_reference_attempt_passes():
    assert check("online_softmax_attention", _online, quiet=True).passed


def test_online_softmax_no_rescale():
    def attempt(q, k, v, block_size):
        return _online(q, k, v, block_size, rescale_l=False, rescale_acc=False)

    result = fails("online_softmax_attention", attempt, "block_size 4 divides T = 12: out: off by", "rescale BOTH")
    assert not result.failed("block_size 32, more than T = 12")  # one block: nothing to rescale, right by chance


def test_online_softmax_rescales_l_but_not_the_output():
    def attempt(q, k, v, block_size):
        return _online(q, k, v, block_size, rescale_acc=False)

    result = fails("online_softmax_attention", attempt, "block_size 5 does not divide T = 12: out: off by")
    assert result.failed("rescale BOTH the running sum l and the running output acc")
    assert not result.failed(": lse")  # the sum is right: only the output is off


def test_online_softmax_without_the_running_max_overflows_on_large_scores():
    def attempt(q, k, v, block_size):
        return _online(q, k, v, block_size, use_max=False)

    result = fails("online_softmax_attention", attempt, "large scores (about 1e3)", "subtract the running max")
    assert [f.check for f in result.failures] == [
        "large scores (about 1e3), block_size 3: out",
        "large scores (about 1e3), block_size 3: lse",
    ]  # right on ordinary scores: only the large ones show it


def test_online_softmax_drops_the_last_short_block():
    def attempt(q, k, v, block_size):
        return _online(q, k, v, block_size, last_block=False)

    result = fails("online_softmax_attention", attempt, "block_size 5 does not divide T = 12")
    assert not result.failed("block_size 4 divides T = 12")


def test_online_softmax_forms_the_whole_score_matrix():
    def attempt(q, k, v, block_size):  # right numbers, but the (Tq, Tk) scores and weights in memory
        out, _ = tnp.scaled_dot_product_attention(q, k, v)
        s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
        m = s.max(axis=-1, keepdims=True)
        return out, (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]

    result = fails("online_softmax_attention", attempt, "no (Tq, Tk) array", "walk the keys in blocks")
    assert len(result.failures) == 1


def test_online_softmax_lse_without_the_max():
    def attempt(q, k, v, block_size):  # log(l) alone: the log-sum-exp of the scores shifted by the running max
        return _online(q, k, v, block_size, lse_m=False)

    fails("online_softmax_attention", attempt, "lse: off by", "lse = m + log(l)")


def test_online_softmax_float32_upcast():
    def attempt(q, k, v, block_size):
        return _online(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), block_size)

    fails("online_softmax_attention", attempt, "float32, block_size 5: out: dtype float64, expected float32")


# --- rms_norm_forward / rms_norm_backward (chapter 18) ---------------------------------------------------------------


def _ms(x):
    return np.mean(x * x, axis=-1, keepdims=True)


def test_rms_norm_forward_subtracts_the_mean():
    def attempt(x, gamma, eps):  # LayerNorm without the bias
        c = x - x.mean(axis=-1, keepdims=True)
        return gamma * c / np.sqrt(_ms(c) + eps)

    fails("rms_norm_forward", attempt, "a constant row (x = 3 everywhere): off by", "that is LayerNorm")


def test_rms_norm_forward_eps_outside_the_sqrt():
    def attempt(x, gamma, eps):
        return gamma * x / (np.sqrt(_ms(x)) + eps)

    fails("rms_norm_forward", attempt, "small inputs (|x| about 1e-2), eps = 1e-4: off by", "eps goes inside")


def test_rms_norm_forward_root_of_the_sum():
    def attempt(x, gamma, eps):  # the norm, not the root mean square
        return gamma * x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)

    fails("rms_norm_forward", attempt, "2-D input (N, d): off by", "sqrt(mean(x^2) + eps)")


def test_rms_norm_forward_forgets_gamma():
    fails("rms_norm_forward", lambda x, gamma, eps: x / np.sqrt(_ms(x) + eps), "3-D input (B, T, d): off by")


def test_rms_norm_forward_float32_upcast():
    def attempt(x, gamma, eps):
        return gamma * x / np.sqrt(_ms(x.astype(np.float64)) + eps)

    fails("rms_norm_forward", attempt, "float32: dtype float64, expected float32")


def _rms_backward(dy, x, gamma, eps, *, projection=True, mean_term=False, dgamma_axes=None):
    rrms = 1 / np.sqrt(_ms(x) + eps)
    xhat, dxhat = x * rrms, dy * gamma
    dx = dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True) if projection else dxhat
    if mean_term:
        dx = dx - dxhat.mean(axis=-1, keepdims=True)
    dgamma = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0) if dgamma_axes is None else (dy * xhat).sum(dgamma_axes)
    return rrms * dx, dgamma


def test_rms_norm_backward_reference_attempt_passes():
    assert check("rms_norm_backward", _rms_backward, quiet=True).passed


def test_rms_norm_backward_missing_the_projection_term():
    def attempt(dy, x, gamma, eps):
        return _rms_backward(dy, x, gamma, eps, projection=False)

    result = fails("rms_norm_backward", attempt, "2-D input (N, d): dx: off by", "the projection term")
    assert not result.failed("dgamma")


def test_rms_norm_backward_with_layer_norm_mean_term():
    def attempt(dy, x, gamma, eps):
        return _rms_backward(dy, x, gamma, eps, mean_term=True)

    fails("rms_norm_backward", attempt, "3-D input (B, T, d): dx: off by", "no mean term")


def test_rms_norm_backward_dgamma_sums_only_the_first_axis():
    def attempt(dy, x, gamma, eps):
        return _rms_backward(dy, x, gamma, eps, dgamma_axes=0)

    result = fails("rms_norm_backward", attempt, "3-D input (B, T, d): dgamma: shape (3, 8), expected (8,)")
    assert not result.failed("2-D input (N, d)")  # right for (N, d), wrong for (B, T, d)


def test_rms_norm_backward_eps_outside_the_sqrt():
    def attempt(dy, x, gamma, eps):
        rrms = 1 / (np.sqrt(_ms(x)) + eps)
        xhat, dxhat = x * rrms, dy * gamma
        dx = rrms * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
        return dx, (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)

    fails("rms_norm_backward", attempt, "small inputs (|x| about 1e-2), eps = 1e-4: dx: off by", "eps goes inside")


def test_rms_norm_backward_returns_one_gradient():
    fails("rms_norm_backward", lambda dy, x, gamma, eps: _rms_backward(dy, x, gamma, eps)[0], "expected 2: dx, dgamma")


# --- rope_forward / rope_backward (chapter 18) -----------------------------------------------------------------------


def _turn(x0, x1, cos, sin):
    return x0 * cos - x1 * sin, x0 * sin + x1 * cos


def test_rope_forward_halves_pairing():
    def attempt(x, cos, sin):  # pairs (i, i + d/2): the other convention (GPT-NeoX, Llama in Hugging Face)
        h = x.shape[-1] // 2
        return np.concatenate(_turn(x[..., :h], x[..., h:], cos, sin), axis=-1)

    result = fails("rope_forward", attempt, "2-D input (T, d): off by", "interleaved, not the two halves")
    assert not result.failed("d = 2: a single pair")  # one pair: both conventions agree


def test_rope_forward_signs_swapped():
    def attempt(x, cos, sin):  # turns by minus the angle
        y = np.empty_like(x)
        y[..., 0::2], y[..., 1::2] = _turn(x[..., 0::2], x[..., 1::2], cos, -sin)
        return y

    fails("rope_forward", attempt, "d = 2: a single pair: off by", "(x0 cos - x1 sin, x0 sin + x1 cos)")


def test_rope_forward_concatenates_instead_of_interleaving():
    def attempt(x, cos, sin):  # the right pairs, written back as two halves
        return np.concatenate(_turn(x[..., 0::2], x[..., 1::2], cos, sin), axis=-1)

    result = fails("rope_forward", attempt, "4-D input (B, H, T, d), positions 4 to 8: off by")
    assert not result.failed("d = 2")


def test_rope_forward_in_place_uses_the_new_x0():
    def attempt(x, cos, sin):  # x0 is a view: after the first line it holds the rotated values
        x0, x1 = x[..., 0::2], x[..., 1::2]
        x0[...] = x0 * cos - x1 * sin
        x1[...] = x0 * sin + x1 * cos
        return x

    fails("rope_forward", attempt, "2-D input (T, d): off by")


def test_rope_forward_float32_tables_upcast():
    def attempt(x, cos, sin):
        return solution("rope_forward")(x.astype(np.float64), cos.astype(np.float64), sin.astype(np.float64))

    fails("rope_forward", attempt, "float32: dtype float64, expected float32")


def test_rope_backward_rotates_by_plus_the_angle():
    result = fails("rope_backward", solution("rope_forward"), "2-D input (T, d): dx: off by", "MINUS the angle")
    assert len(result.failures) == 5  # every case, float32 included


def test_rope_backward_halves_pairing():
    def attempt(dy, cos, sin):
        h = dy.shape[-1] // 2
        return np.concatenate(_turn(dy[..., :h], dy[..., h:], cos, -sin), axis=-1)

    result = fails("rope_backward", attempt, "4-D input (B, H, T, d), positions 4 to 8: dx: off by")
    assert not result.failed("d = 2")


def test_rope_backward_returns_the_gradient_unturned():
    fails("rope_backward", lambda dy, cos, sin: dy.copy(), "T = 1 at position 5: dx: off by", "(2i, 2i+1)")


def test_rope_backward_negates_the_cosine_too():
    def attempt(dy, cos, sin):  # turning by pi + angle: both members of the pair flipped
        return solution("rope_forward")(dy, -cos, -sin)

    fails("rope_backward", attempt, "dx: off by")


# --- top_p_filter (chapter 17b) -------------------------------------------------------------------------------------


def _softmax(logits):
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _top_p(logits, top_p, *, include_crossing=True, by_rank=False, sort=True, renormalize=True):
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    p = _softmax(logits)
    order = np.argsort(-p, axis=-1, kind="stable") if sort else np.broadcast_to(np.arange(p.shape[-1]), p.shape)
    ranked = np.take_along_axis(p, order, axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked  # the mass of the tokens ranked above each one
    keep_ranked = before < top_p if include_crossing else np.cumsum(ranked, axis=-1) <= top_p
    if by_rank:  # exactly the ranks kept: ties with the last one kept are dropped
        keep = np.zeros_like(keep_ranked)
        np.put_along_axis(keep, order, keep_ranked, axis=-1)
    else:
        smallest = np.where(keep_ranked, ranked, np.inf).min(axis=-1, keepdims=True)
        keep = p >= smallest
    q = np.where(keep, p, 0.0)
    return q / q.sum(axis=-1, keepdims=True) if renormalize else q


def test_top_p_reference_attempt_passes():
    assert check("top_p_filter", _top_p, quiet=True).passed


def test_top_p_excludes_the_token_that_crosses_the_threshold():
    def attempt(logits, top_p):
        return _top_p(logits, top_p, include_crossing=False)

    result = fails("top_p_filter", attempt, "top_p 0.6: keeps 0.4 and 0.3: off by", "the token that crosses")
    assert result.failed("a sure model")  # its only token crosses 0.9 at once: nothing would be left


def test_top_p_without_sorting():
    def attempt(logits, top_p):  # the running sum in vocabulary order
        return _top_p(logits, top_p, sort=False)

    fails("top_p_filter", attempt, "random logits (3, 10), top_p 0.9: off by", "ranked by probability")


def test_top_p_drops_ties_with_the_last_token_kept():
    def attempt(logits, top_p):
        return _top_p(logits, top_p, by_rank=True)

    result = fails("top_p_filter", attempt, "ties: probabilities (0.4, 0.2, 0.2, 0.2), top_p 0.5: off by")
    assert result.failed("a set of probabilities, not of ranks") and len(result.failures) == 1


def test_top_p_not_renormalized():
    def attempt(logits, top_p):
        return _top_p(logits, top_p, renormalize=False)

    result = fails("top_p_filter", attempt, "random logits (4, 50), top_p 0.5: off by")
    assert not result.failed("top_p 1: every token")  # nothing removed: the sum is already 1


def test_top_p_accepts_any_top_p():
    def attempt(logits, top_p):
        return _top_p(logits, min(max(top_p, 1e-9), 1.0))

    fails("top_p_filter", attempt, "top_p = 0.0: accepted it silently", "top_p must be in (0, 1]")


# --- patchify (chapter 19a) -----------------------------------------------------------------------------------------


def _patchify(images, p, order=(0, 2, 4, 1, 3, 5)):
    B, C, H, W = images.shape
    if H % p or W % p:
        raise ValueError(f"patch size {p} must divide {H} and {W}")
    return images.reshape(B, C, H // p, p, W // p, p).transpose(order).reshape(B, (H // p) * (W // p), C * p * p)


def test_patchify_reshape_without_transpose():
    def attempt(images, p):  # stripes of p*p consecutive pixels, not squares
        return images.reshape(images.shape[0], -1, images.shape[1] * p * p)

    result = fails("patchify", attempt, "1 channel, 8 x 8, patch 4 (the digits' shape): off by", "stripes")
    assert result.failed("accepted it silently")  # 8 x 6 has 48 = 3 x 16 pixels: the reshape goes through


def test_patchify_channel_last():
    def attempt(images, p):  # each patch flattened (p, p, C): the order of an image file, not of a Conv2d weight
        return _patchify(images, p, (0, 2, 4, 3, 5, 1))

    result = fails("patchify", attempt, "3 channels, 8 x 8, patch 2: off by", "channel first")
    assert not result.failed("1 channel")  # one channel: both orders agree


def test_patchify_column_major_patches():
    def attempt(images, p):  # the patches taken top to bottom, then left to right
        return _patchify(images, p, (0, 4, 2, 1, 3, 5))

    fails("patchify", attempt, "a 4 x 8 image, patch 2: a grid of 2 x 4: off by", "row-major order")


def test_patchify_drops_the_pixels_that_do_not_fit():
    def attempt(images, p):  # crops silently
        H, W = images.shape[-2:]
        return _patchify(images[..., : H - H % p, : W - W % p], p)

    result = fails("patchify", attempt, "an 8 x 6 image, patch 4", "accepted it silently")
    assert len(result.failures) == 1


def test_patchify_float32_upcast():
    fails("patchify", lambda images, p: _patchify(images.astype(np.float64), p), "float32: dtype float64")


@pytest.mark.parametrize(
    "name",
    [
        "online_softmax_attention",
        "rms_norm_forward",
        "rms_norm_backward",
        "rope_forward",
        "rope_backward",
        "top_p_filter",
        "patchify",
    ],
)
def test_solution_is_the_chapter_one(name):
    assert check(name, solution(name), quiet=True).passed
