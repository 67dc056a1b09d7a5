"""Weight-only quantization (chapter 21a), both tracks: quantize / dequantize within half a step, the same codes in
both tracks, QuantizedLinear against torch's own int8 kernels (weight-only `torch._weight_int8pack_mm`, dynamic
`quantize_dynamic`), the whole GPT quantized, and the refusals."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch, max_abs_diff

import tfm_numpy as tnp
import tfm_torch as tpt
from tfm_common.quantize import group_shapes, layer_group_size, packed_bytes, q_max

SCHEMES = [(8, 1, None), (8, None, None), (8, 1, 16), (4, 1, 32), (4, 1, 64), (4, 1, 128), (4, 1, None), (4, 0, 8)]
CFG = dict(vocab_size=50, d_model=32, n_heads=4, d_ff=128, n_layers=2, max_len=16)


def _weight(shape, dtype=np.float64, seed=0):
    w = np.random.default_rng(seed).standard_normal(shape)
    w[0, :5] *= 30  # an outlier in row 0: its scale is large, the others' are not
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits, axis, group", SCHEMES)
def test_round_trip_within_half_a_step_and_same_codes_in_both_tracks(bits, axis, group, dtype):
    w = _weight((16, 256), dtype)
    codes, scales = tnp.quantize(w, bits, axis=axis, group_size=group)
    assert codes.dtype == np.int8 and codes.shape == w.shape and scales.dtype == w.dtype
    assert np.abs(codes).max() == q_max(bits)  # the largest magnitude of each group maps to +-q_max
    back = tnp.dequantize(codes, scales, axis=axis, group_size=group)
    group_len = group or (w.size if axis is None else w.shape[axis])
    grouped, scale_grouped, _ = group_shapes(w.shape, axis, group_len)
    step = np.broadcast_to(scales.reshape(scale_grouped), grouped).reshape(w.shape)  # each element's group's step
    eps = np.finfo(dtype).eps
    assert (np.abs(w - back) <= step / 2 * (1 + 8 * eps)).all()  # every element, within half its group's step
    ct, st = tpt.quantize(torch.from_numpy(w), bits, axis=axis, group_size=group)
    assert ct.dtype == torch.int8 and np.array_equal(ct.numpy(), codes) and np.array_equal(st.numpy(), scales)
    assert np.array_equal(tpt.dequantize(ct, st, axis=axis, group_size=group).numpy(), back)


def test_scales_layout_and_codes_range():
    w = _weight((6, 64))
    c8, s8 = tnp.quantize(w, 8, axis=1)
    assert s8.shape == (6, 1) and np.allclose(s8[:, 0], np.abs(w).max(axis=1) / 127)
    c4, s4 = tnp.quantize(w, 4, axis=-1, group_size=32)
    assert s4.shape == (6, 2) and np.allclose(s4, np.abs(w.reshape(6, 2, 32)).max(axis=2) / 7)
    assert c4.min() >= -7 and c4.max() <= 7 and c8.min() >= -127 and c8.max() <= 127  # -8 and -128 unused
    ct, st = tnp.quantize(w, 8, axis=None)
    assert st.shape == (1, 1) and st[0, 0] == np.abs(w).max() / 127
    codes, scales = tnp.quantize(np.zeros((2, 8)), 4, axis=1)  # an all-zero group: codes 0, scale 0, exact
    assert not codes.any() and not scales.any() and not tnp.dequantize(codes, scales, axis=1).any()
    assert not tpt.quantize(torch.zeros(2, 8, dtype=torch.float64), 4, axis=1)[0].any()


def test_per_channel_beats_per_tensor_on_an_outlier_row():
    w = _weight((16, 64))
    w[0, 0] = 100.0  # one outlier sets the per-tensor step: 100 / 127
    err = {axis: np.abs(w - tnp.dequantize(*tnp.quantize(w, 8, axis=axis), axis=axis))[1:].max() for axis in (1, None)}
    assert err[1] * 10 < err[None]  # rows without the outlier keep their own fine step


def _linear_pair(in_f, out_f, bias=True, dtype=np.float64, seed=0):
    lin = tnp.Linear(in_f, out_f, bias=bias, rng=seed, dtype=dtype)
    lin.weight.data[3, :4] *= 20
    twin = tpt.Linear(in_f, out_f, bias=bias, dtype=torch.float64 if dtype == np.float64 else torch.float32)
    load_np_into_torch(lin, twin)
    return lin, twin


@pytest.mark.parametrize("bits, group, per_tensor", [(8, None, False), (4, 32, False), (4, 64, False),
                                                      (8, None, True), (8, 16, False)])  # fmt: skip
def test_quantized_linear_equal_between_tracks_and_to_the_hand_reference(bits, group, per_tensor):
    lin, twin = _linear_pair(64, 24)
    q = tnp.QuantizedLinear.from_linear(lin, bits, group, per_tensor=per_tensor)
    qt = tpt.QuantizedLinear.from_linear(twin, bits, group, per_tensor=per_tensor)
    assert list(q.state_dict()) == list(qt.state_dict()) == ["codes", "scales", "bias"]
    assert np.array_equal(q.codes.data, qt.codes.numpy()) and np.array_equal(q.bias.data, lin.bias.data)
    x = np.random.default_rng(1).standard_normal((3, 5, 64))
    y, yt = q(x), qt(torch.from_numpy(x))
    assert max_abs_diff(y, yt) < 1e-12  # the int8 (int4) matmul, float64, in both tracks
    axis = None if per_tensor else 1
    w_hat = q.codes.data.astype(np.float64) * np.repeat(q.scales.data, group or 64, axis=1) \
        if not per_tensor else q.codes.data * q.scales.data[0, 0]  # fmt: skip
    assert np.array_equal(w_hat, tnp.dequantize(q.codes.data, q.scales.data, axis=axis, group_size=group))
    assert np.abs(y - (x @ w_hat.T + lin.bias.data)).max() < 1e-12
    assert np.abs(y - lin(x)).max() > 0  # quantized: not the float layer's output


def test_loading_a_quantized_state_dict_across_tracks():
    lin, twin = _linear_pair(64, 8, bias=False)
    q = tnp.QuantizedLinear.from_linear(lin, 4, 32)
    qt = tpt.QuantizedLinear(64, 8, 4, 32, bias=False, dtype=torch.float64)
    qt.load_state_dict(q.state_dict())
    assert qt.codes.dtype == torch.int8 and np.array_equal(qt.codes.numpy(), q.codes.data)
    q2 = tnp.QuantizedLinear(64, 8, 4, 32, bias=False, dtype=np.float64)
    q2.load_state_dict({k: v.numpy() for k, v in qt.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((4, 64))
    assert np.array_equal(q2(x), q(x))


def test_weight_only_int8_against_torch_weight_int8pack_mm():
    """torch's own weight-only int8 kernel: x (M, K) float32, codes (N, K) int8, one scale per output channel."""
    lin, twin = _linear_pair(128, 48, bias=False, dtype=np.float32)
    qt = tpt.QuantizedLinear.from_linear(twin, 8)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((7, 128)).astype(np.float32))
    theirs = torch._weight_int8pack_mm(x, qt.codes, qt.scales[:, 0])
    ours = qt(x)
    exact = (x.double() @ qt.codes.double().T) * qt.scales[:, 0].double()
    scale = exact.abs().max().item()
    assert (ours - theirs).abs().max().item() < 1e-5 * scale  # float32 rounding of the same sum
    assert (ours.double() - exact).abs().max().item() < 1e-5 * scale


