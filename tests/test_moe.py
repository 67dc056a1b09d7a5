"""Mixture of experts (chapter 20c): the routing decisions (tfm_common.moe), the layer's hand-written backward
(gradient check with the top-k choice held fixed), the two tracks' agreement, the auxiliary losses, the refusals,
and the MoEGPT option."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_tracks import TOL, load_np_into_torch, max_abs_diff

import tfm_numpy as tn
import tfm_numpy.moe as nm
import tfm_torch as tt
import tfm_torch.moe as tm
from tfm_common.lm_recipe import train_lm
from tfm_common.moe import balance_fractions, expert_capacity, renormalizes, route
from tfm_numpy.gradcheck import numeric_grad, rel_error

CASES = [(1, None), (2, None), (2, 0.6), (1, 0.5), (3, 1.0), (4, None)]  # (top_k, capacity_factor), 4 experts


def pair(top_k=2, cf=None, aux=0.3, z=0.2, d=6, d_ff=5, E=4, seed=1):
    kw = dict(capacity_factor=cf, aux_loss_coef=aux, z_loss_coef=z, rng=seed)
    m = nm.MoEFeedForward(d, d_ff, E, top_k, dtype=np.float64, **kw)
    t = tm.MoEFeedForward(d, d_ff, E, top_k, dtype=torch.float64, **kw)
    load_np_into_torch(m, t)
    return m, t


def routing_margin(m, x) -> float:
    """The smallest gap, over tokens, between the top_k-th router probability and the next one (inf for k = E)."""
    p = np.sort(tn.softmax(x.reshape(-1, m.d_model) @ m.router.weight.data.T), axis=1)[:, ::-1]
    return np.inf if m.top_k == m.n_experts else float((p[:, m.top_k - 1] - p[:, m.top_k]).min())


@pytest.mark.parametrize("top_k, cf", CASES)
def test_gradient_check_with_the_choice_held_fixed(top_k, cf):
    """L = sum(w * y) + a aux_loss + b z_loss: backward against central differences (float64, < 1e-7). The top-k
    choice and the capacity's drops are piecewise constant: the inputs are drawn so that every token's k-th and
    (k+1)-th probabilities differ by more than 1e-4 (h = 1e-6 moves them by far less), and every perturbed forward
    is asserted to route exactly as the unperturbed one, so the check differentiates one fixed routing."""
    m, _ = pair(top_k, cf)
    rng = np.random.default_rng(top_k * 10 + int(10 * (cf or 0)))
    for _ in range(50):
        x = rng.standard_normal((2, 5, 6))
        if routing_margin(m, x) > 1e-4:
            break
    assert routing_margin(m, x) > 1e-4
    w = rng.standard_normal(x.shape)
    m.zero_grad()
    m(x)
    base = m.routing
    dx = m.backward(w)

    def loss(_=None) -> float:
        y = m(x)
        assert np.array_equal(m.routing.experts, base.experts) and np.array_equal(m.routing.keep, base.keep)
        return float((w * y).sum()) + m.aux_loss_coef * m.aux_loss + m.z_loss_coef * m.z_loss

    errors = {"x": rel_error(dx, numeric_grad(loss, x))}
    errors |= {n: rel_error(p.grad, numeric_grad(loss, p.data)) for n, p in m.named_parameters()}
    assert max(errors.values()) < 1e-7, errors
    if cf is not None and cf < 1:
        assert base.dropped > 0  # the case covers dropped assignments


@pytest.mark.parametrize("top_k, cf", CASES)
def test_tracks_agree_on_outputs_losses_routing_and_every_gradient(top_k, cf):
    m, t = pair(top_k, cf)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 4, 6))
    m.zero_grad()
    y = m(x)
    dx = m.backward(w)
    xt = torch.tensor(x, requires_grad=True)
    yt = t(xt)
    yt.backward(torch.from_numpy(w))
    assert max_abs_diff(y, yt) < TOL and max_abs_diff(dx, xt.grad) < TOL
    grads = m.grads()
    for name, p in t.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        assert max_abs_diff(grads[name], g) < TOL, name
    assert abs(m.aux_loss - float(t.aux_loss.detach())) < TOL and abs(m.z_loss - float(t.z_loss.detach())) < TOL
    assert np.array_equal(m.tokens_per_expert, t.tokens_per_expert) and m.dropped == t.dropped


def test_torch_backward_adds_the_aux_losses_as_if_added_to_the_loss():
    """tfm_torch differentiates a aux + b z inside the backward: the same gradients as a layer with zero coefficients
    whose caller adds a aux + b z to its loss."""
    _, t = pair(2, 0.8, aux=0.3, z=0.2)
    _, t0 = pair(2, 0.8, aux=0.0, z=0.0)
    x = torch.tensor(np.random.default_rng(0).standard_normal((4, 6)))
    (t(x) ** 2).sum().backward()
    y0 = t0(x)
    ((y0**2).sum() + 0.3 * t0.aux_loss + 0.2 * t0.z_loss).backward()
    for (name, p), p0 in zip(t.named_parameters(), t0.parameters(), strict=True):
        if p.grad is not None:
            assert max_abs_diff(p.grad, p0.grad) < TOL, name
    assert max_abs_diff(t.router.weight.grad, t0.router.weight.grad) < TOL


def test_float32_in_float32_out_and_close_to_float64():
    m, t = pair(2, 1.0)
    x = np.random.default_rng(0).standard_normal((2, 3, 6))
    y64 = m(x)
    m32 = nm.MoEFeedForward(6, 5, 4, 2, capacity_factor=1.0, rng=1)
    m32.load_state_dict(m.state_dict())
    y32 = m32(x.astype(np.float32))
    assert y32.dtype == np.float32 and np.abs(y32 - y64).max() < 1e-5
    assert m32.backward(np.ones_like(y32)).dtype == np.float32


def test_routing_decisions_capacity_first_choices_first_and_ties():
    probs = np.array([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.4, 0.4, 0.2], [0.1, 0.2, 0.7]])
    r = route(probs, 2, capacity=2)
    assert r.experts.tolist() == [[0, 1], [0, 2], [0, 1], [2, 1]]  # the tie of token 2 goes to the lower index
    # expert 0: first choices of tokens 0, 1, 2 -> token 2's dropped; expert 1: the second choices of 0, 2, 3 ->
    # token 3's dropped; expert 2: token 3's first choice, token 1's second
    assert r.keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert r.chosen.tolist() == [3, 3, 2] and r.kept.tolist() == [2, 2, 2] and r.dropped == 2
    assert r.dropped_share == 2 / 8
    toks, slots = r.groups[1]
    assert toks.tolist() == [0, 2] and slots.tolist() == [1, 1]  # service order: all first choices, then seconds
    assert route(probs, 2, None).keep.all()
    assert balance_fractions(r, 3).tolist() == [3 / 8, 3 / 8, 2 / 8]


def test_expert_capacity_formula():
    assert expert_capacity(16, 4, 2, 1.25) == 10  # 1.25 * 16 * 2 / 4 = 10 exactly, not 11
    assert expert_capacity(10, 4, 1, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(10, 4, 1, None) is None
    assert renormalizes(2) and not renormalizes(1)


@pytest.mark.parametrize("lib", [nm, tm])
def test_gates_top1_is_the_probability_topk_sums_to_one(lib):
    dt = np.float64 if lib is nm else torch.float64
    x = np.random.default_rng(0).standard_normal((5, 6))
    for k in (1, 2):
        m = lib.MoEFeedForward(6, 5, 4, k, rng=2, dtype=dt)
        xx = x if lib is nm else torch.from_numpy(x)
        _, probs, routing, gates = m.route(xx)
        probs, gates = (
            np.asarray(probs.detach() if lib is tm else probs),
            np.asarray(gates.detach() if lib is tm else gates),
        )
        if k == 1:
            assert np.allclose(gates[:, 0], probs.max(axis=1))
        else:
            assert np.allclose(gates.sum(axis=1), 1)


def test_a_dropped_token_gets_no_expert_output_and_the_count_is_kept():
    m, _ = pair(1, 0.25)  # 8 tokens, 4 experts: capacity ceil(0.25 * 8 / 4) = 1 token per expert
    x = np.random.default_rng(5).standard_normal((8, 6))
    y = m(x)
    assert m.routing.capacity == 1 and m.dropped == 8 - m.tokens_per_expert.sum() >= 4
    dropped = ~m.routing.keep[:, 0]
    assert np.all(y[dropped] == 0) and np.all(np.abs(y[~dropped]).sum(axis=1) > 0)


def test_balancing_loss_is_one_when_balanced_and_grows_with_imbalance():
    m = nm.MoEFeedForward(4, 3, 4, 1, dtype=np.float64)
    m.router.weight.data[...] = np.eye(4) * 5  # token i goes to expert i: f and P uniform over 4 one-hot tokens
    m(np.eye(4))
    assert abs(m.aux_loss - 1) < 1e-12
    m(np.tile(np.eye(4)[:1], (4, 1)))  # every token to expert 0
    assert m.aux_loss > 3 and m.tokens_per_expert.tolist() == [4, 0, 0, 0]
    z = np.log(np.exp(5) + 3)
    assert abs(m.z_loss - z * z) < 1e-12


BAD = [
    (dict(top_k=5), ValueError, "top_k must be <= n_experts=4"),
    (dict(top_k=0), ValueError, "top_k must be an int >= 1"),
    (dict(top_k=1.5), TypeError, "top_k expected an int"),
    (dict(n_experts=0), ValueError, "n_experts must be an int >= 1"),
    (dict(capacity_factor=0), ValueError, "capacity_factor must be > 0"),
    (dict(capacity_factor=-1.0), ValueError, "capacity_factor must be in [0, inf)"),
    (dict(capacity_factor=float("nan")), TypeError, "capacity_factor expected a finite float"),
    (dict(capacity_factor="1"), TypeError, "capacity_factor expected"),
    (dict(activation="swiglu"), ValueError, "activation must be one of ('relu', 'gelu')"),
    (dict(aux_loss_coef=-0.1), ValueError, "aux_loss_coef must be in [0, inf)"),
    (dict(z_loss_coef=None), TypeError, "z_loss_coef expected"),
    (dict(d_ff=0), ValueError, "d_ff must be an int >= 1"),
]


@pytest.mark.parametrize("lib", [nm, tm])
@pytest.mark.parametrize("bad, err, text", BAD)
def test_refusals_alike(lib, bad, err, text):
    args = dict(d_model=6, d_ff=5, n_experts=4, top_k=2) | bad
    with pytest.raises(
        err, match="MoEFeedForward: " + text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        lib.MoEFeedForward(args.pop("d_model"), args.pop("d_ff"), args.pop("n_experts"), args.pop("top_k"), **args)


@pytest.mark.parametrize("lib", [nm, tm])
def test_bad_inputs_and_capacity_changes_refused_and_the_layer_unchanged(lib):
    m = lib.MoEFeedForward(6, 5, 4, 2, rng=0)
    arr = (lambda a: a) if lib is nm else torch.from_numpy
    with pytest.raises(ValueError, match="MoEFeedForward: expected last dimension 6"):
        m(arr(np.zeros((2, 5), np.float32)))
    with pytest.raises(TypeError, match="MoEFeedForward: expected dtype"):
        m(arr(np.zeros((2, 6), np.float64)))
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        m.set_capacity_factor(0.0)
    assert m.capacity_factor is None and m.routing is None
    m.set_capacity_factor(1.5)
    assert m.capacity_factor == 1.5


# -- the GPT option --------------------------------------------------------------------------------------------------
CFG = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=12, n_layers=2, max_len=8)


def gpt_pair(**moe):
    moe = dict(n_experts=4, top_k=2, capacity_factor=1.0) | moe
    m = nm.MoEGPT(**CFG, **moe, rng=0, dtype=np.float64)
    t = tm.MoEGPT(**CFG, **moe, rng=0, dtype=torch.float64)
    load_np_into_torch(m, t)
    return m, t


def test_moe_gpt_same_keys_agree_and_block_methods_are_the_gpts():
    m, t = gpt_pair()
    assert list(m.state_dict()) == list(t.state_dict())
    assert "layers.0.ff.router.weight" in m.state_dict() and "layers.1.ff.experts.3.linear2.bias" in m.state_dict()
    assert m.config["n_experts"] == 4 and m.config["top_k"] == 2 and t.config == m.config
    for cls, base in ((nm.MoEGPTBlock, tn.GPTBlock), (tm.MoEGPTBlock, tt.GPTBlock), (nm.MoEGPT, tn.GPT)):
        assert "forward" not in cls.__dict__ and "backward" not in cls.__dict__ and issubclass(cls, base)
    ids = np.random.default_rng(0).integers(0, 40, (3, 8))
    w = np.random.default_rng(1).standard_normal((3, 8, 40))
    m.zero_grad()
    logits = m(ids)
    m.backward(w)
    lt = t(torch.from_numpy(ids))
    (lt * torch.from_numpy(w)).sum().backward()
    assert max_abs_diff(logits, lt) < TOL
    grads = m.grads()
    for name, p in t.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        assert max_abs_diff(grads[name], g) < TOL, name
    assert abs(m.aux_losses() - t.aux_losses()) < TOL and m.aux_losses() > 0


def test_moe_gpt_trains_with_the_dense_gpts_loop_in_both_tracks():
    ids = np.random.default_rng(0).integers(0, 40, 400)
    kw = dict(steps=4, batch_size=4, block_size=8, peak=1e-2, warmup=2, seed=0)
    m, t = gpt_pair()
    m32, t32 = nm.MoEGPT(**CFG, n_experts=4, top_k=1, rng=0), tm.MoEGPT(**CFG, n_experts=4, top_k=1, rng=0)
    load_np_into_torch(m32, t32)
    ln, lt = train_lm(m32, tn, ids, **kw), train_lm(t32, tt, ids, **kw)
    assert np.all(np.isfinite(ln)) and np.abs(ln - lt).max() < 1e-3
    assert all(layer.tokens_per_expert.sum() == 4 * 8 for layer in m32.moe_layers())


@pytest.mark.parametrize("lib", [nm, tm])
def test_moe_gpt_refusals(lib):
    with pytest.raises(TypeError, match="window is not an option"):
        lib.MoEGPT(**CFG, n_experts=4, window=4)
    with pytest.raises(ValueError, match="MoEGPT: top_k must be <= n_experts=2"):
        lib.MoEGPT(**CFG, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="MoEGPT: activation must be one of"):
        lib.MoEGPT(**CFG, n_experts=2, activation="swiglu")
    with pytest.raises(ValueError, match="MoEGPT: capacity_factor must be > 0"):
        lib.MoEGPT(**CFG, n_experts=2, capacity_factor=0)
