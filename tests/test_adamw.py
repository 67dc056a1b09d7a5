"""AdamW (decoupled weight decay) in both tracks: against torch.optim.AdamW step for step in float64, the difference
from Adam's L2 penalty, state dicts and checkpoints, bad input refused as Adam refuses it, a failed step that
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff
from test_optim import assert_same_steps, grads_for, make_params, run_both

import tfm_numpy as tn
import tfm_torch as tt
from tfm_numpy.module import Parameter


def run_adamw(n_steps, lr_fn, weight_decay, betas=(0.9, 0.98), eps=1e-9, dtype=np.float64, reference=None):
    """The same parameters and gradients through tfm_numpy.AdamW and `reference` (plain torch.optim.AdamW)."""
    ref = torch.optim.AdamW if reference is None else reference
    return run_both(n_steps, lr_fn, betas, eps, weight_decay, dtype, ours=tn.AdamW, ref=ref)


@pytest.mark.parametrize(
    "lr_fn, weight_decay",
    [
        (lambda s: 1e-2, 0.0),
        (lambda s: 1e-2, 0.1),
        (lambda s: tn.noam_lr(s, 16, 4, factor=2.0), 0.5),  # the lr changes every step, so does the decay factor
        (lambda s: 3e-2, 2.0),
    ],
    ids=["no-decay", "decay-0.1", "noam-decay-0.5", "decay-2"],
)
def test_adamw_matches_torch_step_for_step_float64(lr_fn, weight_decay):
    assert_same_steps(*run_adamw(10, lr_fn, weight_decay), n_steps=10)


def test_torch_track_adamw_matches_numpy_adamw():
    np_params, t_params, opt_np, opt_t = run_adamw(6, lambda s: 1e-2, 0.3, reference=tt.AdamW)
    assert isinstance(opt_t, torch.optim.AdamW) and opt_t.step_count == 6 and opt_t.lr == 1e-2
    for p, tp in zip(np_params, t_params, strict=True):
        assert max_abs_diff(p.data, tp) < 1e-12


def test_adamw_is_not_adam_with_weight_decay_but_is_adam_without():
    """With weight decay the two updates differ; with none they are the same numbers."""
    for wd, same in ((0.1, False), (0.0, True)):
        pa, pw = make_params(), make_params()
        adam, adamw = tn.Adam(pa, lr=1e-2, weight_decay=wd), tn.AdamW(pw, lr=1e-2, weight_decay=wd)
        for step in range(1, 4):
            for a, w, g in zip(pa, pw, grads_for(step), strict=True):
                a.grad[...] = g
                w.grad[...] = g
            adam.step()
            adamw.step()
        diff = max(np.abs(a.data - w.data).max() for a, w in zip(pa, pw, strict=True))
        assert (diff == 0.0) if same else (diff > 1e-4)


def test_adamw_decay_alone_shrinks_by_the_same_fraction():
    """With a zero gradient, Adam's update is 0 and AdamW multiplies each weight by (1 - lr wd) per step."""
    params = make_params()
    start = [p.data.copy() for p in params]
    opt = tn.AdamW(params, lr=0.1, weight_decay=0.5)
    for _ in range(3):
        for p in params:
            p.grad[...] = 0.0
        opt.step()
    for p, s in zip(params, start, strict=True):
        assert np.allclose(p.data, s * 0.95**3, rtol=1e-14, atol=0)


def test_adamw_defaults_alike_in_both_tracks():
    np_opt = tn.make_adamw(tn.Linear(3, 2, rng=0))
    t_opt = tt.make_adamw(tt.Linear(3, 2, rng=0))
    group = t_opt.param_groups[0]
    assert (np_opt.lr, np_opt.betas, np_opt.eps, np_opt.weight_decay) == (1e-3, (0.9, 0.98), 1e-9, 0.01)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.98), 1e-9, 0.01)
    assert isinstance(np_opt, tn.Adam) and repr(np_opt).startswith("AdamW(")


def test_adamw_float32_stays_float32():
    np_params, t_params, opt_np, _ = run_adamw(5, lambda s: 1e-2, 0.1, dtype=np.float32)
    for p, tp in zip(np_params, t_params, strict=True):
        assert p.data.dtype == np.float32 and max_abs_diff(p.data, tp) < 1e-5
    assert all(m.dtype == np.float32 for m in opt_np.exp_avg + opt_np.exp_avg_sq)


def test_adamw_state_dict_round_trip_continues_identically():
    a_params, _, opt_a, _ = run_adamw(4, lambda s: 1e-2, 0.2)
    b_params = [Parameter(p.data.copy()) for p in a_params]
    opt_b = tn.AdamW(b_params, lr=0.5, weight_decay=0.0)
    opt_b.load_state_dict(opt_a.state_dict())
    assert opt_b.step_count == 4 and opt_b.lr == 1e-2 and opt_b.weight_decay == 0.2
    for step in (5, 6):
        for pa, pb, g in zip(a_params, b_params, grads_for(step), strict=True):
            pa.grad[...] = g
            pb.grad[...] = g
        opt_a.step()
        opt_b.step()
    assert all(np.array_equal(pa.data, pb.data) for pa, pb in zip(a_params, b_params, strict=True))


@pytest.mark.parametrize("L", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "AdamW: lr must be"),
        (dict(betas=(0.9, 1.0)), r"AdamW: betas\[1\] must be in \[0.0, 1.0\)"),
        (dict(betas=0.9), "AdamW: betas expected a pair"),
        (dict(eps=float("nan")), "AdamW: eps must be"),
        (dict(weight_decay=-0.1), "AdamW: weight_decay must be"),
    ],
)
def test_adamw_bad_arguments_refused_alike(L, kwargs, match):
    model = L.Linear(3, 2, rng=0)
    with pytest.raises(ValueError, match=match):
        L.make_adamw(model, **kwargs)


