"""Layers in both tracks: gradient checks, agreement with the torch twin and with torch.nn, state dicts,
initialization, float32 end to end, dropout, the Module contract, and clear errors on bad input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers_tracks import (
    TOL,
    assert_tracks_agree,
    load_np_into_torch,
    max_abs_diff,
    run_numpy,
    run_torch,
    to_numpy,
    to_torch,
)
from torch import nn

import tfm_numpy as tn
import tfm_torch as tt

F64, F32 = np.float64, np.float32
T64, T32 = torch.float64, torch.float32


# -- the cases: one per layer and shape --------------------------------------------------------------------------------
@dataclass
class Case:
    """A layer configuration: how to build it in each track and in torch.nn, and an input for it."""

    name: str
    args: tuple  # constructor arguments shared by tfm_numpy, tfm_torch (and torch.nn where they coincide)
    x_shape: tuple  # input shape (for Embedding: the shape of the token ids)
    ref: Any  # builds the torch.nn reference (float64)
    kwargs: dict | None = None

    def numpy(self, dtype=F64, rng=0):
        kw = dict(self.kwargs or {})
        if self.name in ("Linear", "Embedding", "LayerNorm"):
            kw["dtype"] = dtype
        if self.name in ("Linear", "Embedding"):
            kw["rng"] = rng
        return getattr(tn, self.name)(*self.args, **kw)

    def torch(self, dtype=T64, rng=0):
        kw = dict(self.kwargs or {})
        if self.name in ("Linear", "Embedding", "LayerNorm"):
            kw["dtype"] = dtype
        if self.name in ("Linear", "Embedding"):
            kw["rng"] = rng
        return getattr(tt, self.name)(*self.args, **kw)

    def input(self, rng: np.random.Generator, dtype=F64) -> np.ndarray:
        if self.name == "Embedding":
            ids = rng.integers(0, self.args[0], self.x_shape)
            pad = (self.kwargs or {}).get("padding_idx")
            if pad is not None:  # make sure the padding token and a repeated id both occur
                ids.reshape(-1)[0] = pad % self.args[0]
            ids.reshape(-1)[-1] = ids.reshape(-1)[0]
            return ids
        return rng.standard_normal(self.x_shape).astype(dtype)

    def __repr__(self) -> str:
        return f"{self.name}{self.args}{self.kwargs or ''}@{self.x_shape}"


def _gelu(approximate):
    return lambda: nn.GELU(approximate=approximate)


CASES = [
    Case("Linear", (1, 1), (1, 1), lambda: nn.Linear(1, 1, dtype=T64)),
    Case("Linear", (5, 3), (1, 5), lambda: nn.Linear(5, 3, dtype=T64)),
    Case("Linear", (7, 4), (2, 3, 7), lambda: nn.Linear(7, 4, dtype=T64)),
    Case("Linear", (2, 9), (3, 1, 2), lambda: nn.Linear(2, 9, bias=False, dtype=T64), {"bias": False}),
    Case("Embedding", (1, 1), (1,), lambda: nn.Embedding(1, 1, dtype=T64)),
    Case("Embedding", (7, 4), (2, 5), lambda: nn.Embedding(7, 4, padding_idx=0, dtype=T64), {"padding_idx": 0}),
    Case("Embedding", (11, 3), (1, 9), lambda: nn.Embedding(11, 3, padding_idx=-1, dtype=T64), {"padding_idx": -1}),
    Case("Embedding", (5, 6), (3,), lambda: nn.Embedding(5, 6, dtype=T64)),
    Case("ReLU", (), (1,), nn.ReLU),
    Case("ReLU", (), (2, 3, 5), nn.ReLU),
    Case("GELU", (), (1, 1), _gelu("none")),
    Case("GELU", (), (4, 7), _gelu("none")),
    Case("GELU", (), (3, 5), _gelu("tanh"), {"approximate": "tanh"}),
    Case("GELU", (), (1,), _gelu("tanh"), {"approximate": "tanh"}),
    Case("LayerNorm", (1,), (1, 1), lambda: nn.LayerNorm(1, dtype=T64)),
    Case("LayerNorm", (5,), (1, 5), lambda: nn.LayerNorm(5, dtype=T64)),
    Case("LayerNorm", ((2, 3),), (4, 2, 3), lambda: nn.LayerNorm((2, 3), dtype=T64)),
    Case("LayerNorm", (7,), (2, 3, 7), lambda: nn.LayerNorm(7, eps=1e-3, dtype=T64), {"eps": 1e-3}),
]
ONE_PER_LAYER = [CASES[i] for i in (2, 5, 9, 11, 12, 16)]


def randomize(mod, rng: np.random.Generator) -> None:
    """Random parameters (LayerNorm starts at ones and zeros, which would hide a swapped weight and bias)."""
    for p in mod.parameters():
        p.data[...] = rng.standard_normal(p.shape)


# -- gradient checks ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_gradient_check_float64(case):
    rng = np.random.default_rng(1)
    mod = case.numpy(F64)
    randomize(mod, rng)
    errors = tn.grad_check(mod, case.input(rng), seed=2)
    expected = {f"input{i}" for i in range(1) if case.name != "Embedding"} | set(dict(mod.named_parameters()))
    assert set(errors) == expected
    assert max(errors.values()) < 1e-7, errors


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 1, 7)])
def test_gradient_check_dropout_with_fixed_mask(shape):
    rng = np.random.default_rng(3)
    x, mask = rng.standard_normal(shape), rng.random(shape) >= 0.4
    errors = tn.grad_check(tn.Dropout(0.4), x, forward_kwargs={"mask": mask})
    assert errors["input0"] < 1e-7


def test_gradient_check_detects_a_wrong_layer_norm_backward():
    """The checker can fail: drop the xhat term of the LayerNorm backward and it must notice."""

    class BrokenLayerNorm(tn.LayerNorm):
        def backward(self, grad_out):
            xhat, rstd, axes = self._saved()
            dxhat = grad_out * self.weight.data
            self.weight.grad += (grad_out * xhat).sum(axis=0)
            self.bias.grad += grad_out.sum(axis=0)
            return rstd * (dxhat - dxhat.mean(axis=axes, keepdims=True))  # missing: - xhat * mean(dxhat * xhat)

    errors = tn.grad_check(BrokenLayerNorm(6, dtype=F64), np.random.default_rng(0).standard_normal((3, 6)))
    assert errors["input0"] > 1e-2
    assert errors["weight"] < 1e-7 and errors["bias"] < 1e-7


# -- agreement: NumPy vs torch twin vs torch.nn ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_numpy_twin_and_torch_nn_agree_float64(case):
    rng = np.random.default_rng(4)
    np_mod = case.numpy(F64)
    randomize(np_mod, rng)
    twin, ref = case.torch(T64, rng=99), case.ref()
    load_np_into_torch(np_mod, twin)
    load_np_into_torch(np_mod, ref)
    x = case.input(rng)
    out = np_mod(x)
    g = rng.standard_normal(out.shape)
    np_result = run_numpy(np_mod, (x,), g)
    assert_tracks_agree(np_result, run_torch(twin, (x,), g))
    assert_tracks_agree(np_result, run_torch(ref, (x,), g))
    if case.name == "Embedding" and np_mod.padding_idx is not None:
        assert np.all(np_result[2]["weight"][np_mod.padding_idx] == 0)  # the padding row gets no gradient


@pytest.mark.parametrize("case", ONE_PER_LAYER, ids=repr)
def test_state_dict_keys_and_parameter_order_match_torch(case):
    np_mod, twin, ref = case.numpy(), case.torch(), case.ref()
    keys = list(np_mod.state_dict())
    assert keys == list(twin.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in np_mod.named_parameters()] == [n for n, _ in twin.named_parameters()]
    assert list(np_mod.grads()) == [n for n, _ in twin.named_parameters()]


@pytest.mark.parametrize("case", [c for c in ONE_PER_LAYER if c.name in ("Linear", "Embedding", "LayerNorm")], ids=repr)
def test_state_dict_round_trip_both_ways(case):
    rng = np.random.default_rng(5)
    np_mod = case.numpy(F64, rng=1)
    randomize(np_mod, rng)
    twin = case.torch(T64, rng=2)
    load_np_into_torch(np_mod, twin)  # numpy -> torch
    for k, v in twin.state_dict().items():
        assert np.array_equal(v.numpy(), np_mod.state_dict()[k])
    back = case.numpy(F64, rng=3)
    back.load_state_dict(twin.state_dict())  # torch -> numpy (np.asarray reads CPU tensors)
    for k, v in back.state_dict().items():
        assert np.array_equal(v, np_mod.state_dict()[k])
    float32_twin = case.torch(T32, rng=4)
    load_np_into_torch(np_mod, float32_twin)  # float64 weights into a float32 module: converted, dtype kept
    assert all(p.dtype == T32 for p in float32_twin.parameters())


# -- float32 end to end ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ONE_PER_LAYER, ids=repr)
def test_float32_stays_float32_and_matches_float64(case):
    rng = np.random.default_rng(6)
    mod32 = case.numpy(F32)
    x = case.input(rng, F32)
    out = mod32(x)
    g = rng.standard_normal(out.shape).astype(F32)
    out, gin, gp = run_numpy(mod32, (x,), g)
    assert out.dtype == F32
    assert gin is None if case.name == "Embedding" else gin.dtype == F32
    assert all(v.dtype == F32 and mod32.state_dict()[k].dtype == F32 for k, v in gp.items())
    # the same computation in float64 (weights cast up) agrees to float32 precision
    mod64 = case.numpy(F64)
    mod64.load_state_dict(mod32.state_dict())
    out64, gin64, gp64 = run_numpy(mod64, (x if case.name == "Embedding" else x.astype(F64),), g.astype(F64))

    def close(a, ref):  # to float32 precision, relative to the reference's scale
        return max_abs_diff(a, ref) < 1e-5 * max(1.0, np.abs(ref).max())

    assert close(out, out64) and (gin is None or close(gin, gin64)) and all(close(gp[k], gp64[k]) for k in gp)
    # and the float32 torch twin stays float32 too, and agrees on the output and every gradient
    twin = case.torch(T32)
    load_np_into_torch(mod32, twin)
    t_out, t_gin, t_gp = run_torch(twin, (x,), g)
    assert t_out.dtype == T32 and all(v.dtype == T32 for v in t_gp.values()) and all(v.dtype == T32 for v in t_gin)
    assert close(t_out, out64) and all(close(t_gp[k], gp64[k]) for k in gp64)
    assert gin is None or close(t_gin[0], gin64)


def test_module_astype_converts_parameters_and_gradients():
    lin = tn.Linear(3, 2)
    assert lin.weight.dtype == F32 and lin.weight.grad.dtype == F32
    lin.double()
    assert lin.weight.dtype == F64 and lin.bias.grad.dtype == F64
    assert lin(np.ones((1, 3))).dtype == F64


# -- initialization ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lib, dt", [(tn, F32), (tt, T32)])
def test_initialization_matches_torch_defaults(lib, dt):
    lin = lib.Linear(64, 256, rng=0)
    w, b = to_numpy(lin.weight.data), to_numpy(lin.bias.data)
    bound = 1 / 8  # 1 / sqrt(in_features), as torch's kaiming_uniform_(a=sqrt(5))
    assert w.dtype == b.dtype == F32 and lin.weight.dtype == dt
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert abs(w.std() - bound / np.sqrt(3)) < 0.03 * bound / np.sqrt(3)  # uniform, not normal
    emb = to_numpy(lib.Embedding(1000, 16, padding_idx=3, rng=0).weight.data)
    assert np.all(emb[3] == 0)
    rows = np.delete(emb, 3, axis=0)
    assert abs(rows.mean()) < 0.03 and abs(rows.std() - 1) < 0.03  # N(0, 1)
    ln = lib.LayerNorm((2, 3))
    assert np.all(to_numpy(ln.weight.data) == 1) and np.all(to_numpy(ln.bias.data) == 0)


@pytest.mark.parametrize("lib", [tn, tt])
def test_initialization_is_reproducible_from_a_seed_or_generator(lib):
    a, b, c = lib.Embedding(5, 4, rng=7), lib.Embedding(5, 4, rng=7), lib.Embedding(5, 4, rng=8)
    assert np.array_equal(to_numpy(a.weight.data), to_numpy(b.weight.data))
    assert not np.array_equal(to_numpy(a.weight.data), to_numpy(c.weight.data))
    g = np.random.default_rng(1) if lib is tn else torch.Generator().manual_seed(1)
    first, second = lib.Linear(3, 3, rng=g), lib.Linear(3, 3, rng=g)  # a shared generator moves on
    assert not np.array_equal(to_numpy(first.weight.data), to_numpy(second.weight.data))


# -- dropout -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lib", [tn, tt])
def test_dropout_is_identity_in_eval(lib):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(F32)
    drop = lib.Dropout(0.5, rng=0).eval()
    if lib is tn:
        assert drop(x) is x
        g = np.ones_like(x)
        assert drop.backward(g) is g
    else:
        xt = to_torch(x)
        assert drop(xt) is xt


@pytest.mark.parametrize("lib", [tn, tt])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_preserves_the_mean_and_drops_a_fraction_p(lib, p):
    n = 200_000
    x = np.full(n, 2.0, dtype=F32)
    drop = lib.Dropout(p, rng=123)
    out = to_numpy(drop(x if lib is tn else to_torch(x)))
    assert out.dtype == F32
    kept = out != 0
    assert np.allclose(out[kept], 2.0 / (1 - p), rtol=1e-6)  # survivors scaled by 1 / (1 - p)
    sd_frac = np.sqrt(p * (1 - p) / n)
    assert abs((~kept).mean() - p) < 5 * sd_frac
    assert abs(out.mean() - 2.0) < 5 * 2.0 / (1 - p) * sd_frac  # E[out] = x


@pytest.mark.parametrize("lib", [tn, tt])
def test_dropout_same_seed_same_mask_different_seed_different_mask(lib):
    x = np.ones((6, 7), dtype=F32)
    x = x if lib is tn else to_torch(x)
    m1 = to_numpy(lib.Dropout(0.5, rng=5)(x))
    m2 = to_numpy(lib.Dropout(0.5, rng=5)(x))
    m3 = to_numpy(lib.Dropout(0.5, rng=6)(x))
    assert np.array_equal(m1, m2) and not np.array_equal(m1, m3)
    drop = lib.Dropout(0.5, rng=5)
    assert not np.array_equal(to_numpy(drop(x)), to_numpy(drop(x)))  # a new mask at every call


def test_dropout_backward_uses_the_forward_mask():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    drop = tn.Dropout(0.3, rng=1)
    out = drop(x)
    mask = drop.mask
    assert mask.dtype == np.bool_ and 0 < mask.sum() < mask.size
    assert np.array_equal(out == 0, ~mask)
    assert np.allclose(out, np.where(mask, x / 0.7, 0), rtol=1e-15, atol=0)
    dx = drop.backward(g)
    assert np.array_equal(dx == 0, ~mask)
    assert np.allclose(dx, np.where(mask, g / 0.7, 0), rtol=1e-15, atol=0)


def test_dropout_tracks_agree_with_a_shared_mask_and_with_torch_functional_dropout():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    np_drop = tn.Dropout(0.25, rng=0)
    np_result = run_numpy(np_drop, (x,), g)
    assert_tracks_agree(np_result, run_torch(tt.Dropout(0.25), (x,), g, mask=to_torch(np_drop.mask)))
    # torch.nn.functional.dropout (global generator, forked so nothing leaks): read its mask, replay it in ours
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ref = nn.functional.dropout(to_torch(x), p=0.25, training=True)
    mask = to_numpy(ref) != 0
    assert max_abs_diff(ref, tn.Dropout(0.25)(x, mask=mask)) < TOL
    assert max_abs_diff(ref, tt.Dropout(0.25)(to_torch(x), mask=to_torch(mask))) < TOL


def test_dropout_p_zero_is_identity_in_training_and_float32_mask_scale_stays_float32():
    x = np.arange(6, dtype=F32).reshape(2, 3)
    assert tn.Dropout(0.0)(x) is x
    out = tn.Dropout(0.5, rng=0)(x)
    assert out.dtype == F32 and tn.Dropout(0.5, rng=0).forward(x).dtype == F32


# -- embedding details -------------------------------------------------------------------------------------------------
def test_embedding_backward_accumulates_repeated_ids_and_skips_padding():
    emb = tn.Embedding(4, 2, padding_idx=1, dtype=F64)
    ids = np.array([[0, 0, 1, 3], [3, 3, 1, 0]])
    emb(ids)
    g = np.arange(16, dtype=F64).reshape(2, 4, 2)
    assert emb.backward(g) is None
    expected = np.zeros((4, 2))
    for (b, t), i in np.ndenumerate(ids):
        if i != 1:
            expected[i] += g[b, t]
    assert np.array_equal(emb.weight.grad, expected)
    assert np.array_equal(emb(ids)[0, 2], np.zeros(2))  # the padding row stays zero


# -- the Module contract -----------------------------------------------------------------------------------------------
def test_zero_grad_and_gradients_accumulate_across_forward_backward_pairs():
    rng = np.random.default_rng(0)
    ln = tn.LayerNorm(4, dtype=F64)
    x, g = rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    ln(x)
    ln.backward(g)
    once = {k: v.copy() for k, v in ln.grads().items()}
    assert all(np.abs(v).max() > 0 for v in once.values())
    ln(x)
    ln.backward(g)  # a second forward-backward pair adds, as torch's .grad does
    for k, v in ln.grads().items():
        assert np.allclose(v, 2 * once[k], rtol=1e-15, atol=0)
    ln.zero_grad()
    assert all(np.all(v == 0) for v in ln.grads().values())


class _Block(tn.Module):
    """A small container for the contract tests: Linear -> ReLU -> Dropout, in a ModuleList."""

    def __init__(self):
        super().__init__()
        self.layers = tn.ModuleList([tn.Linear(3, 4, rng=0), tn.ReLU(), tn.Dropout(0.5, rng=0)])
        self.norm = tn.LayerNorm(4)


def test_train_and_eval_propagate_to_every_submodule():
    block = _Block()
    assert all(m.training for _, m in block.named_modules())
    block.eval()
    assert not any(m.training for _, m in block.named_modules())
    x = np.ones((2, 4), dtype=F32)
    assert block.layers[2](x) is x
    block.train()
    assert all(m.training for _, m in block.named_modules())
    assert list(block.state_dict()) == ["layers.0.weight", "layers.0.bias", "norm.weight", "norm.bias"]


def test_load_state_dict_strict_errors_and_all_or_nothing():
    block = _Block()
    state = block.state_dict()
    with pytest.raises(KeyError, match=r"missing keys \['norm.bias'\]"):
        block.load_state_dict({k: v for k, v in state.items() if k != "norm.bias"})
    with pytest.raises(KeyError, match=r"unexpected keys \['extra'\]"):
        block.load_state_dict({**state, "extra": np.zeros(1)})
    bad = {k: v + 1 for k, v in state.items()}
    bad["norm.bias"] = np.zeros(5, dtype=F32)
    with pytest.raises(ValueError, match=r"'norm.bias' expected shape \(4,\), got \(5,\)"):
        block.load_state_dict(bad)
    for k, v in block.state_dict().items():  # nothing was copied
        assert np.array_equal(v, state[k])
    block.load_state_dict({"norm.weight": np.full(4, 2.0)}, strict=False)
    assert np.all(block.norm.weight.data == 2) and block.norm.weight.dtype == F32


def test_state_dict_returns_copies():
    lin = tn.Linear(2, 2)
    lin.state_dict()["weight"][...] = 5
    assert not np.any(lin.weight.data == 5)


# -- bad input: clear errors naming what was wrong, in both tracks -----------------------------------------------------
def _arr(lib, a):
    return a if lib is tn else to_torch(a)


@pytest.mark.parametrize("lib", [tn, tt])
@pytest.mark.parametrize(
    "make, call, exc, match",
    [
        (lambda L: L.Linear(5, 3), lambda m, A: m(A(np.ones((2, 4), F32))), ValueError, "Linear: expected last dim.*5"),
        (
            lambda L: L.Linear(5, 3),
            lambda m, A: m(A(np.ones((2, 5), np.int64))),
            TypeError,
            "Linear.*float32 or float64",
        ),
        (
            lambda L: L.Linear(5, 3),
            lambda m, A: m(A(np.ones((2, 5), F64))),
            TypeError,
            "Linear: expected dtype .*float32",
        ),
        (
            lambda L: L.Linear(5, 3),
            lambda m, A: m([[1.0] * 5]),
            TypeError,
            "Linear: expected a (numpy.ndarray|torch.Tensor)",
        ),
        (lambda L: L.Embedding(7, 3), lambda m, A: m(A(np.array([[0.0, 1.0]]))), TypeError, "Embedding: ids.*integer"),
        (lambda L: L.Embedding(7, 3), lambda m, A: m(A(np.array([True]))), TypeError, "Embedding: ids.*integer"),
        (lambda L: L.Embedding(7, 3), lambda m, A: m(A(np.array([0, 7]))), ValueError, r"ids.*\[0, 7\), got 7"),
        (lambda L: L.Embedding(7, 3), lambda m, A: m(A(np.array([-1, 2]))), ValueError, r"ids.*\[0, 7\), got -1"),
        (lambda L: L.ReLU(), lambda m, A: m(A(np.array([1, 2]))), TypeError, "ReLU.*float32 or float64"),
        (lambda L: L.GELU(), lambda m, A: m(A(np.array([1, 2]))), TypeError, "GELU.*float32 or float64"),
        (
            lambda L: L.LayerNorm(4),
            lambda m, A: m(A(np.ones((2, 5), F32))),
            ValueError,
            r"LayerNorm.*trailing shape \(4,\)",
        ),
        (lambda L: L.LayerNorm(4), lambda m, A: m(A(np.ones((2, 4), F64))), TypeError, "LayerNorm: expected dtype"),
        (lambda L: L.Dropout(0.5), lambda m, A: m(A(np.ones(3, F32)), mask=A(np.ones(4, bool))), ValueError, "mask"),
        (lambda L: L.Dropout(0.5), lambda m, A: m(A(np.ones(3, np.int32))), TypeError, "Dropout.*float32 or float64"),
    ],
)
def test_bad_inputs_raise_clear_errors(lib, make, call, exc, match):
    with pytest.raises(exc, match=match):
        call(make(lib), lambda a: _arr(lib, a))


@pytest.mark.parametrize("lib", [tn, tt])
@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda L: L.Linear(0, 3), ValueError, "Linear: in_features must be an int >= 1, got 0"),
        (lambda L: L.Embedding(0, 3), ValueError, "Embedding: num_embeddings must be an int >= 1, got 0"),
        (lambda L: L.Embedding(5, 3, padding_idx=5), ValueError, r"padding_idx must be in \[-5, 5\), got 5"),
        (lambda L: L.Embedding(5, 3, padding_idx=1.0), TypeError, "padding_idx expected an int"),
        (lambda L: L.GELU(approximate="exact"), ValueError, "approximate must be 'none' or 'tanh', got 'exact'"),
        (lambda L: L.Dropout(1.0), ValueError, r"Dropout: p must be in \[0, 1\), got 1.0"),
        (lambda L: L.Dropout(-0.1), ValueError, r"p must be in \[0, 1\), got -0.1"),
        (lambda L: L.Dropout("0.1"), TypeError, "Dropout: p expected a float, got str"),
        (lambda L: L.Dropout(0.1, rng="seed"), TypeError, "rng: expected"),
        (lambda L: L.LayerNorm(4, eps=0.0), ValueError, "LayerNorm: eps must be > 0"),
        (lambda L: L.LayerNorm(0), ValueError, "LayerNorm: normalized_shape must be an int >= 1, got 0"),
        (lambda L: L.Linear(2, 2, dtype=np.int32 if L is tn else torch.int32), TypeError, "dtype: expected"),
    ],
)
def test_bad_constructor_arguments_raise_clear_errors(lib, build, exc, match):
    with pytest.raises(exc, match=match):
        build(lib)


@pytest.mark.parametrize("case", ONE_PER_LAYER + [Case("Dropout", (0.5,), (2, 3), None)], ids=repr)
def test_backward_before_forward_is_a_clear_error(case):
    with pytest.raises(RuntimeError, match=rf"{case.name}.backward\(\) called before forward\(\)"):
        case.numpy().backward(np.ones((2, 3), F32))


@pytest.mark.parametrize("case", ONE_PER_LAYER, ids=repr)
def test_backward_checks_the_shape_and_dtype_of_grad_out(case):
    rng = np.random.default_rng(0)
    mod = case.numpy(F32)
    out = mod(case.input(rng, F32))
    with pytest.raises(ValueError, match=rf"{case.name}.backward: grad_out expected shape {re_shape(out.shape)}"):
        mod.backward(np.ones(out.shape + (1,), F32))
    with pytest.raises(TypeError, match=rf"{case.name}.backward: grad_out expected dtype float32"):
        mod.backward(np.ones(out.shape, F64))


def re_shape(shape: tuple) -> str:
    return str(shape).replace("(", r"\(").replace(")", r"\)")


def test_numpy_track_never_imports_torch():
    import ast
    import pathlib

    for path in pathlib.Path(tn.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"
