"""Scaled dot-product attention, masks and multi-head attention in both tracks.

Gradient checks (float64 central differences), the two tracks against each other, against
`torch.nn.MultiheadAttention` and `torch.nn.functional.scaled_dot_product_attention`, known values, bad input.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tfm_numpy as tn
import tfm_torch as tt

GRAD_TOL = 1e-7  # relative error of analytic vs central-difference gradients (float64)
TRACK_TOL = 1e-10  # max abs difference between implementations (float64)


# -- helpers -------------------------------------------------------------------------------------------------


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / (||a|| + ||b||): scale-free, and 0 when both are 0."""
    denom = np.linalg.norm(a) + np.linalg.norm(b)
    return 0.0 if denom == 0 else float(np.linalg.norm(a - b) / denom)


def numeric_grad(loss, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar `loss()` with respect to the array `x`, perturbed in place."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = loss()
        x[i] = old - eps
        down = loss()
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


def t(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(a, requires_grad=grad)


def masks_for(name: str, B: int, Tq: int, Tk: int, rng) -> np.ndarray | None:
    """Masks of the kinds the book uses, each with at least one allowed key per row."""
    if name == "none":
        return None
    lengths = rng.integers(1, Tk + 1, size=B)
    lengths[0] = Tk - 1 if Tk > 1 else Tk  # at least one sequence really padded
    pad = (np.arange(Tk)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Tk)
    causal = np.tril(np.ones((Tq, Tk), dtype=bool))[None, None]  # (1, 1, Tq, Tk)
    return {"padding": pad, "causal": causal, "combined": pad & causal}[name]


# -- scaled dot-product attention: gradient checks --------------------------------------------------------------

SDPA_CASES = {
    "no mask": ((2, 3), 4, 6, "none"),
    "padding": ((2, 3), 5, 5, "padding"),
    "causal": ((2, 3), 5, 5, "causal"),
    "combined": ((2, 3), 5, 5, "combined"),
    "Tq != Tk, padding": ((2, 2), 3, 7, "padding"),
    "Tq != Tk, causal": ((2, 2), 6, 4, "causal"),
    "batch 1, one head": ((1, 1), 4, 4, "combined"),
    "3-D (no head axis)": ((2,), 4, 5, "none"),
}


@pytest.mark.parametrize("case", SDPA_CASES, ids=list(SDPA_CASES))
def test_sdpa_gradcheck(case):
    lead, Tq, Tk, mask_kind = SDPA_CASES[case]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((*lead, Tq, 4))
    k = rng.standard_normal((*lead, Tk, 4))
    v = rng.standard_normal((*lead, Tk, 3))
    mask = masks_for(mask_kind, lead[0], Tq, Tk, rng)
    if mask is not None and len(lead) == 1:
        mask = mask[:, 0]
    G = rng.standard_normal((*lead, Tq, 3))  # loss = sum(out * G), so dL/dout = G

    def loss():
        return float((tn.scaled_dot_product_attention(q, k, v, mask)[0] * G).sum())

    out, w = tn.scaled_dot_product_attention(q, k, v, mask)
    grads = tn.scaled_dot_product_attention_backward(G, q, k, v, w)
    for name, x, g in zip("qkv", (q, k, v), grads, strict=True):
        assert g.shape == x.shape
        assert rel_err(g, numeric_grad(loss, x)) < GRAD_TOL, name
    if mask is not None:
        assert np.all(w[~np.broadcast_to(mask, w.shape)] == 0)  # masked keys get exactly zero weight
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-12)


def left_padded_decoder_mask() -> np.ndarray:
    """Sequence 0 starts with two pads: under a causal mask its first two queries have nothing to attend to."""
    tokens = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    return tn.decoder_mask(tokens, pad_id=0)  # (2, 1, 5, 5)


def test_sdpa_fully_masked_row_is_zero_with_zero_gradients():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    mask = left_padded_decoder_mask()
    out, w = tn.scaled_dot_product_attention(q, k, v, mask)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w))
    assert np.all(out[0, :, :2] == 0) and np.all(w[0, :, :2] == 0)
    np.testing.assert_allclose(w[0, :, 2:].sum(-1), 1.0, atol=1e-12)
    G = rng.standard_normal(out.shape)
    dq, dk, dv = tn.scaled_dot_product_attention_backward(G, q, k, v, w)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    assert np.all(dq[0, :, :2] == 0)  # the empty rows pass no gradient to their queries
    assert np.all(dk[0, :, :2] == 0) and np.all(dv[0, :, :2] == 0)  # nor to the padded keys

    def loss():
        return float((tn.scaled_dot_product_attention(q, k, v, mask)[0] * G).sum())

    for x, g in zip((q, k, v), (dq, dk, dv), strict=True):
        assert rel_err(g, numeric_grad(loss, x)) < GRAD_TOL


