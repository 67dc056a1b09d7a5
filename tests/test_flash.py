"""FlashAttention by hand: the tiled forward and backward of both tracks against the explicit attention (float64,
1e-12), central differences, torch.autograd.gradcheck, F.scaled_dot_product_attention, tile skipping, bad input."""

import contextlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_tracks import max_abs_diff, to_numpy, to_torch

import tfm_numpy as tn
import tfm_numpy.attention as tn_attention
import tfm_torch as tt
import tfm_torch.attention as tt_attention
from tfm_common.npz_checkpoint import META_KEY

EXACT = 1e-12  # float64: tiled vs explicit, same arithmetic in another order
B, H, T, S, D = 2, 3, 11, 7, 4


def qkv(seed=0, tq=T, tk=T, dtype=np.float64):
    g = np.random.default_rng(seed)
    q = g.standard_normal((B, H, tq, D)).astype(dtype)
    k = g.standard_normal((B, H, tk, D)).astype(dtype)
    v = g.standard_normal((B, H, tk, D + 1)).astype(dtype)  # dv != dk on purpose
    return q, k, v


def left_padded_causal():
    """(B, 1, T, T): causal and padding, the second row left-padded, so its first query rows see nothing."""
    tokens = np.ones((B, T), dtype=np.int64)
    tokens[1, :3] = 0
    return tn.padding_mask(tokens, 0) & tn.causal_mask(T)


MASKS = {
    "none": lambda: None,
    "causal": lambda: tn.causal_mask(T),
    "padding": lambda: np.arange(T)[None, None, None, :] < np.array([T, 6])[:, None, None, None],
    "left-padded causal": left_padded_causal,
}
BLOCKS = [1, 3, 4, 11, 64]  # 3 and 4 leave a shorter last tile; 64 > T: one tile


def logsumexp(q, k, mask):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(axis=-1, keepdims=True)))[..., 0]
    return np.where(np.isfinite(m[..., 0]), out, -np.inf)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_numpy_forward_and_backward_equal_explicit(mask_name, block):
    q, k, v = qkv()
    mask = MASKS[mask_name]()
    out, lse = tn.flash_attention(q, k, v, mask, tile_size=block)
    ref, w = tn.scaled_dot_product_attention(q, k, v, mask)
    assert np.abs(out - ref).max() < EXACT
    assert np.array_equal(np.isinf(lse), np.isinf(logsumexp(q, k, mask)))
    fin = np.isfinite(lse)
    assert np.abs(lse[fin] - logsumexp(q, k, mask)[fin]).max() < EXACT
    g = np.random.default_rng(1).standard_normal(out.shape)
    grads = tn.flash_attention_backward(g, q, k, v, out, lse, mask, tile_size=block)
    refs = tn.scaled_dot_product_attention_backward(g, q, k, v, w)
    for a, b in zip(grads, refs, strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() < EXACT


def test_fully_masked_rows_give_zero_output_zero_gradients_and_lse_minus_inf():
    q, k, v = qkv()
    mask = left_padded_causal()
    out, lse = tn.flash_attention(q, k, v, mask, tile_size=4)
    assert np.all(out[1, :, :3] == 0) and np.all(lse[1, :, :3] == -np.inf)
    assert np.all(np.isfinite(lse[0])) and np.all(np.isfinite(out))
    dq, dk, dv = tn.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, mask, tile_size=4)
    assert np.all(dq[1, :, :3] == 0) and np.all(dk[1, :, :3] == 0) and np.all(dv[1, :, :3] == 0)


def test_cross_attention_shapes_and_broadcast_masks():
    """Tq != Tk, a padding mask of fewer dimensions than the scores, leading dimensions other than (B, H)."""
    q, k, v = qkv(tq=T, tk=S)
    mask = np.array([True] * 5 + [False] * 2)  # (Tk,): broadcasts to every row
    out, _ = tn.flash_attention(q, k, v, mask, tile_size=3)
    assert np.abs(out - tn.scaled_dot_product_attention(q, k, v, mask)[0]).max() < EXACT
    out2, _ = tn.flash_attention(q[0, 0], k[0, 0], v[0, 0], tile_size=2)  # (T, D): no leading dimensions
    assert np.abs(out2 - tn.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0])[0]).max() < EXACT


