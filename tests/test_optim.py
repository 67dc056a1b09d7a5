"""Optimization in both tracks: Adam against torch.optim.Adam step for step, the warm-up schedule of the paper,
gradient clipping against torch.nn.utils.clip_grad_norm_, state dicts, dtypes and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff

import tfm_numpy as tn
import tfm_torch as tt
from tfm_numpy.module import Parameter

SHAPES = [(3, 4), (4,), (2, 3, 2), (1,)]


def make_params(dtype=np.float64, seed=0):
    g = np.random.default_rng(seed)
    return [Parameter(g.standard_normal(s).astype(dtype)) for s in SHAPES]


def grads_for(step: int, dtype=np.float64):
    """A different, fixed gradient for every step (scales spread over orders of magnitude)."""
    g = np.random.default_rng(100 + step)
    return [(g.standard_normal(s) * 10.0 ** g.integers(-3, 2)).astype(dtype) for s in SHAPES]


def run_both(n_steps, lr_fn, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, dtype=np.float64, *, ours=None, ref=None):
    """The same parameters and gradients through one of our optimizers (`ours`, default tfm_numpy.Adam) and torch's
    (`ref`, default plain torch.optim.Adam, not our subclass), step by step."""
    ours, ref = ours or tn.Adam, ref or torch.optim.Adam
    np_params = make_params(dtype)
    t_params = [torch.nn.Parameter(torch.from_numpy(p.data.copy())) for p in np_params]
    opt_np = ours(np_params, lr=lr_fn(1), betas=betas, eps=eps, weight_decay=weight_decay)
    opt_t = ref(t_params, lr=lr_fn(1), betas=betas, eps=eps, weight_decay=weight_decay)
    for step in range(1, n_steps + 1):
        opt_np.lr = lr_fn(step)
        for group in opt_t.param_groups:
            group["lr"] = lr_fn(step)
        for p, tp, g in zip(np_params, t_params, grads_for(step, dtype), strict=True):
            p.grad[...] = g
            tp.grad = torch.from_numpy(g.copy())
        opt_np.step()
        opt_t.step()
    return np_params, t_params, opt_np, opt_t


@pytest.mark.parametrize(
    "lr_fn, weight_decay",
    [
        (lambda s: 1e-2, 0.0),
        (lambda s: tn.noam_lr(s, 16, 4, factor=2.0), 0.0),  # changes every step: up for 4 steps, then down
        (lambda s: 1e-2, 0.1),
    ],
    ids=["constant-lr", "noam-lr", "weight-decay"],
)
def test_adam_matches_torch_step_for_step_float64(lr_fn, weight_decay):
    assert_same_steps(*run_both(10, lr_fn, weight_decay=weight_decay), n_steps=10)


def assert_same_steps(np_params, t_params, opt_np, opt_t, n_steps: int) -> None:
    """Parameters, both moments and the step count of our optimizer equal torch's (float64, 1e-12)."""
    for p, tp in zip(np_params, t_params, strict=True):
        assert max_abs_diff(p.data, tp) < 1e-12
    state_t = [opt_t.state[tp] for tp in t_params]
    for m, v, st in zip(opt_np.exp_avg, opt_np.exp_avg_sq, state_t, strict=True):
        assert max_abs_diff(m, st["exp_avg"]) < 1e-12 and max_abs_diff(v, st["exp_avg_sq"]) < 1e-12
    assert opt_np.step_count == n_steps == int(state_t[0]["step"])


def test_adam_moved_the_parameters():
    np_params, *_ = run_both(3, lambda s: 1e-2)
    start = make_params()
    assert all(np.abs(p.data - q.data).max() > 1e-3 for p, q in zip(np_params, start, strict=True))


