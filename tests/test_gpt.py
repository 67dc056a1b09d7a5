"""The decoder-only GPT in both tracks: identical state_dict keys for every option combination, logits and every
gradient equal in float64, a whole-model gradient check for each norm x positional x activation x key/value heads,
the 2017 options as chapter 8's Pre-LN EncoderLayer under a causal mask, causality, the key/value cache, sampling
(greedy, temperature, top-k, top-p; the same tokens in both tracks) and bad input refused alike."""

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.config import GPT_ACTIVATIONS as ACTIVATIONS
from tfm_common.config import GPT_NORMS as NORMS
from tfm_common.config import GPT_POSITIONAL as POSITIONAL
from tfm_common.sampling import sample_next

GRAD_TOL = 1e-7
TRACK_TOL = 1e-10
V = 11
TINY = dict(vocab_size=V, d_model=8, n_heads=4, d_ff=12, n_layers=2, max_len=8)
TOKENS = np.array([[3, 7, 1, 9, 5, 2], [2, 10, 4, 0, 6, 6]])
INPUTS, TARGETS = TOKENS[:, :-1], TOKENS[:, 1:]  # the causal LM: predict token t + 1 from tokens 0 .. t

COMBOS = list(itertools.product(NORMS, POSITIONAL, ACTIVATIONS, [None, 2]))
IDS = [f"{n}-{p}-{a}-kv{k or 4}" for n, p, a, k in COMBOS]


