"""Part III building blocks in both tracks: the feed-forward sublayer, encoder and decoder layers (Post-LN and
Pre-LN) and their stacks. Gradient checks (float64 central differences, dropout off and on with frozen masks),
the NumPy track against the torch twin, and the torch twin against torch.nn.TransformerEncoderLayer /
TransformerDecoderLayer with converted weights."""

import functools

import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch, max_abs_diff, run_numpy, run_torch, to_torch

import tfm_numpy as tn
import tfm_torch as tt

GRAD_TOL = 1e-7  # relative error, backward vs central differences (float64)
TRACK_TOL = 1e-10  # max abs difference between implementations (float64)
D, H, DFF, B, T, S = 8, 2, 16, 2, 4, 5  # tiny: gradient checks perturb every entry of every parameter


def inputs(seed: int = 0, d: int = D):
    """x (B, T, d), memory (B, S, d), masks with padding in both sides (True = may attend)."""
    rng = np.random.default_rng(seed)
    x, memory = rng.standard_normal((B, T, d)), rng.standard_normal((B, S, d))
    src_mask = (np.arange(S)[None, :] < np.array([S, 3])[:, None])[:, None, None, :]  # (B, 1, 1, S)
    tgt_pad = (np.arange(T)[None, :] < np.array([T, 2])[:, None])[:, None, None, :]  # (B, 1, 1, T)
    tgt_mask = tgt_pad & np.tril(np.ones((T, T), dtype=bool))[None, None]  # (B, 1, T, T)
    enc_mask = (np.arange(T)[None, :] < np.array([T, 3])[:, None])[:, None, None, :]  # for an encoder on x
    return x, memory, enc_mask, tgt_mask, src_mask


def assert_grad_check(module, args, tol: float = GRAD_TOL) -> dict[str, float]:
    """tn.grad_check below tol for every input and parameter, except each attention's k_proj.bias: q.(k + b) =
    q.k + q.b adds one number to a whole row of scores, which softmax ignores, so its true gradient is 0 and a
    relative error would compare two round-off noises. That gradient must be ~0 instead."""
    errors = tn.grad_check(module, args)
    out = module(*args)
    module.zero_grad()
    module.backward(np.random.default_rng(3).standard_normal(out.shape))
    grads, scale = module.grads(), max(np.abs(g).max() for g in module.grads().values())
    module.zero_grad()
    zero = [k for k in errors if k.endswith("k_proj.bias")]
    assert all(np.abs(grads[k]).max() < 1e-12 * scale for k in zero), {k: np.abs(grads[k]).max() for k in zero}
    checked = {k: v for k, v in errors.items() if k not in zero}
    assert max(checked.values()) < tol, {k: v for k, v in checked.items() if v >= tol}
    return checked


class FrozenDropout(tn.Module):
    """Runs `inner` with every Dropout's generator re-seeded before each forward: the same masks every time, so
    central differences see a deterministic function even in training mode with dropout on."""

    def __init__(self, inner: tn.Module, seed: int = 0):
        super().__init__()
        self.inner, self.seed = inner, seed

    def forward(self, *args):
        for i, (_, m) in enumerate(self.inner.named_modules()):
            if isinstance(m, tn.Dropout):
                m.rng = np.random.default_rng([self.seed, i])
        return self.inner(*args)

    def backward(self, grad_out):
        return self.inner.backward(grad_out)


def build(lib, kind: str, norm_first: bool, dropout: float = 0.0, activation: str = "relu", dtype=None, **kw):
    dt = dtype or (np.float64 if lib is tn else torch.float64)
    if kind == "ff":
        return lib.PositionwiseFeedForward(D, DFF, dropout, activation, rng=1, dtype=dt)
    cls = {"enc": lib.EncoderLayer, "dec": lib.DecoderLayer}.get(kind)
    if cls is not None:
        return cls(D, H, DFF, dropout, activation, norm_first, rng=1, dtype=dt)
    cls = {"encoder": lib.Encoder, "decoder": lib.Decoder}[kind]
    d = kw.pop("d", D)
    return cls(2, d, H, 2 * d, dropout, activation, norm_first, rng=1, dtype=dt, **kw)