def test_against_torch_dynamic_int8_linear():
    """torch.ao's dynamic Linear quantizes the weight per channel (scale max|w| / 127.5, codes in [-128, 127]) and
    each input per tensor to [0, 127] (reduce_range): with its codes and scales in our QuantizedLinear, the outputs
    differ only by its activation rounding, at most sum_k |W_jk| * step_x / 2 per output."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    lin, twin = _linear_pair(64, 32, dtype=np.float32)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 32))
    ref.load_state_dict({f"0.{k}": v for k, v in twin.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dyn = quantize_dynamic(ref, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)[0]
        w_q = dyn.weight()
        their_codes, their_scales = w_q.int_repr(), w_q.q_per_channel_scales().float()
    ours_own = tpt.quantize(twin.weight.detach(), 8, axis=1)[0]
    assert (their_codes.int() - ours_own.int()).abs().max() <= 1  # amax/127.5 against amax/127: a code apart at most
    qt = tpt.QuantizedLinear.from_linear(twin, 8)
    with torch.no_grad():
        qt.codes.copy_(their_codes)
        qt.scales.copy_(their_scales[:, None])
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((6, 64)).astype(np.float32))
    step_x = (x.max().clamp(min=0) - x.min().clamp(max=0)).item() / 127
    bound = qt.weight().abs().sum(dim=1) * step_x / 2  # (out,)
    diff = (qt(x) - dyn(x)).abs().detach()
    assert (diff <= bound * 1.001 + 1e-5).all()
    assert diff.max() > 0  # the activations were quantized: not the same numbers


@pytest.fixture(scope="module")
def gpts():
    m = tnp.GPT(**CFG, rng=0, dtype=np.float64)
    mt = tpt.GPT(**CFG, dtype=torch.float64)
    load_np_into_torch(m, mt)
    return m, mt


@pytest.mark.parametrize("bits, group, per_tensor", [(8, None, False), (4, 64, False), (4, 128, False),
                                                      (8, None, True)])  # fmt: skip
def test_quantized_gpt_equal_between_tracks(gpts, bits, group, per_tensor):
    m, mt = gpts
    before = m.state_dict()
    q = tnp.quantize_linears(m, bits, group, per_tensor=per_tensor)
    qt = tpt.quantize_linears(mt, bits, group, per_tensor=per_tensor)
    assert all(np.array_equal(v, m.state_dict()[k]) for k, v in before.items())  # a copy: the model is unchanged
    assert isinstance(m.output_projection, tnp.Linear) and isinstance(mt.output_projection, tpt.Linear)
    assert list(q.state_dict()) == list(qt.state_dict())
    assert [n for n, _ in q.named_parameters()] == [n for n, _ in qt.named_parameters()]
    assert all(np.array_equal(v, qt.state_dict()[k].numpy()) for k, v in q.state_dict().items())
    tokens = np.random.default_rng(0).integers(0, CFG["vocab_size"], (2, 12))
    assert max_abs_diff(q(tokens), qt(torch.from_numpy(tokens))) < 1e-12
    assert tnp.model_bytes(q) == tpt.model_bytes(qt)


def test_quantize_linears_replaces_every_linear_and_ties_the_embedding(gpts):
    m, _ = gpts
    q = tnp.quantize_linears(m, 4, 128)
    linears = [n for n, mod in m.named_modules() if type(mod) is tnp.Linear]
    assert all(isinstance(dict(q.named_modules())[n], tnp.QuantizedLinear) for n in linears)
    assert not any(type(mod) is tnp.Linear for _, mod in q.named_modules())
    assert isinstance(q.embed, tnp.QuantizedEmbedding) and q.embed.codes is q.output_projection.codes
    assert q.layers[0].ff.linear2.group_size == 128 and q.layers[0].ff.linear1.group_size == 32  # d_model 32: a row
    assert layer_group_size(128, 32) == 32 and layer_group_size(None, 32) is None
    # the embedding reads the same dequantized table the output projection multiplies by
    assert np.array_equal(q.embed(np.array([[3, 7]]))[0], q.output_projection.weight()[[3, 7]])
    quantized = {"embed"} | set(linears)  # each float weight becomes codes and scales, in its place
    want = []
    for k in m.state_dict():
        owner, _, leaf = k.rpartition(".")
        want += [f"{owner}.codes", f"{owner}.scales"] if owner in quantized and leaf == "weight" else [k]
    assert list(q.state_dict()) == want


def test_quantize_linears_by_prefix(gpts):
    m, mt = gpts
    prefixes = ("layers.0.self_attn", "layers.1.ff")
    q = tnp.quantize_linears(m, 4, 32, prefixes=prefixes)
    chosen = {n for n, mod in q.named_modules() if isinstance(mod, tnp.QuantizedLinear)}
    assert chosen == {f"layers.0.self_attn.{p}_proj" for p in ("q", "k", "v", "out")} | {
        "layers.1.ff.linear1",
        "layers.1.ff.linear2",
    }
    assert type(q.embed) is tnp.Embedding and type(q.output_projection) is tnp.Linear
    qt = tpt.quantize_linears(mt, 4, 32, prefixes=prefixes)
    assert list(q.state_dict()) == list(qt.state_dict())
    tokens = np.random.default_rng(1).integers(0, CFG["vocab_size"], (2, 9))
    assert max_abs_diff(q(tokens), qt(torch.from_numpy(tokens))) < 1e-12
    tied = tnp.quantize_linears(m, 8, prefixes=("output_projection",))
    assert isinstance(tied.embed, tnp.QuantizedEmbedding)  # the tied table goes with its output projection


def test_quantized_gpt_decodes_with_the_cache(gpts):
    m, _ = gpts
    q = tnp.quantize_linears(m, 4, 32)
    tokens = np.random.default_rng(2).integers(0, CFG["vocab_size"], (1, 10))
    cache: dict = {}
    q.forward_step(tokens[:, :6], cache)
    stepped = q.forward_step(tokens[:, 6:], cache)
    assert np.abs(stepped - q(tokens)[:, 6:]).max() < 1e-12
    out = q.generate(tokens[:, :3], 5, temperature=0.0)
    assert np.array_equal(out, q.generate(tokens[:, :3], 5, temperature=0.0, use_cache=False))


def test_model_bytes_counts_codes_at_their_bit_width(gpts):
    m, mt = gpts
    m32 = tnp.GPT(**CFG, rng=0)
    assert tnp.model_bytes(m32) == 4 * m32.num_parameters() and tnp.model_bytes(m) == 8 * m.num_parameters()
    q = tnp.quantize_linears(m32, 4, 32)
    entries = []
    for _, p in q.named_parameters():
        entries.append((p.data.size, 4 if p.data.dtype == np.int8 else 32))
    assert tnp.model_bytes(q) == packed_bytes(entries) < tnp.model_bytes(m32) / 4
    assert packed_bytes([(3, 4)]) == 2  # two int4 codes a byte, rounded up
    q8 = tpt.quantize_linears(mt.float(), 8)
    mt.double()
    n_codes = sum(p.numel() for n, p in q8.named_parameters() if n.endswith("codes"))
    assert tpt.model_bytes(q8) == n_codes + 4 * (q8.num_parameters() - n_codes)


def test_quantized_layers_are_inference_only(gpts):
    m, mt = gpts
    lin, twin = _linear_pair(32, 8)
    q, qt = tnp.QuantizedLinear.from_linear(lin, 8), tpt.QuantizedLinear.from_linear(twin, 8)
    x = np.ones((2, 32))
    y = q(x)
    with pytest.raises(RuntimeError, match="QuantizedLinear is inference only"):
        q.backward(np.ones_like(y))
    xt = torch.ones(2, 32, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="QuantizedLinear is inference only"):
        qt(xt).sum().backward()
    assert not any(p.requires_grad for p in qt.parameters())
    qm = tnp.quantize_linears(m, 8)
    tokens = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(RuntimeError, match="inference only"):
        qm.backward(np.ones_like(qm(tokens)))
    assert qm.double().layers[0].ff.linear1.codes.dtype == np.int8  # a dtype change keeps the codes integer
    assert tpt.quantize_linears(mt, 8).float().layers[0].ff.linear1.codes.dtype == torch.int8


BAD_QUANTIZE = [
    (dict(bits=3), ValueError, "bits must be 4 or 8, got 3"),
    (dict(bits=16), ValueError, "bits must be 4 or 8"),
    (dict(bits=True), ValueError, "bits must be 4 or 8"),
    (dict(bits=8.0), ValueError, "bits must be 4 or 8"),
    (dict(group_size=48), ValueError, "group_size must divide the length 64 of axis 1"),
    (dict(group_size=0), ValueError, "group_size must be an int >= 1"),
    (dict(group_size=32.0), TypeError, "group_size expected an int or None"),
    (dict(axis=None, group_size=32), ValueError, "group_size=32 needs an axis"),
    (dict(axis=2), ValueError, r"axis must be in \[-2, 2\)"),
    (dict(axis=-3), ValueError, "axis must be an int >= -2"),
    (dict(axis=1.0), TypeError, "axis expected an int"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_QUANTIZE)
@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_quantize_refuses_bad_arguments(track, kwargs, error, match):
    w = np.ones((4, 64))
    args = dict(bits=4, axis=1, group_size=None) | kwargs
    fn, w = (tnp.quantize, w) if track == "numpy" else (tpt.quantize, torch.from_numpy(w))
    with pytest.raises(error, match=match):
        fn(w, args.pop("bits"), **args)


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_quantize_refuses_non_float_and_non_finite_input(track):
    mod, conv = (tnp, np.asarray) if track == "numpy" else (tpt, torch.tensor)
    with pytest.raises(TypeError, match="w expected a float32 or float64"):
        mod.quantize(conv(np.ones((2, 8), dtype=np.int64)), 8, axis=1)
    with pytest.raises(TypeError, match="w expected a"):
        mod.quantize([[1.0, 2.0]], 8, axis=1)
    with pytest.raises(ValueError, match="w must be finite"):
        mod.quantize(conv(np.array([[1.0, np.nan]])), 8, axis=1)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        mod.quantize(conv(np.array(1.0)), 8, axis=None)
    codes, scales = mod.quantize(conv(np.ones((2, 8))), 8, axis=1)
    with pytest.raises(TypeError, match="codes expected"):
        mod.dequantize(conv(np.ones((2, 8))), scales, axis=1)
    with pytest.raises(TypeError, match="scales expected"):
        mod.dequantize(codes, conv(np.ones((2, 1), dtype=np.int64)), axis=1)
    with pytest.raises(ValueError, match=r"scales expected shape \(2, 2\)"):
        mod.dequantize(codes, scales, axis=1, group_size=4)


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_quantized_layers_refuse_bad_arguments(track, gpts):
    mod = tnp if track == "numpy" else tpt
    model = gpts[0] if track == "numpy" else gpts[1]
    lin = mod.Linear(64, 8, dtype="float64")
    with pytest.raises(ValueError, match="QuantizedLinear: bits must be 4 or 8, got 2"):
        mod.QuantizedLinear.from_linear(lin, 2)
    with pytest.raises(ValueError, match="QuantizedLinear: group_size must divide the length 64"):
        mod.QuantizedLinear.from_linear(lin, 4, 128)  # one layer: not clamped, refused
    with pytest.raises(ValueError, match="QuantizedLinear: in_features must be an int >= 1, got 0"):
        mod.QuantizedLinear(0, 8, 8)
    with pytest.raises(TypeError, match="QuantizedEmbedding: per_tensor expected True or False"):
        mod.QuantizedEmbedding(10, 8, 8, per_tensor=1)
    q = mod.QuantizedLinear.from_linear(lin, 8)
    x32 = np.ones((2, 64), dtype=np.float32)
    with pytest.raises(TypeError, match="QuantizedLinear: expected dtype"):
        q(x32 if track == "numpy" else torch.from_numpy(x32))
    with pytest.raises(ValueError, match="prefix 'layers.7' names no Linear layer"):
        mod.quantize_linears(model, 8, prefixes=("layers.7",))
    with pytest.raises(TypeError, match="prefixes expected a tuple of str"):
        mod.quantize_linears(model, 8, prefixes="layers.0")
    with pytest.raises(ValueError, match="quantize_linears: bits must be 4 or 8, got 5"):
        mod.quantize_linears(model, 5)
    with pytest.raises(ValueError, match="quantize_linears: group_size must divide the length 32"):
        mod.quantize_linears(model, 4, 24)
    assert type(model.output_projection) is mod.Linear  # refused before anything changed
