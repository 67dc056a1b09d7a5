"""Wrong attempts at the exercises of Parts III-IV (chapters 8-13): each fails with a message that points at the
mistake, and the chapter's own worked solution passes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_exercises import fails, solution

from tfm_numpy.exercises import check


@pytest.mark.parametrize(
    "name",
    [
        "residual_forward",
        "residual_backward",
        "decoder_mask",
        "noam_lr",
        "adam_step",
        "length_penalty",
        "hypothesis_score",
    ],
)
def test_the_chapter_solution_passes(name):
    result = check(name, solution(name), quiet=True)
    assert result.passed, result.report()


# --- residual_forward (chapter 8) ----------------------------------------------------------------------------------


def test_residual_forward_post_ln_normalizes_the_sublayer_only():
    def attempt(x, sublayer, norm, norm_first):  # x + norm(F(x)): the norm on the branch, not on the sum
        return x + sublayer(norm(x)) if norm_first else x + norm(sublayer(x))

    result = fails("residual_forward", attempt, "Post-LN, (B, T, d): off by", "norm(x + sublayer(x))")
    assert not result.failed("Pre-LN")


def test_residual_forward_pre_ln_normalizes_the_output_too():
    def attempt(x, sublayer, norm, norm_first):
        return norm(x + sublayer(norm(x))) if norm_first else norm(x + sublayer(x))

    result = fails("residual_forward", attempt, "Pre-LN, (B, T, d): off by", "no norm on the output")
    assert not result.failed("Post-LN")


def test_residual_forward_swaps_the_placements():
    def attempt(x, sublayer, norm, norm_first):  # norm_first read the wrong way round
        return norm(x + sublayer(x)) if norm_first else x + sublayer(norm(x))

    fails("residual_forward", attempt, "Post-LN, (B, T, d): off by", "Pre-LN, (B, T, d): off by")


def test_residual_forward_without_the_skip():
    def attempt(x, sublayer, norm, norm_first):
        return sublayer(norm(x)) if norm_first else norm(sublayer(x))

    fails("residual_forward", attempt, "Post-LN, length 1: off by", "Pre-LN, length 1: off by")


def test_residual_forward_float64_only():
    def attempt(x, sublayer, norm, norm_first):
        x = x.astype(np.float64)
        return x + sublayer(norm(x)) if norm_first else norm(x + sublayer(x))

    fails("residual_forward", attempt, "Post-LN, float32: raised")


# --- residual_backward (chapter 8) ---------------------------------------------------------------------------------


def _forward(x, sublayer, norm, norm_first):
    return x + sublayer(norm(x)) if norm_first else norm(x + sublayer(x))


def test_residual_backward_forgets_the_skip_path():
    def attempt(dy, x, sublayer, norm, norm_first):
        _forward(x, sublayer, norm, norm_first)
        if norm_first:
            return norm.backward(sublayer.backward(dy))
        return sublayer.backward(norm.backward(dy))

    fails("residual_backward", attempt, "Post-LN, (B, T, d): dx: off by", "Pre-LN, (B, T, d): dx: off by", "skip path")


def test_residual_backward_post_ln_skip_carries_dy():
    def attempt(dy, x, sublayer, norm, norm_first):  # chapter 8's exercise 5: dy instead of J_LN^T dy on the skip
        _forward(x, sublayer, norm, norm_first)
        if norm_first:
            return dy + norm.backward(sublayer.backward(dy))
        return dy + sublayer.backward(norm.backward(dy))

    result = fails("residual_backward", attempt, "Post-LN, (B, T, d): dx: off by", "carries dz, not dy")
    assert not result.failed("Pre-LN")


def test_residual_backward_pre_ln_skips_the_norm_backward():
    def attempt(dy, x, sublayer, norm, norm_first):
        _forward(x, sublayer, norm, norm_first)
        if norm_first:
            return dy + sublayer.backward(dy)  # the branch's norm left out of the chain
        dz = norm.backward(dy)
        return dz + sublayer.backward(dz)

    result = fails("residual_backward", attempt, "Pre-LN, (B, T, d): dx: off by", "Pre-LN: dx = dy + norm's backward")
    assert not result.failed("Post-LN")


def test_residual_backward_without_running_the_forward():
    def attempt(dy, x, sublayer, norm, norm_first):  # the modules have no cache: their backward refuses
        if norm_first:
            return dy + norm.backward(sublayer.backward(dy))
        dz = norm.backward(dy)
        return dz + sublayer.backward(dz)

    fails("residual_backward", attempt, "raised RuntimeError", "run the forward first")


def test_residual_backward_backward_in_the_forward_order():
    def attempt(dy, x, sublayer, norm, norm_first):  # Post-LN: the sublayer's backward before the norm's
        _forward(x, sublayer, norm, norm_first)
        if norm_first:
            return dy + norm.backward(sublayer.backward(dy))
        dz = dy + sublayer.backward(dy)
        return norm.backward(dz)

    fails("residual_backward", attempt, "Post-LN, (B, T, d): dx: off by")


# --- noam_lr (chapter 12) ------------------------------------------------------------------------------------------


def _noam(step, d_model, warmup, factor=1.0):
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def test_noam_lr_max_instead_of_min():
    def attempt(step, d_model, warmup, factor=1.0):
        _noam(step, d_model, warmup)
        return factor * d_model**-0.5 * max(step**-0.5, step * warmup**-1.5)

    fails("noam_lr", attempt, "the paper: d_model 512, warmup 4000, steps", "min(step^-0.5")


def test_noam_lr_step_from_zero():
    def attempt(step, d_model, warmup, factor=1.0):  # t counted from 0: the first update gets lr 0
        return factor * d_model**-0.5 * min(max(step - 1, 1e-300) ** -0.5, (step - 1) * warmup**-1.5)

    fails("noam_lr", attempt, "off by", "step counting from 1")


def test_noam_lr_step_zero_gives_zero():
    def attempt(step, d_model, warmup, factor=1.0):  # the paper's formula, with step 0 silently 0
        return 0.0 if step == 0 else _noam(step, d_model, warmup, factor)

    result = fails("noam_lr", attempt, "step 0: accepted it silently")
    assert not result.failed("the paper")


def test_noam_lr_step_zero_divides_by_zero():
    def attempt(step, d_model, warmup, factor=1.0):
        return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)

    fails("noam_lr", attempt, "step 0: raised ZeroDivisionError", "expected a ValueError")


def test_noam_lr_ignores_the_factor():
    def attempt(step, d_model, warmup, factor=1.0):
        return _noam(step, d_model, warmup)

    result = fails("noam_lr", attempt, "chapter 12: d_model 64, warmup 100, factor 0.2")
    assert not result.failed("the paper")


def test_noam_lr_warmup_to_the_minus_half():
    def attempt(step, d_model, warmup, factor=1.0):
        _noam(step, d_model, warmup)
        return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-0.5)

    fails("noam_lr", attempt, "the paper: d_model 512, warmup 4000")


# --- adam_step (chapter 12) ----------------------------------------------------------------------------------------


def _adam(param, grad, m, v, t, lr, betas, eps, weight_decay, *, correct=True, eps_inside=False, t0=0, decoupled=False):
    beta1, beta2 = betas
    g = grad if decoupled else grad + weight_decay * param
    if decoupled:
        param = param * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    t = t + t0
    m_hat, v_hat = (m / (1 - beta1**t), v / (1 - beta2**t)) if correct else (m, v)
    denom = np.sqrt(v_hat + eps) if eps_inside else np.sqrt(v_hat) + eps
    return param - lr * m_hat / denom, m, v


def test_adam_step_without_bias_correction():
    result = fails(
        "adam_step", lambda *a: _adam(*a, correct=False), "first step, t = 1 (zero moments): param: off by", "m_hat"
    )
    assert not result.failed("first step, t = 1 (zero moments): m")


def test_adam_step_eps_inside_the_sqrt():
    result = fails(
        "adam_step", lambda *a: _adam(*a, eps_inside=True), "tiny gradients 1e-12", "eps outside the square root"
    )
    assert not result.failed("step t = 5")


def test_adam_step_t_from_zero():
    # the step number one too high (t counted as if the first step were t = 0 and then incremented before use)
    fails("adam_step", lambda *a: _adam(*a, t0=1), "first step, t = 1 (zero moments): param: off by", "t = 1 at the")


def test_adam_step_decoupled_weight_decay():
    result = fails("adam_step", lambda *a: _adam(*a, decoupled=True), "weight decay 0.1 (L2, in the gradient)")
    assert not result.failed("step t = 5")


def test_adam_step_squares_the_moment_not_the_gradient():
    def attempt(param, grad, m, v, t, lr, betas, eps, weight_decay):
        beta1, beta2 = betas
        g = grad + weight_decay * param
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * m * m
        return param - lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps), m, v

    fails("adam_step", attempt, "step t = 5: v: off by", "grad^2")


def test_adam_step_float64_out():
    def attempt(*a):
        return tuple(x.astype(np.float64) for x in _adam(*a))

    fails("adam_step", attempt, "float32: param: dtype float64, expected float32")


# --- length_penalty (chapter 13) -----------------------------------------------------------------------------------


def test_length_penalty_plain_power():
    fails("length_penalty", lambda length, alpha: np.asarray(length, float) ** alpha, "one length, |Y| = 10", "Wu")


def test_length_penalty_precedence():
    result = fails("length_penalty", lambda length, alpha: (5 + np.asarray(length)) / 6**alpha, "alpha 0.6: off by")
    assert result.failed("the whole fraction to the power alpha")


def test_length_penalty_times_alpha():
    fails("length_penalty", lambda length, alpha: (5 + np.asarray(length)) / 6 * alpha, "alpha 0: no penalty")


def test_length_penalty_integer_division():
    fails("length_penalty", lambda length, alpha: ((5 + np.asarray(length)) // 6) ** alpha, "alpha 0.6: off by")


# --- hypothesis_score (chapter 13) ---------------------------------------------------------------------------------


def _score(token_logp, tokens, eos_id, pad_id, alpha, *, eos_counts=True, past_eos=False, pads=False, lp=None):
    is_eos = tokens == eos_id
    before = (np.cumsum(is_eos, axis=1) - is_eos == 0) if eos_counts else np.cumsum(is_eos, axis=1) == 0
    counted = np.ones_like(before) if pads else (before | past_eos) & (tokens != pad_id)
    n = counted.sum(axis=1)
    penalty = ((5 + n) / 6) ** alpha if lp is None else lp(n, alpha)
    return np.where(counted, token_logp, 0.0).sum(axis=1) / penalty


def test_hypothesis_score_divides_by_the_length():
    fails("hypothesis_score", lambda *a: _score(*a, lp=lambda n, alpha: n), "alpha 0.6: off by", "length_penalty")


def test_hypothesis_score_without_the_eos():
    fails("hypothesis_score", lambda *a: _score(*a, eos_counts=False), "5 hypotheses, alpha 0.6: off by")


def test_hypothesis_score_past_the_first_eos():
    result = fails("hypothesis_score", lambda *a: _score(*a, past_eos=True), "off by", "at index (3,)")
    assert not result.failed("one hypothesis of length 1")


def test_hypothesis_score_counts_the_padding():
    fails("hypothesis_score", lambda *a: _score(*a, pads=True), "5 hypotheses, alpha 0: log p itself: off by")


def test_hypothesis_score_plain_power():
    fails("hypothesis_score", lambda *a: _score(*a, lp=lambda n, alpha: n**alpha), "alpha 0.6: off by")


# --- decoder_mask (chapter 9) --------------------------------------------------------------------------------------


def _causal(T):
    return np.tril(np.ones((T, T), dtype=bool))


def test_decoder_mask_pads_the_queries_too():
    def attempt(tokens, pad_id):  # padded query rows masked as well: their rows are fully masked
        real = tokens != pad_id
        return _causal(tokens.shape[1])[None, None] & real[:, None, :, None] & real[:, None, None, :]

    result = fails("decoder_mask", attempt, "chapter 9's batch, padding in sentence 1: off by 1", "on the keys")
    assert not result.failed("no padding")


def test_decoder_mask_or_instead_of_and():
    def attempt(tokens, pad_id):
        return _causal(tokens.shape[1])[None, None] | (tokens != pad_id)[:, None, None, :]

    fails("decoder_mask", attempt, "no padding: causal alone: off by 1", "causal AND padding")


def test_decoder_mask_sees_the_future():
    def attempt(tokens, pad_id):  # triu: query i attends to keys i..T-1
        return np.triu(np.ones((tokens.shape[1],) * 2, dtype=bool))[None, None] & (tokens != pad_id)[:, None, None, :]

    result = fails("decoder_mask", attempt, "no padding: causal alone: off by 1", "(j <= i)")
    assert not result.failed("length 1")


def test_decoder_mask_true_means_padding():
    def attempt(tokens, pad_id):  # torch's key_padding_mask convention (True = masked) mixed into ours
        return _causal(tokens.shape[1])[None, None] & (tokens == pad_id)[:, None, None, :]

    fails("decoder_mask", attempt, "off by 1")


def test_decoder_mask_without_the_head_axis():
    def attempt(tokens, pad_id):
        return _causal(tokens.shape[1])[None] & (tokens != pad_id)[:, None, :]

    fails("decoder_mask", attempt, "shape (2, 5, 5), expected (2, 1, 5, 5)")


def test_decoder_mask_as_integers():
    def attempt(tokens, pad_id):
        return (_causal(tokens.shape[1])[None, None] & (tokens != pad_id)[:, None, None, :]).astype(np.int64)

    fails("decoder_mask", attempt, "dtype int64, expected bool")


def test_decoder_mask_pad_id_zero_hard_coded():
    def attempt(tokens, pad_id):
        return _causal(tokens.shape[1])[None, None] & (tokens != 0)[:, None, None, :]

    result = fails("decoder_mask", attempt, "pad_id 3, three sentences: off by 1")
    assert not result.failed("chapter 9's batch")