def perturb(model, seed=0):
    """Norm weights (and biases) away from 1 (and 0), so that a swapped or dropped norm shows."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if ".norm" in name or name.startswith("norm"):
            p.data[...] += 0.3 * rng.standard_normal(p.shape)
    return model


def np_gpt(norm="layernorm", positional="learned", activation="gelu", n_kv_heads=None, seed=0, **kw):
    cfg = {**TINY, **kw}
    opts = dict(norm=norm, positional=positional, activation=activation, n_kv_heads=n_kv_heads)
    return perturb(tn.GPT(**cfg, **opts, rng=seed, dtype=np.float64), seed)


def twin(model: tn.GPT, dtype=torch.float64) -> tt.GPT:
    t = tt.GPT(**model.config, rng=1, dtype=dtype)  # another init, overwritten: the book's one-liner
    t.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return t.train(model.training)


def T(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


# -- the same keys, the same function ---------------------------------------------------------------------------------


def test_state_dict_keys_identical_for_every_option_combination():
    for combo in itertools.product(NORMS, POSITIONAL, ACTIVATIONS, [None, 1, 2], [True, False]):
        norm, pos, act, kv, tie = combo
        opts = dict(norm=norm, positional=pos, activation=act, n_kv_heads=kv, tie_output=tie)
        a, b = tn.GPT(**TINY, **opts), tt.GPT(**TINY, **opts)
        assert list(a.state_dict()) == list(b.state_dict()), combo
        shapes = {k: v.shape for k, v in a.state_dict().items()}
        assert shapes == {k: tuple(v.shape) for k, v in b.state_dict().items()}, combo
        assert a.num_parameters() == b.num_parameters(), combo
        assert ("pos.weight" in shapes) == (pos == "learned")
        assert ("norm.bias" in shapes) == (norm == "layernorm")
        assert shapes["layers.0.self_attn.k_proj.weight"] == ((kv or 4) * 2, 8)


def run_both(model: tn.GPT, t: tt.GPT, seed: int = 1):
    model.zero_grad()
    logits = model(INPUTS)
    g = np.random.default_rng(seed).standard_normal(logits.shape)
    model.backward(g)
    t.zero_grad(set_to_none=True)
    t_logits = t(T(INPUTS))
    t_logits.backward(T(g))
    return logits, model.grads(), t_logits, {k: p.grad for k, p in t.named_parameters()}


@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", COMBOS, ids=IDS)
def test_numpy_and_torch_agree_float64(norm, positional, activation, n_kv_heads):
    model = np_gpt(norm, positional, activation, n_kv_heads).eval()
    logits, grads, t_logits, t_grads = run_both(model, twin(model))
    assert logits.shape == (2, 5, V) and list(grads) == list(t_grads)
    scale = max(np.abs(g).max() for g in grads.values())
    diffs = [max_abs_diff(logits, t_logits) / np.abs(logits).max()]
    diffs += [max_abs_diff(grads[k], t_grads[k]) / scale for k in grads]
    assert max(diffs) < TRACK_TOL, max(diffs)


def test_tracks_agree_with_dropout_on_and_shared_masks():
    model = np_gpt("rmsnorm", "rope", "swiglu", 2, dropout=0.3).train()
    t = twin(model)
    model(INPUTS)
    masks = {n: m.mask for n, m in model.named_modules() if isinstance(m, tn.Dropout) and m.mask is not None}
    assert len(masks) == 1 + 2 * 4  # embeddings; per layer attention, ff, and the two residual branches
    for name, m in t.named_modules():
        if name in masks:
            m.forward = functools.partial(tt.Dropout.forward, m, mask=T(masks[name]))
    for name, m in model.named_modules():
        if name in masks:
            m.forward = functools.partial(tn.Dropout.forward, m, mask=masks[name])
    logits, grads, t_logits, t_grads = run_both(model, t)
    assert max_abs_diff(logits, t_logits) < TRACK_TOL
    assert max(max_abs_diff(grads[k], t_grads[k]) for k in grads) < TRACK_TOL
    assert max_abs_diff(logits, model.eval()(INPUTS)) > 1e-3  # the masks did something


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_2017_options_are_the_pre_ln_encoder_layer_with_a_causal_mask(lib, activation):
    """One GPT block with LayerNorm, multi-head attention and a two-matrix feed-forward IS chapter 8's
    EncoderLayer(norm_first=True) given a causal mask: same keys, same outputs."""
    dt = np.float64 if lib is tn else torch.float64
    block = lib.GPTBlock(8, 2, 16, activation=activation, rng=0, dtype=dt)
    layer = lib.EncoderLayer(8, 2, 16, 0.0, activation, norm_first=True, rng=1, dtype=dt)
    assert list(block.state_dict()) == list(layer.state_dict())
    layer.load_state_dict(block.state_dict())
    x = np.random.default_rng(2).standard_normal((2, 5, 8))
    x = x if lib is tn else T(x)
    mask = lib.causal_mask(5)
    assert max_abs_diff(block(x, mask), layer(x, mask)) < 1e-14


def test_tied_output_gets_both_gradients_and_untied_is_separate():
    tied = np_gpt().eval()
    assert tied.output_projection.weight is tied.embed.weight
    assert "output_projection.weight" not in tied.grads() and "output_projection.weight" in tied.state_dict()
    untied = tn.GPT(**TINY, tie_output=False, rng=0, dtype=np.float64).eval()
    untied.load_state_dict({**tied.state_dict(), "output_projection.weight": tied.embed.weight.data})
    g = np.random.default_rng(3).standard_normal((2, 5, V))
    for m in (tied, untied):
        m.zero_grad()
        m(INPUTS)
        m.backward(g)
    total = untied.embed.weight.grad + untied.output_projection.weight.grad
    assert max_abs_diff(tied.embed.weight.grad, total) < 1e-13


# -- the whole-model gradient check -----------------------------------------------------------------------------------


def model_grad_check(model: tn.GPT, h: float = 1e-5, seed: int = 0) -> dict[str, float]:
    """Backward against central differences of the causal LM loss, each parameter along a random +-1 direction over
    all its entries and at its largest-gradient entry (as tests/test_transformer.py's check, which explains the
    error measures and why k_proj.bias has a true gradient of zero; with rope it has not: the rotation makes q.R_s b
    depend on the key's position s)."""
    loss_fn = tn.CrossEntropyLoss()
    model.zero_grad()
    loss_fn(model(INPUTS), TARGETS)
    model.backward(loss_fn.backward())
    analytic = {name: g.copy() for name, g in model.grads().items()}
    scale = max(np.abs(g).max() for g in analytic.values())
    rng = np.random.default_rng(seed)
    errors = {}
    for name, p in model.named_parameters():

        def derivative(direction, p=p) -> float:
            original = p.data.copy()
            p.data[...] = original + h * direction
            up = float(loss_fn(model(INPUTS), TARGETS))
            p.data[...] = original - h * direction
            down = float(loss_fn(model(INPUTS), TARGETS))
            p.data[...] = original
            return (up - down) / (2 * h)

        g = analytic[name]
        v = rng.choice([-1.0, 1.0], size=p.shape)
        a, n = float((g * v).sum()), derivative(v)
        if name.endswith("k_proj.bias") and model.config["positional"] != "rope":  # rotated, the bias is not a shift
            assert abs(a) < 1e-12 * scale and abs(n) < 1e-8, (name, a, n)
            continue
        err = [abs(a - n) / np.abs(g * v).sum()]
        i = int(np.abs(g).argmax())
        e = np.zeros(g.size)
        e[i] = 1
        n = derivative(e.reshape(g.shape))
        err.append(abs(g.flat[i] - n) / max(np.abs(g).max(), abs(n)))
        errors[name] = max(err)
    return errors


@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", COMBOS, ids=IDS)
def test_whole_model_gradient_check(norm, positional, activation, n_kv_heads):
    model = np_gpt(norm, positional, activation, n_kv_heads, n_layers=1).eval()
    errors = model_grad_check(model)
    checked = set(errors) | {n for n, _ in model.named_parameters() if n.endswith("k_proj.bias")}
    assert any(n.endswith("k_proj.bias") for n in errors) == (positional == "rope")
    assert checked == {n for n, _ in model.named_parameters()}
    assert max(errors.values()) < GRAD_TOL, {k: v for k, v in errors.items() if v >= GRAD_TOL}


def test_gradient_check_catches_a_wrong_rope_backward(monkeypatch):
    """The check can fail: a rotary backward that rotates forward instead of back."""
    original = tn.RotaryEmbedding.rotate
    monkeypatch.setattr(
        tn.RotaryEmbedding, "rotate", lambda self, x, offset=0, inverse=False: original(self, x, offset)
    )
    errors = model_grad_check(np_gpt(positional="rope", n_layers=1).eval())
    assert errors["layers.0.self_attn.q_proj.weight"] > 1e-3


# -- causality and the cache ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("positional", POSITIONAL)
def test_the_future_does_not_leak(lib, positional):
    model = np_gpt(positional=positional).eval()
    t = twin(model)
    run = model if lib is tn else (lambda x: t(T(x)).detach().numpy())
    base = run(INPUTS)
    changed = INPUTS.copy()
    changed[:, 3] = 8
    out = run(changed)
    assert max_abs_diff(base[:, :3], out[:, :3]) < 1e-14 and max_abs_diff(base[:, 3:], out[:, 3:]) > 1e-3


CACHE_CASES = [("layernorm", "learned", "gelu", None), ("layernorm", "sinusoidal", "relu", 1),
               ("rmsnorm", "rope", "swiglu", 2), ("rmsnorm", "rope", "gelu", None)]  # fmt: skip


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", CACHE_CASES)
def test_cached_logits_equal_uncached(lib, norm, positional, activation, n_kv_heads):
    model = np_gpt(norm, positional, activation, n_kv_heads).eval()
    m, x = (model, TOKENS) if lib is tn else (twin(model), T(TOKENS))
    full = np.asarray(m(x).detach() if lib is tt else m(x))
    cache, steps = {}, []
    for t0, t1 in ((0, 3), (3, 4), (4, 6)):  # a prompt of three, then one token, then two
        out = m.forward_step(x[:, t0:t1], cache)
        steps.append(np.asarray(out.detach() if lib is tt else out))
    assert cache["length"] == 6 and len(cache["layers"]) == 2
    assert max_abs_diff(np.concatenate(steps, axis=1), full) < 1e-12
    k = cache["layers"][0]["k"]
    assert tuple(k.shape) == (2, n_kv_heads or 4, 6, 2)  # (B, n_kv_heads, T, d_head)
    with pytest.raises(ValueError, match="has length 3 after 6 cached positions, more than max_len=8"):
        m.forward_step(x[:, :3], cache)


def test_numpy_backward_after_forward_step_is_an_error():
    """A forward fills the caches; a forward_step after it must not leave them for a backward that would then
    differentiate the earlier forward."""
    model = np_gpt()
    model(INPUTS)
    model.forward_step(INPUTS, {})
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward(np.ones((2, 5, V)))


# -- generation -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", CACHE_CASES)
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.7, 3)])
def test_both_tracks_generate_the_same_tokens(norm, positional, activation, n_kv_heads, temperature, top_k):
    model = np_gpt(norm, positional, activation, n_kv_heads).eval()
    prompt = TOKENS[:, :2]
    a = model.generate(prompt, 6, temperature, top_k, rng=5)
    b = twin(model).generate(T(prompt), 6, temperature, top_k, rng=5)
    assert a.shape == (2, 8) and np.array_equal(a[:, :2], prompt)
    assert np.array_equal(a, b.numpy())
    assert np.array_equal(a, model.generate(prompt, 6, temperature, top_k, rng=5, use_cache=False))


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_greedy_is_the_argmax_of_the_uncached_model_and_top_k_one_is_greedy(lib):
    model = np_gpt(positional="rope").eval()
    m, conv = (model, np.asarray) if lib is tn else (twin(model), T)
    out = np.asarray(m.generate(conv(TOKENS[:, :2]), 5, temperature=0))
    for t in range(2, 7):
        logits = np.asarray(m(conv(out[:, :t])).detach() if lib is tt else m(out[:, :t]))
        assert np.array_equal(out[:, t], logits[:, -1].argmax(-1))
    assert np.array_equal(out, np.asarray(m.generate(conv(TOKENS[:, :2]), 5, temperature=1.3, top_k=1, rng=9)))