@pytest.mark.parametrize("mask_name", ["none", "left-padded causal"])
def test_numpy_backward_gradient_check(mask_name):
    """Central differences of L = sum(w * out) against the tiled backward (relative error < 1e-7)."""
    q, k, v = qkv(seed=2, tq=5, tk=5)
    mask = None if mask_name == "none" else left_padded_causal()[..., :5, :5]
    w = np.random.default_rng(3).standard_normal((B, H, 5, D + 1))

    def loss():
        return float((w * tn.flash_attention(q, k, v, mask, tile_size=2)[0]).sum())

    out, lse = tn.flash_attention(q, k, v, mask, tile_size=2)
    grads = tn.flash_attention_backward(w, q, k, v, out, lse, mask, tile_size=2)
    for x, g in zip((q, k, v), grads, strict=True):
        assert tn.rel_error(g, tn.numeric_grad(lambda _: loss(), x)) < 1e-7


def test_causal_tiles_above_the_diagonal_are_skipped():
    """With T = 4 blocks, a causal mask leaves 4 * 5 / 2 = 10 tiles of the 16; K and V are read only there."""
    q, k, v = qkv(tq=8, tk=8)
    stats = tn.flash_attention_counts(q, k, v, tn.causal_mask(8), tile_size=2)
    assert stats["tiles"] == 10 and stats["tiles_skipped"] == 6
    assert stats["q"] == q.size and stats["o"] == B * H * 8 * (D + 1)
    assert stats["k"] == B * H * 2 * D * 10  # every computed tile reads one block of keys
    full = tn.flash_attention_counts(q, k, v, tile_size=2)
    assert full["tiles"] == 16 and full["k"] == 4 * k.size  # Tq / Br = 4 passes over K


def test_float32_stays_float32():
    q, k, v = qkv(dtype=np.float32)
    out, lse = tn.flash_attention(q, k, v, tn.causal_mask(T), tile_size=4)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    grads = tn.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, tn.causal_mask(T), tile_size=4)
    assert all(g.dtype == np.float32 for g in grads)
    ref = tn.scaled_dot_product_attention(q, k, v, tn.causal_mask(T))[0]
    assert np.abs(out - ref).max() < 1e-5


# -- torch ---------------------------------------------------------------------------------------------------


def torch_mask(mask):
    return None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))


@pytest.mark.parametrize("block", [3, 64])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_torch_equals_numpy_and_explicit(mask_name, block):
    q, k, v = qkv(seed=4)
    mask = MASKS[mask_name]()
    out, lse = tn.flash_attention(q, k, v, mask, tile_size=block)
    g = np.random.default_rng(5).standard_normal(out.shape)
    grads = tn.flash_attention_backward(g, q, k, v, out, lse, mask, tile_size=block)
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    t_out, t_lse = tt.flash_attention(tq, tk, tv, torch_mask(mask), tile_size=block)
    t_out.backward(to_torch(g))
    assert max_abs_diff(t_out, out) < EXACT
    assert np.array_equal(to_numpy(t_lse) == -np.inf, lse == -np.inf)
    assert max_abs_diff(np.nan_to_num(to_numpy(t_lse), neginf=0), np.nan_to_num(lse, neginf=0)) < EXACT
    for a, b in zip((tq.grad, tk.grad, tv.grad), grads, strict=True):
        assert max_abs_diff(a, b) < EXACT
    eq, ek, ev = (to_torch(x, requires_grad=True) for x in (q, k, v))  # the explicit torch attention
    ref = tt.scaled_dot_product_attention(eq, ek, ev, torch_mask(mask))[0]
    ref.backward(to_torch(g))
    assert max_abs_diff(ref, t_out) < EXACT
    for a, b in zip((eq.grad, ek.grad, ev.grad), (tq.grad, tk.grad, tv.grad), strict=True):
        assert max_abs_diff(a, b) < EXACT


