"""The gradient checkers themselves: the definition of relative error, central differences, float64 only,
inputs that are passed through, several inputs, the padding row, and (most important) that they catch bugs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_tracks import to_torch

import tfm_numpy as tn
import tfm_torch as tt

F64 = np.float64


# -- rel_error ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lib", [tn, tt])
def test_rel_error_definition(lib):
    assert lib.rel_error(np.array([1.0, 2.0]), np.array([1.0, 2.5])) == pytest.approx(0.5 / 2.5)
    assert lib.rel_error(np.array([1e-9, 0.0]), np.array([0.0, 0.0])) == 1.0  # scale-free: tiny arrays too
    assert lib.rel_error(np.zeros(3), np.zeros(3)) == 0.0
    assert lib.rel_error(np.zeros(0), np.zeros(0)) == 0.0
    assert lib.rel_error(3.0, 3.0) == 0.0
    with pytest.raises(ValueError, match="rel_error: shapes differ"):
        lib.rel_error(np.zeros(2), np.zeros(3))


def test_rel_error_same_in_both_tracks():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    assert tn.rel_error(a, b) == pytest.approx(tt.rel_error(to_torch(a), to_torch(b)), rel=1e-15)


# -- numeric_grad ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lib", [tn, tt])
def test_numeric_grad_of_a_known_function_and_x_restored(lib):
    x0 = np.random.default_rng(1).standard_normal((2, 3))
    x = x0.copy() if lib is tn else to_torch(x0)
    grad = lib.numeric_grad(lambda z: (z**3).sum() + (z[0, 0] * z[1, 2]), x)
    expected = 3 * x0**2
    expected[0, 0] += x0[1, 2]
    expected[1, 2] += x0[0, 0]
    assert np.allclose(np.asarray(grad), expected, rtol=1e-8, atol=1e-9)
    assert np.array_equal(np.asarray(x), x0)  # every perturbation undone, bit for bit


@pytest.mark.parametrize("lib", [tn, tt])
def test_numeric_grad_refuses_float32(lib):
    x = np.zeros(3, np.float32)
    with pytest.raises(TypeError, match="numeric_grad: x expected a float64"):
        lib.numeric_grad(lambda z: z.sum(), x if lib is tn else to_torch(x))


def test_numeric_grad_refuses_a_non_contiguous_view():
    x = np.zeros((4, 4))[:, :2]  # rows 32 bytes apart, columns 8: no flat view exists
    with pytest.raises(ValueError, match="contiguous"):
        tn.numeric_grad(lambda z: z.sum(), x)


# -- grad_check --------------------------------------------------------------------------------------------------------
class WrongBiasLinear(tn.Linear):
    """A plausible bug: the bias gradient averaged over the batch instead of summed."""

    def backward(self, grad_out):
        x2, x_shape = self._saved()
        g2 = grad_out.reshape(-1, self.out_features)
        self.weight.grad += g2.T @ x2
        self.bias.grad += g2.mean(axis=0)
        return (g2 @ self.weight.data).reshape(x_shape)


class TransposedInputGradLinear(tn.Linear):
    """Another: the input gradient through W instead of W^T (only shape-correct when W is square)."""

    def backward(self, grad_out):
        x2, x_shape = self._saved()
        g2 = grad_out.reshape(-1, self.out_features)
        self.weight.grad += g2.T @ x2
        self.bias.grad += g2.sum(axis=0)
        return (g2 @ self.weight.data.T).reshape(x_shape)


@pytest.mark.parametrize("cls, bad", [(WrongBiasLinear, "bias"), (TransposedInputGradLinear, "input0")])
def test_grad_check_catches_a_wrong_backward(cls, bad):
    x = np.random.default_rng(2).standard_normal((3, 4))
    errors = tn.grad_check(cls(4, 4, dtype=F64), x)
    assert errors[bad] > 1e-2
    assert all(err < 1e-7 for name, err in errors.items() if name != bad)


def test_grad_check_reports_inputs_and_parameters_by_name_and_leaves_grads_zeroed():
    lin = tn.Linear(3, 2, dtype=F64)
    x = np.random.default_rng(3).standard_normal((2, 3))
    x_before = x.copy()
    errors = tn.grad_check(lin, x)
    assert list(errors) == ["input0", "weight", "bias"]
    assert max(errors.values()) < 1e-7
    assert np.array_equal(x, x_before)  # the caller's array is never perturbed
    assert all(np.all(g == 0) for g in lin.grads().values())


@pytest.mark.parametrize("lib", [tn, tt])
def test_grad_check_refuses_float32(lib):
    mod = lib.Linear(3, 2)  # float32 by default
    x = np.zeros((1, 3), np.float32)
    with pytest.raises(TypeError, match=r"grad_check: parameter 'weight' is .*float32.*double\(\)"):
        lib.grad_check(mod, x if lib is tn else to_torch(x))
    relu = lib.ReLU()
    with pytest.raises(TypeError, match="grad_check: input0 is .*float32"):
        lib.grad_check(relu, x if lib is tn else to_torch(x))


class Bilinear(tn.Module):
    """Two float inputs and a pass-through integer argument: out = (a * b)[..., idx]."""

    def forward(self, a, idx, b):
        self._cache = (a, b, idx)
        return (a * b)[..., idx]

    def backward(self, grad_out):
        a, b, idx = self._saved()
        full = np.zeros_like(a)
        np.add.at(full, (..., idx), grad_out)  # scatter back to the selected columns
        return full * b, None, full * a  # one entry per input, None for the integer one


def test_grad_check_with_several_inputs_and_an_integer_pass_through():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((2, 5))
    errors = tn.grad_check(Bilinear(), (a, np.array([0, 3, 3]), a))  # the same array twice: checked separately
    assert list(errors) == ["input0", "input2"]
    assert max(errors.values()) < 1e-7


def test_grad_check_uses_forward_kwargs_and_given_loss_weights():
    rng = np.random.default_rng(5)
    x, mask = rng.standard_normal((3, 4)), rng.random((3, 4)) > 0.5
    drop = tn.Dropout(0.5)
    errors = tn.grad_check(drop, x, forward_kwargs={"mask": mask}, loss_weights=np.ones((3, 4)))
    assert errors["input0"] < 1e-7
    with pytest.raises(ValueError, match="could not be broadcast|shapes"):
        tn.grad_check(tn.ReLU(), x, loss_weights=np.ones((2, 2)))


def test_grad_check_leaves_out_the_padding_row_and_why():
    """Central differences see the padding row (it is used in the forward), the decreed gradient is zero."""
    emb = tn.Embedding(6, 3, padding_idx=2, dtype=F64)
    ids = np.array([[2, 0, 5, 2], [1, 2, 2, 4]])
    assert tn.grad_check(emb, ids)["weight"] < 1e-7
    w = np.random.default_rng(6).standard_normal((2, 4, 3))
    numeric = tn.numeric_grad(lambda _: np.sum(w * emb(ids)), emb.weight.data)
    assert np.abs(numeric[2]).max() > 0.1  # what calculus says for the padding row
    emb.zero_grad()
    emb(ids)
    emb.backward(w)
    assert np.all(emb.weight.grad[2] == 0)  # what the convention says


# -- the torch twin's checker ------------------------------------------------------------------------------------------
class _WrongSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x  # should be 2 x


class WrongSquare(torch.nn.Module):
    def forward(self, x):
        return _WrongSquare.apply(x)


def test_torch_grad_check_catches_a_wrong_backward_and_passes_the_twins():
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert tt.grad_check(WrongSquare(), x)["input0"] > 0.1
    for mod in (tt.Linear(4, 2, dtype=torch.float64), tt.LayerNorm(4, dtype=torch.float64), tt.GELU("tanh")):
        errors = tt.grad_check(mod, x)
        assert max(errors.values()) < 1e-7, (mod, errors)


def test_both_checkers_report_the_same_names():
    np_mod, t_mod = tn.LayerNorm(4, dtype=F64), tt.LayerNorm(4, dtype=torch.float64)
    x = np.random.default_rng(7).standard_normal((2, 4))
    assert list(tn.grad_check(np_mod, x)) == list(tt.grad_check(t_mod, to_torch(x))) == ["input0", "weight", "bias"]
    ids = np.array([[0, 1, 1]])
    np_emb, t_emb = tn.Embedding(3, 2, padding_idx=1, dtype=F64), tt.Embedding(3, 2, padding_idx=1, dtype=torch.float64)
    np_err, t_err = tn.grad_check(np_emb, ids), tt.grad_check(t_emb, to_torch(ids))
    assert list(np_err) == list(t_err) == ["weight"] and max(*np_err.values(), *t_err.values()) < 1e-7
    logits, targets = np.random.default_rng(8).standard_normal((3, 5)), np.array([1, 0, 4])
    ce_np, ce_t = tn.CrossEntropyLoss(ignore_index=0), tt.CrossEntropyLoss(ignore_index=0)
    assert tn.grad_check(ce_np, (logits, targets))["input0"] < 1e-7
    assert tt.grad_check(ce_t, (to_torch(logits), to_torch(targets)))["input0"] < 1e-7
