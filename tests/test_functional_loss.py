"""softmax, log_softmax, their backward, erf, and CrossEntropyLoss in both tracks, against torch.nn.functional."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_tracks import TOL, max_abs_diff, to_torch

import tfm_numpy as tn
import tfm_torch as tt
from tfm_numpy.functional import gelu_float32, normal_cdf_pdf_float32

F64, F32 = np.float64, np.float32


# -- softmax and log_softmax -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, axis", [((5,), -1), ((1, 7), -1), ((3, 4, 5), 0), ((3, 4, 5), 1), ((3, 4, 5), -1)])
@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
def test_softmax_and_log_softmax_match_torch_on_any_axis(shape, axis, fn):
    x = np.random.default_rng(0).standard_normal(shape) * 3
    ref = getattr(F, fn)(to_torch(x), dim=axis)
    out = getattr(tn, fn)(x, axis=axis)
    assert out.shape == x.shape and out.dtype == F64
    assert max_abs_diff(out, ref) < TOL
    assert max_abs_diff(getattr(tt, fn)(to_torch(x), axis=axis), ref) < TOL
    p = out if fn == "softmax" else np.exp(out)
    assert np.allclose(p.sum(axis=axis), 1, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_softmax_is_stable_at_logits_of_plus_minus_1e4(dtype):
    x = np.array([[1e4, 0.0, -1e4], [-1e4, -1e4, -1e4 + 1], [1e4, 1e4, 1e4]], dtype=dtype)
    # a RuntimeWarning (overflow in exp) would fail this test: pyproject turns them into errors
    p, logp = tn.softmax(x), tn.log_softmax(x)
    assert p.dtype == logp.dtype == dtype
    assert np.all(np.isfinite(p)) and np.all(np.isfinite(logp))
    e = math.exp(1)
    expected_p = [[1, 0, 0], [1 / (2 + e), 1 / (2 + e), e / (2 + e)], [1 / 3] * 3]
    assert np.allclose(p, expected_p, rtol=1e-6, atol=0)
    assert logp[0, 2] == pytest.approx(-2e4, rel=1e-6)  # finite: not log(0)
    assert logp[1, 2] == pytest.approx(1 - math.log(2 + e), rel=1e-6)
    assert max_abs_diff(p, F.softmax(to_torch(x), dim=-1)) < 1e-6
    ref = F.log_softmax(to_torch(x), dim=-1).numpy()
    assert np.all(np.abs(logp - ref) <= 1e-6 * np.maximum(1.0, np.abs(ref)))  # relative to each entry, -2e4 or -1
    tp, tlogp = tt.softmax(to_torch(x)), tt.log_softmax(to_torch(x))
    assert torch.isfinite(tp).all() and torch.isfinite(tlogp).all() and tp.dtype == to_torch(x).dtype
    assert max_abs_diff(tp, p) < 1e-6


def test_naive_softmax_would_overflow():
    """The reason for the max shift, checked: exp(1e4) is inf in float64, so the naive softmax gives nan."""
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(np.array([1e4, 0.0])) / np.exp(np.array([1e4, 0.0])).sum()
    assert np.isnan(naive[0])
    assert np.allclose(tn.softmax(np.array([1e4, 0.0])), [1, 0])


@pytest.mark.parametrize("shape, axis", [((6,), -1), ((2, 3, 4), 1), ((4, 5), 0)])
def test_softmax_backward_matches_the_jacobian_and_autograd(shape, axis):
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal(shape), rng.standard_normal(shape)
    p = tn.softmax(x, axis=axis)
    dx = tn.softmax_backward(p, g, axis=axis)
    # autograd's vector-Jacobian product
    xt = to_torch(x, requires_grad=True)
    F.softmax(xt, dim=axis).backward(to_torch(g))
    assert max_abs_diff(dx, xt.grad) < TOL
    # the explicit Jacobian diag(p) - p p^T, on one slice along the axis
    pm, gm, dm = (np.moveaxis(a, axis, -1).reshape(-1, shape[axis]) for a in (p, g, dx))
    jac = np.diag(pm[0]) - np.outer(pm[0], pm[0])
    assert np.allclose(jac @ gm[0], dm[0], rtol=0, atol=1e-14)
    # the torch twin's helper is the same formula
    assert max_abs_diff(tt.softmax_backward(to_torch(p), to_torch(g), axis=axis), dx) < TOL
    # and central differences agree
    w = rng.standard_normal(shape)
    num = tn.numeric_grad(lambda z: np.sum(w * tn.softmax(z, axis=axis)), x.copy())
    assert tn.rel_error(tn.softmax_backward(p, w, axis=axis), num) < 1e-7


def test_log_softmax_backward_matches_autograd():
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    xt = to_torch(x, requires_grad=True)
    F.log_softmax(xt, dim=0).backward(to_torch(g))
    dx = tn.log_softmax_backward(tn.log_softmax(x, axis=0), g, axis=0)
    assert max_abs_diff(dx, xt.grad) < TOL
    assert max_abs_diff(tt.log_softmax_backward(to_torch(tn.log_softmax(x, axis=0)), to_torch(g), axis=0), dx) < TOL


def test_softmax_rejects_non_float_input():
    with pytest.raises(TypeError, match="softmax: expected a float32 or float64 array, got dtype int64"):
        tn.softmax(np.arange(3))
    with pytest.raises(TypeError, match="log_softmax: expected a torch.Tensor"):
        tt.log_softmax(np.zeros(3))


# -- erf (NumPy has none; the exact GELU needs it) ---------------------------------------------------------------------
def test_erf_matches_math_erf_to_float64_precision():
    x = np.concatenate([np.linspace(-7, 7, 20001), np.geomspace(1e-300, 8, 2000), -np.geomspace(1e-12, 8, 500)])
    ref = np.array([math.erf(v) for v in x])
    got = tn.erf(x)
    rel = np.abs(got - ref) / np.maximum(np.abs(ref), np.finfo(F64).tiny)
    assert rel.max() < 1e-15
    assert max_abs_diff(got, torch.erf(to_torch(x))) < 1e-15


def test_erf_special_values_and_dtype():
    out = tn.erf(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e300]))
    assert out[0] == 0 and np.signbit(out[1]) and list(out[2:4]) == [1, -1] and np.isnan(out[4]) and out[5] == 1
    assert tn.erf(np.array([0.5], F32)).dtype == F32
    assert tn.erf(np.array(0.5)).shape == ()


def test_float32_normal_cdf_of_the_gelu_is_accurate_to_float32():
    """The exact GELU's float32 fast path (no table): a few float32 ulps, as accurate as torch's own float32 GELU."""
    x = np.linspace(-13, 8, 200001).astype(F32)
    ref = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x.astype(F64)])
    got, density = normal_cdf_pdf_float32(x)
    assert got.dtype == density.dtype == F32
    density_ref = np.exp(-0.5 * x.astype(F64) ** 2) / math.sqrt(2 * math.pi)
    assert np.abs(density - density_ref).max() < 2 * np.finfo(F32).eps
    assert np.abs(got - ref).max() < 4 * np.finfo(F32).eps  # absolute, everywhere
    left = (x < 0) & (x > -5)  # the left tail keeps relative accuracy (cancellation-free: no 1 - erf there)
    assert (np.abs(got - ref) / ref)[left].max() < 1e-5
    exact_gelu = x.astype(F64) * ref
    ours, torchs = tn.GELU()(x).astype(F64), torch.nn.functional.gelu(torch.from_numpy(x)).double().numpy()
    assert np.abs(ours - exact_gelu).max() <= 1.5 * np.abs(torchs - exact_gelu).max()
    special = normal_cdf_pdf_float32(np.array([np.inf, -np.inf, np.nan, 1e30, -1e30, 0.0], F32))[0]
    assert list(special[:2]) == [1, 0] and np.isnan(special[2]) and list(special[3:]) == [1, 0, 0.5]
    strided = x[:, None][::-2]  # not contiguous: the flat views must still write into the result
    assert np.array_equal(normal_cdf_pdf_float32(strided)[0], normal_cdf_pdf_float32(x[::-2].copy())[0][:, None])


@pytest.mark.parametrize("n", [1, 3 * (1 << 15) + 7])  # one short block; several blocks and a short last one
def test_float32_gelu_blocks_give_the_unfused_numbers_bit_for_bit(n):
    """gelu_float32 fuses x Phi and Phi + x phi into the blocks of the CDF: the same float32 numbers as the
    unfused formulas (the GELU's outputs and gradients did not move when it was fused), any layout of x."""
    x = (np.random.default_rng(5).standard_normal((n, 2)) * 4).astype(F32)
    x[0] = [-0.0, np.nan]
    for xs in (x, x[::-1, ::-1], x.T):  # contiguous, reversed views, a transpose: the results keep x's shape
        cdf, pdf = normal_cdf_pdf_float32(xs)
        y, dydx = gelu_float32(xs)
        assert y.shape == dydx.shape == xs.shape and y.dtype == dydx.dtype == F32
        for got, want in ((y, xs * cdf), (dydx, cdf + xs * pdf)):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bits: signs of zeros and nans too
    layer = tn.GELU()
    assert np.array_equal(layer(x), gelu_float32(x)[0], equal_nan=True)
    assert np.array_equal(layer.backward(np.ones_like(x)), gelu_float32(x)[1], equal_nan=True)


# -- cross-entropy -----------------------------------------------------------------------------------------------------
def _logits_targets(shape, V, rng, ignore_index=None, n_ignored=2):
    logits = rng.standard_normal((*shape, V)) * 2
    targets = rng.integers(0, V, shape)
    if ignore_index is not None:
        targets.reshape(-1)[:n_ignored] = ignore_index
    return logits, targets


CE_CASES = [
    # (batch shape, V, ignore_index, label_smoothing)
    ((1,), 2, None, 0.0),
    ((4,), 5, None, 0.1),
    ((2, 3), 7, 0, 0.0),
    ((2, 3), 7, 0, 0.2),
    ((3, 5), 4, -100, 0.1),
    ((2, 4), 6, 3, 1.0),
    ((), 5, None, 0.3),  # one position: logits (V,), targets a 0-d array
]


@pytest.mark.parametrize("shape, V, ignore_index, eps", CE_CASES)
def test_cross_entropy_matches_torch_functional_and_the_twin(shape, V, ignore_index, eps):
    rng = np.random.default_rng(3)
    logits, targets = _logits_targets(shape, V, rng, ignore_index)
    ce = tn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=eps)
    loss = ce(logits, targets)
    dlogits = ce.backward()
    assert loss.dtype == F64 and np.shape(loss) == () and dlogits.shape == logits.shape
    # torch.nn.functional.cross_entropy: classes at dim 1, so flatten to (N, V)
    ref_in = to_torch(logits.reshape(-1, V), requires_grad=True)
    ref_ignore = -100 if ignore_index is None else ignore_index
    ref = F.cross_entropy(ref_in, to_torch(targets.reshape(-1)), ignore_index=ref_ignore, label_smoothing=eps)
    ref.backward()
    assert abs(float(loss) - ref.item()) < TOL
    assert max_abs_diff(dlogits, ref_in.grad.reshape(logits.shape)) < TOL
    # the torch twin, with autograd
    t_in = to_torch(logits, requires_grad=True)
    t_loss = tt.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=eps)(t_in, to_torch(targets))
    t_loss.backward()
    assert abs(float(loss) - t_loss.item()) < TOL
    assert max_abs_diff(dlogits, t_in.grad) < TOL


