"""Hostile inputs to the newer blocks (issue 32, items 4, 7, 8, 10 in part, 11), both tracks side by side: the tiled
attention's backward, the masks, RoPE, grouped-query attention, Swin's window helpers, the decoding caches, and the
norms at the float32 limits. Every case is refused with the same exception and message in both tracks, or gives the
documented result. The helpers (`TRACKS`, `T`, `f64`, `ids`) are tests/test_hostile.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_tracks import to_numpy
from test_hostile import TRACKS, T, f64, ids

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.validate import check_decode_cache


def f64dt(L):
    return np.float64 if L is tn else torch.float64


def detached(L, a):
    return a.detach() if L is tt else a


# -- flash_attention_backward: what the forward returned, or a clear error (item 4) -----------------------------------
def flash_backward(L, grad=None, out=None, lse=None, dtype=np.float64):
    """flash_attention_backward with one of its saved arguments replaced (a function of the right one)."""
    q, k, v = (f64(L, (1, 2, 4, 8), seed) for seed in (1, 2, 3))
    good_out, good_lse = (detached(L, a) for a in L.flash_attention(q, k, v))
    g = T(L, np.ones((1, 2, 4, 8)))
    return L.flash_attention_backward(
        g if grad is None else grad(L, g),
        q,
        k,
        v,
        good_out if out is None else out(L, good_out),
        good_lse if lse is None else lse(L, good_lse),
    )


def _f32(L, a):
    return a.float() if L is tt else a.astype(np.float32)


# -- the table: (the failing call, exception type, a regex the message must match), the same in both tracks -------
REFUSED = {
    # item 4: torch used to broadcast a wrong lse or out into wrong gradients; obscure errors for the rest
    "flash lse broadcast": (
        lambda L: flash_backward(L, lse=lambda L, a: a[..., :1]),
        ValueError,
        r"flash_attention_backward: lse expected shape \(1, 2, 4\) \(q's without dk\), got \(1, 2, 1\)",
    ),
    "flash out broadcast": (
        lambda L: flash_backward(L, out=lambda L, a: a[..., :1, :]),
        ValueError,
        r"flash_attention_backward: out expected shape \(1, 2, 4\) \+ \(dv,\) \(the forward's\), got \(1, 2, 1, 8\)",
    ),
    "flash out last dim": (
        lambda L: flash_backward(L, out=lambda L, a: a[..., :4]),
        ValueError,
        r"grad_out and out must have one shape \(flash_attention's output\), got grad_out \(1, 2, 4, 8\) and out "
        r"\(1, 2, 4, 4\)",
    ),
    "flash grad shape": (
        lambda L: flash_backward(L, grad=lambda L, g: g[..., :7]),
        ValueError,
        r"flash_attention_backward: grad_out and out must have one shape",
    ),
    "flash grad list": (
        lambda L: flash_backward(L, grad=lambda L, g: [[1.0]]),
        TypeError,
        r"flash_attention_backward: grad_out expected a (numpy\.ndarray|torch\.Tensor) \(what flash_attention "
        r"returned\), got list",
    ),
    "flash lse None": (
        lambda L: flash_backward(L, lse=lambda L, a: None),
        TypeError,
        r"flash_attention_backward: lse expected a (numpy\.ndarray|torch\.Tensor) .*, got NoneType",
    ),
    "flash grad float32": (
        lambda L: flash_backward(L, grad=lambda L, g: _f32(L, g)),
        TypeError,
        r"flash_attention_backward: grad_out expected dtype (torch\.)?float64 \(q's\), got (torch\.)?float32",
    ),
    "flash lse float32": (
        lambda L: flash_backward(L, lse=lambda L, a: _f32(L, a)),
        TypeError,
        r"flash_attention_backward: lse expected dtype (torch\.)?float64 \(q's\), got (torch\.)?float32",
    ),
    # item 8: a mask with fewer axes than the scores (but one) is ambiguous: (B, S) read as (Tq, S) when Tq == B
    "MHA (B, S) mask when T == B": (
        lambda L: L.MultiHeadAttention(8, 2, dtype=f64dt(L))(
            *[f64(L, (3, 3, 8))] * 3, mask=T(L, np.ones((3, 3), bool))
        ),
        ValueError,
        r"mask: shape \(3, 3\) has 2 dimensions, the attention scores \(3, 2, 3, 3\) have 4: give every axis",
    ),
    "MHA (B, T, T) mask when H == B": (
        lambda L: L.MultiHeadAttention(8, 2, dtype=f64dt(L))(
            *[f64(L, (2, 3, 8))] * 3, mask=T(L, np.ones((2, 3, 3), bool))
        ),
        ValueError,
        r"mask: shape \(2, 3, 3\) has 3 dimensions",
    ),
    "sdpa 2-D mask on 4-D scores": (
        lambda L: L.scaled_dot_product_attention(*[f64(L, (2, 1, 2, 4))] * 3, T(L, np.ones((2, 2), bool))),
        ValueError,
        r"mask: shape \(2, 2\) has 2 dimensions, the attention scores \(2, 1, 2, 2\) have 4",
    ),
    "padding_mask pad_id None": (
        lambda L: L.padding_mask(ids(L, [[1, 2]]), None),
        TypeError,
        r"padding_mask: pad_id expected an int, got NoneType None",
    ),
    "padding_mask pad_id float": (
        lambda L: L.padding_mask(ids(L, [[1, 2]]), 1.0),
        TypeError,
        r"padding_mask: pad_id expected an int, got float 1.0",
    ),
    "padding_mask pad_id negative": (
        lambda L: L.padding_mask(ids(L, [[1, 2]]), -1),
        ValueError,
        r"padding_mask: pad_id must be an int >= 0, got -1",
    ),
    "decoder_mask pad_id None": (
        lambda L: L.decoder_mask(ids(L, [[1, 2]]), None),
        TypeError,
        r"padding_mask: pad_id expected an int",
    ),
    "sdpa zero keys": (
        lambda L: L.scaled_dot_product_attention(f64(L, (2, 3)), f64(L, (0, 3)), f64(L, (0, 3))),
        ValueError,
        r"scaled_dot_product_attention: k must hold at least one key \(Tk >= 1\), got k \(0, 3\)",
    ),
    "attention_weights zero keys": (
        lambda L: L.attention_weights(f64(L, (2, 3)), f64(L, (0, 3))),
        ValueError,
        r"scaled_dot_product_attention: k must hold at least one key",
    ),
    "flash zero keys": (
        lambda L: L.flash_attention(f64(L, (2, 3)), f64(L, (0, 3)), f64(L, (0, 3))),
        ValueError,
        r"flash_attention: k must hold at least one key \(Tk >= 1\), got k \(0, 3\)",
    ),
    "MHA zero keys": (
        lambda L: L.MultiHeadAttention(8, 2, dtype=f64dt(L))(f64(L, (1, 2, 8)), f64(L, (1, 0, 8)), f64(L, (1, 0, 8))),
        ValueError,
        r"MultiHeadAttention: attention needs at least one key \(Tk >= 1\), got Tk=0",
    ),
    "MHA flash zero keys": (
        lambda L: L.MultiHeadAttention(8, 2, attn_impl="flash", dtype=f64dt(L))(
            f64(L, (1, 2, 8)), f64(L, (1, 0, 8)), f64(L, (1, 0, 8))
        ),
        ValueError,
        r"MultiHeadAttention: attention needs at least one key",
    ),
    # item 7: the modern blocks
    "apply_rope int x": (
        lambda L: L.apply_rope(ids(L, np.ones((3, 4))), *L.rope_angles(3, 4, dtype=f64dt(L))),
        TypeError,
        r"apply_rope: x: expected a float32 or float64 (array|tensor), got dtype (torch\.)?int64",
    ),
    "apply_rope table of length 1": (
        lambda L: L.apply_rope(f64(L, (3, 4)), *[t[:1] for t in L.rope_angles(3, 4, dtype=f64dt(L))]),
        ValueError,
        r"apply_rope: cos expected shape \(3, 2\) \(x's T positions, d/2 pairs\), got \(1, 2\)",
    ),
    "apply_rope sin of another length": (
        lambda L: L.apply_rope(f64(L, (3, 4)), L.rope_angles(3, 4, dtype=f64dt(L))[0], L.rope_angles(4, 4)[1]),
        TypeError,
        r"apply_rope: sin expected x's dtype (torch\.)?float64, got (torch\.)?float32",
    ),
    "apply_rope odd d": (
        lambda L: L.apply_rope(f64(L, (3, 5)), *L.rope_angles(3, 4, dtype=f64dt(L))),
        ValueError,
        r"apply_rope: x's last dimension must be even",
    ),
    "repeat_kv float": (
        lambda L: L.repeat_kv(f64(L, (1, 2, 3, 4)), 1.5),
        TypeError,
        r"repeat_kv: n_rep expected an int, got float 1.5",
    ),
    "repeat_kv zero": (
        lambda L: L.repeat_kv(f64(L, (1, 2, 3, 4)), 0),
        ValueError,
        r"repeat_kv: n_rep must be an int >= 1, got 0",
    ),
    "repeat_kv 3-D": (
        lambda L: L.repeat_kv(f64(L, (2, 3, 4)), 2),
        ValueError,
        r"repeat_kv: x expected a (numpy\.ndarray|torch\.Tensor) \(B, Hkv, T, d\), got shape \(2, 3, 4\)",
    ),
    "GQA bias str": (
        lambda L: L.GroupedQueryAttention(8, 2, bias="no"),
        TypeError,
        r"GroupedQueryAttention: bias expected True or False, got 'no'",
    ),
    "MHA bias str": (
        lambda L: L.MultiHeadAttention(8, 2, bias="no"),
        TypeError,
        r"MultiHeadAttention: bias expected True or False, got 'no'",
    ),
    "GQA negative offset": (
        lambda L: L.GroupedQueryAttention(8, 2, dtype=f64dt(L))(f64(L, (1, 3, 8)), offset=-1),
        ValueError,
        r"GroupedQueryAttention: offset must be an int >= 0, got -1",
    ),
    "GQA float offset": (
        lambda L: L.GroupedQueryAttention(8, 2, dtype=f64dt(L))(f64(L, (1, 3, 8)), offset=1.5),
        TypeError,
        r"GroupedQueryAttention: offset expected an int, got float 1.5",
    ),
    "window_reverse wrong H": (
        lambda L: L.window_reverse(f64(L, (4, 4, 3)), 2, 6, 4),
        ValueError,
        r"window_reverse: 4 windows are not a whole number of 6x4 grids of nW=6 windows each",
    ),
    "window_reverse wrong window": (
        lambda L: L.window_reverse(f64(L, (4, 9, 3)), 2, 4, 4),
        ValueError,
        r"window_reverse: windows expected shape \(B nW, 4, C\) for window_size=2, got \(4, 9, 3\)",
    ),
    "cyclic_shift float": (
        lambda L: L.cyclic_shift(f64(L, (1, 4, 4, 3)), 1.5),
        TypeError,
        r"cyclic_shift: shift expected an int, got float 1.5",
    ),
    "cyclic_shift 2-D": (
        lambda L: L.cyclic_shift(f64(L, (4, 4)), 1),
        ValueError,
        r"cyclic_shift: x expected a (numpy\.ndarray|torch\.Tensor) of 4 dimensions, got shape \(4, 4\)",
    ),
    "fill str": (
        lambda L: L.attention_weights(f64(L, (2, 3)), f64(L, (2, 3)), fill="x"),
        TypeError,
        r"attention_weights: fill expected None or a float such as -1e9 or float\('-inf'\), got str 'x'",
    ),
    "fill nan": (
        lambda L: L.scaled_dot_product_attention(*[f64(L, (2, 3))] * 3, T(L, [True, False]), fill=float("nan")),
        ValueError,
        r"scaled_dot_product_attention: fill must be a number below \+inf .*, got nan",
    ),
    "fill +inf": (
        lambda L: L.attention_weights(f64(L, (2, 3)), f64(L, (2, 3)), T(L, [True, False]), fill=float("inf")),
        ValueError,
        r"attention_weights: fill must be a number below \+inf",
    ),
    "fill bool": (
        lambda L: L.attention_weights(f64(L, (2, 3)), f64(L, (2, 3)), fill=True),
        TypeError,
        r"attention_weights: fill expected None or a float",
    ),
    # item 10: Swin on an empty batch (ViT and GPT return an empty result; Swin's blocks cannot: refused alike)
    "Swin empty batch": (
        lambda L: L.Swin(8, 2, 3, 5, 8, depths=(2,), n_heads=(2,), window_size=2, dtype=f64dt(L))(f64(L, (0, 3, 8, 8))),
        ValueError,
        r"Swin: images expected a batch of at least one \(B >= 1\), got shape \(0, 3, 8, 8\)",
    ),
    "SwinBlock empty batch": (
        lambda L: L.SwinBlock(8, 2, 16, (4, 4), 2, shift=1, dtype=f64dt(L))(f64(L, (0, 16, 8))),
        ValueError,
        r"SwinBlock: x expected a batch of at least one \(B >= 1\), got shape \(0, 16, 8\)",
    ),
}


@TRACKS
@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_a_clear_error(L, case):
    build, exc, match = REFUSED[case]
    with pytest.raises(exc, match=match):
        build(L)


# -- what stays accepted next to the refusals ----------------------------------------------------------------------
@TRACKS
def test_accepted_next_to_the_refusals(L):
    q = f64(L, (2, 2, 3, 4))
    key_mask = T(L, [True, True, False])  # (Tk,): the same keys for every row, unambiguous
    out, w = L.scaled_dot_product_attention(q, q, q, key_mask)
    assert tuple(w.shape) == (2, 2, 3, 3) and float(w[..., 2].abs().max() if L is tt else np.abs(w[..., 2]).max()) == 0
    full = T(L, np.ones((2, 1, 1, 3), bool))  # every axis given
    assert tuple(L.scaled_dot_product_attention(q, q, q, full)[0].shape) == (2, 2, 3, 4)
    assert tuple(L.flash_attention(q, q, q, key_mask)[0].shape) == (2, 2, 3, 4)
    for fill in (-1e9, -1e4, float("-inf"), np.float32(-1e4)):
        L.attention_weights(q, q, key_mask, fill=fill)
    grid = f64(L, (1, 4, 4, 3))
    back = L.cyclic_shift(L.cyclic_shift(grid, np.int64(1)), -1)  # a negative shift undoes, a NumPy int is an int
    assert np.array_equal(np.asarray(back), np.asarray(grid))
    assert tuple(L.repeat_kv(f64(L, (1, 2, 3, 4)), np.int64(2)).shape) == (1, 4, 3, 4)
    assert tuple(L.padding_mask(ids(L, [[1, 0]]), np.int64(0)).shape) == (1, 1, 1, 2)
    gqa = L.GroupedQueryAttention(8, 2, bias=np.bool_(False), dtype=f64dt(L))
    assert tuple(gqa(f64(L, (1, 3, 8)), offset=4).shape) == (1, 3, 8)  # offset without rotary: any position >= 0


# -- decoding caches from elsewhere (item 10): refused before anything is appended -----------------------------------
def _gpt(L, n_layers=2, **kw):
    return L.GPT(20, 8, 2, 16, n_layers, 16, dtype=f64dt(L), **kw).eval()


def _filled_cache(L, **kw):
    cache = {}
    _gpt(L, **kw).forward_step(ids(L, [[1, 2]]), cache)
    return cache


def _snapshot(cache):
    return cache["length"], [(to_numpy(c["k"]).copy(), to_numpy(c["v"]).copy()) for c in cache["layers"]]


CACHES = {
    "not a dict": (lambda L: None, {}, 1, TypeError, r"GPT\.forward_step: cache expected a dict \(empty at the first"),
    "other layers": (lambda L: _filled_cache(L), dict(n_layers=3), 1, ValueError,
                     r"the cache holds 2 layers for length 2, this model has 3 layers: a cache from another model"),
    "other kv heads": (lambda L: _filled_cache(L), dict(n_kv_heads=1), 1, ValueError,
                       r"layer 0 of the cache holds .*expected \(B, n_kv_heads, length, d_head\) = \(1, 1, 2, 4\)"),
    "other batch": (lambda L: _filled_cache(L), {}, 2, ValueError,
                    r"layer 0 of the cache holds .*= \(2, 2, 2, 4\): a cache from another model or batch"),
    "length float": (lambda L: {"length": 1.0}, {}, 1, TypeError, r"cache\['length'\] expected an int"),
}  # fmt: skip


@TRACKS
@pytest.mark.parametrize("case", CACHES)
def test_gpt_forward_step_refuses_a_cache_of_another_model(L, case):
    make_cache, model_kw, batch, exc, match = CACHES[case]
    cache = make_cache(L)
    before = _snapshot(cache) if isinstance(cache, dict) and "layers" in cache else None
    with pytest.raises(exc, match=match):
        _gpt(L, **model_kw).forward_step(ids(L, np.ones((batch, 1))), cache)
    if before is not None:  # nothing appended, the length unchanged
        after = _snapshot(cache)
        assert after[0] == before[0]
        assert all(
            np.array_equal(a, b) for x, y in zip(after[1], before[1], strict=True) for a, b in zip(x, y, strict=True)
        )


@TRACKS
def test_attention_forward_step_refuses_a_foreign_cache(L):
    x = f64(L, (1, 1, 8))
    with pytest.raises(TypeError, match=r"MultiHeadAttention: cache expected a dict \(empty at the first step\)"):
        L.MultiHeadAttention(8, 2, dtype=f64dt(L)).forward_step(x, x, x, None)
    cache = {}
    L.GroupedQueryAttention(8, 2, dtype=f64dt(L)).forward_step(x, cache)  # keys (1, 2, 1, 4)
    with pytest.raises(ValueError, match=r"GroupedQueryAttention: the cache holds keys of shape \(1, 2, 1, 4\), this "
                                         r"module's are \(B, 1, T, 4\): a cache from another model"):  # fmt: skip
        L.GroupedQueryAttention(8, 2, n_kv_heads=1, dtype=f64dt(L)).forward_step(x, cache)
    assert tuple(cache["k"].shape) == (1, 2, 1, 4)  # untouched


# -- the norms at the float32 limits (item 11) -----------------------------------------------------------------------
NORMS = {"RMSNorm": lambda L, dt: L.RMSNorm(4, dtype=dt), "LayerNorm": lambda L, dt: L.LayerNorm(4, dtype=dt)}
ROWS = np.array(
    [
        [0.3, -1.2, 2.0, 0.7],  # ordinary: the plain formula's numbers, bit for bit
        [1e30, -1e30, 3e30, 0.0],  # x^2 overflows float32 (it gave zeros)
        [3.4e38, -3.4e38, 1e38, 3.4e38],  # at float32's largest
        [2e19, 1e19, -3e19, 5e18],  # the squares overflow, the numbers do not
        [1e-30, -2e-30, 3e-30, 0.0],  # tiny: eps dominates (x^2 underflows; harmless)
    ]
)


def _plain(name, x, eps):
    """The textbook formula in x's dtype (what the first row must equal exactly)."""
    if name == "RMSNorm":
        return x * (1 / np.sqrt(np.square(x).mean(-1, keepdims=True) + eps))
    xc = x - x.mean(-1, keepdims=True)
    return xc * (1 / np.sqrt(np.square(xc).mean(-1, keepdims=True) + eps))


