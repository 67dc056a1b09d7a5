"""Speculative decoding (tfm_numpy/tfm_torch.speculative_generate, tfm_common.speculative), proved rather than
assumed: at temperature 0 the target's greedy output token for token; at temperature > 0 the target's own sampling
distribution (a chi-square test against the exact probabilities, enumerated on a tiny vocabulary), which wrong
acceptance rules fail; the same tokens in both tracks; rolled-back caches equal fresh ones; the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch, to_numpy

import tfm_numpy as tn
import tfm_numpy.speculative as np_spec
import tfm_torch as tt
from tfm_common.sampling import sample_next
from tfm_common.speculative import (
    chi2_sf,
    chi_square_test,
    continuation_probabilities,
    distribution,
    gamma_q,
    sample_from,
    verify,
)

V = 6
CFG = dict(vocab_size=V, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=24)
DRAFT_CFG = dict(vocab_size=V, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=24)
PROMPTS = [np.array([[1]]), np.array([[3, 0, 5]]), np.array([[2, 2, 4, 1, 0, 3, 5]])]


def np_models(draft_kind: str):
    """A float64 target and a draft: 'good' (the target's weights plus small noise), 'bad' (another random GPT,
    smaller), or 'same' (the target itself)."""
    target = tn.GPT(**CFG, rng=0, dtype=np.float64)
    if draft_kind == "same":
        return target, target
    if draft_kind == "bad":
        return target, tn.GPT(**DRAFT_CFG, rng=1, dtype=np.float64)
    draft = tn.GPT(**CFG, rng=2, dtype=np.float64)
    noise = np.random.default_rng(3)
    noisy = {k: v + 0.05 * noise.standard_normal(v.shape) for k, v in target.state_dict().items()}
    noisy["output_projection.weight"] = noisy["embed.weight"]  # one tied parameter
    draft.load_state_dict(noisy)
    return target, draft


def twin(np_model):
    t = tt.GPT(**np_model.config, rng=0, dtype=torch.float64)
    load_np_into_torch(np_model, t)
    return t


def models(track: str, draft_kind: str):
    target, draft = np_models(draft_kind)
    if track == "numpy":
        return target, draft, tn, np.asarray
    t_target = twin(target)
    return t_target, t_target if draft is target else twin(draft), tt, torch.from_numpy


# -- the chi-square p-value -----------------------------------------------------------------------------------------
def test_gamma_q_known_values():
    for x in (0.1, 1.0, 2.5, 7.0, 30.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)  # 2 degrees of freedom: e^(-x/2)
        assert gamma_q(0.5, x) == pytest.approx(math.erfc(math.sqrt(x)), rel=1e-11)  # Q(1/2, x) = erfc(sqrt x)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-10)  # the 5% critical values
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-10)
    assert chi2_sf(0.0, 3) == 1.0 and gamma_q(2.0, 0.0) == 1.0


def test_gamma_q_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 5, 17, 60, 200):
        for x in (0.01, 0.5, dof * 0.7, dof, dof * 1.5, dof + 40.0):
            assert chi2_sf(x, dof) == pytest.approx(stats.chi2.sf(x, dof), rel=1e-9, abs=1e-300)


def test_chi_square_test_pools_small_cells_and_rejects_impossible_counts():
    probs = np.array([0.5, 0.3, 0.19, 0.01])
    fit = chi_square_test(np.array([50, 30, 19, 1]), probs)  # 0.01 * 100 < 5: pooled with nothing else
    assert fit.statistic == pytest.approx(0.0) and fit.dof == 3 and fit.p_value == pytest.approx(1.0)
    assert chi_square_test(np.array([50, 30, 19, 1]), np.array([0.5, 0.3, 0.2, 0.0])).p_value == 0.0
    assert chi_square_test(np.array([90, 5, 4, 1]), probs).p_value < 1e-10


# -- the distributions and the rule, without models ----------------------------------------------------------------
def test_distribution_is_what_sample_next_draws_from():
    rng = np.random.default_rng(0)
    for temperature, top_k in ((1.0, None), (0.7, 3), (2.0, 1), (0.0, None)):
        logits = rng.standard_normal((200, 7)) * 3
        p = distribution(logits, temperature, top_k)
        assert np.allclose(p.sum(-1), 1) and (p >= 0).all()
        if top_k is not None:
            assert ((p > 0).sum(-1) == top_k).all()
        u = np.random.default_rng(1).random(200)
        ours = [sample_from(p[i], u[i]) for i in range(200)]
        theirs = [
            sample_next(logits[i : i + 1], temperature, top_k, np.random.default_rng([2, i]))[0] for i in range(200)
        ]
        same_u = [sample_next(logits[i : i + 1], temperature, top_k, _Fixed(u[i]))[0] for i in range(200)]
        assert ours == same_u and len(theirs) == 200


class _Fixed:
    """A stand-in Generator whose next uniforms are given."""

    def __init__(self, *u):
        self.u = list(u)

    def random(self, n=None):
        return self.u.pop(0) if n is None else np.array([self.u.pop(0) for _ in range(n)])


def test_verify_accepts_with_probability_min_1_p_over_q_and_resamples_from_the_residual():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = np.array([[0.2, 0.6, 0.2]])
    assert verify(p, q, np.array([1]), _Fixed(0.49, 0.0)) == (1, 0)  # u < p/q = 0.5: accepted, bonus from p[1]
    assert verify(p, q, np.array([1]), _Fixed(0.51, 0.0)) == (0, 0)  # rejected: residual (0.3, 0, 0) -> token 0
    assert verify(p, q, np.array([0]), _Fixed(0.999, 0.99)) == (1, 2)  # p/q >= 1: always accepted
    onehot = np.eye(3)  # greedy: accept iff the draft token is the target's argmax, else take the argmax
    assert verify(onehot[[2, 1]], onehot[[0]], np.array([0]), _Fixed(0.0, 0.5)) == (0, 2)
    assert verify(onehot[[2, 1]], onehot[[2]], np.array([2]), _Fixed(0.999, 0.5)) == (1, 1)


def sample_rounds(rule, p, q, n, seed=0):
    """The first token of n rounds with fixed distributions p (2, V), q (1, V)."""
    rng = np.random.default_rng(seed)
    first = np.zeros(p.shape[1], dtype=np.int64)
    for _ in range(n):
        x = sample_from(q[0], rng.random())
        a, nxt = rule(p, q, np.array([x]), rng)
        first[x if a else nxt] += 1
    return first


def wrong_accept_always(p, q, drafted, rng):
    rng.random(len(drafted) + 1)
    return len(drafted), sample_from(p[-1], 0.5)


def wrong_resample_from_p(p, q, drafted, rng):
    """Leviathan's acceptance, but a rejection draws from p instead of the residual max(0, p - q)."""
    u = rng.random(len(drafted) + 1)
    for i, x in enumerate(drafted):
        if u[i] * q[i, x] >= p[i, x]:
            return i, sample_from(p[i], u[-1])
    return len(drafted), sample_from(p[len(drafted)], u[-1])