@pytest.mark.parametrize("shape, V, ignore_index, eps", CE_CASES)
def test_cross_entropy_gradient_check(shape, V, ignore_index, eps):
    rng = np.random.default_rng(4)
    logits, targets = _logits_targets(shape, V, rng, ignore_index)
    ce = tn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=eps)
    errors = tn.grad_check(ce, (logits, targets))
    assert set(errors) == {"input0"} and errors["input0"] < 1e-7


def test_cross_entropy_fused_gradient_is_softmax_minus_smoothed_target_over_n_valid():
    rng = np.random.default_rng(5)
    V, eps = 5, 0.1
    logits = rng.standard_normal((4, V))
    targets = np.array([1, 0, 4, 0])  # 0 is ignored: two valid positions
    ce = tn.CrossEntropyLoss(ignore_index=0, label_smoothing=eps)
    loss = ce(logits, targets)
    q = np.full((4, V), eps / V)  # torch's convention: eps/V on every class, the target included
    q[np.arange(4), targets] += 1 - eps
    valid = (targets != 0)[:, None]
    expected_grad = (tn.softmax(logits) - q) * valid / 2
    assert np.allclose(ce.backward(), expected_grad, rtol=1e-14, atol=1e-16)
    expected_loss = -(q * tn.log_softmax(logits) * valid).sum() / 2
    assert float(loss) == pytest.approx(expected_loss, rel=1e-14)
    assert np.allclose(ce.backward(2.5), 2.5 * expected_grad, rtol=1e-14, atol=1e-16)  # chain rule scale