def args_for(kind: str, seed: int = 0, d: int = D):
    x, memory, enc_mask, tgt_mask, src_mask = inputs(seed, d)
    if kind == "ff":
        return (x,)
    if kind in ("enc", "encoder"):
        return (x, enc_mask)
    return (x, memory, tgt_mask, src_mask)


# -- gradient checks -------------------------------------------------------------------------------------------

CASES = [(k, nf) for k in ("enc", "dec") for nf in (False, True)]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_gradient_check(activation):
    assert_grad_check(build(tn, "ff", False, activation=activation).eval(), args_for("ff"))


@pytest.mark.parametrize("kind,norm_first", CASES, ids=[f"{k}-{'preLN' if nf else 'postLN'}" for k, nf in CASES])
def test_layer_gradient_check(kind, norm_first):
    errors = assert_grad_check(build(tn, kind, norm_first).eval(), args_for(kind))
    names = {"input0", "input1"} if kind == "dec" else {"input0"}
    assert names <= set(errors), "the input gradients (x, and memory for the decoder) must be checked"


@pytest.mark.parametrize("kind,norm_first", CASES, ids=[f"{k}-{'preLN' if nf else 'postLN'}" for k, nf in CASES])
def test_layer_gradient_check_with_dropout_on(kind, norm_first):
    """Training mode, p = 0.3 everywhere (attention weights, hidden layer, residual branches), frozen masks."""
    module = FrozenDropout(build(tn, kind, norm_first, dropout=0.3).train())
    assert_grad_check(module, args_for(kind))
    assert any(not m.mask.all() for _, m in module.named_modules() if isinstance(m, tn.Dropout) and m.p > 0)


STACKS = [(k, nf, fn) for k in ("encoder", "decoder") for nf in (False, True) for fn in (None, not nf)]


@pytest.mark.parametrize("kind,norm_first,final_norm", STACKS)
def test_stack_gradient_check(kind, norm_first, final_norm):
    """Two layers (the gradient of memory sums over the decoder's layers), with and without the final norm."""
    module = build(tn, kind, norm_first, final_norm=final_norm, d=4).eval()  # d_model 4, d_ff 8: fast enough
    assert (module.norm is not None) == (norm_first if final_norm is None else final_norm)
    assert_grad_check(module, args_for(kind, d=4))


def test_gradient_check_catches_a_missing_residual_gradient(monkeypatch):
    """The check can fail: drop the residual path's own gradient (dx = f'(x)^T dy instead of dy + f'(x)^T dy)."""

    def wrong(self, grad_out):
        dx = self.norm2.backward(grad_out)
        dx = self._ff_block_backward(dx)  # BUG: "dx +" missing
        dx = self.norm1.backward(dx)
        return dx + self._sa_block_backward(dx)

    monkeypatch.setattr(tn.EncoderLayer, "backward", wrong)
    errors = tn.grad_check(build(tn, "enc", False).eval(), args_for("enc"))
    assert errors["input0"] > 1e-2


# -- NumPy track vs torch twin ---------------------------------------------------------------------------------

ALL = [("ff", False)] + CASES + [("encoder", False), ("encoder", True), ("decoder", False), ("decoder", True)]


@pytest.mark.parametrize("kind,norm_first", ALL, ids=[f"{k}-{'preLN' if nf else 'postLN'}" for k, nf in ALL])
def test_numpy_and_torch_twin_agree_float64(kind, norm_first):
    np_mod, t_mod = build(tn, kind, norm_first).eval(), build(tt, kind, norm_first).eval()
    assert list(np_mod.state_dict()) == list(t_mod.state_dict())
    load_np_into_torch(np_mod, t_mod)
    args = args_for(kind)
    floats = tuple(a for a in args if a.dtype.kind == "f")
    grad_out = np.random.default_rng(5).standard_normal((B, T, D))
    np_out, np_gin, np_gp = run_numpy(np_mod, args, grad_out)
    t_args = [to_torch(a, requires_grad=True) for a in args]
    t_mod.zero_grad(set_to_none=True)
    t_out = t_mod(*t_args)
    t_out.backward(to_torch(grad_out))
    np_gin = np_gin if isinstance(np_gin, tuple) else (np_gin,)
    t_gin = [a.grad for a in t_args if a.is_floating_point()]
    assert len(np_gin) == len(t_gin) == len(floats)
    diffs = [max_abs_diff(np_out, t_out)] + [max_abs_diff(a, b) for a, b in zip(np_gin, t_gin, strict=True)]
    diffs += [max_abs_diff(np_gp[k], p.grad) for k, p in t_mod.named_parameters()]
    assert max(diffs) < TRACK_TOL, diffs