def test_adamw_bad_params_and_lr():
    with pytest.raises(ValueError, match="AdamW: params is empty"):
        tn.AdamW([])
    with pytest.raises(TypeError, match="AdamW: params expected an iterable"):
        tn.AdamW(make_params()[0])
    opt = tn.AdamW(make_params())
    with pytest.raises(ValueError, match="AdamW: lr must be"):
        opt.lr = float("inf")
    with pytest.raises(ValueError, match="lr must be"):
        tt.make_adamw(tt.Linear(3, 2, rng=0)).lr = -1.0


def test_adamw_failed_step_changes_nothing():
    """A bad gradient on the last parameter is found before the decay shrinks the first ones."""
    params = make_params()
    opt = tn.AdamW(params, lr=0.1, weight_decay=0.5)
    for p, g in zip(params, grads_for(1), strict=True):
        p.grad[...] = g
    opt.step()
    before = [p.data.copy() for p in params]
    state = opt.state_dict()
    params[-1].grad = np.zeros((7,))
    with pytest.raises(ValueError, match=r"AdamW.step: params\[3\] has data"):
        opt.step()
    assert all(np.array_equal(p.data, b) for p, b in zip(params, before, strict=True))
    assert opt.step_count == 1
    after = opt.state_dict()
    for moment in ("exp_avg", "exp_avg_sq"):
        assert all(np.array_equal(x, y) for x, y in zip(state[moment], after[moment], strict=True))


def test_adamw_load_state_dict_rejects_mismatch_without_changing_anything():
    opt = tn.AdamW(make_params())
    good = opt.state_dict()
    with pytest.raises(ValueError, match=r"AdamW.load_state_dict: exp_avg: 3 arrays"):
        opt.load_state_dict(dict(good, exp_avg=good["exp_avg"][:3], step=5))
    assert opt.step_count == 0


# -- checkpoints: AdamW's state in files, refused by an Adam (the meaning of weight_decay differs) --------------


def trained(L, opt_fn):
    model = L.Transformer(7, 9, d_model=8, n_heads=2, d_ff=16, n_layers=1, dropout=0.0, max_len=12, rng=0)
    opt = opt_fn(model, lr=0.01, weight_decay=0.1)
    src, tgt = np.array([[1, 2, 3, 4]]), np.array([[1, 5, 6]])
    for _ in range(2):
        if L is tn:
            logits = model(src, tgt)
            model.zero_grad()
            model.backward(2 * logits / 100)
        else:
            opt.zero_grad()
            (model(torch.from_numpy(src), torch.from_numpy(tgt)) ** 2).sum().div(100).backward()
        opt.step()
    return model, opt


def test_adamw_checkpoint_round_trip_numpy_and_across_tracks(tmp_path):
    model, opt = trained(tn, tn.make_adamw)
    path = tn.save_checkpoint(tmp_path / "w.npz", model, opt)
    opt2 = tn.make_adamw(model, lr=0.5, weight_decay=0.0)
    tn.load_checkpoint(path, model, opt2)
    assert opt2.step_count == 2 and opt2.weight_decay == 0.1
    assert all(np.array_equal(a, b) for a, b in zip(opt.exp_avg, opt2.exp_avg, strict=True))
    tmodel = tt.Transformer(7, 9, d_model=8, n_heads=2, d_ff=16, n_layers=1, dropout=0.0, max_len=12, rng=0)
    topt = tt.make_adamw(tmodel)
    tt.load_checkpoint(path, tmodel, topt)
    assert topt.step_count == 2 and topt.param_groups[0]["weight_decay"] == 0.1
    back = tt.export_npz(tmp_path / "back.npz", tmodel, topt)
    opt3 = tn.make_adamw(model)
    tn.load_checkpoint(back, model, opt3)
    assert all(np.array_equal(a, b) for a, b in zip(opt.exp_avg_sq, opt3.exp_avg_sq, strict=True))


def test_adam_and_adamw_checkpoints_do_not_mix(tmp_path):
    model, opt = trained(tn, tn.make_adamw)
    path = tn.save_checkpoint(tmp_path / "w.npz", model, opt)
    with pytest.raises(ValueError, match="holds AdamW state, the optimizer is Adam"):
        tn.load_checkpoint(path, model, tn.make_adam(model))
    tmodel = tt.Transformer(7, 9, d_model=8, n_heads=2, d_ff=16, n_layers=1, dropout=0.0, max_len=12, rng=0)
    with pytest.raises(ValueError, match="holds AdamW state, the optimizer is Adam"):
        tt.load_checkpoint(path, tmodel, tt.make_adam(tmodel))
    model_a, opt_a = trained(tn, tn.make_adam)
    path_a = tn.save_checkpoint(tmp_path / "a.npz", model_a, opt_a)
    with pytest.raises(ValueError, match="holds Adam state, the optimizer is AdamW"):
        tn.load_checkpoint(path_a, model_a, tn.make_adamw(model_a))
    tmodel2, topt2 = trained(tt, tt.make_adamw)
    with pytest.raises(ValueError, match="holds Adam state, the optimizer is AdamW"):
        tt.load_checkpoint(path_a, tmodel2, topt2)


def test_unknown_optimizer_type_in_a_file_is_refused(tmp_path):
    import json

    model, opt = trained(tn, tn.make_adamw)
    path = tn.save_checkpoint(tmp_path / "w.npz", model, opt)
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays["__meta__"]))
    meta["optim"]["type"] = "SGD"
    arrays["__meta__"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"type='SGD' must be one of \('Adam', 'AdamW'\)"):
        tn.load_checkpoint(tmp_path / "bad.npz", model, tn.make_adamw(model))
