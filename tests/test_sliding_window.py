"""Sliding-window attention and the rolling key/value cache (chapter 21c), both tracks: GPT(window=w, sinks=s) is a
WindowedGPT whose logits equal full attention under the band mask applied by hand (explicit and tiled kernels), the
tiled kernel skips the tiles outside the band, cached == uncached, the rolling cache runs past max_len with RoPE and
equals a longer model's forward at the true positions, its memory stays sinks + window slots, a gradient check, the
two tracks agree, checkpoints carry the window, and bad options are refused alike."""

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.rolling_cache import kept_positions, rolling_slots, window_allowed

V = 23
TINY = dict(vocab_size=V, d_model=16, n_heads=4, d_ff=24, n_layers=2, max_len=16)
TOKENS = np.random.default_rng(0).integers(0, V, (2, 16))
LONG = np.random.default_rng(1).integers(0, V, (2, 70))
LIBS = [tn, tt]
IDS = ["numpy", "torch"]


def perturb(model, seed=0):
    """Norm weights away from 1 and biases away from 0, so that nothing cancels by accident."""
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] += 0.3 * rng.standard_normal(p.data.shape)
    return model


def np_gpt(window=5, sinks=0, positional="rope", seed=0, **kw):
    return perturb(tn.GPT(**{**TINY, **kw}, positional=positional, window=window, sinks=sinks, rng=seed,
                          dtype=np.float64), seed).eval()  # fmt: skip


def twin(model, **kw):
    """The torch twin of a NumPy model (kw: other constructor arguments, e.g. a longer max_len)."""
    t = tt.GPT(**{**model.config, **kw}, rng=1, dtype=torch.float64)
    t.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return t.eval()


def same_weights(model, **kw):
    """A NumPy model of the same weights, other constructor arguments (window=None: the full causal GPT)."""
    m = tn.GPT(**{**model.config, **kw}, rng=1, dtype=np.float64)
    m.load_state_dict(model.state_dict())
    return m.eval()


def run(lib, model, tokens):
    """model's logits as a NumPy array, model being a NumPy model (run in lib's track)."""
    if lib is tn:
        return model(tokens)
    return twin(model)(torch.from_numpy(tokens)).detach().numpy()


# -- the band ----------------------------------------------------------------------------------------------------------


def test_window_allowed_is_the_band_plus_sinks():
    q, k = np.arange(10)[:, None], np.arange(10)[None, :]
    band = window_allowed(q, k, 3)
    assert (band == (np.tril(np.ones((10, 10), bool)) & ~np.tril(np.ones((10, 10), bool), -3))).all()
    sinks = window_allowed(q, k, 3, 2)
    assert (sinks == (band | (k < 2) & (k <= q))).all()
    assert not window_allowed(5, -1, 10).any()  # an empty slot is never seen
    assert (tn.band_mask(10, 3, 2) == sinks[None, None]).all()
    assert (tt.band_mask(10, 3, 2).numpy() == sinks[None, None]).all()
    assert (tn.band_mask(6, 6) == tn.causal_mask(6)).all()


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("attn_impl", ["explicit", "flash"])
@pytest.mark.parametrize("window,sinks,positional", [(1, 0, "rope"), (4, 0, "rope"), (5, 2, "learned"),
                                                     (16, 0, "sinusoidal")])  # fmt: skip
def test_windowed_logits_equal_full_attention_with_the_band_applied_by_hand(lib, attn_impl, window, sinks, positional):
    """The full GPT's layers run under the band mask by hand (the GPT's own forward, its causal mask swapped)."""
    model = np_gpt(window, sinks, positional)
    full = same_weights(model, window=None, sinks=0)
    x = full._embed(TOKENS, 0)
    mask = tn.causal_mask(16) & tn.band_mask(16, window, sinks)
    for layer in full.layers:
        x = layer(x, mask)
    want = full.output_projection(full.norm(x))
    tn.use_attention(model, attn_impl, tile_size=4)
    got = run(lib, model, TOKENS) if lib is tn else None
    if lib is tt:
        t = tt.use_attention(twin(model), attn_impl, tile_size=4)
        got = t(torch.from_numpy(TOKENS)).detach().numpy()
    assert max_abs_diff(got, want) < 1e-12
    if window < 16:  # the band changes something: the full model differs
        assert max_abs_diff(full(TOKENS), want) > 1e-3


