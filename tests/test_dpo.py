"""DPO (tfm_numpy/tfm_torch.dpo, tfm_common.preference): the response log-probabilities and the DPO loss with their
hand-written backward, gradient-checked in float64 and equal to torch autograd; one training step equal in both
tracks; the reference-model mistake (the policy as its own reference) read off the numbers; the task's pairs and
batches; the refusals, alike in both tracks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers_tracks import TOL, load_np_into_torch, max_abs_diff, to_numpy, to_torch

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.data import EOS_ID, PAD_ID
from tfm_common.preference import (
    PreferenceBatch,
    ReversalTask,
    preference_batch,
    preference_pairs,
    sample_answers,
    sft_batch,
)
from tfm_numpy.gradcheck import numeric_grad, rel_error

TASK = ReversalTask(n_symbols=4, min_len=2, max_len=5)
CFG = dict(vocab_size=TASK.vocab_size, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=TASK.max_tokens,
           dropout=0.0)  # fmt: skip


def _seq_inputs(rng, B=3, T=6, V=7, dtype=np.float64):
    logits = (2 * rng.standard_normal((B, T, V))).astype(dtype)
    targets = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) < 0.6
    mask[:, -1] = True  # no empty row
    mask[0] = False
    mask[0, 2:4] = True  # a prompt before and padding after, as in a real batch
    return logits, targets, mask


def _logps(rng, B=4, dtype=np.float64, scale=3.0):
    return [(-scale * rng.random(B) - 0.1).astype(dtype) for _ in range(4)]


# -- sequence log-probabilities ------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,T", [(3, 6), (1, 1), (2, 9)])
def test_sequence_logps_is_the_masked_sum_and_matches_torch(B, T):
    rng = np.random.default_rng(B * 10 + T)
    logits, targets, mask = _seq_inputs(rng, B, T)
    if T == 1:
        mask[:] = True
    got = tn.sequence_logps(logits, targets, mask)
    by_hand = [sum(math.log(np.exp(logits[b, t] - logits[b, t].max())[targets[b, t]]
                            / np.exp(logits[b, t] - logits[b, t].max()).sum())
                   for t in range(T) if mask[b, t]) for b in range(B)]  # fmt: skip
    assert np.abs(got - by_hand).max() < 1e-12
    ours = tt.sequence_logps(to_torch(logits), to_torch(targets), to_torch(mask))
    assert max_abs_diff(got, ours) < 1e-12


def test_sequence_logps_backward_gradcheck_and_autograd():
    rng = np.random.default_rng(1)
    logits, targets, mask = _seq_inputs(rng)
    grad = rng.standard_normal(logits.shape[0])
    d = tn.sequence_logps_backward(grad, logits, targets, mask)
    num = numeric_grad(lambda _=None: float(grad @ tn.sequence_logps(logits, targets, mask)), logits)
    assert rel_error(d, num) < 1e-7
    assert np.all(d[~mask] == 0)  # the prompt and the padding get nothing
    lt = to_torch(logits, requires_grad=True)
    (tt.sequence_logps(lt, to_torch(targets), to_torch(mask)) @ to_torch(grad)).backward()
    assert max_abs_diff(d, lt.grad) < TOL


def test_sequence_logps_float32_stays_float32():
    logits, targets, mask = _seq_inputs(np.random.default_rng(2), dtype=np.float32)
    assert tn.sequence_logps(logits, targets, mask).dtype == np.float32
    assert tn.sequence_logps_backward(np.ones(3, np.float32), logits, targets, mask).dtype == np.float32


# -- the DPO loss --------------------------------------------------------------------------------------------------


def test_dpo_loss_is_the_formula_and_matches_torch():
    rng = np.random.default_rng(3)
    pc, pr, rc, rr = _logps(rng)
    out = tn.dpo_loss(pc, pr, rc, rr, 0.3)
    z = 0.3 * ((pc - rc) - (pr - rr))
    assert abs(out.loss - np.mean(np.log1p(np.exp(-z)))) < 1e-14
    assert np.abs(out.chosen_rewards - 0.3 * (pc - rc)).max() < 1e-15
    assert np.abs(out.margins - z).max() < 1e-15
    ours = tt.dpo_loss(*(to_torch(a) for a in (pc, pr, rc, rr)), 0.3)
    for a, b in zip(out, ours, strict=True):
        assert max_abs_diff(a, b) < 1e-14


@pytest.mark.parametrize("B,beta", [(4, 0.1), (1, 0.5), (7, 2.0)])
def test_dpo_loss_backward_gradcheck_and_autograd(B, beta):
    rng = np.random.default_rng(B)
    pc, pr, rc, rr = _logps(rng, B)
    d_c, d_r = tn.dpo_loss_backward(1.7, pc, pr, rc, rr, beta)
    for i, (arg, got) in enumerate(((pc, d_c), (pr, d_r))):

        def loss(_=None, i=i):
            a = [pc, pr, rc, rr]
            return 1.7 * float(tn.dpo_loss(*a, beta).loss)

        assert rel_error(got, numeric_grad(loss, arg)) < 1e-7, i
    ts = [to_torch(a, requires_grad=True) for a in (pc, pr, rc, rr)]
    (1.7 * tt.dpo_loss(*ts, beta).loss).backward()
    assert max_abs_diff(d_c, ts[0].grad) < TOL and max_abs_diff(d_r, ts[1].grad) < TOL
    # the reference's gradient would be the negative; the backward gives it none: the reference is frozen
    assert max_abs_diff(-d_c, ts[2].grad) < TOL


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dpo_loss_is_stable_at_huge_margins(dtype):
    """log sigmoid at z = -1000 and +1000: the naive log(1 / (1 + exp(-z))) gives inf / a lost gradient."""
    pc = np.array([-1.0, -2001.0], dtype)
    pr = np.array([-2001.0, -1.0], dtype)
    zero = np.zeros(2, dtype)
    out = tn.dpo_loss(pc, pr, zero, zero, 0.5)
    assert np.isfinite(out.loss) and out.loss.dtype == dtype
    assert abs(float(out.loss) - 500.0) < 1e-3  # (0 + 1000) / 2
    d_c, d_r = tn.dpo_loss_backward(1.0, pc, pr, zero, zero, 0.5)
    assert d_c.dtype == dtype and np.allclose(d_c, [0.0, -0.25]) and np.allclose(d_r, -d_c)
    t = tt.dpo_loss(*(to_torch(a) for a in (pc, pr, zero, zero)), 0.5)
    assert abs(float(t.loss) - float(out.loss)) < 1e-3


# -- one training step, both tracks ----------------------------------------------------------------------------------


def _models(dtype=np.float64):
    policy_np, ref_np = tn.GPT(**CFG, rng=0, dtype=dtype), tn.GPT(**CFG, rng=1, dtype=dtype)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    policy_t, ref_t = tt.GPT(**CFG, dtype=tdt), tt.GPT(**CFG, dtype=tdt)
    load_np_into_torch(policy_np, policy_t)
    load_np_into_torch(ref_np, ref_t)
    return policy_np, ref_np, policy_t, ref_t


def _batch():
    pairs = [("abcd", TASK.answer("abcd"), TASK.answer("abca")),
             ("ab", TASK.answer("ab"), [5, 6, EOS_ID]),
             ("dcbad", TASK.answer("dcbad"), [4, 4])]  # fmt: skip
    return preference_batch(TASK, pairs)


def test_dpo_train_step_same_in_both_tracks():
    policy_np, ref_np, policy_t, ref_t = _models()
    opt_np, opt_t = tn.make_adam(policy_np), tt.make_adam(policy_t)
    batch = _batch()
    for _ in range(3):
        a = tn.dpo_train_step(policy_np, ref_np, batch, opt_np, 0.5, 1e-2, clip_norm=1.0)
        b = tt.dpo_train_step(policy_t, ref_t, batch, opt_t, 0.5, 1e-2, clip_norm=1.0)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL
    for k, v in policy_t.state_dict().items():  # a key bias's gradient is 0 up to rounding (softmax ignores a
        if not k.endswith("k_proj.bias"):  # shift of every score): Adam divides that noise by its own size
            assert max_abs_diff(policy_np.state_dict()[k], v) < TOL, k
    assert a.loss < math.log(2) + 0.1 and a.reward_accuracy >= 2 / 3


def test_dpo_step_gradients_equal_hand_chain():
    """The step's gradients are sequence_logps_backward(dpo_loss_backward(...)) through the model: torch's
    autograd on the same batch gives every parameter's gradient to 1e-10."""
    policy_np, ref_np, policy_t, ref_t = _models()
    batch = _batch()
    tn.dpo_train_step(policy_np, ref_np, batch, tn.make_adam(policy_np), 0.5, 0.0)  # lr 0: gradients only
    tt.dpo_train_step(policy_t, ref_t, batch, tt.make_adam(policy_t), 0.5, 0.0)
    for name, p in policy_t.named_parameters():
        assert max_abs_diff(policy_np.grads()[name], p.grad) < TOL, name