def test_sampler_follows_the_distribution_and_top_k():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = sample_next(np.repeat(logits, 4000, axis=0), 1.0, None, np.random.default_rng(0))  # 4000 rows, one each
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.abs(freq - [0.5, 0.3, 0.15, 0.05]).max() < 0.03  # ~4 standard errors at n = 4000
    top2 = sample_next(np.repeat(logits, 2000, axis=0), 1.0, 2, np.random.default_rng(1))
    assert set(top2) == {0, 1} and abs((top2 == 0).mean() - 0.5 / 0.8) < 0.04
    cold = sample_next(np.repeat(logits, 200, axis=0), 0.05, None, np.random.default_rng(2))
    assert (cold == 0).all()  # temperature -> 0: the argmax (p1/p0 = 0.6^20 ~ 4e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 0.5), (0.7, 3, 0.8), (1.3, None, 0.05)])
def test_both_tracks_draw_the_same_tokens_with_top_p(temperature, top_k, top_p):
    model = np_gpt(positional="rope").eval()
    prompt = TOKENS[:, :2]
    a = model.generate(prompt, 6, temperature, top_k, rng=5, top_p=top_p)
    b = twin(model).generate(T(prompt), 6, temperature, top_k, rng=5, top_p=top_p)
    assert np.array_equal(a, b.numpy())
    assert np.array_equal(a, model.generate(prompt, 6, temperature, top_k, rng=5, top_p=top_p, use_cache=False))


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_top_p_one_is_no_filter_and_a_tiny_top_p_is_greedy(lib):
    model = np_gpt().eval()
    m, conv = (model, np.asarray) if lib is tn else (twin(model), T)
    prompt = conv(TOKENS[:, :2])
    free = np.asarray(m.generate(prompt, 6, 1.0, rng=3))
    assert np.array_equal(free, np.asarray(m.generate(prompt, 6, 1.0, rng=3, top_p=1.0)))
    assert np.array_equal(free, np.asarray(m.generate(prompt, 6, 1.0, rng=3, top_p=1)))
    greedy = np.asarray(m.generate(prompt, 6, temperature=0))
    assert np.array_equal(greedy, np.asarray(m.generate(prompt, 6, 1.0, rng=3, top_p=1e-9)))  # the nucleus is the top