def test_numpy_and_torch_twin_agree_with_dropout_on_and_shared_masks():
    """Dropout in training mode: the NumPy layer's masks handed to the torch twin's Dropout modules, by name."""
    np_mod, t_mod = build(tn, "dec", True, dropout=0.3).train(), build(tt, "dec", True, dropout=0.3).train()
    load_np_into_torch(np_mod, t_mod)
    args = args_for("dec")
    grad_out = np.random.default_rng(5).standard_normal((B, T, D))
    np_result = run_numpy(np_mod, args, grad_out)
    masks = {name: m.mask for name, m in np_mod.named_modules() if isinstance(m, tn.Dropout)}
    for name, m in t_mod.named_modules():
        if isinstance(m, tt.Dropout):
            m.forward = functools.partial(tt.Dropout.forward, m, mask=torch.from_numpy(masks[name]))
    t_result = run_torch(t_mod, args, grad_out)
    assert max_abs_diff(np_result[0], t_result[0]) < TRACK_TOL
    assert all(max_abs_diff(np_result[2][k], t_result[2][k]) < TRACK_TOL for k in np_result[2])
    assert max_abs_diff(np_result[1][0], t_result[1][0]) < TRACK_TOL  # dx
    assert max_abs_diff(np_result[1][1], t_result[1][1]) < TRACK_TOL  # d memory


# -- torch twin vs torch.nn layers -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,norm_first", CASES, ids=[f"{k}-{'preLN' if nf else 'postLN'}" for k, nf in CASES])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_torch_twin_matches_torch_nn_layers(kind, norm_first, activation):
    """Our layer vs torch.nn.TransformerEncoderLayer / TransformerDecoderLayer (batch_first), converted keys and
    masks (ours True = may attend; torch's True = may NOT attend), train mode with dropout 0 (no fast path)."""
    ours = build(tt, kind, norm_first, activation=activation)
    nn_cls = torch.nn.TransformerEncoderLayer if kind == "enc" else torch.nn.TransformerDecoderLayer
    ref = nn_cls(D, H, DFF, 0.0, activation, batch_first=True, norm_first=norm_first, dtype=torch.float64)
    prefix = "encoder.layers.0." if kind == "enc" else "decoder.layers.0."
    mapped = tt.to_reference_state_dict({prefix + k: v for k, v in ours.state_dict().items()})
    ref.load_state_dict({k.removeprefix("transformer." + prefix): v for k, v in mapped.items()})
    x, memory, enc_mask, tgt_mask, src_mask = (to_torch(a) for a in inputs())
    if kind == "enc":
        out = ours(x, enc_mask)
        expected = ref(x, src_key_padding_mask=~enc_mask[:, 0, 0])
    else:
        out = ours(x, memory, tgt_mask, src_mask)
        causal_not = ~torch.ones(T, T, dtype=torch.bool).tril()
        expected = ref(
            x,
            memory,
            tgt_mask=causal_not,
            tgt_key_padding_mask=~tgt_mask[:, 0, -1],  # the last query row sees every real key: the padding
            memory_key_padding_mask=~src_mask[:, 0, 0],
        )
    assert max_abs_diff(out, expected) < TRACK_TOL