def test_the_rule_gives_p_and_wrong_rules_do_not():
    p = np.array([[0.4, 0.3, 0.2, 0.1], [0.25] * 4])
    q = np.array([[0.1, 0.2, 0.3, 0.4]])
    assert chi_square_test(sample_rounds(verify, p, q, 4000), p[0]).p_value > 1e-3
    assert chi_square_test(sample_rounds(wrong_accept_always, p, q, 4000), p[0]).p_value < 1e-12
    assert chi_square_test(sample_rounds(wrong_resample_from_p, p, q, 4000), p[0]).p_value < 1e-12


# -- the cache rollback ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("track", ["numpy", "torch"])
@pytest.mark.parametrize("preallocate", [True, False])
def test_rolled_back_cache_then_a_step_equals_a_fresh_cache(track, preallocate):
    target, _, lib, arr = models(track, "bad")
    seq = arr(np.array([[1, 4, 2, 0, 5, 3, 3, 1]]))
    cache = {"preallocate": preallocate}
    target.forward_step(seq[:, :3], cache)
    target.forward_step(seq[:, 3:7], cache)  # 4 proposals, 2 of them to be rejected
    buffers = [layer["k"] for layer in cache["layers"]]
    assert lib.rollback_cache(cache, 5) is cache and cache["length"] == 5
    assert all(tuple(layer["v"].shape)[2] == 5 for layer in cache["layers"])
    if preallocate:  # still views of the same buffers: nothing copied
        assert all(to_numpy(layer["k"]).base is not None or track == "torch" for layer in cache["layers"])
        assert all(layer["k_buf"].shape[2] >= 7 for layer in cache["layers"]) and len(buffers) == 2
    other = arr(np.array([[2, 5, 4]]))  # the next step writes over the forgotten positions 5, 6
    rolled = target.forward_step(other, cache)
    fresh_cache = {}
    target.forward_step(seq[:, :5], fresh_cache)
    fresh = target.forward_step(other, fresh_cache)
    full = target.forward(arr(np.concatenate([to_numpy(seq[:, :5]), to_numpy(other)], axis=1)))[:, -3:]
    assert np.abs(to_numpy(rolled) - to_numpy(fresh)).max() < 1e-12
    assert np.abs(to_numpy(rolled) - to_numpy(full)).max() < 1e-10
    for a, b in zip(cache["layers"], fresh_cache["layers"], strict=True):
        assert np.abs(to_numpy(a["k"]) - to_numpy(b["k"])).max() < 1e-12


