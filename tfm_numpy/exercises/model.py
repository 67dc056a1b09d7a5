"""Graded exercises of Parts III-IV (chapters 8-13): the residual sublayer, the decoder's mask, the optimizer and its
schedule, the search's score.

Each `grade_<name>(g)` draws seeded inputs, calls the attempt through the grader and compares it with the library:
the residual sublayer with `EncoderLayer` (its self-attention branch silenced, so that one residual block is left),
the decoder's mask with `tnp.decoder_mask`, Adam with `tnp.Adam`, the schedule with `tfm_common.schedules.noam_lr`,
the length penalty with `tnp.length_penalty` and a hypothesis's score with `tnp.sequence_scores` (on a stand-in
model whose logits are given). See foundations.py for the pattern.
"""

from __future__ import annotations

import copy

import numpy as np

from tfm_common.schedules import noam_lr

from ..decoding import length_penalty, sequence_scores
from ..encoder_decoder import EncoderLayer
from ..functional import log_softmax
from ..layers import LayerNorm
from ..masks import decoder_mask
from ..module import Module, Parameter
from ..optim import Adam
from .grading import Exercise, Finding, Grader, central_differences

__all__ = ["EXERCISES"]


# --- chapter 8: a residual sublayer, Post-LN and Pre-LN ------------------------------------------------------------


class _PassThrough(LayerNorm):
    """A LayerNorm's place and sizes, but it passes its input on, and its gradient back, unchanged."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return grad_out


def _one_block(norm_first: bool, d: int, seed: int, dtype=np.float64) -> EncoderLayer:
    """A library EncoderLayer (eval, dropout 0) reduced to ONE residual block around its feed-forward sublayer:
    its self-attention's output projection is zero (that branch adds 0 and passes back 0) and its norm1 passes
    through, so that it computes norm2(x + ff(x)) (Post-LN) or x + ff(norm2(x)) (Pre-LN), with its own backward."""
    rng = np.random.default_rng(seed)
    layer = EncoderLayer(d, 2, 4 * d, 0.0, norm_first=norm_first, rng=rng, dtype=dtype).eval()
    layer.self_attn.out_proj.weight.data[...] = 0
    layer.self_attn.out_proj.bias.data[...] = 0
    layer.norm1 = _PassThrough(d, dtype=dtype)
    layer.norm2.weight.data[...] = 1 + 0.5 * rng.standard_normal(d)  # a norm that scales and shifts: not a no-op
    layer.norm2.bias.data[...] = 0.5 * rng.standard_normal(d)
    return layer


def _parts(layer: EncoderLayer):
    """Fresh copies of the block's sublayer and norm for one call of the attempt (no cache left from another)."""
    return copy.deepcopy(layer.ff), copy.deepcopy(layer.norm2)


_RESIDUAL_CASES = (("(B, T, d)", (2, 5, 8)), ("length 1", (1, 1, 8)), ("(B, T, d) wider", (3, 4, 12)))
_PLACES = {False: "Post-LN", True: "Pre-LN"}
_FORWARD_HINTS = {
    False: "Post-LN normalizes the sum: y = norm(x + sublayer(x))",
    True: "Pre-LN normalizes the sublayer's input only: y = x + sublayer(norm(x)), no norm on the output",
}
_BACKWARD_HINTS = {
    False: "Post-LN: dz = norm's backward of dy, then dx = dz + the sublayer's backward of dz (the skip path "
    "carries dz, not dy)",
    True: "Pre-LN: dx = dy + norm's backward of (the sublayer's backward of dy): the skip path carries dy itself",
}


def grade_residual_forward(g: Grader) -> None:
    for norm_first, place in _PLACES.items():
        for k, (label, shape) in enumerate(_RESIDUAL_CASES):
            layer = _one_block(norm_first, shape[-1], 300 + k)
            x = np.random.default_rng([301, k]).standard_normal(shape)
            check, hint = f"{place}, {label}", _FORWARD_HINTS[norm_first]
            got = g.run(check, x, *_parts(layer), norm_first, hint=hint)
            g.compare(check, got, layer(x), tol=1e-12, hint=hint)
    for norm_first, place in _PLACES.items():
        layer = _one_block(norm_first, 8, 310, np.float32)
        x = np.random.default_rng(311).standard_normal((2, 3, 8)).astype(np.float32)
        got = g.run(f"{place}, float32", x, *_parts(layer), norm_first)
        g.compare(f"{place}, float32", got, layer(x), tol=1e-5, dtype=np.float32)