# -- contract ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_state_dict_keys_follow_torch_naming(lib):
    keys = list(build(lib, "dec", False).state_dict())
    assert keys[:2] == ["self_attn.q_proj.weight", "self_attn.q_proj.bias"]
    assert "cross_attn.out_proj.weight" in keys and "ff.linear1.weight" in keys and "ff.linear2.bias" in keys
    assert [k for k in keys if k.startswith("norm")] == [f"norm{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")]
    enc = build(lib, "encoder", True)
    assert list(enc.state_dict())[-2:] == ["norm.weight", "norm.bias"]
    assert "layers.1.ff.linear2.weight" in enc.state_dict()
    assert build(lib, "encoder", False).norm is None


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_attention_weights_are_kept_for_every_layer(lib):
    enc, dec = build(lib, "encoder", False).eval(), build(lib, "decoder", True).eval()
    x, memory, enc_mask, tgt_mask, src_mask = inputs()
    if lib is tt:
        x, memory, enc_mask, tgt_mask, src_mask = (to_torch(a) for a in (x, memory, enc_mask, tgt_mask, src_mask))
    enc(x, enc_mask)
    dec(x, memory, tgt_mask, src_mask)
    ws, self_w, cross_w = enc.attention_weights(), dec.attention_weights("self"), dec.attention_weights("cross")
    assert [tuple(w.shape) for w in ws] == [(B, H, T, T)] * 2
    assert [tuple(w.shape) for w in self_w] == [(B, H, T, T)] * 2
    assert [tuple(w.shape) for w in cross_w] == [(B, H, T, S)] * 2
    cross = np.asarray(cross_w[1])
    assert np.allclose(cross.sum(-1), 1) and np.all(cross[1, :, :, 3:] == 0)  # padded source keys get nothing
    assert np.all(np.asarray(self_w[0])[0][:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)  # no future
    with pytest.raises(ValueError, match="kind must be 'self' or 'cross'"):
        dec.attention_weights("encoder")


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_float32_stays_float32(lib):
    dt = np.float32 if lib is tn else torch.float32
    mod = build(lib, "dec", True, dtype=dt).eval()
    x, memory, _, tgt_mask, src_mask = inputs()
    x, memory = x.astype(np.float32), memory.astype(np.float32)
    if lib is tt:
        x, memory, tgt_mask, src_mask = (to_torch(a) for a in (x, memory, tgt_mask, src_mask))
    out = mod(x, memory, tgt_mask, src_mask)
    assert out.dtype == dt
    if lib is tn:
        dx, dmem = mod.backward(np.ones_like(out))
        assert dx.dtype == dmem.dtype == np.float32
        assert all(g.dtype == np.float32 for g in mod.grads().values())


BAD = {
    "activation": (lambda lib: lib.EncoderLayer(8, 2, 16, activation="tanh"), ValueError, "activation must be one of"),
    "ff activation": (lambda lib: lib.PositionwiseFeedForward(8, 16, activation="swish"), ValueError, "activation"),
    "heads": (lambda lib: lib.DecoderLayer(8, 3, 16), ValueError, "divisible by n_heads=3"),
    "norm_first": (lambda lib: lib.EncoderLayer(8, 2, 16, norm_first="yes"), TypeError, "norm_first expected True"),
    "d_ff": (lambda lib: lib.EncoderLayer(8, 2, 0), ValueError, "d_ff must be an int >= 1, got 0"),
    "n_layers": (lambda lib: lib.Encoder(0, 8, 2, 16), ValueError, "n_layers must be an int >= 1, got 0"),
    "final_norm": (lambda lib: lib.Decoder(1, 8, 2, 16, final_norm=1), TypeError, "final_norm expected True"),
    "dropout": (lambda lib: lib.EncoderLayer(8, 2, 16, dropout=1.0), ValueError, r"p must be in \[0, 1\)"),
}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD)
def test_bad_constructor_arguments(lib, case):
    make, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        make(lib)


def test_bad_inputs_and_backward_misuse_numpy():
    layer = build(tn, "dec", False).eval()
    x, memory, _, tgt_mask, src_mask = inputs()
    with pytest.raises(RuntimeError, match="before forward"):
        layer.backward(np.ones((B, T, D)))
    with pytest.raises(ValueError, match=r"DecoderLayer: x: expected last dimension 8"):
        layer(x[..., :4], memory, tgt_mask, src_mask)
    with pytest.raises(ValueError, match=r"expected shape \(B, T, d_model\)"):
        layer(x[None], memory, tgt_mask, src_mask)
    with pytest.raises(TypeError, match="DecoderLayer: memory: expected dtype float64"):
        layer(x, memory.astype(np.float32), tgt_mask, src_mask)
    layer(x, memory, tgt_mask, src_mask)
    with pytest.raises(ValueError, match="DecoderLayer.backward: grad_out expected shape"):
        layer.backward(np.ones((B, T + 1, D)))