def test_the_tiled_kernel_skips_the_tiles_outside_the_band():
    q = k = v = np.random.default_rng(0).standard_normal((1, 1, 64, 8))
    causal = tn.flash_attention_counts(q, k, v, tn.causal_mask(64), tile_size=8)
    band = tn.flash_attention_counts(q, k, v, tn.band_mask(64, 8), tile_size=8)
    assert causal["tiles"] == 8 * 9 // 2  # the lower triangle of 8 x 8 tiles
    assert band["tiles"] == 8 + 7  # the diagonal and the one below: a window of 8 spans at most two tiles
    assert band["tiles_skipped"] == 64 - 15
    out, _ = tn.flash_attention(q, k, v, tn.band_mask(64, 8), tile_size=8)
    assert max_abs_diff(out, tn.scaled_dot_product_attention(q, k, v, tn.band_mask(64, 8))[0]) < 1e-12


# -- the cache ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("positional,sinks", [("rope", 0), ("rope", 2), ("learned", 1)])
def test_cached_equals_uncached(lib, positional, sinks):
    model = np_gpt(5, sinks, positional)
    m = model if lib is tn else twin(model)
    x = TOKENS if lib is tn else torch.from_numpy(TOKENS)
    cache, outs = {}, []
    for start, stop in [(0, 3), (3, 4), (4, 11), (11, 12), (12, 16)]:  # chunks longer and shorter than the window
        outs.append(m.forward_step(x[:, start:stop], cache))
    got = np.concatenate([np.asarray(o.detach() if lib is tt else o) for o in outs], axis=1)
    assert max_abs_diff(got, run(lib, model, TOKENS)) < 1e-12
    want = model.generate(TOKENS[:, :3], 12, temperature=0.7, rng=4, use_cache=False)
    assert (np.asarray(m.generate(x[:, :3], 12, temperature=0.7, rng=4)) == want).all()


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("sinks,attn_impl", [(0, "explicit"), (3, "explicit"), (2, "flash")])
def test_rolling_cache_runs_past_max_len_and_equals_the_forward_at_true_positions(lib, sinks, attn_impl):
    """A model of max_len 16 steps through 70 positions; the reference is the same weights with max_len 128 run on
    the whole text under the band mask: every key at its true position (RoPE), which is what each step of the
    rolling cache recomputes from its sinks + window keys."""
    model = tn.use_attention(np_gpt(6, sinks), attn_impl, tile_size=4)
    long = same_weights(model, max_len=128)
    want = long(LONG)
    m = model if lib is tn else tt.use_attention(twin(model), attn_impl, tile_size=4)
    x = LONG if lib is tn else torch.from_numpy(LONG)
    cache = {}
    outs = [m.forward_step(x[:, :9], cache)]  # a prompt longer than the window
    outs += [m.forward_step(x[:, i : i + 1], cache) for i in range(9, 70)]
    got = np.concatenate([np.asarray(o.detach() if lib is tt else o) for o in outs], axis=1)
    assert cache["length"] == 70
    assert max_abs_diff(got, want) < 1e-12
    greedy = m.generate(x[:, :5], 60, temperature=0)  # 64 positions past max_len 16
    assert max_abs_diff(np.asarray(greedy), long.generate(LONG[:, :5], 60, temperature=0)) == 0


