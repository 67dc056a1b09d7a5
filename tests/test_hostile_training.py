"""Hostile inputs to sampling, the language model's training and evaluation, mixed precision and the optimizers,
both tracks (issue 32, items 1, 2, 3, 5, 6, part of 10, and the finite check's caller): each is refused with a clear
error naming the argument, before anything changes, or gives a documented result. The helpers are test_hostile's.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_hostile import TINY, TRACKS, T, _batch, _state

import tfm_numpy as tn
from tfm_common.data import PAD_ID, Batch
from tfm_common.sampling import sample_next

V = 7  # the GPT's vocabulary


def gpt(L, dtype=None):
    dt = dtype or (np.float64 if L is tn else torch.float64)
    return L.GPT(vocab_size=V, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=12, rng=0, dtype=dt)


def windows(L, B=2, T_=4, seed=0):
    a = np.random.default_rng(seed).integers(0, V, (B, T_ + 1))
    return T(L, a[:, :-1]), T(L, a[:, 1:])


def lm_setup(L, make=None):
    """A GPT and its optimizer after one real step (so the optimizer has moments to keep), and a loss."""
    m = gpt(L)
    opt = (make or L.make_adamw)(m)
    loss_fn = L.CrossEntropyLoss()
    L.lm_train_step(m, *windows(L), opt, loss_fn, 1e-2)
    return m, opt, loss_fn


def assert_unchanged(L, before, m, opt):
    after = _state(L, m, opt)
    assert after[1] == before[1], "the step count moved"
    assert all(np.array_equal(after[0][k], v) for k, v in before[0].items()), "a weight moved"
    if L is tn:
        assert all(np.array_equal(a, b) for a, b in zip(after[2], before[2], strict=True)), "a moment moved"
    else:
        assert all(torch.equal(after[2][k], v) for k, v in before[2].items()), "a moment moved"


# -- 1. sampling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.5, 2), (0.0, None)])
def test_an_infinite_logit_takes_all_the_probability(temperature, top_k):
    rng = np.random.default_rng(0)
    assert sample_next(np.array([[0.0, np.inf, 0.0]]), temperature, top_k, rng).tolist() == [1]
    draws = sample_next(np.tile([np.inf, 5.0, np.inf, -np.inf], (400, 1)), 1.0, top_k, rng)
    assert set(draws.tolist()) == {0, 2}  # the +inf tokens share it, the finite ones get none


@pytest.mark.parametrize(
    "row, match",
    [
        ([0.0, np.nan, 1.0], "sample_next: the logits of row 1 hold NaN"),
        ([-np.inf, -np.inf, -np.inf], "sample_next: every logit of row 1 is -inf"),
    ],
    ids=["nan", "all -inf"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_without_a_distribution_are_refused(row, match, temperature):
    logits = np.array([[0.0, 1.0, 2.0], row])
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    with pytest.raises(FloatingPointError, match=match):
        sample_next(logits, temperature, None, rng)
    assert rng.bit_generator.state == state  # refused before any draw


@pytest.mark.parametrize("temperature", [1e-308, 5e-324, 1e-300])
def test_a_tiny_temperature_is_greedy(temperature):
    logits = np.random.default_rng(0).standard_normal((50, 9)) * 3
    got = sample_next(logits, temperature, None, np.random.default_rng(1))
    assert got.tolist() == logits.argmax(axis=-1).tolist()


@TRACKS
def test_generate_at_a_tiny_temperature_gives_the_greedy_tokens(L):
    m, prompt = gpt(L), T(L, np.array([[1, 2], [3, 4]]))
    greedy = m.generate(prompt, 6, temperature=0.0)
    assert (m.generate(prompt, 6, temperature=1e-308, rng=0) == greedy).all()


@TRACKS
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_generate_refuses_nan_logits_and_names_itself(L, use_cache):
    m = gpt(L)
    with torch.no_grad():
        m.norm.weight.data[0] = np.nan  # a NaN weight: every logit NaN
    with pytest.raises(FloatingPointError, match="GPT.generate: the logits of row 0 hold NaN"):
        m.generate(T(L, np.array([[1, 2]])), 3, use_cache=use_cache)
    assert m.training  # the caller's mode is back


# -- 2. lm_eval_loss -------------------------------------------------------------------------------------------------


@TRACKS
@pytest.mark.parametrize(
    "ids, exc, match",
    [
        ([1, 2, 3, 4, -1], ValueError, r"lm_eval_loss: ids: values must be in \[0, 7\), got -1"),
        ([1, 2, 3, 4, 7], ValueError, r"lm_eval_loss: ids: values must be in \[0, 7\), got 7"),
        ([1.0, 2.5, 3.0, 4.0, 5.0], TypeError, "lm_eval_loss: ids expected integer token ids, got dtype float64"),
        ([True, False, True, True, False], TypeError, "lm_eval_loss: ids expected integer token ids, got dtype bool"),
        ([1, 2, 3], ValueError, "lm_eval_loss: ids has 3 tokens, fewer than one window: block_size=4"),
        ([1, 2, 3, 4], ValueError, "lm_eval_loss: ids has 4 tokens, fewer than one window"),
        ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], ValueError, r"lm_eval_loss: ids expected a 1-D array.*\(2, 5\)"),
    ],
    ids=["-1", "V", "float", "bool", "3 ids", "4 ids", "2-D"],
)
def test_lm_eval_loss_refuses_ids_it_cannot_score(L, ids, exc, match):
    with pytest.raises(exc, match=match):
        L.lm_eval_loss(gpt(L), T(L, np.array(ids)), 4)


@TRACKS
def test_lm_eval_loss_still_scores_a_python_list_of_ids(L):
    ids = [1, 2, 3, 4, 5, 6, 0, 1, 2]
    loss, y = L.lm_eval_loss(gpt(L), ids, 4)
    assert y.shape == (2, 4) and np.isfinite(loss)


# -- 3 and 10. lm_train_step: an empty batch, a nested list --------------------------------------------------------


@TRACKS
@pytest.mark.parametrize(
    "what, exc, match",
    [
        ("empty", ValueError, r"lm_train_step: x holds no windows \(shape \(0, 4\)\)"),
        ("list x", TypeError, "lm_train_step: x expected a numpy.ndarray.* of token ids \\(B, T\\), got list"),
        ("list y", TypeError, "lm_train_step: y expected a numpy.ndarray.* of token ids \\(B, T\\), got list"),
    ],
    ids=["empty", "list x", "list y"],
)
def test_lm_train_step_refuses_before_any_change(L, what, exc, match):
    m, opt, loss_fn = lm_setup(L)
    x, y = windows(L)
    if what == "empty":
        x, y = x[:0], y[:0]
    elif what == "list x":
        x = x.tolist()
    else:
        y = y.tolist()
    before = _state(L, m, opt)
    with pytest.raises(exc, match=match):
        L.lm_train_step(m, x, y, opt, loss_fn, 1e-2)
    assert_unchanged(L, before, m, opt)


def _empty():
    z = np.zeros((0, 3), dtype=np.int64)
    return Batch(z, z, z, 0)


@TRACKS
@pytest.mark.parametrize("step", ["train_step", "train_step_accumulated", "train_step_mixed"])
def test_the_encoder_decoder_steps_refuse_an_empty_batch_too(L, step):
    m, opt, scaler, loss_fn = mixed_setup(L)
    before, scale = _state(L, m, opt), (scaler.scale, scaler.good_steps, scaler.overflows)
    batch = [_empty(), _empty()] if step == "train_step_accumulated" else _empty()
    extra = (scaler,) if step == "train_step_mixed" else ()
    what = "micro_batches hold no rows" if step == "train_step_accumulated" else r"batch holds no rows \(src shape"
    with pytest.raises(ValueError, match=f"^{step}: {what}"):
        getattr(L, step)(m, batch, opt, loss_fn, 1e-3, *extra)
    assert (scaler.scale, scaler.good_steps, scaler.overflows) == scale
    assert_unchanged(L, before, m, opt)


@TRACKS
def test_lm_train_step_refuses_an_infinite_clip_norm_in_both_tracks(L):
    m, opt, loss_fn = lm_setup(L)
    before = _state(L, m, opt)
    with pytest.raises(ValueError, match=r"clip_grad_norm: max_norm must be in \[0.0, inf\), got inf"):
        L.lm_train_step(m, *windows(L), opt, loss_fn, 1e-2, clip_norm=float("inf"))
    assert_unchanged(L, before, m, opt)


def test_the_numpy_door_prints_the_step_itself():
    """The check runs at the door; `show_source` reads the printed function through `__wrapped__`."""
    import inspect

    for f in (tn.lm_train_step, tn.train_step_mixed):
        assert f.__wrapped__.__name__ == f.__name__
        src = inspect.getsource(f)
        assert src.startswith(f"def {f.__name__}(") and "with_door" not in src


# -- 5. LossScaler and a failed mixed-precision step ---------------------------------------------------------------


@TRACKS
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_scale=0), "LossScaler: init_scale must be > 0, got 0"),
        (dict(init_scale=0.0), "LossScaler: init_scale must be > 0, got 0.0"),
        (dict(backoff=1.0), r"LossScaler: backoff must be in \(0, 1\), got 1.0"),
        (dict(backoff=0), r"LossScaler: backoff must be in \(0, 1\), got 0"),
    ],
    ids=["init_scale 0", "init_scale 0.0", "backoff 1", "backoff 0"],
)
def test_loss_scaler_refuses_a_scale_that_could_never_recover(L, kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.LossScaler(**kwargs)


def mixed_setup(L):
    dt = np.float32 if L is tn else torch.float32
    m = L.Transformer(src_vocab_size=11, tgt_vocab_size=11, **TINY, dtype=dt)
    opt, scaler = L.make_adam(m), L.LossScaler(init_scale=2.0**10, growth_interval=3)
    loss_fn = L.CrossEntropyLoss(ignore_index=PAD_ID)
    r = L.train_step_mixed(m, _batch(), opt, loss_fn, 1e-3, scaler)
    assert not r.skipped
    return m, opt, scaler, loss_fn


@TRACKS
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=-1.0), ValueError, r"train_step_mixed: lr must be in \[0.0, inf\), got -1.0"),
        (dict(lr=float("nan")), ValueError, "train_step_mixed: lr must be in"),
        (dict(lr="x"), TypeError, "train_step_mixed: lr expected a float, got str"),
        (dict(clip_norm=-1.0), ValueError, r"train_step_mixed: clip_norm must be in \[0.0, inf\), got -1.0"),
        (dict(clip_norm=float("inf")), ValueError, "train_step_mixed: clip_norm must be in"),
        (dict(scaler=2.0), TypeError, "train_step_mixed: scaler expected a LossScaler or None, got float"),
    ],
    ids=["lr -1", "lr nan", "lr str", "clip_norm -1", "clip_norm inf", "scaler float"],
)
def test_a_failed_mixed_step_leaves_the_scaler_model_and_optimizer(L, kwargs, exc, match):
    m, opt, scaler, loss_fn = mixed_setup(L)
    before, scale = _state(L, m, opt), (scaler.scale, scaler.good_steps, scaler.overflows)
    args = dict(lr=1e-3, scaler=scaler, clip_norm=None) | kwargs
    with pytest.raises(exc, match=match):
        L.train_step_mixed(m, _batch(), opt, loss_fn, **args)
    assert (scaler.scale, scaler.good_steps, scaler.overflows) == scale
    assert_unchanged(L, before, m, opt)


# -- 6. optimizers -------------------------------------------------------------------------------------------------


@TRACKS
@pytest.mark.parametrize("make", ["Adam", "AdamW", "make_adam", "make_adamw"])
def test_eps_zero_is_refused(L, make):
    m = gpt(L)
    owner = {"make_adam": "Adam", "make_adamw": "AdamW"}.get(make, make)
    with pytest.raises(ValueError, match=f"^{owner}: eps must be > 0"):
        getattr(L, make)(m if make.startswith("make") else m.parameters(), eps=0)


@TRACKS
@pytest.mark.parametrize("make", ["Adam", "AdamW"])
def test_a_parameter_given_twice_is_refused_by_both_optimizers(L, make):
    p = list(gpt(L).parameters())[0]
    with pytest.raises(ValueError, match=f"{make}: params contains the same Parameter twice"):
        getattr(L, make)([p, p])


@TRACKS
def test_clip_grad_norm_refuses_a_parameter_given_twice(L):
    p = list(gpt(L).parameters())[0]
    p.grad = np.ones_like(p.data) if L is tn else torch.ones_like(p)
    with pytest.raises(ValueError, match="clip_grad_norm: params contains the same Parameter twice"):
        L.clip_grad_norm([p, p], 1.0)
    assert (p.grad == 1).all()


@TRACKS
def test_clip_grad_norm_refuses_an_infinite_max_norm(L):
    with pytest.raises(ValueError, match=r"clip_grad_norm: max_norm must be in \[0.0, inf\), got inf"):
        L.clip_grad_norm(gpt(L).parameters(), float("inf"))


def _tamper(L, sd, part, value):
    """A copy of an optimizer's state_dict with parameter 0's `part` (a moment, or eps) replaced."""
    sd = copy.deepcopy(sd)
    if part == "eps":
        (sd.__setitem__("eps", value) if L is tn else sd["param_groups"][0].__setitem__("eps", value))
    elif L is tn:
        sd[part][0][...] = value
    else:
        sd["state"][0][part].fill_(value)
    return sd


@TRACKS
@pytest.mark.parametrize(
    "part, value, match",
    [
        ("exp_avg_sq", -1.0, r"exp_avg_sq\[0\] holds negative values"),
        ("exp_avg_sq", np.nan, r"exp_avg_sq\[0\] holds non-finite values"),
        ("exp_avg", np.nan, r"exp_avg\[0\] holds non-finite values"),
        ("exp_avg", np.inf, r"exp_avg\[0\] holds non-finite values"),
        ("eps", 0.0, "eps must be > 0"),
    ],
    ids=["exp_avg_sq -1", "exp_avg_sq nan", "exp_avg nan", "exp_avg inf", "eps 0"],
)
def test_load_state_dict_refuses_moments_no_run_can_have(L, part, value, match):
    m, opt, _ = lm_setup(L, L.make_adam)
    bad = _tamper(L, opt.state_dict(), part, value)
    before = _state(L, m, opt)
    with pytest.raises(ValueError, match=f"Adam.load_state_dict: {match}"):
        opt.load_state_dict(bad)
    assert_unchanged(L, before, m, opt)


@TRACKS
@pytest.mark.parametrize("saved, loaded", [("make_adamw", "make_adam"), ("make_adam", "make_adamw")])
def test_a_checkpoint_of_one_adam_does_not_load_into_the_other(L, tmp_path, saved, loaded):
    m, opt, _ = lm_setup(L, getattr(L, saved))
    path = L.save_checkpoint(tmp_path / ("c.npz" if L is tn else "c.pt"), m, opt)
    m2, opt2, _ = lm_setup(L, getattr(L, loaded))
    before = _state(L, m2, opt2)
    kinds = ("AdamW", "Adam") if saved == "make_adamw" else ("Adam", "AdamW")
    with pytest.raises(ValueError, match="holds {} state, the optimizer is {}$".format(*kinds)):
        L.load_checkpoint(path, m2, opt2)
    assert_unchanged(L, before, m2, opt2)


@TRACKS
def test_a_learning_rate_of_the_wrong_type_is_a_type_error_in_both_tracks(L):
    opt = L.make_adamw(gpt(L))
    with pytest.raises(TypeError, match="set_lr: lr expected a float, got str 'x'"):
        L.set_lr(opt, "x")
    with pytest.raises(TypeError, match="AdamW: lr expected a float, got str 'x'"):
        opt.lr = "x"
    with pytest.raises(ValueError, match=r"set_lr: lr must be in \[0.0, inf\), got -1.0"):
        L.set_lr(opt, -1.0)
    assert opt.lr == 1e-3


# -- also: the finite check names its caller -------------------------------------------------------------------------


@TRACKS
@pytest.mark.parametrize("caller", ["lm_train_step", "train_step_accumulated", "train_step_mixed"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_finite_check_names_the_step_that_called_it(L, caller):
    """A regression test: apply_update already passed its caller's name (ddec19c); the message names it."""
    if caller == "lm_train_step":
        m, opt, loss_fn = lm_setup(L)
        call = lambda: L.lm_train_step(m, *windows(L), opt, loss_fn, 1e-2)  # noqa: E731
    else:
        m, opt, _, loss_fn = mixed_setup(L)
        if caller == "train_step_mixed":  # no scaler: an overflow is refused, not skipped
            call = lambda: L.train_step_mixed(m, _batch(), opt, loss_fn, 1e-3)  # noqa: E731
        else:
            call = lambda: L.train_step_accumulated(m, [_batch()], opt, loss_fn, 1e-3)  # noqa: E731
    before = _state(L, m, opt)
    with torch.no_grad():
        m.output_projection.weight.data[1, 0] = np.inf  # the loss (and its gradient) not finite
    with pytest.raises(FloatingPointError, match=f"^{caller}: the loss is nan"):
        call()
    with torch.no_grad():
        m.output_projection.weight.data[1, 0] = float(before[0]["output_projection.weight"][1, 0])
    assert_unchanged(L, before, m, opt)