def grade_residual_backward(g: Grader) -> None:
    hint_raise = "the modules' backward uses the cache of their last forward: run the forward first, in the backward"
    for norm_first, place in _PLACES.items():
        for k, (label, shape) in enumerate(_RESIDUAL_CASES):
            layer = _one_block(norm_first, shape[-1], 320 + k)
            rng = np.random.default_rng([321, k])
            x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
            check = f"{place}, {label}"
            got = g.run(check, dy, x, *_parts(layer), norm_first, hint=hint_raise)
            layer(x)
            library = {"dx": layer.backward(dy)}
            numeric = {"dx": central_differences(lambda x, layer=layer: layer(x), {"x": x}, dy)["x"]}
            g.backward(check, got, library, numeric, hints={"dx": _BACKWARD_HINTS[norm_first]})
    for norm_first, place in _PLACES.items():
        layer = _one_block(norm_first, 8, 330, np.float32)
        rng = np.random.default_rng(331)
        x, dy = (rng.standard_normal((2, 3, 8)).astype(np.float32) for _ in range(2))
        got = g.run(f"{place}, float32", dy, x, *_parts(layer), norm_first, hint=hint_raise)
        layer(x)
        g.gradients(f"{place}, float32", got, {"dx": layer.backward(dy)}, tol=1e-5, dtype=np.float32)


# --- chapter 9: the decoder's self-attention mask ----------------------------------------------------------------


def grade_decoder_mask(g: Grader) -> None:
    hint = "mask[b, 0, i, j] = (j <= i) and tokens[b, j] != pad_id: causal AND padding, the padding on the keys"
    cases = (  # label, tokens (B, T), pad_id
        ("chapter 9's batch, padding in sentence 1", [[1, 2, 3, 4, 5], [1, 6, 7, 0, 0]], 0),
        ("no padding: causal alone", [[1, 2, 3], [4, 5, 6]], 0),
        ("length 1", [[1], [1]], 0),
        ("pad_id 3, three sentences", [[5, 6, 7, 8], [5, 3, 3, 3], [9, 4, 3, 3]], 3),
    )
    for label, tokens, pad_id in cases:
        tokens = np.array(tokens, dtype=np.int64)
        got = g.run(label, tokens, pad_id, hint=hint)
        expected = decoder_mask(tokens, pad_id)
        if g.compare(label, got, expected, tol=0, dtype=np.bool_, hint=hint):  # booleans: equal, or not
            g.result.findings[-1] = Finding(label, True, f"{expected.shape}, the library's mask exactly")


# --- chapter 12: the warm-up schedule and one Adam step ------------------------------------------------------------


def grade_noam_lr(g: Grader) -> None:
    hint = "lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counting from 1"
    cases = (
        ("the paper: d_model 512, warmup 4000", 512, 4000, None, (1, 2, 100, 3999, 4000, 4001, 10_000, 100_000)),
        ("chapter 12: d_model 64, warmup 100, factor 0.2", 64, 100, 0.2, (1, 50, 99, 100, 101, 400, 1000)),
        ("warmup 1: the peak at step 1", 16, 1, 2.0, (1, 2, 3, 50)),
    )
    for label, d_model, warmup, factor, steps in cases:
        kwargs = {} if factor is None else {"factor": factor}

        def lrs(d_model=d_model, warmup=warmup, steps=steps, kwargs=kwargs):
            return np.array([float(g.attempt(s, d_model, warmup, **kwargs)) for s in steps])

        got = g.run(label, fn=lrs, hint=hint)
        expected = np.array([noam_lr(s, d_model, warmup, **kwargs) for s in steps])
        g.compare(f"{label}, steps {', '.join(map(str, steps))}", got, expected, tol=1e-12, hint=hint)
    g.refuses("step 0", 0, 512, 4000, expected="says that step counts from 1 (the first update)")
    g.refuses("step -1", -1, 512, 4000, expected="says that step counts from 1")