@pytest.mark.parametrize("lib", [tn, tt])
def test_cross_entropy_all_ignored_gives_zero_loss_and_zero_gradient(lib):
    """Our documented choice; torch's F.cross_entropy returns nan (0/0) here."""
    logits = np.random.default_rng(6).standard_normal((2, 3, 4))
    targets = np.zeros((2, 3), dtype=np.int64)
    if lib is tn:
        ce = tn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
        assert ce(logits, targets) == 0
        assert np.all(ce.backward() == 0)
    else:
        x = to_torch(logits, requires_grad=True)
        loss = tt.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)(x, to_torch(targets))
        loss.backward()
        assert loss.item() == 0 and torch.all(x.grad == 0)
    ref = F.cross_entropy(to_torch(logits.reshape(-1, 4)), to_torch(targets.reshape(-1)), ignore_index=0)
    assert torch.isnan(ref)


def test_cross_entropy_float32_stays_float32():
    rng = np.random.default_rng(7)
    logits, targets = _logits_targets((3, 4), 6, rng, ignore_index=2)
    ce = tn.CrossEntropyLoss(ignore_index=2, label_smoothing=0.1)
    loss = ce(logits.astype(F32), targets)
    assert loss.dtype == F32
    assert ce.backward().dtype == F32 and ce.backward(np.float64(2.0)).dtype == F32
    loss64 = tn.CrossEntropyLoss(ignore_index=2, label_smoothing=0.1)(logits, targets)
    assert abs(float(loss) - float(loss64)) < 1e-5
    t_loss = tt.CrossEntropyLoss(ignore_index=2, label_smoothing=0.1)(to_torch(logits.astype(F32)), to_torch(targets))
    assert t_loss.dtype == torch.float32 and abs(t_loss.item() - float(loss64)) < 1e-5