def test_adam_float32_stays_float32_and_agrees_with_torch():
    np_params, t_params, opt_np, _ = run_both(10, lambda s: 1e-2, dtype=np.float32)
    for p, tp in zip(np_params, t_params, strict=True):
        assert p.data.dtype == p.grad.dtype == np.float32 and tp.dtype == torch.float32
        assert max_abs_diff(p.data, tp) < 1e-5
    assert all(m.dtype == np.float32 for m in opt_np.exp_avg + opt_np.exp_avg_sq)


def test_adam_updates_in_place_and_tied_parameters_once():
    emb = tn.Embedding(5, 3, rng=0, dtype=np.float64)
    head = tn.Linear(3, 5, bias=False, rng=1, dtype=np.float64)
    head.weight = emb.weight  # tied: one Parameter under two names
    model = tn.Module()
    model.emb, model.head = emb, head
    opt = tn.make_adam(model, lr=0.1)
    assert len(opt.params) == 1
    array, before = emb.weight.data, emb.weight.data.copy()
    emb.weight.grad[...] = 1.0
    opt.step()
    assert head.weight.data is array  # the same array, changed in place
    # Adam's first step moves every entry by lr * g / (|g| + eps) = 0.1: once, although the parameter has two names
    assert np.allclose(array, before - 0.1, rtol=0, atol=1e-8)  # eps = 1e-9 shortens the step by 1e-10
    with pytest.raises(ValueError, match="same Parameter twice"):
        tn.Adam([emb.weight, head.weight])


def test_adam_zero_grad_and_set_lr():
    params = make_params()
    opt = tn.Adam(params)
    for p in params:
        p.grad[...] = 1.0
    opt.zero_grad()
    assert all((p.grad == 0).all() for p in params)
    tn.set_lr(opt, 0.5)
    assert opt.lr == 0.5


def test_adam_state_dict_round_trip_continues_identically():
    a_params, _, opt_a, _ = run_both(4, lambda s: 1e-2)
    b_params = [Parameter(p.data.copy()) for p in a_params]
    opt_b = tn.Adam(b_params, lr=0.5)
    opt_b.load_state_dict(opt_a.state_dict())
    assert opt_b.step_count == 4 and opt_b.lr == 1e-2 and opt_b.betas == (0.9, 0.98)
    for step in (5, 6):
        for pa, pb, g in zip(a_params, b_params, grads_for(step), strict=True):
            pa.grad[...] = g
            pb.grad[...] = g
        opt_a.step()
        opt_b.step()
    assert all(np.array_equal(pa.data, pb.data) for pa, pb in zip(a_params, b_params, strict=True))
    sd = opt_a.state_dict()
    sd["exp_avg"][0][...] = 123.0  # a copy: the optimizer is not changed through it
    assert not (opt_a.exp_avg[0] == 123.0).any()


def test_adam_load_state_dict_rejects_mismatch_without_changing_anything():
    params = make_params()
    opt = tn.Adam(params)
    for p in params:
        p.grad[...] = 1.0
    opt.step()  # moments of its own, so that a partial load would show
    good = {k: [2 * a for a in v] if isinstance(v, list) else v for k, v in opt.state_dict().items()}
    kept = [a.copy() for a in opt.exp_avg + opt.exp_avg_sq]
    bad = dict(good, exp_avg_sq=[*good["exp_avg_sq"][:-1], np.zeros((2, 2))])
    with pytest.raises(ValueError, match=r"exp_avg_sq\[3\] expected shape \(1,\), got \(2, 2\)"):
        opt.load_state_dict(bad | {"step": 7})
    assert opt.step_count == 1
    assert all(np.array_equal(a, b) for a, b in zip(opt.exp_avg + opt.exp_avg_sq, kept, strict=True))
    with pytest.raises(ValueError, match="3 arrays, the optimizer has 4"):
        opt.load_state_dict(dict(good, exp_avg=good["exp_avg"][:3]))
    with pytest.raises(KeyError, match="expected keys"):
        opt.load_state_dict({"step": 1})