def _adam_reference(param, grad, m, v, t, lr, betas, eps, weight_decay):
    """The library's Adam, restored to step t - 1 with moments m and v, after one step on `grad`."""
    p = Parameter(param.copy())
    opt = Adam([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    opt.load_state_dict({
        "step": t - 1, "lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay,
        "exp_avg": [m], "exp_avg_sq": [v],
    })  # fmt: skip
    p.grad = grad.copy()
    opt.step()
    return {"param": p.data, "m": opt.exp_avg[0], "v": opt.exp_avg_sq[0]}


_ADAM_HINTS = {
    "param": "param - lr * m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t), "
    "t = 1 at the first step, eps outside the square root",
    "m": "m = beta1 m + (1 - beta1) grad (with weight decay: grad + weight_decay * param)",
    "v": "v = beta2 v + (1 - beta2) grad^2 (with weight decay: grad + weight_decay * param)",
}


def grade_adam_step(g: Grader) -> None:
    rng = np.random.default_rng(1201)
    paper = ((0.9, 0.98), 1e-9)
    cases = (  # label, shape, t, lr, (betas, eps), weight_decay, gradient scale, zero moments
        ("first step, t = 1 (zero moments)", (3, 4), 1, 1e-3, paper, 0.0, 1.0, True),
        ("step t = 5", (3, 4), 5, 1e-3, paper, 0.0, 1.0, False),
        ("step t = 2000 (bias correction faded)", (5,), 2000, 5e-4, paper, 0.0, 1.0, False),
        ("betas (0.8, 0.9), eps 1e-6, t = 3", (2, 3, 2), 3, 1e-2, ((0.8, 0.9), 1e-6), 0.0, 1.0, False),
        ("weight decay 0.1 (L2, in the gradient), t = 4", (3, 4), 4, 1e-2, paper, 0.1, 1.0, False),
        ("tiny gradients 1e-12 (eps matters), t = 1", (4,), 1, 1e-3, paper, 0.0, 1e-12, True),
    )
    for label, shape, t, lr, (betas, eps), wd, scale, zero in cases:
        param, grad = rng.standard_normal(shape), scale * rng.standard_normal(shape)
        m = np.zeros(shape) if zero else scale * 0.3 * rng.standard_normal(shape)
        v = np.zeros(shape) if zero else scale**2 * rng.uniform(0.1, 1.0, shape)
        got = g.run(label, param, grad, m, v, t, lr, betas, eps, wd, hint=_ADAM_HINTS["param"])
        expected = _adam_reference(param, grad, m, v, t, lr, betas, eps, wd)
        g.gradients(label, got, expected, tol=1e-12, hints=_ADAM_HINTS)
    shape = (3, 4)
    param, grad, m = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    v = rng.uniform(0.1, 1.0, shape).astype(np.float32)
    got = g.run("float32", param, grad, m, v, 7, 1e-3, (0.9, 0.98), 1e-9, 0.0)
    expected = _adam_reference(param, grad, m, v, 7, 1e-3, (0.9, 0.98), 1e-9, 0.0)
    g.gradients("float32", got, expected, tol=1e-5, dtype=np.float32)


# --- chapter 13: the length penalty and a hypothesis's score ------------------------------------------------------


def grade_length_penalty(g: Grader) -> None:
    hint = "lp = ((5 + |Y|) / 6) ** alpha: the whole fraction to the power alpha (Wu et al.)"
    cases = (
        ("one length, |Y| = 10, alpha 0.6", 10, 0.6),
        ("|Y| = 1 (lp = 1 for any alpha)", 1, 0.6),
        ("lengths (B,) = 1..30, alpha 0.6", np.arange(1, 31), 0.6),
        ("lengths (B,), alpha 0: no penalty", np.array([1, 4, 9, 30]), 0.0),
        ("lengths (B,), alpha 1", np.array([1, 2, 7, 20]), 1.0),
        ("lengths (2, 3), alpha 2", np.array([[1, 2, 3], [10, 20, 40]]), 2.0),
    )
    for label, length, alpha in cases:
        got = g.run(label, length, alpha, hint=hint)
        g.compare(label, got, length_penalty(length, alpha), tol=1e-12, hint=hint)


class _FixedLogits(Module):
    """A stand-in model for `sequence_scores`: whatever the input, its decoder's logits are the given (B, L, V)."""

    def __init__(self, logits: np.ndarray, pad_id: int):
        super().__init__()
        self.logits, self.pad_id, self.tgt_vocab_size = logits, pad_id, logits.shape[-1]

    def forward(self, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
        return self.logits.copy()


_PAD, _BOS, _EOS, _V = 0, 1, 2, 7


def grade_hypothesis_score(g: Grader) -> None:
    hints = "log p(Y) = the sum of token_logp up to and including the first eos (no pad), divided by " \
        "length_penalty(|Y|, alpha), |Y| counting the same tokens, eos included"  # fmt: skip
    rows = [  # (B, L) outputs of a search: each with its eos, pad after it, or truncated without one
        [5, 3, 4, _EOS, _PAD, _PAD, _PAD],  # eos, then padding
        [3, 4, 5, 6, 3, 4, 5],  # truncated at max_len: no eos, every token counts
        [_EOS, _PAD, _PAD, _PAD, _PAD, _PAD, _PAD],  # eos at once: |Y| = 1
        [4, _EOS, 5, _EOS, 3, _PAD, _PAD],  # tokens after the first eos do not count
        [6, 6, 3, _PAD, _PAD, _PAD, _PAD],  # no eos, padding: the non-pad tokens count
    ]
    rng = np.random.default_rng(1301)
    cases = (
        ("5 hypotheses, alpha 0.6", np.array(rows), 0.6),
        ("5 hypotheses, alpha 0: log p itself", np.array(rows), 0.0),
        ("5 hypotheses, alpha 1", np.array(rows), 1.0),
        ("one hypothesis of length 1", np.array([[_EOS]]), 0.6),
    )
    for label, tokens, alpha in cases:
        logits = 2.0 * rng.standard_normal((*tokens.shape, _V))
        token_logp = np.take_along_axis(log_softmax(logits), tokens[..., None], axis=-1)[..., 0]  # (B, L)
        got = g.run(label, token_logp, tokens, _EOS, _PAD, alpha, hint=hints)
        src = np.ones((len(tokens), 1), dtype=np.int64)
        expected = sequence_scores(_FixedLogits(logits, _PAD), src, tokens, _BOS, _EOS, alpha=alpha)
        g.compare(label, got, expected, tol=1e-12, hint=hints)


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "residual_forward",
        "08_sublayers",
        "residual_forward(x, sublayer, norm, norm_first) -> y: x (B, T, d); sublayer, norm modules",
        grade_residual_forward,
    ),
    Exercise(
        "residual_backward",
        "08_sublayers",
        "residual_backward(dy, x, sublayer, norm, norm_first) -> dx: dy, x (B, T, d)",
        grade_residual_backward,
    ),
    Exercise(
        "decoder_mask",
        "09_encoder_decoder",
        "decoder_mask(tgt_tokens, pad_id) -> mask (B, 1, T, T) bool, True = may attend: tgt_tokens (B, T) int",
        grade_decoder_mask,
    ),
    Exercise(
        "noam_lr",
        "12_training",
        "noam_lr(step, d_model, warmup, factor=1.0) -> lr: a float; step counts from 1",
        grade_noam_lr,
    ),
    Exercise(
        "adam_step",
        "12_training",
        "adam_step(param, grad, m, v, t, lr, betas, eps, weight_decay) -> (param, m, v): arrays of one shape",
        grade_adam_step,
    ),
    Exercise(
        "length_penalty",
        "13_decoding",
        "length_penalty(length, alpha) -> lp: length an int or an int array, lp float64 of its shape",
        grade_length_penalty,
    ),
    Exercise(
        "hypothesis_score",
        "13_decoding",
        "hypothesis_score(token_logp, tokens, eos_id, pad_id, alpha) -> (B,): token_logp (B, L), tokens (B, L)",
        grade_hypothesis_score,
    ),
)