@pytest.mark.parametrize("lib", [tn, tt])
def test_rollback_refuses_growing_the_cache(lib):
    with pytest.raises(ValueError, match="length must be <= the cache's length 0, got 3"):
        lib.rollback_cache({}, 3)
    with pytest.raises(ValueError, match="length must be an int >= 0, got -1"):
        lib.rollback_cache({"length": 2}, -1)


# -- greedy: the target's output, token for token ----------------------------------------------------------------
@pytest.mark.parametrize("track", ["numpy", "torch"])
@pytest.mark.parametrize("draft_kind", ["good", "bad", "same"])
def test_greedy_equals_the_targets_greedy_output(track, draft_kind):
    target, draft, lib, arr = models(track, draft_kind)
    for prompt in PROMPTS:
        n = CFG["max_len"] - prompt.shape[1] + 1  # up to the last position
        want = to_numpy(target.generate(arr(prompt), n, temperature=0))
        for k in range(1, 6) if track == "numpy" else (1, 3, 5):
            out = lib.speculative_generate(target, draft, arr(prompt), n, k=k, temperature=0, rng=0)
            assert np.array_equal(to_numpy(out.tokens), want), (prompt, k)
            assert out.new_tokens == n and out.target_forwards == len(out.accepted) < n
            assert (out.accepted <= out.proposed).all() and (out.proposed <= k).all()
            if draft_kind == "same":
                assert (out.accepted == out.proposed).all() and out.acceptance_rate == 1.0


def test_good_drafts_are_accepted_more_than_bad_ones():
    rates = {}
    for kind in ("good", "bad"):
        target, draft, _, _ = models("numpy", kind)
        out = tn.speculative_generate(target, draft, PROMPTS[1], 20, k=4, temperature=0, rng=0)
        rates[kind] = out.acceptance_rate
    assert rates["good"] > 0.8 and rates["bad"] < rates["good"]


# -- sampling: the target's distribution ---------------------------------------------------------------------------
TINY = dict(vocab_size=5, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=8)


def tiny_pair():
    target = tn.GPT(**TINY, rng=10, dtype=np.float64)
    draft = tn.GPT(**TINY, rng=11, dtype=np.float64)
    for m in (target, draft):  # sharper distributions than the initialization's: a draft far from the target
        m.embed.weight.data *= 2.0
    return target, draft


