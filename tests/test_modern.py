"""Since 2017, in both tracks: RMSNorm (against torch.nn.RMSNorm), rotary position embedding (the offset property,
its backward), the SwiGLU feed-forward (parameter count), grouped-query attention (against
F.scaled_dot_product_attention(enable_gqa=True) and against MultiHeadAttention, its key/value cache): gradient
checks in float64, the two tracks against each other, bad input refused alike."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_tracks import TOL, assert_tracks_agree, load_np_into_torch, max_abs_diff, run_numpy, run_torch, to_torch

import tfm_numpy as tn
import tfm_torch as tt

GRAD_TOL = 1e-7
RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 5, 8))  # (B, T, d)
G = RNG.standard_normal((2, 5, 8))  # an output gradient


# -- RMSNorm -------------------------------------------------------------------------------------------------------


def rms_pair(d=8, eps=1e-6, seed=0):
    a = tn.RMSNorm(d, eps, dtype=np.float64)
    a.weight.data[...] = 1 + 0.3 * np.random.default_rng(seed).standard_normal(d)  # away from 1: a dropped w shows
    b = tt.RMSNorm(d, eps, dtype=torch.float64)
    load_np_into_torch(a, b)
    return a, b


def test_rmsnorm_gradient_check():
    errors = tn.grad_check(rms_pair()[0], X)
    assert set(errors) == {"input0", "weight"} and max(errors.values()) < GRAD_TOL, errors


def test_rmsnorm_tracks_agree_and_match_torch_nn_rmsnorm():
    a, b = rms_pair(eps=1e-5)
    assert_tracks_agree(run_numpy(a, (X,), G), run_torch(b, (X,), G))
    ref = torch.nn.RMSNorm(8, eps=1e-5, dtype=torch.float64)
    assert list(ref.state_dict()) == list(a.state_dict()) == ["weight"]
    load_np_into_torch(a, ref)
    assert_tracks_agree(run_numpy(a, (X,), G), run_torch(ref, (X,), G))


def test_rmsnorm_output_has_unit_rms_and_ignores_scale():
    a, _ = rms_pair()
    a.weight.data[...] = 1
    y = a(X)
    assert np.allclose(np.sqrt((y**2).mean(-1)), 1, atol=1e-6)
    assert max_abs_diff(a(5 * X), y) < 1e-5  # scaling x changes nothing (up to eps = 1e-6 against mean(x^2) ~ 1)
    assert max_abs_diff(a(X + 1), y) > 0.1  # but, unlike LayerNorm, a shift does


# -- rotary position embedding --------------------------------------------------------------------------------------


def test_rope_scores_depend_only_on_the_offset():
    """(R_p q) . (R_{p+k} k) is the same for every p, in both tracks; and it is q . R_k k."""
    d, L = 16, 64
    q, k = RNG.standard_normal(d), RNG.standard_normal(d)
    for lib, to in ((tn, np.asarray), (tt, torch.from_numpy)):
        rope = lib.RotaryEmbedding(d, L, dtype=np.float64 if lib is tn else torch.float64)
        Q = np.asarray(rope(to(np.tile(q, (L, 1)))))  # (L, d): q at every position
        K = np.asarray(rope(to(np.tile(k, (L, 1)))))
        for off in (0, 1, 5, 20):
            dots = np.einsum("pd,pd->p", Q[: L - off], K[off:])  # position p against p + off
            assert np.ptp(dots) < 1e-12 * np.abs(dots).max()
            assert abs(dots[0] - q @ K[off]) < 1e-12  # = q . R_off k
        assert np.ptp(np.einsum("pd,pd->p", Q[5:], K[:-5])) < 1e-12  # negative offsets too
        assert np.allclose(np.linalg.norm(Q, axis=1), np.linalg.norm(q))  # a rotation keeps the norm


def test_rope_is_chapter_7s_rotation():
    """Rotating the pairs (0, 1) of every column pair by p w_i gives (cos, sin) of p w_i: chapter 7's table, with
    each (sin, cos) pair swapped."""
    d, L = 8, 10
    pe = tn.sinusoidal_positional_encoding(L, d, dtype=np.float64)
    ones = np.tile(np.array([1.0, 0.0] * (d // 2)), (L, 1))  # (1, 0) in every pair
    rotated = tn.RotaryEmbedding(d, L, dtype=np.float64)(ones)  # (cos p w_i, sin p w_i)
    assert max_abs_diff(rotated[:, 0::2], pe[:, 1::2]) < 1e-15 and max_abs_diff(rotated[:, 1::2], pe[:, 0::2]) < 1e-15


@pytest.mark.parametrize("offset", [0, 3])
def test_rope_gradient_check_and_tracks_agree(offset):
    x = RNG.standard_normal((2, 3, 5, 8))  # (B, H, T, d_head)
    g = RNG.standard_normal(x.shape)
    a = tn.RotaryEmbedding(8, 10, dtype=np.float64)
    assert tn.grad_check(a, x, forward_kwargs={"offset": offset})["input0"] < GRAD_TOL
    b = tt.RotaryEmbedding(8, 10, dtype=torch.float64)
    assert list(b.state_dict()) == [] and a.state_dict() == {}
    assert_tracks_agree(run_numpy(a, (x,), g, offset=offset), run_torch(b, (x,), g, offset=offset))
    assert max_abs_diff(a.rotate(a(x, offset), offset, inverse=True), x) < 1e-14  # the inverse is the transpose


def test_rope_float32_and_astype():
    a = tn.RotaryEmbedding(8, 10)
    assert a(np.ones((2, 4, 8), np.float32)).dtype == np.float32
    a.double()
    assert a(np.ones((2, 4, 8))).dtype == np.float64


# -- SwiGLU ---------------------------------------------------------------------------------------------------------


def test_swiglu_gradient_check_and_tracks_agree():
    a = tn.SwiGLUFeedForward(8, 12, rng=1, dtype=np.float64)
    errors = tn.grad_check(a, X)
    assert set(errors) == {"input0", "gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert max(errors.values()) < GRAD_TOL, errors
    b = tt.SwiGLUFeedForward(8, 12, rng=5, dtype=torch.float64)
    load_np_into_torch(a, b)
    assert_tracks_agree(run_numpy(a, (X,), G), run_torch(b, (X,), G))
    # the reference formula, with torch's own silu
    ref = b.down_proj(F.silu(b.gate_proj(to_torch(X))) * b.up_proj(to_torch(X)))
    assert max_abs_diff(a(X), ref) < TOL


@pytest.mark.parametrize("d_model,d_ff", [(8, 32), (64, 256), (512, 2048), (4096, 16384)])
def test_swiglu_two_thirds_keeps_the_parameter_count(d_model, d_ff):
    h = tn.swiglu_hidden_size(d_ff)
    assert h == tt.swiglu_hidden_size(d_ff)
    two = 2 * d_model * d_ff  # two matrices of the d_ff-wide feed-forward (without biases)
    three = 3 * d_model * h
    assert abs(three - two) <= 1.5 * d_model  # rounding h to an int: at most half a column of three matrices
    if d_model == 8:
        assert tn.SwiGLUFeedForward(d_model, h).num_parameters() == three


def test_swiglu_with_dropout_shared_mask():
    a = tn.SwiGLUFeedForward(8, 12, dropout=0.5, rng=1, dtype=np.float64).train()
    b = tt.SwiGLUFeedForward(8, 12, dropout=0.5, rng=1, dtype=torch.float64).train()
    load_np_into_torch(a, b)
    out = a(X)
    mask = torch.from_numpy(a.dropout.mask)
    b.dropout.forward = lambda x, _f=b.dropout.forward: _f(x, mask=mask)
    assert max_abs_diff(out, b(to_torch(X))) < TOL


# -- grouped-query attention ----------------------------------------------------------------------------------------


def gqa_pair(n_heads=4, n_kv_heads=2, rope=False, d=8, max_len=10, seed=0):
    ra = tn.RotaryEmbedding(d // n_heads, max_len, dtype=np.float64) if rope else None
    rb = tt.RotaryEmbedding(d // n_heads, max_len, dtype=torch.float64) if rope else None
    a = tn.GroupedQueryAttention(d, n_heads, n_kv_heads, rotary=ra, rng=seed, dtype=np.float64)
    b = tt.GroupedQueryAttention(d, n_heads, n_kv_heads, rotary=rb, rng=seed + 1, dtype=torch.float64)
    load_np_into_torch(a, b)
    return a, b


GQA_CASES = [(4, 4, False), (4, 2, False), (4, 1, True), (4, 2, True)]


@pytest.mark.parametrize("n_heads,n_kv_heads,rope", GQA_CASES)
def test_gqa_gradient_check_and_tracks_agree(n_heads, n_kv_heads, rope):
    a, b = gqa_pair(n_heads, n_kv_heads, rope)
    mask = tn.causal_mask(5)
    errors = tn.grad_check(a, X, forward_kwargs={"mask": mask, "offset": 2})
    # the key bias has a true gradient of zero without rotation (a shift of each score row: differences are noise);
    # rotated, q.R_s b depends on the key position s and its gradient is real, so it is checked too
    assert max(v for k, v in errors.items() if rope or k != "k_proj.bias") < GRAD_TOL, errors
    assert a.k_proj.weight.shape == (n_kv_heads * 8 // n_heads, 8)
    assert_tracks_agree(
        run_numpy(a, (X,), G, mask=mask, offset=2), run_torch(b, (X,), G, mask=torch.from_numpy(mask), offset=2)
    )


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_matches_torch_sdpa_enable_gqa(n_kv_heads):
    """Our attention over repeated key/value heads equals F.scaled_dot_product_attention(..., enable_gqa=True),
    output and gradients of q, k, v, in both tracks (the NumPy one summing each group with the module's own
    `_sum_groups`, what GroupedQueryAttention.backward does)."""
    B, H, T, dh = 2, 4, 5, 3
    q, k, v = (RNG.standard_normal((B, h, T, dh)) for h in (H, n_kv_heads, n_kv_heads))
    g = RNG.standard_normal((B, H, T, dh))
    mask = tn.causal_mask(T)
    qt, kt, vt = (to_torch(a, requires_grad=True) for a in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=torch.from_numpy(mask), enable_gqa=True)
    ref.backward(to_torch(g))
    # torch track: the library's attention over tt.repeat_kv
    qt2, kt2, vt2 = (to_torch(a, requires_grad=True) for a in (q, k, v))
    n_rep = H // n_kv_heads
    ours, _ = tt.scaled_dot_product_attention(
        qt2, tt.repeat_kv(kt2, n_rep), tt.repeat_kv(vt2, n_rep), torch.from_numpy(mask)
    )
    ours.backward(to_torch(g))
    assert max_abs_diff(ours, ref) < TOL
    assert max(max_abs_diff(x.grad, y.grad) for x, y in ((qt, qt2), (kt, kt2), (vt, vt2))) < TOL
    # NumPy track: forward through repeat_kv, backward summing each group (what GroupedQueryAttention does)
    out, p = tn.scaled_dot_product_attention(q, tn.repeat_kv(k, n_rep), tn.repeat_kv(v, n_rep), mask)
    dq, dk_rep, dv_rep = tn.scaled_dot_product_attention_backward(
        g, q, tn.repeat_kv(k, n_rep), tn.repeat_kv(v, n_rep), p
    )
    module = tn.GroupedQueryAttention(H * dh, H, n_kv_heads=n_kv_heads, rng=0, dtype=np.float64)
    dk, dv = (module._sum_groups(x) for x in (dk_rep, dv_rep))
    assert max_abs_diff(out, ref) < TOL
    assert max(max_abs_diff(x, y.grad) for x, y in ((dq, qt), (dk, kt), (dv, vt))) < TOL


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_gqa_with_all_heads_is_multi_head_attention(lib):
    """n_kv_heads = n_heads and no rotary: the same state_dict keys and the same function as MultiHeadAttention."""
    dt = np.float64 if lib is tn else torch.float64
    gqa = lib.GroupedQueryAttention(8, 2, rng=3, dtype=dt)
    mha = lib.MultiHeadAttention(8, 2, rng=4, dtype=dt)
    assert list(gqa.state_dict()) == list(mha.state_dict())
    mha.load_state_dict(gqa.state_dict())
    x = X if lib is tn else to_torch(X)
    mask = lib.causal_mask(5)
    assert max_abs_diff(gqa(x, mask), mha(x, x, x, mask)) < 1e-14


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("n_heads,n_kv_heads,rope", GQA_CASES)
def test_gqa_cached_steps_equal_forward_and_the_cache_holds_kv_heads(lib, n_heads, n_kv_heads, rope):
    a, b = gqa_pair(n_heads, n_kv_heads, rope)
    m = a if lib is tn else b
    x = X if lib is tn else to_torch(X)
    full = m(x, lib.causal_mask(5))
    cache, outs = {}, []
    for t0, t1 in ((0, 2), (2, 3), (3, 5)):  # a prompt of two, then one, then two positions
        mask = np.tri(t1 - t0, t1, t0, dtype=bool)[None, None]
        outs.append(m.forward_step(x[:, t0:t1], cache, mask if lib is tn else torch.from_numpy(mask)))
    stepped = np.concatenate([np.asarray(o.detach() if lib is tt else o) for o in outs], axis=1)
    assert max_abs_diff(stepped, full) < 1e-13
    assert tuple(cache["k"].shape) == tuple(cache["v"].shape) == (2, n_kv_heads, 5, 8 // n_heads)
    kv = (cache["k"], cache["v"])  # the written part of the preallocated buffers
    per_token = sum(t.nbytes if lib is tn else t.element_size() * t.nelement() for t in kv) / (2 * 5)
    assert per_token == 2 * n_kv_heads * (8 // n_heads) * 8  # keys and values, float64: the formula


def test_gqa_backward_after_forward_step_is_an_error():
    a, _ = gqa_pair()
    a.forward_step(X, {})
    with pytest.raises(RuntimeError, match="before forward"):
        a.backward(G)


# -- bad input, refused alike -----------------------------------------------------------------------------------------

BAD = {
    "rms d": (lambda lib: lib.RMSNorm(0), ValueError, "RMSNorm: d must be an int >= 1, got 0"),
    "rms eps": (lambda lib: lib.RMSNorm(4, eps=0.0), ValueError, "RMSNorm: eps must be > 0"),
    "rms eps type": (lambda lib: lib.RMSNorm(4, eps="x"), TypeError, "RMSNorm: eps expected a finite float"),
    "rope odd": (lambda lib: lib.RotaryEmbedding(5, 10), ValueError, "d_head must be even"),
    "rope base": (lambda lib: lib.RotaryEmbedding(4, 10, base=0.5), ValueError, "base must be in"),
    "swiglu": (lambda lib: lib.SwiGLUFeedForward(4, 0), ValueError, "d_ff must be an int >= 1"),
    "kv divides": (lambda lib: lib.GroupedQueryAttention(8, 4, 3), ValueError, "n_heads=4 must be divisible by n_kv"),
    "kv zero": (lambda lib: lib.GroupedQueryAttention(8, 4, 0), ValueError, "n_kv_heads must be an int >= 1"),
    "kv float": (lambda lib: lib.GroupedQueryAttention(8, 4, 2.0), TypeError, "n_kv_heads expected an int"),
    "heads": (lambda lib: lib.GroupedQueryAttention(8, 3), ValueError, "d_model=8 must be divisible by n_heads=3"),
    "rotary size": (
        lambda lib: lib.GroupedQueryAttention(8, 2, rotary=lib.RotaryEmbedding(2, 10)),
        ValueError,
        "rotary expected a RotaryEmbedding with d_head=4",
    ),
}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD)
def test_bad_arguments(lib, case):
    make, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        make(lib)


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_bad_inputs(lib):
    conv = (lambda a: a) if lib is tn else torch.from_numpy
    rope = lib.RotaryEmbedding(4, 6, dtype=np.float64 if lib is tn else torch.float64)
    with pytest.raises(ValueError, match="sequence length 5 starting at position 3 exceeds max_len 6"):
        rope(conv(np.zeros((1, 5, 4))), offset=3)
    with pytest.raises(ValueError, match="expected last dimension 4"):
        rope(conv(np.zeros((1, 5, 3))))
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        rope(conv(np.zeros((1, 5, 4))), offset=-1)
    gqa = lib.GroupedQueryAttention(8, 2, 1, dtype=np.float64 if lib is tn else torch.float64)
    with pytest.raises(ValueError, match=r"x must be \(B, T, d_model\)"):
        gqa(conv(np.zeros((1, 1, 5, 8))))
    with pytest.raises(TypeError, match="expected dtype"):
        gqa(conv(np.zeros((1, 5, 8), np.float32)))
    with pytest.raises(ValueError, match="expected last dimension 6"):
        lib.RMSNorm(6)(conv(np.zeros((1, 5, 4), np.float32)))