def test_sdpa_fill_variants_on_a_fully_masked_row():
    """-1e9 and -1e4 make an empty row attend uniformly to everything (padding included); -inf makes NaN."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 4, 3)) for _ in range(3))
    mask = np.array([[False, False, False, False], [True, False, False, False], [True, True, False, False],
                     [True, True, True, True]])[None, None]  # fmt: skip
    safe, w_safe = tn.scaled_dot_product_attention(q, k, v, mask)
    assert np.all(safe[0, 0, 0] == 0)
    for fill in (-1e9, -1e4):
        out, w = tn.scaled_dot_product_attention(q, k, v, mask, fill=fill)
        np.testing.assert_allclose(w[0, 0, 0], 0.25, atol=1e-15)  # uniform over all four keys
        np.testing.assert_allclose(out[0, 0, 0], v[0, 0].mean(0), atol=1e-12)
        np.testing.assert_allclose(out[0, 0, 1:], safe[0, 0, 1:], atol=1e-12)  # other rows agree
        # backward after a fill: the masked scores were constants, so their gradient is zero
        dq, dk, dv = tn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, w, mask)
        assert np.all(dq[0, 0, 0] == 0)
    out, w = tn.scaled_dot_product_attention(q, k, v, mask, fill=-np.inf)  # no RuntimeWarning escapes
    assert np.all(np.isnan(out[0, 0, 0])) and np.all(np.isnan(w[0, 0, 0]))
    np.testing.assert_allclose(out[0, 0, 1:], safe[0, 0, 1:], atol=1e-12)

    out_t, w_t = tt.scaled_dot_product_attention(t(q), t(k), t(v), torch.from_numpy(mask), fill=-1e9)
    np.testing.assert_allclose(w_t[0, 0, 0].numpy(), 0.25, atol=1e-15)
    out_t, _ = tt.scaled_dot_product_attention(t(q), t(k), t(v), torch.from_numpy(mask), fill=float("-inf"))
    assert torch.isnan(out_t[0, 0, 0]).all()


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_causal_mask_with_equal_scores_gives_running_means(lib):
    conv = (lambda a: a) if lib is tn else torch.from_numpy
    q = conv(np.zeros((1, 1, 5, 3)))  # all scores 0: each row averages the values it may see
    v = conv(np.arange(1.0, 6.0)[:, None][None, None])  # (1, 1, 5, 1): values 1..5
    out, _ = lib.scaled_dot_product_attention(q, q, v, lib.causal_mask(5))
    np.testing.assert_allclose(np.asarray(out).ravel(), [1, 1.5, 2, 2.5, 3], atol=1e-15)


# -- scaled dot-product attention: agreement --------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "combined", "empty rows"])
def test_sdpa_numpy_vs_torch_twin_and_functional(mask_kind):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    mask = left_padded_decoder_mask() if mask_kind == "empty rows" else masks_for(mask_kind, 2, 5, 5, rng)
    G = rng.standard_normal((2, 3, 5, 4))
    out, w = tn.scaled_dot_product_attention(q, k, v, mask)
    grads = tn.scaled_dot_product_attention_backward(G, q, k, v, w)
    m_t = None if mask is None else torch.from_numpy(mask)
    for name, fn in (("twin", lambda *a: tt.scaled_dot_product_attention(*a, m_t)[0]),
                     ("F.sdpa", lambda *a: F.scaled_dot_product_attention(*a, attn_mask=m_t))):  # fmt: skip
        qt, kt, vt = t(q, True), t(k, True), t(v, True)
        out_t = fn(qt, kt, vt)
        (out_t * t(G)).sum().backward()
        assert np.abs(out - out_t.detach().numpy()).max() < TRACK_TOL, name
        for g, xt in zip(grads, (qt, kt, vt), strict=True):
            assert np.abs(g - xt.grad.numpy()).max() < TRACK_TOL, name
    _, w_t = tt.scaled_dot_product_attention(t(q), t(k), t(v), m_t)
    assert np.abs(w - w_t.numpy()).max() < TRACK_TOL


def test_sdpa_float32_stays_float32():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 2, 4, 8)).astype(np.float32) for _ in range(3))
    out, w = tn.scaled_dot_product_attention(q, k, v, tn.causal_mask(4))
    assert out.dtype == w.dtype == np.float32
    grads = tn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, w)
    assert all(g.dtype == np.float32 for g in grads)
    out_t, w_t = tt.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), tt.causal_mask(4))
    assert out_t.dtype == w_t.dtype == torch.float32
    np.testing.assert_allclose(out, out_t.numpy(), atol=1e-5)


# -- masks ---------------------------------------------------------------------------------------------------


def test_masks_numpy_and_torch():
    tokens = np.array([[5, 6, 7, 0], [8, 0, 0, 0]])
    pad = tn.padding_mask(tokens, pad_id=0)
    assert pad.shape == (2, 1, 1, 4) and pad.dtype == np.bool_
    np.testing.assert_array_equal(pad[:, 0, 0], [[1, 1, 1, 0], [1, 0, 0, 0]])
    causal = tn.causal_mask(4)
    assert causal.shape == (1, 1, 4, 4) and causal.dtype == np.bool_
    np.testing.assert_array_equal(causal[0, 0], np.tril(np.ones((4, 4))))
    assert not causal[0, 0, 0, 1] and causal[0, 0, 1, 0]  # query 0 may not see key 1; query 1 may see key 0
    dec = tn.decoder_mask(tokens, pad_id=0)
    assert dec.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(dec, pad & causal)
    np.testing.assert_array_equal(dec[1, 0, 3], [1, 0, 0, 0])

    tok_t = torch.from_numpy(tokens)
    for ours, theirs in (
        (pad, tt.padding_mask(tok_t, 0)),
        (causal, tt.causal_mask(4)),
        (dec, tt.decoder_mask(tok_t, 0)),
    ):
        assert theirs.dtype == torch.bool
        np.testing.assert_array_equal(ours, theirs.numpy())


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_mask_builders_reject_bad_input(lib):
    conv = np.asarray if lib is tn else torch.as_tensor
    with pytest.raises(ValueError, match="integer"):
        lib.padding_mask(conv([[1.0, 0.0]]), 0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        lib.padding_mask(conv([1, 0]), 0)
    with pytest.raises(ValueError, match="T must be positive"):
        lib.causal_mask(0)


# -- multi-head attention ------------------------------------------------------------------------------------

D, H = 8, 2


def mha_inputs(kind: str, B: int, Tq: int, Tk: int, rng):
    """(query, key, value, mask) for self- or cross-attention; self-attention shares one array."""
    if kind.startswith("self"):
        x = rng.standard_normal((B, Tq, D))
        tokens = np.where(np.arange(Tq)[None] < Tq - np.arange(B)[:, None], 1, 0)  # sequence b has b pads
        mask = {"self": None, "self causal": tn.causal_mask(Tq), "self decoder": tn.decoder_mask(tokens, 0)}[kind]
        return x, x, x, mask
    xq, mem = rng.standard_normal((B, Tq, D)), rng.standard_normal((B, Tk, D))
    tokens = np.where(np.arange(Tk)[None] < Tk - np.arange(B)[:, None], 1, 0)
    return xq, mem, mem, (tn.padding_mask(tokens, 0) if kind == "cross padding" else None)


MHA_CASES = {
    "self": ("self", 2, 4, 4, H),
    "self causal": ("self causal", 2, 4, 4, H),
    "self decoder": ("self decoder", 2, 5, 5, H),
    "cross": ("cross", 2, 3, 5, H),
    "cross padding": ("cross padding", 2, 3, 5, H),
    "batch 1, one head": ("self decoder", 1, 4, 4, 1),
}


@pytest.mark.parametrize("case", MHA_CASES, ids=list(MHA_CASES))
def test_mha_gradcheck(case):
    kind, B, Tq, Tk, n_heads = MHA_CASES[case]
    rng = np.random.default_rng(6)
    mha = tn.MultiHeadAttention(D, n_heads, rng=7, dtype=np.float64)
    query, key, value, mask = mha_inputs(kind, B, Tq, Tk, rng)
    G = rng.standard_normal((B, Tq, D))

    def loss():
        return float((mha(query, key, value, mask) * G).sum())

    out = mha(query, key, value, mask)
    assert out.shape == (B, Tq, D) and mha.attn_weights.shape == (B, n_heads, Tq, Tk)
    mha.zero_grad()
    d_query, d_key, d_value = mha.backward(G)
    if kind.startswith("self"):  # one array fed all three inputs: its gradient is the sum
        assert rel_err(d_query + d_key + d_value, numeric_grad(loss, query)) < GRAD_TOL
    else:
        assert rel_err(d_query, numeric_grad(loss, query)) < GRAD_TOL
        assert rel_err(d_key + d_value, numeric_grad(loss, key)) < GRAD_TOL
    for name, p in mha.named_parameters():
        numeric = numeric_grad(loss, p.data)
        if name == "k_proj.bias":  # q.(k + b) = q.k + q.b shifts a whole row of scores: softmax ignores it
            assert np.abs(p.grad).max() < 1e-14 and np.abs(numeric).max() < 1e-8
        else:
            assert rel_err(p.grad, numeric) < GRAD_TOL, name


def test_mha_gradcheck_with_dropout_in_training():
    """The same dropout mask in every forward (the generator reset), so the loss is a fixed function."""
    rng = np.random.default_rng(8)
    mha = tn.MultiHeadAttention(D, H, dropout=0.3, rng=9, dtype=np.float64)
    x, _, _, mask = mha_inputs("self decoder", 2, 4, 4, rng)
    G = rng.standard_normal((2, 4, D))

    def run():
        mha.dropout.rng = np.random.default_rng(10)
        return mha(x, x, x, mask)

    def loss():
        return float((run() * G).sum())

    out = run()
    dropped = mha.dropout.mask
    assert dropped is not None and not dropped.all()  # some attention weights really were dropped
    mha.zero_grad()
    dx = sum(mha.backward(G))
    assert rel_err(dx, numeric_grad(loss, x)) < GRAD_TOL
    assert rel_err(mha.q_proj.weight.grad, numeric_grad(loss, mha.q_proj.weight.data)) < GRAD_TOL
    mha.eval()  # dropout off: a different, deterministic output
    assert np.abs(mha(x, x, x, mask) - out).max() > 1e-3
    np.testing.assert_array_equal(mha(x, x, x, mask), mha(x, x, x, mask))


def test_mha_fully_masked_rows_give_zero_context_and_finite_gradients():
    rng = np.random.default_rng(11)
    mha = tn.MultiHeadAttention(D, H, rng=12, dtype=np.float64)
    x = rng.standard_normal((2, 5, D))
    mask = left_padded_decoder_mask()
    out = mha(x, x, x, mask)
    assert np.all(mha.attn_weights[0, :, :2] == 0)
    np.testing.assert_allclose(out[0, :2], np.broadcast_to(mha.out_proj.bias.data, (2, D)), atol=1e-15)
    mha.zero_grad()
    grads = mha.backward(np.ones_like(out))
    assert all(np.all(np.isfinite(g)) for g in (*grads, *mha.grads().values()))


def torch_mha_run(tm, query, key, value, mask, G):
    """Run a torch module on copies of the numpy inputs; returns (out, input grads summed per distinct array)."""
    arrays = {id(a): t(a, True) for a in (query, key, value)}  # shared numpy arrays -> one shared leaf
    out = tm(arrays[id(query)], arrays[id(key)], arrays[id(value)], mask)
    (out * t(G)).sum().backward()
    return out.detach().numpy(), [a.grad.numpy() for a in arrays.values()]


def numpy_grads_per_array(query, key, value, grads):
    summed: dict[int, np.ndarray] = {}
    for a, g in zip((query, key, value), grads, strict=True):
        summed[id(a)] = summed.get(id(a), 0) + g
    return list(summed.values())


@pytest.mark.parametrize("case", MHA_CASES, ids=list(MHA_CASES))
@pytest.mark.parametrize("bias", [True, False])
def test_mha_numpy_vs_torch_twin(case, bias):
    kind, B, Tq, Tk, n_heads = MHA_CASES[case]
    rng = np.random.default_rng(13)
    mha = tn.MultiHeadAttention(D, n_heads, bias=bias, rng=14, dtype=np.float64)
    twin = tt.MultiHeadAttention(D, n_heads, bias=bias, rng=15, dtype=torch.float64)
    assert list(twin.state_dict()) == list(mha.state_dict())
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in mha.state_dict().items()})
    query, key, value, mask = mha_inputs(kind, B, Tq, Tk, rng)
    G = rng.standard_normal((B, Tq, D))

    out = mha(query, key, value, mask)
    mha.zero_grad()
    grads = numpy_grads_per_array(query, key, value, mha.backward(G))
    out_t, grads_t = torch_mha_run(twin, query, key, value, None if mask is None else torch.from_numpy(mask), G)
    assert np.abs(out - out_t).max() < TRACK_TOL
    assert np.abs(mha.attn_weights - twin.attn_weights.numpy()).max() < TRACK_TOL
    for g, g_t in zip(grads, grads_t, strict=True):
        assert np.abs(g - g_t).max() < TRACK_TOL
    for name, p in twin.named_parameters():
        assert np.abs(mha.grads()[name] - p.grad.numpy()).max() < TRACK_TOL, name

    # and back: the twin's (different) initial weights into NumPy give the twin's output
    twin2 = tt.MultiHeadAttention(D, n_heads, bias=bias, rng=16, dtype=torch.float64)
    mha.load_state_dict({k: v.numpy() for k, v in twin2.state_dict().items()})
    out2_t, _ = torch_mha_run(twin2, query, key, value, None if mask is None else torch.from_numpy(mask), G)
    assert np.abs(mha(query, key, value, mask) - out2_t).max() < TRACK_TOL


def to_torch_nn_mha(mha, bias: bool) -> torch.nn.MultiheadAttention:
    """Our four projections packed into torch.nn.MultiheadAttention: in_proj_weight = [Wq; Wk; Wv]."""
    sd = {k: torch.from_numpy(v) for k, v in mha.state_dict().items()}
    ref = torch.nn.MultiheadAttention(mha.d_model, mha.n_heads, bias=bias, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]))
        ref.out_proj.weight.copy_(sd["out_proj.weight"])
        if bias:
            ref.in_proj_bias.copy_(torch.cat([sd["q_proj.bias"], sd["k_proj.bias"], sd["v_proj.bias"]]))
            ref.out_proj.bias.copy_(sd["out_proj.bias"])
    return ref


@pytest.mark.parametrize("case", ["self", "self causal", "self decoder", "cross", "cross padding"])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_numpy_vs_torch_nn_multihead_attention(case, bias):
    kind, B, Tq, Tk, n_heads = MHA_CASES[case]
    rng = np.random.default_rng(17)
    mha = tn.MultiHeadAttention(D, n_heads, bias=bias, rng=18, dtype=np.float64)
    ref = to_torch_nn_mha(mha, bias)
    query, key, value, mask = mha_inputs(kind, B, Tq, Tk, rng)
    G = rng.standard_normal((B, Tq, D))

    # our mask (True = may attend) split into torch's two, which mean the opposite (True = may NOT attend)
    kwargs = {}
    if kind == "self causal":
        kwargs["attn_mask"] = torch.from_numpy(~mask[0, 0])  # (Tq, Tk)
    elif kind == "self decoder":
        tokens = np.where(np.arange(Tq)[None] < Tq - np.arange(B)[:, None], 1, 0)
        kwargs["attn_mask"] = torch.from_numpy(~tn.causal_mask(Tq)[0, 0])
        kwargs["key_padding_mask"] = torch.from_numpy(~tn.padding_mask(tokens, 0)[:, 0, 0])  # (B, Tk)
    elif mask is not None:
        kwargs["key_padding_mask"] = torch.from_numpy(~mask[:, 0, 0])

    out = mha(query, key, value, mask)
    mha.zero_grad()
    grads = numpy_grads_per_array(query, key, value, mha.backward(G))
    wrapped = lambda q, k, v, _m: ref(q, k, v, need_weights=True, **kwargs)[0]  # noqa: E731
    out_t, grads_t = torch_mha_run(wrapped, query, key, value, None, G)
    assert np.abs(out - out_t).max() < TRACK_TOL
    for g, g_t in zip(grads, grads_t, strict=True):
        assert np.abs(g - g_t).max() < TRACK_TOL
    wq, wk, wv = ref.in_proj_weight.grad.numpy().reshape(3, D, D)
    for ours, theirs in ((mha.q_proj.weight.grad, wq), (mha.k_proj.weight.grad, wk), (mha.v_proj.weight.grad, wv),
                         (mha.out_proj.weight.grad, ref.out_proj.weight.grad.numpy())):  # fmt: skip
        assert np.abs(ours - theirs).max() < TRACK_TOL
    if bias:
        packed = np.concatenate([mha.q_proj.bias.grad, mha.k_proj.bias.grad, mha.v_proj.bias.grad])
        assert np.abs(packed - ref.in_proj_bias.grad.numpy()).max() < TRACK_TOL

    with torch.no_grad():  # its weights are averaged over heads by default; per head on request
        xs = [torch.from_numpy(a) for a in (query, key, value)]
        _, w_avg = ref(*xs, need_weights=True, **kwargs)
        _, w_all = ref(*xs, need_weights=True, average_attn_weights=False, **kwargs)
    assert np.abs(mha.attn_weights.mean(axis=1) - w_avg.numpy()).max() < TRACK_TOL
    assert np.abs(mha.attn_weights - w_all.numpy()).max() < TRACK_TOL


def test_mha_float32_stays_float32():
    rng = np.random.default_rng(19)
    mha = tn.MultiHeadAttention(D, H, dropout=0.1, rng=20)
    x = rng.standard_normal((2, 4, D)).astype(np.float32)
    out = mha(x, x, x, tn.causal_mask(4))
    assert out.dtype == mha.attn_weights.dtype == np.float32
    grads = mha.backward(np.ones_like(out))
    assert all(g.dtype == np.float32 for g in grads)
    assert all(g.dtype == np.float32 for g in mha.grads().values())
    twin = tt.MultiHeadAttention(D, H, rng=20, dtype=torch.float32)
    assert twin(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x)).dtype == torch.float32
    mha64 = tn.MultiHeadAttention(D, H, rng=20).double()  # astype carries the whole module over
    assert mha64(x.astype(np.float64), x.astype(np.float64), x.astype(np.float64)).dtype == np.float64


def test_mha_split_merge_roundtrip_and_the_head_layout():
    mha = tn.MultiHeadAttention(D, H, dtype=np.float64)
    x = np.arange(2 * 3 * D, dtype=np.float64).reshape(2, 3, D)
    heads = mha._split(x)  # (B, H, T, dk)
    assert heads.shape == (2, H, 3, D // H)
    np.testing.assert_array_equal(heads[1, 1, 2], x[1, 2, D // H :])  # head h = feature slice h of each position
    np.testing.assert_array_equal(mha._merge(heads), x)


# -- bad input -----------------------------------------------------------------------------------------------

TRACKS = {"numpy": (tn, np.asarray, np.float64), "torch": (tt, torch.as_tensor, torch.float64)}


@pytest.mark.parametrize("track", TRACKS)
def test_attention_rejects_bad_input(track):
    lib, conv, f64 = TRACKS[track]
    rng = np.random.default_rng(21)
    q, k, v = (conv(rng.standard_normal((2, 2, 3, 4))) for _ in range(3))
    with pytest.raises(ValueError, match=r"d_model=10 must be divisible by n_heads=3"):
        lib.MultiHeadAttention(10, 3)
    with pytest.raises(TypeError, match="boolean"):
        lib.scaled_dot_product_attention(q, k, v, conv(np.ones((1, 1, 3, 3), dtype=np.int64)))
    with pytest.raises(TypeError, match="boolean"):
        lib.scaled_dot_product_attention(q, k, v, conv(np.ones((1, 1, 3, 3))))
    with pytest.raises(ValueError, match=r"shape \(1, 1, 3, 4\) does not broadcast .* \(2, 2, 3, 3\)"):
        lib.scaled_dot_product_attention(q, k, v, conv(np.ones((1, 1, 3, 4), dtype=bool)))
    with pytest.raises(ValueError, match="does not broadcast"):  # would grow the batch from 2 to 3
        lib.scaled_dot_product_attention(q, k, v, conv(np.ones((3, 1, 1, 3), dtype=bool)))
    with pytest.raises(ValueError, match="does not broadcast"):  # more dimensions than the scores
        lib.scaled_dot_product_attention(q, k, v, conv(np.ones((1, 1, 1, 3, 3), dtype=bool)))
    with pytest.raises(ValueError, match="same last dimension dk"):
        lib.scaled_dot_product_attention(q, conv(rng.standard_normal((2, 2, 3, 5))), v)
    with pytest.raises(ValueError, match="k and v"):
        lib.scaled_dot_product_attention(q, k, conv(rng.standard_normal((2, 2, 4, 4))))
    with pytest.raises(TypeError, match="float32 or float64"):
        lib.scaled_dot_product_attention(conv(np.ones((2, 2, 3, 4), dtype=np.int64)), k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        lib.scaled_dot_product_attention(q, k, conv(rng.standard_normal((2, 2, 3, 4)).astype(np.float32)))

    mha = lib.MultiHeadAttention(D, H, dtype=f64)
    x = conv(rng.standard_normal((2, 3, D)))
    with pytest.raises(TypeError, match="expected dtype"):
        mha(x.float() if track == "torch" else x.astype(np.float32), x, x)
    with pytest.raises(ValueError, match="last dimension 8"):
        mha(x, conv(rng.standard_normal((2, 3, 6))), x)
    with pytest.raises(ValueError, match="batch sizes differ"):
        mha(x, conv(rng.standard_normal((1, 3, D))), conv(rng.standard_normal((1, 3, D))))
    with pytest.raises(ValueError, match="key and value lengths differ"):
        mha(x, x, conv(rng.standard_normal((2, 4, D))))
    with pytest.raises(ValueError, match=r"\(B, T, d_model\)"):
        mha(x[0], x[0], x[0])
    with pytest.raises(TypeError, match="boolean"):
        mha(x, x, x, conv(np.ones((2, 1, 1, 3), dtype=np.float64)))


def test_numpy_backward_checks():
    mha = tn.MultiHeadAttention(D, H, dtype=np.float64)
    with pytest.raises(RuntimeError, match="before forward"):
        mha.backward(np.ones((2, 3, D)))
    x = np.ones((2, 3, D))
    mha(x, x, x)
    with pytest.raises(ValueError, match="expected shape"):
        mha.backward(np.ones((2, 4, D)))


def test_mha_dropout_numpy_vs_torch_twin_with_the_same_mask():
    rng = np.random.default_rng(22)
    mha = tn.MultiHeadAttention(D, H, dropout=0.4, rng=23, dtype=np.float64)
    twin = tt.MultiHeadAttention(D, H, dropout=0.4, rng=23, dtype=torch.float64)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in mha.state_dict().items()})
    x, _, _, mask = mha_inputs("self decoder", 2, 5, 5, rng)
    G = rng.standard_normal((2, 5, D))
    out = mha(x, x, x, mask)
    mha.zero_grad()
    dx = sum(mha.backward(G))
    keep = torch.from_numpy(mha.dropout.mask)  # the twin draws its own masks: hand it NumPy's
    twin.dropout.forward = lambda p: tt.Dropout.forward(twin.dropout, p, mask=keep)
    out_t, (dx_t,) = torch_mha_run(twin, x, x, x, torch.from_numpy(mask), G)
    assert np.abs(out - out_t).max() < TRACK_TOL and np.abs(dx - dx_t).max() < TRACK_TOL
    for name, p in twin.named_parameters():
        assert np.abs(mha.grads()[name] - p.grad.numpy()).max() < TRACK_TOL, name