def test_cross_entropy_accepts_int32_targets_in_both_tracks():
    rng = np.random.default_rng(8)
    logits, targets = _logits_targets((5,), 3, rng)
    a = tn.CrossEntropyLoss()(logits, targets.astype(np.int32))
    b = tt.CrossEntropyLoss()(to_torch(logits), to_torch(targets.astype(np.int32)))
    assert abs(float(a) - b.item()) < TOL


@pytest.mark.parametrize("lib", [tn, tt])
@pytest.mark.parametrize(
    "logits, targets, kwargs, exc, match",
    [
        (np.zeros((2, 3, 4)), np.zeros((2, 4), np.int64), {}, ValueError, r"targets expected shape \(2, 3\)"),
        (np.zeros((2, 4)), np.zeros(2), {}, TypeError, "targets.*integer.*float64"),
        (np.zeros((2, 4)), np.array([0, 4]), {}, ValueError, r"targets: values must be in \[0, 4\), got 4"),
        (np.zeros((2, 4)), np.array([0, -1]), {"ignore_index": -100}, ValueError, r"\[0, 4\) or -100, got -1"),
        (np.zeros((2, 4), np.int64), np.array([0, 1]), {}, TypeError, "logits.*float32 or float64"),
    ],
)
def test_cross_entropy_bad_inputs(lib, logits, targets, kwargs, exc, match):
    ce = lib.CrossEntropyLoss(**kwargs)
    with pytest.raises(exc, match=match):
        ce(logits, targets) if lib is tn else ce(to_torch(logits), to_torch(targets))


@pytest.mark.parametrize("lib", [tn, tt])
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
        ({"label_smoothing": -0.1}, ValueError, r"label_smoothing must be in \[0, 1\], got -0.1"),
        ({"label_smoothing": "0.1"}, TypeError, "label_smoothing expected a float"),
        ({"ignore_index": 0.5}, TypeError, "ignore_index expected an int or None, got float"),
    ],
)
def test_cross_entropy_bad_arguments(lib, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        lib.CrossEntropyLoss(**kwargs)


def test_cross_entropy_backward_errors():
    ce = tn.CrossEntropyLoss()
    with pytest.raises(RuntimeError, match=r"CrossEntropyLoss.backward\(\) called before forward\(\)"):
        ce.backward()
    ce(np.zeros((2, 3)), np.array([0, 1]))
    with pytest.raises(ValueError, match="grad_out expected a scalar"):
        ce.backward(np.ones(2))


def test_cross_entropy_state_and_names_match_between_tracks():
    a, b = tn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1), tt.CrossEntropyLoss(0, 0.1)
    assert a.state_dict() == {} and dict(b.state_dict()) == {}
    assert (a.ignore_index, a.label_smoothing) == (b.ignore_index, b.label_smoothing)
    assert repr(a) == repr(b)