def assert_same_as_plain(L, y, plain):
    """An ordinary row: NumPy's norms run the textbook operations, so the same bits; torch's kernels (rsqrt, its
    reductions) may round the last bit otherwise on another CPU, so within a few ulps there."""
    if L is tn:
        assert np.array_equal(y, plain)
    else:
        np.testing.assert_allclose(y, plain, rtol=8 * np.finfo(y.dtype).eps, atol=0)


@TRACKS
@pytest.mark.parametrize("name", NORMS)
def test_norms_at_the_float32_limits(L, name):
    x32, x64 = ROWS.astype(np.float32), ROWS.astype(np.float64)
    ref = NORMS[name](tn, np.float64)(x64)  # float64: no overflow for these rows
    ref_dx = NORMS[name](tn, np.float64)
    ref_dx(x64)
    g = np.random.default_rng(0).standard_normal(x64.shape)
    ref_grad = ref_dx.backward(g)
    m = NORMS[name](L, np.float32 if L is tn else torch.float32)
    if L is tn:
        y = m(x32)
        dx = m.backward(g.astype(np.float32))
    else:
        xt = torch.from_numpy(x32).requires_grad_(True)
        yt = m(xt)
        yt.backward(torch.from_numpy(g.astype(np.float32)))
        y, dx = yt.detach().numpy(), xt.grad.numpy()
    assert np.isfinite(y).all() and np.isfinite(dx).all()
    assert np.abs(y - ref).max() < 1e-6, f"{name} in float32 against float64: {np.abs(y - ref).max(axis=-1)}"
    # the gradient (about 1/rms) relative to its row's size, against float64's
    scale = np.abs(ref_grad).max(axis=-1, keepdims=True)
    assert (np.abs(dx - ref_grad) / scale).max() < 1e-5
    plain = _plain(name, x32[:1], np.float32(m.eps))
    assert_same_as_plain(L, y[:1], plain)


