"""LoRA in both tracks (issue 33, section 3): LoRALinear's backward by hand (gradient-checked, the frozen base gets no
gradient), the tracks agreeing on outputs and every gradient, merge, add_lora on a GPT (only the adapters train),
the adapter file (saved from one track, loaded into the other, a mismatched base refused, a refused load changing
nothing) and the refusals, alike in both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_tracks import TOL, assert_tracks_agree, load_np_into_torch, run_numpy, run_torch, to_numpy

import tfm_numpy as tnp
import tfm_torch as tt
from tfm_common.lora import base_fingerprint, lora_scaling, match_targets

TRACKS = {"numpy": tnp, "torch": tt}
CFG = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=8)


def np_lora(in_f=6, out_f=5, rank=3, alpha=6.0, bias=True, dtype=np.float64, seed=0):
    """A NumPy LoRALinear with B random (at B = 0 the gradient of A is zero: nothing would be checked)."""
    layer = tnp.LoRALinear(tnp.Linear(in_f, out_f, bias, rng=seed, dtype=dtype), rank, alpha, rng=seed + 1)
    layer.lora_B.data[...] = np.random.default_rng(seed + 2).standard_normal(layer.lora_B.shape).astype(dtype)
    return layer


def twin(layer):
    base = tt.Linear(layer.in_features, layer.out_features, layer.base.bias is not None, dtype=torch.float64)
    t = tt.LoRALinear(base, layer.rank, layer.alpha)
    load_np_into_torch(layer, t)
    return t


def test_forward_is_the_formula_and_starts_as_the_base():
    base = tnp.Linear(6, 5, rng=0, dtype=np.float64)
    layer = tnp.LoRALinear(base, 2, 4.0, rng=1)
    x = np.random.default_rng(3).standard_normal((3, 4, 6))
    assert np.array_equal(layer(x), base(x))  # B = 0: the adapted layer starts as the base
    layer.lora_B.data[...] = np.random.default_rng(4).standard_normal((5, 2))
    A, B, W, b = layer.lora_A.data, layer.lora_B.data, base.weight.data, base.bias.data
    expected = x @ W.T + b + (4.0 / 2) * (x @ A.T @ B.T)
    assert np.max(np.abs(layer(x) - expected)) < 1e-12
    assert lora_scaling(2, 4.0) == layer.scaling == 2.0
    assert list(layer.state_dict()) == ["lora_A", "lora_B", "base.weight", "base.bias"]
    assert list(twin(layer).state_dict()) == list(layer.state_dict())


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6), (1, 6)])
def test_gradient_check_and_frozen_base(shape):
    layer = np_lora()
    x = np.random.default_rng(5).standard_normal(shape)
    errors = tnp.grad_check(layer, (x,))
    for name in ("input0", "lora_A", "lora_B"):
        assert errors[name] < 1e-7, (name, errors[name])
    layer.zero_grad()
    layer(x)
    layer.backward(np.ones((*shape[:-1], 5)))
    assert not layer.base.weight.grad.any() and not layer.base.bias.grad.any()  # frozen: no gradient at all


@pytest.mark.parametrize("bias", [True, False])
def test_tracks_agree_on_outputs_and_every_gradient(bias):
    layer = np_lora(bias=bias)
    t = twin(layer)
    x = np.random.default_rng(6).standard_normal((2, 3, 6))
    g = np.random.default_rng(7).standard_normal((2, 3, 5))
    np_res, t_res = run_numpy(layer, (x,), g), run_torch(t, (x,), g)
    trainable = {k: v for k, v in t_res[2].items() if k.startswith("lora_")}
    assert_tracks_agree((np_res[0], np_res[1], {k: np_res[2][k] for k in trainable}), (t_res[0], t_res[1], trainable))
    assert all(p.grad is None for n, p in t.named_parameters() if n.startswith("base."))  # torch: frozen too


def test_merge_equals_the_adapted_layer_in_both_tracks():
    layer = np_lora()
    x = np.random.default_rng(8).standard_normal((3, 6))
    merged = layer.merge()
    assert type(merged) is tnp.Linear and list(merged.state_dict()) == ["weight", "bias"]
    assert np.max(np.abs(merged(x) - layer(x))) < 1e-12
    t = twin(layer)
    tm = t.merge()
    assert type(tm) is tt.Linear and tm.weight.requires_grad
    assert np.max(np.abs(tm(torch.from_numpy(x)).detach().numpy() - layer(x))) < 1e-12
    assert np.max(np.abs(tm.weight.detach().numpy() - merged.weight.data)) < 1e-12
    assert layer.merge().weight.dtype == np.float64 and np_lora(dtype=np.float32).merge().weight.dtype == np.float32


def gpts(dtype=np.float64):
    m = tnp.GPT(**CFG, dtype=dtype)
    t = tt.GPT(**CFG, dtype=torch.float64 if dtype == np.float64 else torch.float32)
    load_np_into_torch(m, t)
    return m, t


def test_add_lora_on_a_gpt_trains_only_the_adapters_in_both_tracks():
    m, t = gpts()
    base_state = m.state_dict()
    names = tnp.add_lora(m, 2, 4.0, ["q_proj", "layers.*.self_attn.v_proj"], rng=0)
    assert names == tt.add_lora(t, 2, 4.0, ("q_proj", "layers.*.self_attn.v_proj"), rng=0)
    assert names == [f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert list(m.state_dict()) == list(t.state_dict())  # the same keys, in the same order
    assert [n for n, p in t.named_parameters() if p.requires_grad] == [f"{n}.lora_{k}" for n in names for k in "AB"]
    assert [id(p) for p in tt.lora_parameters(t)] == [id(p) for n, p in t.named_parameters() if p.requires_grad]
    # B random so that every gradient is non-zero; both tracks hold the same adapters
    rng = np.random.default_rng(1)
    for p in tnp.lora_parameters(m):
        p.data[...] = rng.standard_normal(p.shape)
    load_np_into_torch(m, t)
    ids = np.random.default_rng(2).integers(0, CFG["vocab_size"], (2, 8))
    g = np.random.default_rng(3).standard_normal((2, 8, CFG["vocab_size"]))
    m.zero_grad()
    y = m(ids)
    m.backward(g)
    yt = t(torch.from_numpy(ids))
    yt.backward(torch.from_numpy(g))
    assert np.max(np.abs(y - yt.detach().numpy())) < TOL
    for (n, p), pt in zip(
        [(n, p) for n, p in m.named_parameters() if n.endswith(("lora_A", "lora_B"))],
        tt.lora_parameters(t),
        strict=True,
    ):
        assert np.max(np.abs(p.grad - pt.grad.numpy())) < TOL, n
    # one Adam step over the adapters moves only them
    opt = tnp.Adam(tnp.lora_parameters(m), lr=1e-2)
    opt.step()
    after = m.state_dict()
    adapted = lambda k: k.replace("q_proj.", "q_proj.base.").replace("v_proj.", "v_proj.base.")  # noqa: E731
    assert all(np.array_equal(after[adapted(k)], v) for k, v in base_state.items())  # the base did not move
    assert sum(p.data.size for p in opt.params) == 4 * 2 * (16 + 16)


def test_merge_lora_gives_back_the_base_names_and_outputs():
    m, t = gpts()
    keys = list(m.state_dict())
    tnp.add_lora(m, 2, 4.0, "linear1", rng=0)
    tt.add_lora(t, 2, 4.0, "linear1", rng=0)
    for p in tnp.lora_parameters(m):
        p.data[...] = 0.1
    load_np_into_torch(m, t)
    ids = np.random.default_rng(2).integers(0, CFG["vocab_size"], (1, 5))
    y = m(ids)
    assert tnp.merge_lora(m) == tt.merge_lora(t) == ["layers.0.ff.linear1", "layers.1.ff.linear1"]
    assert list(m.state_dict()) == list(t.state_dict()) == keys
    assert np.max(np.abs(m(ids) - y)) < 1e-12
    assert np.max(np.abs(t(torch.from_numpy(ids)).detach().numpy() - y)) < 1e-12


@pytest.mark.parametrize("save_in,load_in", [("numpy", "torch"), ("torch", "numpy"), ("numpy", "numpy")])
def test_adapter_file_round_trip_across_tracks(tmp_path, save_in, load_in):
    m, t = gpts()
    base_state = m.state_dict()
    src = {"numpy": m, "torch": t}[save_in]
    TRACKS[save_in].add_lora(src, 2, 3.0, ["q_proj", "out_proj"], rng=0)
    for i, p in enumerate(TRACKS[save_in].lora_parameters(src)):
        if save_in == "numpy":
            p.data[...] = 0.01 * (i + 1)
        else:
            with torch.no_grad():
                p.fill_(0.01 * (i + 1))
    path = tmp_path / "adapters.npz"
    TRACKS[save_in].save_adapters(src, path)
    with np.load(path) as f:  # only the adapters: no base weight in the file
        assert sorted(k for k in f.files if k != "__lora__") == sorted(TRACKS[save_in].lora_state_dict(src))
    dst = tnp.GPT(**CFG, dtype=np.float64) if load_in == "numpy" else tt.GPT(**CFG, dtype=torch.float64)
    dst.load_state_dict(base_state)
    names = TRACKS[load_in].load_adapters(dst, path)
    assert names == [f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "out_proj")]
    ids = np.random.default_rng(0).integers(0, CFG["vocab_size"], (1, 6))
    out = lambda model: model(ids) if isinstance(model, tnp.Module) else model(torch.from_numpy(ids)).detach().numpy()  # noqa: E731
    assert np.max(np.abs(out(dst) - out(src))) < TOL


@pytest.mark.parametrize("track", TRACKS)
def test_a_mismatched_base_is_refused_and_nothing_changes(tmp_path, track):
    tr = TRACKS[track]
    m = tnp.GPT(**CFG, dtype=np.float64) if track == "numpy" else tt.GPT(**CFG, dtype=torch.float64)
    tr.add_lora(m, 2, 4.0, "q_proj", rng=0)
    tr.save_adapters(m, tmp_path / "a.npz")
    other = tnp.GPT(**CFG, rng=9, dtype=np.float64) if track == "numpy" else tt.GPT(**CFG, rng=9, dtype=torch.float64)
    before = {k: to_numpy(v).copy() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="trained on another base model"):
        tr.load_adapters(other, tmp_path / "a.npz")
    smaller = dict(CFG, d_model=8, d_ff=16)
    small = tnp.GPT(**smaller, dtype=np.float64) if track == "numpy" else tt.GPT(**smaller, dtype=torch.float64)
    with pytest.raises(ValueError, match="trained on another base model"):
        tr.load_adapters(small, tmp_path / "a.npz")
    after = {k: to_numpy(v).copy() for k, v in other.state_dict().items()}
    assert list(after) == list(before) and all(np.array_equal(after[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="not an adapter file"):
        (tmp_path / "junk.npz").write_bytes(b"not a zip")
        tr.load_adapters(other, tmp_path / "junk.npz")
    with pytest.raises(TypeError, match="LoRALinear, not a Linear"):  # adapters on adapters
        tr.load_adapters(m, tmp_path / "a.npz")


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize(
    "args,error,words",
    [
        ((0, 1.0), ValueError, "rank must be an int >= 1, got 0"),
        ((9, 1.0), ValueError, "rank must be <= min(in_features, out_features) = 5"),
        ((2.0, 1.0), TypeError, "rank expected an int"),
        ((2, 0.0), ValueError, "alpha must be > 0, got 0.0"),
        ((2, -1.0), ValueError, "alpha must be > 0"),
        ((2, float("nan")), TypeError, "alpha expected a finite float"),
        ((2, "1"), TypeError, "alpha expected a finite float"),
    ],
)
def test_layer_refusals_alike(track, args, error, words):
    tr = TRACKS[track]
    base = tr.Linear(6, 5, rng=0)
    with pytest.raises(error, match=f"^LoRALinear: {words.replace('(', '[(]').replace(')', '[)]')}"):
        tr.LoRALinear(base, *args)


@pytest.mark.parametrize("track", TRACKS)
def test_model_refusals_alike_and_nothing_changes(track):
    tr = TRACKS[track]
    with pytest.raises(TypeError, match="base expected a tfm_.* Linear, got LayerNorm"):
        tr.LoRALinear(tr.LayerNorm(4), 1, 1.0)
    m = tr.GPT(**CFG)
    keys = list(m.state_dict())
    cases = [
        (("nope",), ValueError, "targets pattern 'nope' matches no Linear layer"),
        (("norm1",), TypeError, "picks 'layers.0.norm1', a LayerNorm, not a Linear"),
        ((), TypeError, "targets expected a pattern"),
        ((3,), TypeError, "targets expected a pattern"),
    ]
    for targets, error, words in cases:
        with pytest.raises(error, match=words):
            tr.add_lora(m, 2, 1.0, list(targets))
    with pytest.raises(ValueError, match=r"add_lora \(layers.0.self_attn.q_proj\): rank must be <= .* = 16"):
        tr.add_lora(m, 17, 1.0, "q_proj")
    with pytest.raises(ValueError, match="alpha must be > 0"):
        tr.add_lora(m, 2, 0, ["q_proj", "linear1"])
    with pytest.raises(TypeError, match="add_lora: model expected a tfm_"):
        tr.add_lora(object(), 2, 1.0, "q_proj")
    with pytest.raises(ValueError, match="save_adapters: the model has no LoRA adapters"):
        tr.save_adapters(m, "unused.npz")
    assert list(m.state_dict()) == keys  # every refusal before any change
    if track == "torch":
        assert all(p.requires_grad for p in m.parameters())


def test_targets_match_full_names_or_the_last_part():
    mods = [("a", "GPT"), ("a.q_proj", "Linear"), ("a.b.q_proj", "Linear"), ("a.norm", "LayerNorm")]
    assert match_targets("t", mods, "q_proj") == ["a.q_proj", "a.b.q_proj"]
    assert match_targets("t", mods, "a.*.q_proj") == ["a.b.q_proj"]
    assert match_targets("t", mods, ["a.b.q_proj", "q_proj"]) == ["a.q_proj", "a.b.q_proj"]  # model order, once


def test_fingerprint_sees_through_the_adapters_and_the_tracks():
    m, t = gpts()
    fp = base_fingerprint(m.state_dict())
    tnp.add_lora(m, 1, 1.0, "v_proj")
    assert base_fingerprint(m.state_dict()) == fp
    assert base_fingerprint({k: v.numpy() for k, v in t.state_dict().items()}) == fp
    assert base_fingerprint(m.float().state_dict()) == fp  # float32 copy of float64 weights: the same fingerprint


def test_float32_layer_keeps_float32():
    layer = np_lora(dtype=np.float32)
    x = np.ones((2, 6), np.float32)
    y = layer(x)
    assert y.dtype == np.float32 and layer.backward(np.ones_like(y)).dtype == np.float32
    assert layer.lora_A.grad.dtype == np.float32