def test_sampler_draws_only_the_nucleus_with_its_renormalized_probabilities():
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = np.repeat(np.log(p)[None, :], 6000, axis=0)
    # 0.4 + 0.25 = 0.65 < 0.7 <= 0.8: the nucleus of top_p=0.7 is the first three tokens
    draws = sample_next(logits, 1.0, None, np.random.default_rng(0), top_p=0.7)
    assert set(draws) == {0, 1, 2}
    freq = np.bincount(draws, minlength=6)[:3] / len(draws)
    assert np.abs(freq - p[:3] / 0.8).max() < 0.03  # ~5 standard errors at n = 6000
    assert set(sample_next(logits, 1.0, None, np.random.default_rng(1), top_p=0.65)) == {0, 1}  # reaches it exactly
    assert set(sample_next(logits, 1.0, None, np.random.default_rng(1), top_p=0.4)) == {0}
    # order: temperature first (T = 2 flattens p: the nucleus of 0.7 grows), then top_k, then top_p
    hot = sample_next(logits, 2.0, None, np.random.default_rng(2), top_p=0.7)
    assert set(hot) == {0, 1, 2, 3}
    k2 = sample_next(logits, 1.0, 2, np.random.default_rng(3), top_p=0.7)  # of 0.4 and 0.25, 0.7 needs both
    assert set(k2) == {0, 1}
    assert set(sample_next(logits, 1.0, 2, np.random.default_rng(3), top_p=0.6)) == {0}  # 0.4 / 0.65 >= 0.6
    # ties with the last token kept are kept
    tie = np.repeat(np.log([[0.5, 0.25, 0.25]]), 2000, axis=0)
    assert set(sample_next(tie, 1.0, None, np.random.default_rng(4), top_p=0.6)) == {0, 1, 2}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_generate_restores_training_mode_and_leaves_the_prompt(lib):
    model = np_gpt(dropout=0.2).train()
    m, conv = (model, np.asarray) if lib is tn else (twin(model), T)
    prompt = conv(TOKENS[:, :3])
    out = m.generate(prompt, 2, rng=1)
    assert m.training and tuple(out.shape) == (2, 5) and np.array_equal(np.asarray(out[:, :3]), TOKENS[:, :3])
    assert np.array_equal(np.asarray(out), np.asarray(m.generate(prompt, 2, rng=1)))  # eval: no dropout
    assert np.array_equal(np.asarray(m.generate(prompt, 0)), TOKENS[:, :3])