@TRACKS
def test_decode_cache_validator_refuses_another_models_cache(L):
    """check_decode_cache with the model's sizes refuses a cache filled by a model of other layers or heads (the
    validator alone; the Transformer's door passes them: test_decode_step_refuses_another_models_cache...)."""
    kw = dict(d_model=8, d_ff=16, dropout=0.0, max_len=12)
    m = L.Transformer(11, 11, n_heads=2, n_layers=2, **kw, dtype=f64dt(L)).eval()
    memory, src_mask = m.encode(ids(L, [[3, 4]]))
    cache = {}
    m.decode_step(ids(L, [[1]]), memory, src_mask, cache)
    check_decode_cache(cache, 1, n_layers=2, heads=2, d_head=4)  # its own model's: accepted
    with pytest.raises(ValueError, match=r"the cache holds 2 layers, this model has 3: a cache from another model"):
        check_decode_cache(cache, 1, n_layers=3, heads=2, d_head=4)
    with pytest.raises(ValueError, match=r"layer 0 of the cache holds keys \(1, 2, 1, 4\), expected .*\(1, 4, 1, 2\)"):
        check_decode_cache(cache, 1, n_layers=2, heads=4, d_head=2)


@TRACKS
@pytest.mark.parametrize("name", NORMS)
def test_norms_of_an_empty_batch_and_of_non_finite_rows(L, name):
    """The overflow test of x's extremes must not trip on an empty batch (the ViT and the GPT take B = 0); a row
    holding inf or NaN gives NaN in that row only, as before."""
    m = NORMS[name](L, f64dt(L))
    assert tuple(m(f64(L, (0, 4))).shape) == (0, 4)
    x = np.array([[1.0, 2.0, 3.0, 4.0], [1e200, 1e300, -1e300, 0.0], [np.nan, 1.0, 2.0, 3.0]])
    y = np.asarray(detached(L, m(T(L, x))))
    big = x[1:2] / 1e300  # the row scaled by hand: eps / 1e600 is nothing against its statistics
    assert np.abs(y[1:2] - _plain(name, big, 0.0)).max() < 1e-14  # was zeros (x^2 = inf in float64 too)
    assert_same_as_plain(L, y[:1], _plain(name, x[:1], m.eps))
    assert np.isnan(y[2]).all()