def test_adam_bad_arguments():
    params = make_params()
    with pytest.raises(ValueError, match="lr must be"):
        tn.Adam(params, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0.0, 1.0\)"):
        tn.Adam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas expected a pair"):
        tn.Adam(params, betas=0.9)
    with pytest.raises(ValueError, match="eps must be"):
        tn.Adam(params, eps=-1e-9)
    with pytest.raises(ValueError, match="params is empty"):
        tn.Adam([])
    with pytest.raises(TypeError, match=r"params\[0\] expected a tfm_numpy Parameter"):
        tn.Adam([np.zeros(3)])
    with pytest.raises(TypeError, match="wrap it in a list"):
        tn.Adam(params[0])
    opt = tn.Adam(params)
    with pytest.raises(ValueError, match="lr must be"):
        opt.lr = float("nan")


def test_adam_after_converting_the_model_is_a_clear_error():
    model = tn.Linear(3, 2, rng=0)
    opt = tn.make_adam(model)
    model.double()
    with pytest.raises(ValueError, match="make the optimizer after converting the model"):
        opt.step()


# -- the torch track's Adam ------------------------------------------------------------------------------------


def test_torch_adam_is_torch_adam_with_the_papers_defaults():
    model = tt.Linear(3, 2, rng=0)
    opt = tt.make_adam(model, lr=0.01)
    assert isinstance(opt, torch.optim.Adam)
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["weight_decay"] == 0.0
    np_opt = tn.make_adam(tn.Linear(3, 2, rng=0), lr=0.01)
    assert (np_opt.betas, np_opt.eps, np_opt.weight_decay) == (group["betas"], group["eps"], group["weight_decay"])
    assert opt.step_count == 0
    opt.lr = 0.25
    assert opt.lr == 0.25 and group["lr"] == 0.25
    tt.set_lr(opt, 0.5)
    assert opt.lr == 0.5
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.step()
    assert opt.step_count == 2
    with pytest.raises(ValueError, match="lr must be"):
        tt.set_lr(opt, -1.0)


def test_twin_adams_train_a_linear_layer_identically():
    """The training loop reads the same in both tracks: make_adam, set_lr(noam_lr), clip_grad_norm, step."""
    np_model = tn.Linear(4, 3, rng=0, dtype=np.float64)
    t_model = tt.Linear(4, 3, rng=0, dtype=torch.float64)
    t_model.load_state_dict({k: torch.from_numpy(v) for k, v in np_model.state_dict().items()})
    opt_np, opt_t = tn.make_adam(np_model), tt.make_adam(t_model)
    x = np.random.default_rng(0).standard_normal((5, 4))
    for step in range(1, 11):
        tn.set_lr(opt_np, tn.noam_lr(step, 4, 3))
        tt.set_lr(opt_t, tt.noam_lr(step, 4, 3))
        opt_np.zero_grad()
        np_model.backward(2 * np_model(x))  # L = sum(y^2)
        opt_t.zero_grad()
        (t_model(torch.from_numpy(x)) ** 2).sum().backward()
        n_np = tn.clip_grad_norm(np_model.parameters(), 1.0)
        n_t = tt.clip_grad_norm(t_model.parameters(), 1.0)
        assert abs(n_np - n_t) < 1e-12 * max(1.0, n_t)
        opt_np.step()
        opt_t.step()
    for k, v in np_model.state_dict().items():
        assert max_abs_diff(v, t_model.state_dict()[k]) < 1e-12


# -- the warm-up schedule --------------------------------------------------------------------------------------