# -- float32, counts, bad input ---------------------------------------------------------------------------------------


def test_float32_both_tracks():
    a = tn.GPT(**TINY, norm="rmsnorm", positional="rope", activation="swiglu", n_kv_heads=1, rng=0)
    logits = a(INPUTS)
    assert logits.dtype == np.float32
    a.backward(np.ones_like(logits))
    assert all(g.dtype == np.float32 for g in a.grads().values())
    b = tt.GPT(**TINY, norm="rmsnorm", positional="rope", activation="swiglu", n_kv_heads=1, rng=0)
    b.load_state_dict({k: torch.from_numpy(v) for k, v in a.state_dict().items()})
    assert max_abs_diff(b(T(INPUTS)), logits) < 1e-5


def test_parameter_count_formula():
    d, H, f, L, Vs, ml = 16, 4, 64, 3, 50, 32
    for act, kv, pos, norm in itertools.product(ACTIVATIONS, [None, 1], POSITIONAL, NORMS):
        m = tn.GPT(Vs, d, H, f, L, ml, norm=norm, positional=pos, activation=act, n_kv_heads=kv)
        d_kv = (kv or H) * d // H
        attn = 2 * (d * d + d) + 2 * (d * d_kv + d_kv)
        ff = 3 * d * tn.swiglu_hidden_size(f) if act == "swiglu" else 2 * d * f + f + d
        norms = (2 if norm == "layernorm" else 1) * d
        expected = Vs * d + (ml * d if pos == "learned" else 0) + L * (attn + ff + 2 * norms) + norms
        assert m.num_parameters() == expected, (act, kv, pos, norm)


BAD_CONFIG = {
    "kv divides": (dict(n_kv_heads=3), ValueError, "GPT: n_heads=4 must be divisible by n_kv_heads=3"),
    "kv zero": (dict(n_kv_heads=0), ValueError, "GPT: n_kv_heads must be an int >= 1"),
    "norm": (dict(norm="batchnorm"), ValueError, r"GPT: norm must be one of \('layernorm', 'rmsnorm'\)"),
    "positional": (dict(positional="alibi"), ValueError, "GPT: positional must be one of"),
    "activation": (dict(activation="geglu"), ValueError, "GPT: activation must be one of"),
    "heads": (dict(n_heads=3), ValueError, "GPT: d_model=8 must be divisible by n_heads=3"),
    "rope odd head": (dict(d_model=6, n_heads=2, positional="rope"), ValueError, "rope needs an even d_head"),
    "sinusoidal odd": (dict(d_model=9, n_heads=3, positional="sinusoidal"), ValueError, "even d_model"),
    "dropout": (dict(dropout=1.0), ValueError, r"GPT: dropout must be in \[0, 1\)"),
    "tie": (dict(tie_output=1), TypeError, "GPT: tie_output expected True or False"),
    "vocab": (dict(vocab_size=0), ValueError, "GPT: vocab_size must be an int >= 1"),
    "max_len float": (dict(max_len=8.0), TypeError, "GPT: max_len expected an int"),
}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD_CONFIG)
def test_bad_configuration(lib, case):
    kw, exc, match = BAD_CONFIG[case]
    with pytest.raises(exc, match=match):
        lib.GPT(**{**TINY, **kw})