@TRACKS
def test_decode_step_refuses_another_models_cache_before_appending(L):
    """Transformer.decode_step's door passes its layers, heads and d_head to check_decode_cache: a cache filled by a
    model of three layers, or of four heads, is refused by name and left as it was (it used to fail inside the
    step with "zip() argument 2 is shorter", after the step had appended to it)."""
    kw = dict(d_model=8, d_ff=16, dropout=0.0, max_len=12)
    src = ids(L, [[3, 4]])
    for other in (dict(n_heads=2, n_layers=3), dict(n_heads=4, n_layers=2)):
        donor = L.Transformer(11, 11, **other, **kw, rng=1, dtype=f64dt(L)).eval()
        cache = {}
        donor.decode_step(ids(L, [[1]]), *donor.encode(src), cache)
        keys = set(cache)
        m = L.Transformer(11, 11, n_heads=2, n_layers=2, **kw, dtype=f64dt(L)).eval()
        with pytest.raises(ValueError, match=r"Transformer.decode_step: .*a cache from another model"):
            m.decode_step(ids(L, [[2]]), *m.encode(src), cache)
        assert set(cache) == keys and cache["length"] == 1


@TRACKS
@pytest.mark.parametrize("flag", ["no", 0, None])
def test_generate_refuses_a_use_cache_that_is_not_a_flag(L, flag):
    """use_cache="no" used to run with the cache (a non-empty string is true); one rule for every flag."""
    m = L.GPT(vocab_size=11, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=12, rng=0, dtype=f64dt(L))
    with pytest.raises(TypeError, match=r"GPT.generate: use_cache expected True or False, got"):
        m.generate(ids(L, [[1, 2]]), 2, use_cache=flag)