def test_rolling_cache_equals_recomputing_each_step_from_the_kept_keys():
    """One layer: each step's logits come from the sinks + last window tokens alone, at their true positions."""
    model = np_gpt(4, 2, n_layers=1)
    long = same_weights(model, max_len=128)
    cache = {}
    for i in range(40):
        got = model.forward_step(LONG[:, i : i + 1], cache)[:, -1]
        kept = np.flatnonzero(window_allowed(i, np.arange(i + 1), 4, 2))  # the positions the query at i sees
        x = long.embed(LONG[:, kept]) * np.sqrt(16)
        attn, layer = long.layers[0].self_attn, long.layers[0]
        h = layer.norm1(x)
        q = attn._split(attn.q_proj(h), 4)
        k = attn._split(attn.k_proj(h), 4)
        v = attn._split(attn.v_proj(h), 4)
        cos, sin = tn.rope_angles_at(kept, 4, dtype=np.float64)
        q, k = tn.apply_rope(q, cos, sin), tn.apply_rope(k, cos, sin)
        ctx = tn.scaled_dot_product_attention(q[:, :, -1:], k, v)[0]
        x = x[:, -1:] + attn.out_proj(attn._merge(ctx))
        x = x + layer.ff(layer.norm2(x))
        want = long.output_projection(long.norm(x))[:, -1]
        assert max_abs_diff(got, want) < 1e-12, i


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("kv_dtype", ["float", "int8"])
def test_rolling_cache_memory_is_constant_in_the_generated_length(lib, kv_dtype):
    model = np_gpt(6, 2)
    m = model if lib is tn else twin(model)
    cache, sizes, buffers = m.new_cache(kv_dtype), [], None
    for i in range(60):
        m.forward_step((LONG if lib is tn else torch.from_numpy(LONG))[:, i : i + 1], cache)
        sizes.append((lib.cache_nbytes(cache), cache["layers"][0]["k"].shape[2]))
        if i == 7:  # after sinks + window positions: the same buffers to the end
            buffers = [id(layer[n]) for layer in cache["layers"] for n in layer if n != "kv_dtype"]
    assert sizes[7:] == [sizes[7]] * 53 and sizes[7][1] == 8
    assert [id(layer[n]) for layer in cache["layers"] for n in layer if n != "kv_dtype"] == buffers
    assert sorted(set(cache["slots"])) == [0, 1, *range(54, 60)]
    assert (rolling_slots(cache["slots"], 6, 2) == np.arange(8)).all()  # each position in its own slot
    assert kept_positions(np.arange(60), 59, 6, 2).sum() == 8


def test_rolling_slots_write_the_next_key_over_the_oldest():
    assert list(rolling_slots(np.arange(12), 4, 2)) == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
    assert list(rolling_slots(np.arange(6), 3)) == [0, 1, 2, 0, 1, 2]


# -- gradients, tracks, checkpoints ------------------------------------------------------------------------------------


def test_windowed_gpt_gradient_check():
    """The backward is the GPT's (the same code, another mask): against central differences, every parameter along a
    random direction."""
    model = np_gpt(3, 1, n_layers=1)
    loss_fn = tn.CrossEntropyLoss()
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    model.zero_grad()
    loss_fn(model(inputs), targets)
    model.backward(loss_fn.backward())
    rng, h = np.random.default_rng(0), 1e-5
    for name, p in model.named_parameters():
        d = rng.choice([-1.0, 1.0], size=p.data.shape)
        p.data += h * d
        up = loss_fn(model(inputs), targets)
        p.data -= 2 * h * d
        down = loss_fn(model(inputs), targets)
        p.data += h * d
        numeric, analytic = (up - down) / (2 * h), float((p.grad * d).sum())
        assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), name


@pytest.mark.parametrize("attn_impl", ["explicit", "flash"])
def test_numpy_and_torch_agree_on_logits_and_gradients(attn_impl):
    model = tn.use_attention(np_gpt(4, 1, n_kv_heads=2), attn_impl, tile_size=4)
    t = tt.use_attention(twin(model), attn_impl, tile_size=4)
    g = np.random.default_rng(2).standard_normal((2, 16, V))
    model.zero_grad()
    out = model(TOKENS)
    model.backward(g)
    out_t = t(torch.from_numpy(TOKENS))
    out_t.backward(torch.from_numpy(g))
    assert max_abs_diff(out, out_t) < 1e-10
    grads = dict(t.named_parameters())
    for name, grad in model.grads().items():
        assert max_abs_diff(grad, grads[name].grad) < 1e-10, name


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_a_checkpoint_with_a_window_loads_only_into_the_same_window(lib, tmp_path):
    model = np_gpt(5, 1) if lib is tn else twin(np_gpt(5, 1))
    path = tmp_path / "w.npz"
    lib.save_checkpoint(path, model)
    loaded = lib.load_model(path)
    assert type(loaded).__name__ == "WindowedGPT" and loaded.config["window"] == 5 and loaded.config["sinks"] == 1
    dtype = np.float64 if lib is tn else torch.float64
    for other in (dict(window=6, sinks=1), dict(window=5, sinks=0)):
        with pytest.raises(ValueError, match="configured differently"):
            lib.load_checkpoint(path, lib.GPT(**{**TINY, "positional": "rope", **other}, dtype=dtype))
    with pytest.raises(ValueError, match="holds a WindowedGPT, the model is a GPT"):
        lib.load_checkpoint(path, lib.GPT(**TINY, positional="rope", dtype=dtype))
    plain = lib.GPT(**TINY, dtype=dtype)
    assert "window" not in plain.config and type(plain).__name__ == "GPT"  # the 17b GPT's config is unchanged