BAD_CALLS = {
    "too long": (lambda m, c: m(c(np.ones((2, 9), np.int64))), ValueError, "tokens has length 9, more than max_len=8"),
    "id too large": (lambda m, c: m(c(np.full((1, 3), V))), ValueError, r"values must be in \[0, 11\), got 11"),
    "float tokens": (lambda m, c: m(c(np.ones((1, 3)))), TypeError, "expected an integer"),
    "rank 1": (lambda m, c: m(c(np.ones(3, np.int64))), ValueError, r"expected shape \(B, T\)"),
    "temperature": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, -1.0), ValueError, "temperature must be in"),
    "temperature nan": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, math.nan), TypeError, "temperature expected"),
    "top_k zero": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_k=0), ValueError, "top_k must be an int >= 1"),
    "top_k big": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_k=12), ValueError, "top_k must be <= vocab_size"),
    "top_k float": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_k=2.0), TypeError, "top_k expected an int"),
    "max_new": (lambda m, c: m.generate(c(TOKENS[:, :2]), -1), ValueError, "max_new_tokens must be an int >= 0"),
    "positions": (lambda m, c: m.generate(c(TOKENS[:, :2]), 8), ValueError, "need 9 positions, more than max_len=8"),
    "rng": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, rng="x"), TypeError, "int seed"),
    "top_p zero": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    "top_p big": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    "top_p neg": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_p=-0.1), ValueError, r"top_p must be in \(0, 1\]"),
    "top_p nan": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_p=math.nan), ValueError, "top_p must be in"),
    "top_p str": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_p="0.9"), TypeError, "top_p expected a float"),
    "top_p bool": (lambda m, c: m.generate(c(TOKENS[:, :2]), 2, top_p=True), TypeError, "top_p expected a float"),
}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls(lib, case):
    call, exc, match = BAD_CALLS[case]
    model, conv = (np_gpt(), np.asarray) if lib is tn else (tt.GPT(**TINY), T)
    with pytest.raises(exc, match=match):
        call(model, conv)


# -- training and evaluation ------------------------------------------------------------------------------------------


def test_twin_training_float64_losses_equal_step_by_step():
    """Adam in both tracks from the same weights on the same batches: the same losses, step after step."""
    model = np_gpt("rmsnorm", "rope", "swiglu", 2)
    t = twin(model)
    opt_a, opt_b = tn.make_adam(model), tt.make_adam(t)
    loss_a, loss_b = tn.CrossEntropyLoss(), tt.CrossEntropyLoss()
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(5):
        x = rng.integers(0, V, (3, 6))
        y = rng.integers(0, V, (3, 6))
        ra = tn.lm_train_step(model, x, y, opt_a, loss_a, lr=1e-2, clip_norm=1.0)
        rb = tt.lm_train_step(t, x, y, opt_b, loss_b, lr=1e-2, clip_norm=1.0)
        diffs += [abs(ra.loss - rb.loss), abs(ra.grad_norm - rb.grad_norm)]
    assert max(diffs) < 1e-12
    assert max(max_abs_diff(v, t.state_dict()[k]) for k, v in model.state_dict().items()) < 1e-12


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_lm_eval_loss_is_the_mean_cross_entropy_of_consecutive_windows(lib):
    model = np_gpt().eval()
    m = model if lib is tn else twin(model)
    ids = np.random.default_rng(4).integers(0, V, 23)  # 22 targets: 7 windows of 3 (the last target left out)
    loss, y = lib.lm_eval_loss(m, ids, 3, batch_size=2)
    assert y.shape == (7, 3) and np.array_equal(y.reshape(-1), ids[1:22])
    logits = model(ids[:21].reshape(7, 3))
    expected = float(tn.CrossEntropyLoss()(logits, ids[1:22].reshape(7, 3)))
    assert abs(loss - expected) < 1e-12