def test_policy_as_its_own_reference_reads_zero():
    """The anchors' mistake: the reference log-probabilities taken from the policy itself. The margin is 0 and the
    loss log 2 at every step, whatever the model does; with the gradient flowing through both, it is 0."""
    _, _, policy_t, _ = _models()
    x, y, m = (torch.from_numpy(a) for a in _batch())
    logps = tt.sequence_logps(policy_t(x), y, m)
    out = tt.dpo_loss(logps[:3], logps[3:], logps[:3].detach(), logps[3:].detach(), 0.5)
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-15) and out.margins.abs().max().item() == 0
    out.loss.backward()  # detached: the gradient is beta/2 * d(pc - pr) / B, with no pull back at all
    assert sum(float(p.grad.abs().sum()) for p in policy_t.parameters()) > 0
    policy_t.zero_grad()
    logps = tt.sequence_logps(policy_t(x), y, m)
    tt.dpo_loss(logps[:3], logps[3:], logps[:3], logps[3:], 0.5).loss.backward()  # not detached: nothing learns
    assert sum(float(p.grad.abs().sum()) for p in policy_t.parameters()) == 0


def test_dpo_train_step_refuses_an_unfrozen_reference_and_changes_nothing():
    policy_np, ref_np, policy_t, ref_t = _models()
    batch = _batch()
    for track, policy, ref in ((tn, policy_np, ref_np), (tt, policy_t, ref_t)):
        before = {k: to_numpy(v).copy() for k, v in policy.state_dict().items()}
        with pytest.raises(ValueError, match="reference shares parameters"):
            track.dpo_train_step(policy, policy, batch, track.make_adam(policy), 0.5, 1e-2)
        both = track.make_adam(policy)
        both_ref = track.make_adam(ref)
        if track is tn:
            both.params = both.params + both_ref.params
        else:
            both.add_param_group({"params": list(ref.parameters())})
        with pytest.raises(ValueError, match="stray|not this model's|reference must stay"):
            track.dpo_train_step(policy, ref, batch, both, 0.5, 1e-2)
        with pytest.raises(ValueError, match="beta must be > 0"):
            track.dpo_train_step(policy, ref, batch, track.make_adam(policy), 0.0, 1e-2)
        odd = PreferenceBatch(*(a[:5] for a in batch))
        with pytest.raises(ValueError, match="2B rows"):
            track.dpo_train_step(policy, ref, odd, track.make_adam(policy), 0.5, 1e-2)
        with pytest.raises(TypeError, match="PreferenceBatch"):
            track.dpo_train_step(policy, ref, tuple(batch), track.make_adam(policy), 0.5, 1e-2)
        for k, v in policy.state_dict().items():
            assert np.array_equal(to_numpy(v), before[k]), k