def continuation_counts(target, draft, prompt, n, samples, temperature, top_k, k):
    counts = np.zeros((TINY["vocab_size"],) * n, dtype=np.int64)
    for seed in range(samples):
        out = tn.speculative_generate(target, draft, prompt, n, k=k, temperature=temperature, top_k=top_k, rng=seed)
        counts[tuple(out.tokens[0, prompt.shape[1] :])] += 1
    return counts


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, None), (0.8, 3)])
def test_samples_follow_the_targets_own_distribution(temperature, top_k):
    target, draft = tiny_pair()
    prompt = np.array([[2, 0]])
    exact = continuation_probabilities(target, prompt[0], 3, temperature, top_k)  # (5, 5, 5), by enumeration
    assert exact.sum() == pytest.approx(1.0)
    counts = continuation_counts(target, draft, prompt, 3, 1500, temperature, top_k, k=2)
    fit = chi_square_test(counts, exact)
    print(f"chi-square {fit.statistic:.1f}, {fit.dof} dof, p-value {fit.p_value:.3g}")
    assert fit.p_value > 1e-3 and fit.dof >= 10
    draft_exact = continuation_probabilities(draft, prompt[0], 3, temperature, top_k)
    assert chi_square_test(counts, draft_exact).p_value < 1e-12  # the test tells the draft's distribution apart


@pytest.mark.parametrize("wrong", [wrong_accept_always, wrong_resample_from_p])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, wrong):
    target, draft = tiny_pair()
    prompt = np.array([[2, 0]])
    exact = continuation_probabilities(target, prompt[0], 3, 1.0)
    monkeypatch.setattr(np_spec, "verify", wrong)
    counts = continuation_counts(target, draft, prompt, 3, 1500, 1.0, None, k=2)
    fit = chi_square_test(counts, exact)
    print(f"{wrong.__name__}: chi-square {fit.statistic:.1f}, {fit.dof} dof, p-value {fit.p_value:.3g}")
    assert fit.p_value < 1e-6


def test_continuation_probabilities_are_generates_frequencies_in_the_limit():
    target, _ = tiny_pair()
    exact = continuation_probabilities(target, np.array([1]), 2, 1.0)
    logits = target.forward(np.array([[1, 3]]))[0]
    p1 = distribution(logits[0], 1.0, None)
    p2 = distribution(logits[1], 1.0, None)
    assert exact[3].sum() == pytest.approx(p1[3]) and exact[3] / exact[3].sum() == pytest.approx(p2)


# -- both tracks: the same tokens -----------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_kind", ["good", "bad"])
def test_both_tracks_draw_the_same_tokens(draft_kind):
    t_np, d_np, _, _ = models("numpy", draft_kind)
    t_pt, d_pt, _, _ = models("torch", draft_kind)
    for seed in range(3):
        for temperature, top_k, k in ((1.0, None, 3), (0.7, 4, 2), (1.5, None, 5)):
            prompt = PROMPTS[seed % 3]
            a = tn.speculative_generate(t_np, d_np, prompt, 12, k=k, temperature=temperature, top_k=top_k, rng=seed)
            b = tt.speculative_generate(t_pt, d_pt, torch.from_numpy(prompt), 12, k=k, temperature=temperature,
                                        top_k=top_k, rng=np.random.default_rng(seed))  # fmt: skip
            assert np.array_equal(a.tokens, b.tokens.numpy()) and b.tokens.dtype == torch.long
            assert np.array_equal(a.accepted, b.accepted) and np.array_equal(a.proposed, b.proposed)
            assert (a.target_forwards, a.draft_forwards) == (b.target_forwards, b.draft_forwards)


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_statistics_and_zero_new_tokens(track):
    target, draft, lib, arr = models(track, "good")
    out = lib.speculative_generate(target, draft, arr(PROMPTS[1]), 10, k=3, temperature=1.0, rng=4)
    assert out.new_tokens == 10 and out.tokens.shape == (1, 13)
    assert out.tokens_per_forward == pytest.approx(10 / out.target_forwards)
    assert out.draft_forwards == out.proposed.sum() and out.proposed[:-1].max() == 3
    rejections = int((out.accepted < out.proposed).sum())
    assert out.alpha == pytest.approx(out.accepted.sum() / (out.accepted.sum() + rejections))
    assert out.alpha >= out.acceptance_rate
    empty = lib.speculative_generate(target, draft, arr(PROMPTS[1]), 0, k=3, temperature=1.0, rng=4)
    assert np.array_equal(to_numpy(empty.tokens), PROMPTS[1]) and empty.target_forwards == 0
    assert math.isnan(empty.acceptance_rate) and math.isnan(empty.alpha)


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_modes_are_restored(track):
    target, draft, lib, arr = models(track, "bad")
    target.train(), draft.eval()
    lib.speculative_generate(target, draft, arr(PROMPTS[0]), 4, k=2, temperature=1.0, rng=0)
    assert target.training and not draft.training