# -- torch.nn's GPT (the benchmark's reference) -------------------------------------------------------------------


@pytest.mark.parametrize("positional,activation,tie", [("learned", "gelu", True), ("sinusoidal", "relu", False)])
def test_torch_gpt_matches_gpt_from_torch_nn_layers(positional, activation, tie):
    cfg = dict(vocab_size=13, d_model=16, n_heads=4, d_ff=24, n_layers=2, max_len=9)
    ours = tt.GPT(**cfg, positional=positional, activation=activation, tie_output=tie, rng=2, dtype=torch.float64)
    with torch.no_grad():  # norms away from (1, 0), so that a missing or misplaced norm shows
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(len(name))))
    ref = tt.to_torch_nn_gpt(ours)
    assert isinstance(ref.encoder, torch.nn.TransformerEncoder)
    assert sum(p.numel() for p in ref.parameters()) == ours.num_parameters()
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 13, (3, 9)))
    g = torch.randn(3, 9, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
        m(tokens).backward(g)
    assert (ours(tokens) - ref(tokens)).abs().max().item() < 1e-12
    assert ours.embed.weight.grad is not None
    for ours_name, ref_name in [("embed.weight", "embed.weight"), ("norm.weight", "encoder.norm.weight"),
                                ("layers.1.ff.linear2.weight", "encoder.layers.1.linear2.weight")]:  # fmt: skip
        a, b = ours.get_parameter(ours_name).grad, ref.get_parameter(ref_name).grad
        assert (a - b).abs().max().item() < 1e-12, ours_name
    qkv = ref.get_parameter("encoder.layers.0.self_attn.in_proj_weight").grad  # (3d, d): q, k, v stacked
    ours_qkv = torch.cat([ours.get_parameter(f"layers.0.self_attn.{c}_proj.weight").grad for c in "qkv"])
    assert (qkv - ours_qkv).abs().max().item() < 1e-12


@pytest.mark.parametrize("option", [dict(norm="rmsnorm"), dict(positional="rope"), dict(activation="swiglu"),
                                    dict(n_kv_heads=2)])  # fmt: skip
def test_gpt_from_torch_nn_layers_refuses_what_they_cannot_build(option):
    model = tt.GPT(vocab_size=13, d_model=16, n_heads=4, d_ff=24, n_layers=1, max_len=9, **option, rng=0)
    with pytest.raises(ValueError, match="ReferenceGPT: torch.nn's layers cannot build"):
        tt.to_torch_nn_gpt(model)


# -- the attn_impl option: explicit, tiled ("flash", both tracks), torch's fused kernels ("sdpa", torch only) ------

ATTN_CASES = [("layernorm", "learned", "gelu", None), ("rmsnorm", "rope", "swiglu", 2), ("rmsnorm", "rope", "gelu", 1)]
ATTN_IDS = ["2017", "llama-kv2", "mqa"]


def grads_of(m, lib) -> tuple:
    """Logits and every parameter's gradient for a fixed random dlogits, as NumPy arrays."""
    x = INPUTS if lib is tn else T(INPUTS)
    m.zero_grad()
    logits = m(x)
    g = np.random.default_rng(1).standard_normal(logits.shape)
    if lib is tn:
        m.backward(g)
        return logits, m.grads()
    logits.backward(T(g))
    return logits.detach().numpy(), {k: p.grad.numpy() for k, p in m.named_parameters()}


def assert_same(a: tuple, b: tuple, tol: float = TRACK_TOL) -> None:
    (la, ga), (lb, gb) = a, b
    assert list(ga) == list(gb)
    scale = max(np.abs(g).max() for g in ga.values())
    diffs = [max_abs_diff(la, lb) / np.abs(la).max()] + [max_abs_diff(ga[k], gb[k]) / scale for k in ga]
    assert max(diffs) < tol, max(diffs)


@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", ATTN_CASES, ids=ATTN_IDS)
def test_flash_and_sdpa_equal_explicit_attention_float64(norm, positional, activation, n_kv_heads):
    model = np_gpt(norm, positional, activation, n_kv_heads).train()  # training mode, dropout 0
    explicit = grads_of(model, tn)
    tn.use_attention(model, "flash", tile_size=2)  # tiles smaller than the 5 positions: several per row
    assert_same(grads_of(model, tn), explicit)
    assert all(m.attn_weights is None for _, m in model.named_modules() if isinstance(m, tn.GroupedQueryAttention))
    for attn_impl in ("flash", "sdpa"):
        t = tt.use_attention(twin(model), attn_impl, tile_size=2)
        assert_same(grads_of(t, tt), explicit)  # the NumPy explicit model: twin agreement and option agreement
        # the option's path ran: the explicit one keeps its weights (the twin's explicit run above: not None)
        assert all(m.attn_weights is None for _, m in t.named_modules() if isinstance(m, tt.GroupedQueryAttention))
    t = twin(model)
    grads_of(t, tt)
    assert all(m.attn_weights is not None for _, m in t.named_modules() if isinstance(m, tt.GroupedQueryAttention))


def test_whole_model_gradient_check_with_tiled_attention():
    model = tn.use_attention(np_gpt("rmsnorm", "rope", "swiglu", 2, n_layers=1).eval(), "flash", tile_size=2)
    errors = model_grad_check(model)
    assert max(errors.values()) < GRAD_TOL, {k: v for k, v in errors.items() if v >= GRAD_TOL}


@pytest.mark.parametrize("attn_impl", ["flash", "sdpa"])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_the_attn_impl_options_generate_the_same_tokens_with_the_cache(attn_impl, n_kv_heads):
    model = np_gpt("rmsnorm", "rope", "swiglu", n_kv_heads).eval()
    ref = twin(model).generate(T(TOKENS[:, :3]), 5, temperature=0.0)  # explicit attention
    fast = tt.use_attention(twin(model), attn_impl).generate(T(TOKENS[:, :3]), 5, temperature=0.0)
    assert torch.equal(fast, ref)
    if attn_impl == "flash":
        out = tn.use_attention(model, "flash").generate(TOKENS[:, :3], 5, temperature=0.0)
        np.testing.assert_array_equal(out, ref.numpy())


def test_attn_impl_options_refused_as_for_multi_head_attention():
    with pytest.raises(ValueError, match=r"GroupedQueryAttention: attn_impl='sdpa' .* exists in tfm_torch only"):
        tn.GroupedQueryAttention(8, 4, 2, attn_impl="sdpa")
    with pytest.raises(ValueError, match=r"use_attention: attn_impl='sdpa' .* exists in tfm_torch only"):
        tn.use_attention(np_gpt(), "sdpa")
    for lib in (tn, tt):
        with pytest.raises(ValueError, match=r"GroupedQueryAttention: attn_impl must be one of"):
            lib.GroupedQueryAttention(8, 4, attn_impl="tiled")
        model = lib.use_attention(lib.GPT(**TINY, dropout=0.1, rng=0), "flash").train()
        with pytest.raises(ValueError, match=r"attn_impl='flash' has no dropout on the attention weights"):
            model(INPUTS if lib is tn else T(INPUTS))
        assert "attn_impl='flash', tile_size=64" in repr(model.layers[0].self_attn)


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_the_attn_impl_option_at_construction_is_use_attention(lib):
    attn_impl = "flash" if lib is tn else "sdpa"
    built = lib.GPT(**TINY, n_kv_heads=2, attn_impl=attn_impl, tile_size=4, rng=0)
    switched = lib.use_attention(lib.GPT(**TINY, n_kv_heads=2, rng=0), attn_impl, tile_size=4)
    modes = {(m.attn_impl, m.tile_size) for m in (layer.self_attn for layer in built.layers)}
    assert modes == {(attn_impl, 4)} and list(built.state_dict()) == list(switched.state_dict())
    assert "attn_impl" not in built.config  # how the heads are computed, not what the model is
    x = INPUTS if lib is tn else T(INPUTS)
    np.testing.assert_array_equal(np.asarray(built(x).tolist()), np.asarray(switched(x).tolist()))
    with pytest.raises(ValueError, match=r"GPT: attn_impl must be one of"):
        lib.GPT(**TINY, attn_impl="tiled")


def test_numpy_gpt_refuses_sdpa_by_name():
    with pytest.raises(ValueError, match=r"GPT: attn_impl='sdpa' \(torch.nn.functional.scaled_dot_product_attention\)"):
        tn.GPT(**TINY, attn_impl="sdpa")