# -- refusals, alike --------------------------------------------------------------------------------------------------


def _dpo_refusals(rng):
    pc, pr, rc, rr = _logps(rng, 3)
    nan = pr.copy()
    nan[1] = np.nan
    inf = rr.copy()
    inf[0] = -np.inf
    return [
        ((pc, pr[:2], rc, rr, 0.1), ValueError, "policy_logps_rejected expected shape \\(3,\\)"),
        ((pc[:, None], pr, rc, rr, 0.1), ValueError, "expected shape \\(B,\\)"),
        ((pc[:0], pr[:0], rc[:0], rr[:0], 0.1), ValueError, "B >= 1"),
        ((pc, pr, rc, rr, 0.0), ValueError, "beta must be > 0"),
        ((pc, pr, rc, rr, -1.0), ValueError, "beta must be > 0"),
        ((pc, pr, rc, rr, float("nan")), ValueError, "beta"),
        ((pc, pr, rc, rr, True), TypeError, "beta"),
        ((pc, nan, rc, rr, 0.1), ValueError, "policy_logps_rejected must be finite"),
        ((pc, pr, rc, inf, 0.1), ValueError, "ref_logps_rejected must be finite"),
        ((pc, pr, rc.astype(np.float32), rr, 0.1), TypeError, "share one dtype"),
        ((pc.astype(np.int64), pr, rc, rr, 0.1), TypeError, "float32 or float64"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_dpo_loss_refusals_alike(case):
    args, error, match = _dpo_refusals(np.random.default_rng(5))[case]
    with pytest.raises(error, match=match):
        tn.dpo_loss(*args)
    with pytest.raises(error, match=match):
        tt.dpo_loss(*(to_torch(a) if isinstance(a, np.ndarray) else a for a in args))
    with pytest.raises(error, match=match):
        tn.dpo_loss_backward(1.0, *args)


def _sequence_refusals(rng):
    logits, targets, mask = _seq_inputs(rng)
    empty = mask.copy()
    empty[1] = False
    bad = logits.copy()
    bad[0, 0, 0] = np.inf
    high = targets.copy()
    high[0, 0] = 7
    return [
        ((logits[0], targets[0], mask[0]), ValueError, "logits expected shape \\(B, T, V\\)"),
        ((logits, targets[:, :4], mask), ValueError, "targets expected shape \\(3, 6\\)"),
        ((logits, targets, mask[:2]), ValueError, "mask expected shape \\(3, 6\\)"),
        ((logits, targets, mask.astype(np.int64)), TypeError, "mask expected a boolean"),
        ((logits, targets, empty), ValueError, "mask row 1 selects no token"),
        ((bad, targets, mask), ValueError, "logits must be finite"),
        ((logits, high, mask), ValueError, "values must be in \\[0, 7\\)"),
        ((logits, targets.astype(np.float64), mask), TypeError, "integer"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_sequence_logps_refusals_alike(case):
    args, error, match = _sequence_refusals(np.random.default_rng(6))[case]
    with pytest.raises(error, match=match):
        tn.sequence_logps(*args)
    with pytest.raises(error, match=match):
        tt.sequence_logps(*(to_torch(a) for a in args))
    with pytest.raises(error, match=match):
        tn.sequence_logps_backward(np.ones(len(args[0])), *args)


def test_backward_refusals():
    logits, targets, mask = _seq_inputs(np.random.default_rng(7))
    with pytest.raises(ValueError, match="grad expected shape \\(3,\\)"):
        tn.sequence_logps_backward(np.ones(2), logits, targets, mask)
    with pytest.raises(TypeError, match="dtype"):
        tn.sequence_logps_backward(np.ones(3, np.float32), logits, targets, mask)
    with pytest.raises(ValueError, match="grad_loss expected a finite scalar"):
        tn.dpo_loss_backward(np.ones(2), *_logps(np.random.default_rng(8)), 0.1)


# -- the task -------------------------------------------------------------------------------------------------------


def test_task_batches_mask_the_prompt_and_the_padding():
    x, y = sft_batch(TASK, ["ab", "dcba"])
    v = TASK.vocab
    assert v.decode(x[1], strip_special=False) == "<bos>dcba=abcd"
    assert y[1].tolist() == [PAD_ID] * 5 + TASK.answer("dcba")  # the prompt's predictions ignored
    assert y[0].tolist() == [PAD_ID] * 3 + TASK.answer("ab") + [PAD_ID] * 4  # and the padding
    batch = preference_batch(TASK, [("ab", TASK.answer("ab"), [4, EOS_ID]), ("dcba", TASK.answer("dcba"), [4])])
    assert batch.tokens.shape == (4, 10) and batch.mask.sum(axis=1).tolist() == [3, 5, 2, 1]
    assert batch.targets[2][batch.mask[2]].tolist() == [4, EOS_ID] and batch.targets[3][batch.mask[3]].tolist() == [4]
    full = TASK.prompt("dcba") + [4]  # the rejected answer of row 3, after its prompt
    assert batch.tokens[3, : len(full) - 1].tolist() == full[:-1] and batch.tokens[3, len(full) - 1 :].max() == PAD_ID


def test_pairs_keep_one_right_and_one_wrong():
    right, wrong = TASK.answer("abc"), TASK.answer("abd")
    strings = ["abc", "abc", "abc", "abc"]
    first = [right, wrong, right, wrong]
    second = [wrong, right, right, wrong]
    pairs = preference_pairs(TASK, strings, first, second)
    assert pairs == [("abc", right, wrong), ("abc", right, wrong)]
    assert TASK.response([5, 4, EOS_ID, 6, PAD_ID]) == [5, 4, EOS_ID] and TASK.response([5, 6]) == [5, 6]


def test_sample_answers_groups_by_length_and_matches_one_by_one():
    model = tn.GPT(**CFG, rng=0)
    strings = ["abc", "ab", "dcba", "ca"]
    gen = lambda p, n, t, r: model.generate(p, n, temperature=t, rng=r)  # noqa: E731
    greedy = sample_answers(gen, TASK, strings, 0.0, np.random.default_rng(0))
    for s, got in zip(strings, greedy, strict=True):
        assert got == sample_answers(gen, TASK, [s], 0.0, np.random.default_rng(0))[0]
        assert 1 <= len(got) <= len(s) + 1
    train, test = TASK.split(50, 20, seed=0)
    assert len(train) == 50 and len(test) == 20 and not set(train) & set(test)