# -- refusals, alike in both tracks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_refusals(track):
    target, draft, lib, arr = models(track, "bad")
    other_vocab = (tn if track == "numpy" else tt).GPT(**{**DRAFT_CFG, "vocab_size": V + 1}, rng=0)
    short = (tn if track == "numpy" else tt).GPT(**{**DRAFT_CFG, "max_len": 6}, rng=0)
    prompt = arr(PROMPTS[1])
    base = dict(target=target, draft=draft, tokens=prompt, max_new_tokens=4, k=2, temperature=1.0, rng=0)
    cases = [
        (dict(k=0), ValueError, "k must be an int >= 1, got 0"),
        (dict(k=1.5), TypeError, "k expected an int, got float 1.5"),
        (dict(draft=other_vocab), ValueError, "the draft's vocab_size=7 differs from the target's vocab_size=6"),
        (dict(temperature=-0.5), ValueError, r"temperature must be in \[0.0, inf\), got -0.5"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0, got -1"),
        (dict(tokens=arr(np.zeros((1, 25), dtype=np.int64))), ValueError, "tokens has length 25, more than max_len=24"),
        (dict(max_new_tokens=23), ValueError, "need 25 positions, more than max_len=24"),
        (dict(draft=short, max_new_tokens=5), ValueError, "need 7 positions, more than max_len=6"),
        (dict(tokens=arr(np.zeros((2, 3), dtype=np.int64))), ValueError, r"tokens expected one row, shape \(1, T\)"),
        (dict(tokens=arr(np.array([[1, 6]]))), ValueError, "tokens"),
        (dict(top_k=7), ValueError, "top_k must be <= vocab_size=6, got 7"),
        (dict(draft="a model"), TypeError, "draft expected a tfm_.*GPT, got str"),
        (dict(target=models("torch" if track == "numpy" else "numpy", "bad")[0]), TypeError, "target expected"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            lib.speculative_generate(**{**base, **kwargs})


def test_rollback_of_an_int8_cache_cuts_the_scales_too_and_a_rolling_cache_is_refused():
    cfg = dict(vocab_size=11, d_model=8, n_heads=2, d_ff=12, n_layers=2, max_len=16)
    model = tn.GPT(**cfg, positional="rope", rng=0, dtype=np.float64).eval()
    tokens = np.array([[1, 2, 3, 4, 5, 6]])
    cache = model.new_cache("int8")
    model.forward_step(tokens, cache)
    np_spec.rollback_cache(cache, 4)
    fresh = model.new_cache("int8")
    model.forward_step(tokens[:, :4], fresh)
    for layer, want in zip(cache["layers"], fresh["layers"], strict=True):
        for name in ("k", "v", "k_scale", "v_scale"):
            assert np.array_equal(layer[name], want[name]), name
    assert np.abs(model.forward_step(tokens[:, 4:5], cache) - model.forward_step(tokens[:, 4:5], fresh)).max() == 0
    windowed = tn.GPT(**cfg, positional="rope", window=4, rng=0, dtype=np.float64).eval()
    rolling = {}
    windowed.forward_step(tokens, rolling)
    with pytest.raises(ValueError, match="expected a growing cache"):
        np_spec.rollback_cache(rolling, 2)