@pytest.mark.parametrize("noam_lr", [tn.noam_lr, tt.noam_lr], ids=["numpy", "torch"])
def test_noam_lr_known_values(noam_lr):
    d, w = 512, 4000
    peak = 512**-0.5 * 4000**-0.5
    assert noam_lr(4000, d, w) == pytest.approx(peak, rel=1e-15)
    assert peak == pytest.approx(0.000698771242968684, rel=1e-12)
    assert noam_lr(1, d, w) == pytest.approx(512**-0.5 * 4000**-1.5, rel=1e-15)
    steps = np.arange(1, 12001)
    lrs = np.array([noam_lr(int(s), d, w) for s in steps])
    assert lrs.argmax() + 1 == 4000 and lrs.max() == noam_lr(4000, d, w)
    up, down = steps <= 4000, steps >= 4000
    np.testing.assert_allclose(lrs[up], steps[up] * lrs[0], rtol=1e-12)  # linear warm-up
    np.testing.assert_allclose(lrs[down], peak * np.sqrt(4000 / steps[down]), rtol=1e-12)  # step^-0.5 decay
    assert noam_lr(100, d, w, factor=2.0) == 2.0 * noam_lr(100, d, w)


def test_noam_lr_is_the_same_function_in_both_tracks():
    for step in (1, 2, 399, 400, 401, 10**6):
        for d, w, f in ((512, 4000, 1.0), (64, 400, 2.5), (1, 1, 0.1)):
            assert tn.noam_lr(step, d, w, f) == tt.noam_lr(step, d, w, f)


@pytest.mark.parametrize("noam_lr", [tn.noam_lr, tt.noam_lr], ids=["numpy", "torch"])
def test_noam_lr_bad_input(noam_lr):
    with pytest.raises(ValueError, match="step counts from 1"):
        noam_lr(0, 512, 4000)
    with pytest.raises(TypeError, match="step expected an int"):
        noam_lr(1.5, 512, 4000)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        noam_lr(1, 512, 0)
    with pytest.raises(ValueError, match="d_model must be an int >= 1"):
        noam_lr(1, 0, 10)
    with pytest.raises(ValueError, match="factor must be a positive"):
        noam_lr(1, 512, 10, factor=0.0)


# -- clipping --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipped", "below-threshold"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clip_grad_norm_matches_torch(max_norm, dtype):
    params = make_params(dtype)
    t_params = [torch.nn.Parameter(torch.from_numpy(p.data.copy())) for p in params]
    for p, tp, g in zip(params, t_params, grads_for(1, dtype), strict=True):
        p.grad[...] = g
        tp.grad = torch.from_numpy(g.copy())
    before = [p.grad.copy() for p in params]
    expected = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in before))
    assert (expected > max_norm) == (max_norm == 0.5)  # the two cases are what their names say
    n_np = tn.clip_grad_norm(params, max_norm)
    n_t = torch.nn.utils.clip_grad_norm_(t_params, max_norm)
    rtol = 1e-12 if dtype == np.float64 else 1e-6
    assert isinstance(n_np, float) and n_np == pytest.approx(float(n_t), rel=rtol) == expected
    for p, tp, g0 in zip(params, t_params, before, strict=True):
        assert p.grad.dtype == dtype
        np.testing.assert_allclose(p.grad, tp.grad.numpy(), rtol=rtol, atol=0)
        if max_norm > expected:
            assert np.array_equal(p.grad, g0)  # below the threshold: untouched, bit for bit
    new_norm = math.sqrt(sum(float(np.sum(p.grad.astype(np.float64) ** 2)) for p in params))
    assert new_norm == pytest.approx(min(max_norm, expected), rel=1e-5)


def test_clip_grad_norm_torch_wrapper_and_bad_input():
    t_model = tt.Linear(3, 2, rng=0, dtype=torch.float64)
    (t_model(torch.ones(4, 3, dtype=torch.float64)) * 100).sum().backward()
    ref = [p.grad.clone() for p in t_model.parameters()]
    norm = tt.clip_grad_norm(t_model, 1.0)
    assert isinstance(norm, float) and norm == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in ref]))), rel=1e-12
    )
    assert sum(float((p.grad**2).sum()) for p in t_model.parameters()) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match="max_norm must be"):
        tn.clip_grad_norm(make_params(), -1.0)
    with pytest.raises(ValueError, match="max_norm must be"):
        tt.clip_grad_norm(t_model, -1.0)
    assert tn.clip_grad_norm([], 1.0) == 0.0