# -- refusals, alike in both tracks ------------------------------------------------------------------------------------


def refusals(lib):
    dtype = np.float64 if lib is tn else torch.float64
    ids = TOKENS if lib is tn else torch.from_numpy(TOKENS)
    learned = lib.GPT(**TINY, window=4, dtype=dtype)
    rope = lib.GPT(**TINY, positional="rope", window=4, dtype=dtype)
    full_rope = lib.GPT(**TINY, positional="rope", dtype=dtype)
    calls = {
        "window 0": lambda: lib.GPT(**TINY, window=0),
        "window float": lambda: lib.GPT(**TINY, window=2.0),
        "sinks = window": lambda: lib.GPT(**TINY, window=4, sinks=4),
        "sinks < 0": lambda: lib.GPT(**TINY, window=4, sinks=-1),
        "sinks without window": lambda: lib.GPT(**TINY, sinks=2),
        "WindowedGPT without window": lambda: lib.WindowedGPT(**TINY),
        "learned past max_len": lambda: learned.generate(ids[:, :4], 20),
        "use_cache=False past max_len": lambda: rope.generate(ids[:, :4], 20, use_cache=False),
        "full GPT past max_len": lambda: full_rope.generate(ids[:, :4], 20),
        "learned forward_step past max_len": lambda: learned.forward_step(ids[:, :4], {"length": 14}),
        "a growing cache in a rolling model": lambda: rope.forward_step(ids[:, 5:6], step_cache(full_rope, ids)),
        "band_mask window 0": lambda: lib.band_mask(4, 0),
        "band_mask sinks": lambda: lib.band_mask(4, 2, 2),
        "kv_dtype": lambda: rope.generate(ids[:, :4], 2, kv_dtype="int4"),
    }
    out = {}
    for name, call in calls.items():
        with pytest.raises((ValueError, TypeError)) as e:
            call()
        out[name] = (e.type, str(e.value))
    return out


def step_cache(model, ids):
    cache = {}
    model.forward_step(ids[:, :5], cache)
    return cache


def test_refusals_are_the_same_in_both_tracks():
    a, b = refusals(tn), refusals(tt)
    assert a == b
    assert "window must be an int >= 1, got 0" in a["window 0"][1]
    assert "sinks must be < window=4" in a["sinks = window"][1]
    assert "needs a window" in a["sinks without window"][1]
    assert "only positional='rope' runs past max_len" in a["learned past max_len"][1]
    assert "rolling cache" in a["use_cache=False past max_len"][1]
    assert "more than max_len=16" in a["full GPT past max_len"][1]
    assert "kv_dtype" in a["kv_dtype"][1]


def test_a_failed_step_leaves_the_cache_as_it_was():
    model = np_gpt(4, 0, positional="learned")
    cache = {}
    model.forward_step(TOKENS[:, :10], cache)
    before = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in cache.items() if k != "layers"}
    k0 = cache["layers"][0]["k"].copy()
    with pytest.raises(ValueError, match="max_len"):
        model.forward_step(TOKENS[:, :8], cache)
    assert (cache["slots"] == before["slots"]).all() and cache["length"] == 10
    assert (cache["layers"][0]["k"] == k0).all()