@pytest.mark.parametrize("mask_name", ["none", "causal", "padding"])
def test_torch_equals_scaled_dot_product_attention(mask_name):
    """torch's own fused attention (rows with at least one key: torch gives NaN for an all-masked row)."""
    q, k, v = qkv(seed=6)
    mask = MASKS[mask_name]()
    tq, tk, tv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    out = tt.flash_attention(tq, tk, tv, torch_mask(mask), tile_size=4)[0]
    rq, rk, rv = (to_torch(x, requires_grad=True) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(rq, rk, rv, attn_mask=torch_mask(mask))
    g = to_torch(np.random.default_rng(7).standard_normal(out.shape))
    out.backward(g)
    ref.backward(g)
    assert max_abs_diff(out, ref) < EXACT
    for a, b in zip((tq.grad, tk.grad, tv.grad), (rq.grad, rk.grad, rv.grad), strict=True):
        assert max_abs_diff(a, b) < EXACT


def test_torch_autograd_gradcheck():
    q, k, v = (to_torch(x[:, :, :5], requires_grad=True) for x in qkv(seed=8))
    mask = torch_mask(left_padded_causal()[..., :5, :5])
    flash = lambda a, b, c: tt.flash_attention(a, b, c, mask, tile_size=2)[0]  # noqa: E731
    # float64 central differences: the book's 1e-7, not gradcheck's default atol 1e-5 / rtol 1e-3
    assert torch.autograd.gradcheck(flash, (q, k, v), atol=1e-8, rtol=1e-7)


# -- bad input, the same in both tracks ------------------------------------------------------------------------


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_bad_input_is_a_clear_error(track):
    lib, A = (tn, np.asarray) if track == "numpy" else (tt, lambda a: torch.from_numpy(np.asarray(a)))
    q, k, v = (A(x) for x in qkv())
    with pytest.raises(ValueError, match=r"flash_attention: tile_size must be an int >= 1, got 0"):
        lib.flash_attention(q, k, v, tile_size=0)
    with pytest.raises(TypeError, match=r"flash_attention: tile_size expected an int, got float"):
        lib.flash_attention(q, k, v, tile_size=2.0)
    with pytest.raises(TypeError, match=r"mask: expected a boolean"):
        lib.flash_attention(q, k, v, A(np.ones((1, 1, T, T))))
    with pytest.raises(ValueError, match=r"mask: shape \(1, 1, 3, 3\) does not broadcast"):
        lib.flash_attention(q, k, v, A(np.ones((1, 1, 3, 3), dtype=bool)))
    with pytest.raises(ValueError, match=r"q and k must have the same last dimension"):
        lib.flash_attention(q, k[..., :2], v)


# -- the model option: MultiHeadAttention(attn_impl="flash") and Transformer(attn_impl="flash") ---------------


def tiny_model(track, attn_impl, seed=0, norm_first=False):
    kw = dict(d_model=16, n_heads=2, d_ff=24, n_layers=2, dropout=0.0, max_len=16, norm_first=norm_first)
    m = tn.Transformer(13, 11, **kw, attn_impl=attn_impl, tile_size=3, rng=seed, dtype=np.float64)
    if track == "numpy":
        return m
    twin = tt.Transformer(13, 11, **kw, attn_impl=attn_impl, tile_size=3, rng=seed, dtype=torch.float64)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    return twin


SRC_TOKENS = np.array([[3, 7, 1, 9, 5, 4, 8], [2, 10, 4, 6, 0, 0, 0]])
TGT_TOKENS = np.array([[1, 4, 8, 3, 6, 5, 7, 9], [0, 0, 1, 6, 3, 2, 9, 4]])  # the second left-padded: empty rows


@contextlib.contextmanager
def counting_tiled_calls():
    """Counts the calls of both tracks' tiled kernel by the attention modules: the flash path ran, not an explicit
    one that happens to give the same numbers."""
    saved = tn_attention.flash_attention, tt_attention.flash_attention
    calls = []

    def counted(kernel):
        def wrapped(*args, **kwargs):
            calls.append(1)
            return kernel(*args, **kwargs)

        return wrapped

    tn_attention.flash_attention, tt_attention.flash_attention = (counted(k) for k in saved)
    try:
        yield calls
    finally:
        tn_attention.flash_attention, tt_attention.flash_attention = saved


def model_grads(track, attn_impl, norm_first):
    m = tiny_model(track, attn_impl, norm_first=norm_first)
    dlogits = np.random.default_rng(9).standard_normal((2, 8, 11))
    with counting_tiled_calls() as calls:
        if track == "numpy":
            logits = m(SRC_TOKENS, TGT_TOKENS)
            m.zero_grad()
            m.backward(dlogits)
            grads = m.grads()
        else:
            logits = m(torch.from_numpy(SRC_TOKENS), torch.from_numpy(TGT_TOKENS))
            logits.backward(torch.from_numpy(dlogits))
            logits, grads = to_numpy(logits), {k: to_numpy(p.grad) for k, p in m.named_parameters()}
    assert (len(calls) > 0) == (attn_impl == "flash"), f"{len(calls)} tiled calls with attn_impl={attn_impl!r}"
    return logits, grads


@pytest.mark.parametrize("norm_first", [False, True], ids=["postLN", "preLN"])
@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_transformer_with_flash_attention_has_the_same_logits_and_gradients(track, norm_first):
    """The whole model, every parameter's gradient: tiled attention equals the explicit one (float64, 1e-12)."""
    ref_logits, ref_grads = model_grads(track, "explicit", norm_first)
    logits, grads = model_grads(track, "flash", norm_first)
    assert max_abs_diff(logits, ref_logits) < EXACT
    assert grads.keys() == ref_grads.keys()
    worst = max(np.abs(grads[k] - ref_grads[k]).max() for k in grads)
    assert worst < EXACT, worst


def test_flash_model_tracks_agree_and_the_option_is_switchable():
    np_logits, np_grads = model_grads("numpy", "flash", False)
    t_logits, t_grads = model_grads("torch", "flash", False)
    assert max_abs_diff(np_logits, t_logits) < EXACT
    assert max(np.abs(np_grads[k] - t_grads[k]).max() for k in t_grads) < EXACT
    m = tiny_model("numpy", "explicit")
    assert tn.use_attention(m, "flash", 5) is m
    mhas = [mod for _, mod in m.named_modules() if isinstance(mod, tn.MultiHeadAttention)]
    assert len(mhas) == 6 and all(a.attn_impl == "flash" and a.tile_size == 5 for a in mhas)
    m(SRC_TOKENS, TGT_TOKENS)
    assert all(a.attn_weights is None for a in mhas)  # no weights formed


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_flash_refuses_attention_dropout_in_training_and_bad_options(track):
    lib, A = (tn, np.asarray) if track == "numpy" else (tt, torch.from_numpy)
    mha = lib.MultiHeadAttention(8, 2, dropout=0.1, attn_impl="flash", rng=0)
    x = A(np.zeros((1, 3, 8), dtype=np.float32))
    with pytest.raises(ValueError, match=r"attn_impl='flash' has no dropout on the attention weights"):
        mha(x, x, x)
    mha.eval()
    assert tuple(mha(x, x, x).shape) == (1, 3, 8)  # eval: dropout off, fine
    with pytest.raises(ValueError, match=r"MultiHeadAttention: attn_impl must be one of \('explicit', 'flash'[,)]"):
        lib.MultiHeadAttention(8, 2, attn_impl="tiled")
    with pytest.raises(ValueError, match=r"Transformer: tile_size must be an int >= 1, got 0"):
        lib.Transformer(5, 5, d_model=8, n_heads=2, d_ff=8, n_layers=1, tile_size=0)
    with pytest.raises(ValueError, match=r"use_attention: attn_impl must be one of"):
        lib.use_attention(mha, "fast")


def test_a_checkpoint_does_not_record_attn_impl(tmp_path):
    """attn_impl is how the heads are computed, not what the model is: `config` leaves it out, so a checkpoint of a
    flash model rebuilds (load_model) as an explicit one with the same weights and logits, and no file has ever
    carried the option under either name. A configuration edited by hand to hold the old keyword `attention` is
    refused by name, not silently dropped."""
    m = tiny_model("numpy", "flash")
    assert "attn_impl" not in m.config and "attention" not in m.config
    path = tn.save_checkpoint(tmp_path / "flash.npz", m)
    ref = m(SRC_TOKENS, TGT_TOKENS)
    for lib, as_input in ((tn, np.asarray), (tt, torch.from_numpy)):
        back = lib.load_model(path).eval()
        assert back.config == m.config
        assert {a.attn_impl for _, a in back.named_modules() if isinstance(a, lib.MultiHeadAttention)} == {"explicit"}
        assert max_abs_diff(to_numpy(back(as_input(SRC_TOKENS), as_input(TGT_TOKENS))), ref) < EXACT
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META_KEY][()]))
    meta["model"]["config"]["attention"] = "flash"
    arrays[META_KEY] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    for lib in (tn, tt):
        with pytest.raises(ValueError, match=r"cannot build Transformer .* unexpected keyword argument 'attention'"):
            lib.load_model(path)
