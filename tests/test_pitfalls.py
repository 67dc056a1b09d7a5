"""The pitfall options of chapter 16a (choices of popular Transformer code), in both tracks: the defaults change
nothing; every option is gradient-checked in the NumPy track and agrees with the torch twin in float64; the options
do what they say (temperature, shared head projections, dropout place, masks, embedding scale and norm); bad values
are refused with the same message in both tracks."""

import functools

import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch, max_abs_diff, run_numpy, run_torch, to_numpy
from test_sublayers import FrozenDropout, args_for, assert_grad_check
from test_transformer import GRAD_TOL, SRC, TGT_IN, TRACK_TOL, T, model_grad_check, np_model, run_both, torch_twin

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.pitfalls import MODEL_PITFALLS

D, H, DFF = 8, 2, 16

# one non-default value of every option (and two for embed_scale)
OPTIONS = [
    dict(score_scale="d_model"),
    dict(head_projection="shared"),
    dict(dropout_place="after_norm"),
    dict(ff_dropout=False),
    dict(embed_scale="logits"),
    dict(embed_scale="none"),
    dict(embed_norm=True),
    dict(tgt_padding_mask=False),
    dict(embed_norm=True, final_norm=True),  # the double norm of a Post-LN stack
]
IDS = ["-".join(f"{k}={v}" for k, v in o.items()) for o in OPTIONS]


def test_defaults_change_nothing():
    """Explicit defaults: the same configuration (no new keys), the same weights, the same logits."""
    plain = np_model().eval()
    explicit = np_model(**MODEL_PITFALLS).eval()
    assert plain.config == explicit.config and not set(MODEL_PITFALLS) & set(plain.config)
    assert all(np.array_equal(a, b) for a, b in zip(*(m.state_dict().values() for m in (plain, explicit)), strict=True))
    assert np.array_equal(plain(SRC, TGT_IN), explicit(SRC, TGT_IN))


@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
def test_whole_model_gradient_check(opts):
    model = np_model(**opts).eval()
    assert all(model.config[k] == v for k, v in opts.items())
    # h = 3e-5 (largest error over these variants: 4e-8). At 1e-5 the logits scaled by d^-1/2 make some gradients
    # small and the differences' round-off reached 1.4e-7 (1.1e-6 at 1e-6: it grows as h shrinks, so it is
    # round-off, not the backward); at 1e-4 the truncation of the shared head projection reached 1.2e-7
    errors = model_grad_check(model, h=3e-5)
    assert max(errors.values()) < GRAD_TOL, {k: v for k, v in errors.items() if v >= GRAD_TOL}


@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
def test_numpy_and_torch_models_agree_float64(opts):
    model = np_model(**opts).eval()
    twin = torch_twin(model)
    assert list(model.state_dict()) == list(twin.state_dict())
    logits, grads, t_logits, t_grads = run_both(model, twin)
    assert list(grads) == list(t_grads)
    diffs = [max_abs_diff(logits, t_logits)] + [max_abs_diff(grads[k], t_grads[k]) for k in grads]
    assert max(diffs) < TRACK_TOL, max(diffs)


@pytest.mark.parametrize("opts", [dict(dropout_place="after_norm"), dict(ff_dropout=False)], ids=["after_norm", "ff"])
def test_tracks_agree_with_dropout_on_and_shared_masks(opts):
    """Training mode, p = 0.3: where the dropouts sit is the option, so run it with masks on."""
    model = np_model(dropout=0.3, **opts).train()
    twin = torch_twin(model)
    model(SRC, TGT_IN)  # draws the masks
    masks = {n: m.mask for n, m in model.named_modules() if isinstance(m, tn.Dropout) and m.mask is not None}
    for lib, mod in ((tt, twin), (tn, model)):
        for name, m in mod.named_modules():
            if name in masks:
                mask = torch.from_numpy(masks[name]) if lib is tt else masks[name]
                m.forward = functools.partial(lib.Dropout.forward, m, mask=mask)
    logits, grads, t_logits, t_grads = run_both(model, twin)
    assert max([max_abs_diff(logits, t_logits)] + [max_abs_diff(grads[k], t_grads[k]) for k in grads]) < TRACK_TOL
    hidden = [m for n, m in model.named_modules() if n.endswith("ff.dropout")]
    assert all((m.p == 0) == (opts.get("ff_dropout") is False) for m in hidden)


@pytest.mark.parametrize("kind", ["enc", "dec"])
def test_layer_gradient_check_dropout_after_norm(kind):
    """dropout(norm(x + f(x))) with frozen masks: the backward goes through the dropout, then the norm."""
    cls = tn.EncoderLayer if kind == "enc" else tn.DecoderLayer
    layer = cls(D, H, DFF, 0.3, rng=1, dtype=np.float64, dropout_place="after_norm")
    assert_grad_check(FrozenDropout(layer.train()), args_for(kind))


# -- the attention options ------------------------------------------------------------------------------------


def mha(lib, shared=False, **kw):
    cls = lib.SharedHeadProjectionAttention if shared else lib.MultiHeadAttention
    return cls(D, H, rng=1, dtype=np.float64 if lib is tn else torch.float64, **kw)


@pytest.mark.parametrize("shared,scale", [(False, "d_model"), (True, "d_k"), (True, "d_model")])
def test_attention_options_gradient_check_and_twin(shared, scale):
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((2, 3, D)), rng.standard_normal((2, 5, D))
    mask = np.array([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    m = mha(tn, shared, score_scale=scale)
    assert_grad_check(m, (q, kv, kv, mask))
    t = mha(tt, shared, score_scale=scale)
    load_np_into_torch(m, t)
    g = rng.standard_normal((2, 3, D))
    a, b = run_numpy(m, (q, kv, kv), g, mask=mask), run_torch(t, (q, kv, kv), g, mask=torch.from_numpy(mask))
    from helpers_tracks import assert_tracks_agree

    assert_tracks_agree(a, b)


def test_score_scale_d_model_is_softmax_over_sqrt_d_model():
    m = mha(tn, score_scale="d_model")
    x = np.random.default_rng(2).standard_normal((1, 4, D))
    m(x, x, x)
    q = (x @ m.q_proj.weight.data.T + m.q_proj.bias.data).reshape(1, 4, H, D // H).transpose(0, 2, 1, 3)  # unscaled
    k = m.k_proj(x).reshape(1, 4, H, D // H).transpose(0, 2, 1, 3)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    assert max_abs_diff(m.attn_weights, p / p.sum(-1, keepdims=True)) < 1e-14
    flash = mha(tn, score_scale="d_model", attn_impl="flash", tile_size=2)
    flash.load_state_dict(m.state_dict())
    assert max_abs_diff(flash(x, x, x), m(x, x, x)) < 1e-13


def test_shared_head_projection_counts_and_ties_the_heads():
    """3 (dk^2 + dk) + d^2 + d parameters; heads fed the same slice attend the same way."""
    dk = D // H
    assert mha(tn, True).num_parameters() == 3 * (dk * dk + dk) + D * D + D
    assert sum(p.numel() for p in mha(tt, True).parameters()) == 3 * (dk * dk + dk) + D * D + D
    assert mha(tn).num_parameters() == 4 * (D * D + D)
    x = np.tile(np.random.default_rng(3).standard_normal((1, 4, dk)), (1, 1, H))  # every slice the same
    m = mha(tn, True)
    m(x, x, x)
    assert max_abs_diff(m.attn_weights[:, 0], m.attn_weights[:, 1]) == 0.0


# -- the model options ----------------------------------------------------------------------------------------


def test_no_target_padding_mask_lets_queries_see_padded_keys():
    model = np_model(tgt_padding_mask=False).eval()
    model(SRC, TGT_IN)
    w = model.attention_weights()["decoder"][0]  # (B, H, T, T); row 1 has padding at positions 3
    assert w[1, :, 3, 3].min() > 0  # the padded key, seen by the last query
    ref = np_model().eval()
    ref(SRC, TGT_IN)
    assert ref.attention_weights()["decoder"][0][1, :, 3, 3].max() == 0


@pytest.mark.parametrize("lib", [tn, tt])
@pytest.mark.parametrize("opts", [dict(tgt_padding_mask=False), dict(embed_scale="logits", embed_norm=True)])
def test_decode_step_matches_decode(lib, opts):
    model = np_model(**opts).eval()
    src, tgt = (SRC, TGT_IN) if lib is tn else (T(SRC), T(TGT_IN))
    if lib is tt:
        model = torch_twin(model).eval()
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        full = model.decode(tgt, memory, src_mask)
        cache, steps = {}, []
        for i in range(tgt.shape[1]):
            steps.append(model.decode_step(tgt[:, i : i + 1], memory, src_mask, cache))
    step = np.concatenate([np.asarray(s) for s in steps], axis=1)
    assert max_abs_diff(full, step) < 1e-12


@pytest.mark.parametrize("scale", ["embedding", "logits", "none"])
def test_embedding_scale_and_init(scale):
    model = tn.Transformer(50, 50, d_model=16, n_heads=2, d_ff=16, n_layers=1, rng=0, dtype=np.float64,
                           embed_scale=scale)  # fmt: skip
    std = model.tgt_embed.weight.data[1:].std()
    assert abs(std - (1.0 if scale == "none" else 16**-0.5)) < 0.1 * (1.0 if scale == "none" else 16**-0.5)
    y = np.random.default_rng(0).standard_normal((1, 2, 16))
    out = model._logits(y)
    plain = y @ model.output_projection.weight.data.T
    assert max_abs_diff(out, plain * (16**-0.5 if scale == "logits" else 1.0)) < 1e-12


def test_embed_norm_parameters_in_both_tracks():
    model = np_model(embed_norm=True)
    names = [k for k in model.state_dict() if "embed_norm" in k]
    assert names == ["src_embed_norm.weight", "src_embed_norm.bias", "tgt_embed_norm.weight", "tgt_embed_norm.bias"]
    assert names == [k for k in torch_twin(model).state_dict() if "embed_norm" in k]


def test_torch_nn_conversion_refuses_a_pitfall_model():
    with pytest.raises(ValueError, match="no counterpart of the options \\['score_scale'\\]"):
        tt.to_torch_nn_transformer(torch_twin(np_model(score_scale="d_model")))


# -- bad values: refused, with the same message in both tracks ------------------------------------------------

BAD = [
    ("score_scale", "sqrt_d", ValueError),
    ("head_projection", "split", ValueError),
    ("dropout_place", "before_norm", ValueError),
    ("ff_dropout", 1, TypeError),
    ("embed_scale", "both", ValueError),
    ("embed_norm", "yes", TypeError),
    ("tgt_padding_mask", None, TypeError),
]


def _message(fn, err):
    with pytest.raises(err) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("arg,value,err", BAD, ids=[b[0] for b in BAD])
def test_bad_model_options_refused_alike(arg, value, err):
    kw = dict(d_model=8, n_heads=2, d_ff=16, n_layers=1)
    a = _message(lambda: tn.Transformer(11, 11, **kw, **{arg: value}), err)
    b = _message(lambda: tt.Transformer(11, 11, **kw, **{arg: value}), err)
    assert a == b and arg in a and repr(value) in a


@pytest.mark.parametrize("arg,value,err", BAD[:4], ids=[b[0] for b in BAD[:4]])
@pytest.mark.parametrize("cls", ["EncoderLayer", "DecoderLayer"])
def test_bad_layer_options_refused_alike(cls, arg, value, err):
    a = _message(lambda: getattr(tn, cls)(D, H, DFF, **{arg: value}), err)
    b = _message(lambda: getattr(tt, cls)(D, H, DFF, **{arg: value}), err)
    assert a == b and arg in a


@pytest.mark.parametrize("lib", [tn, tt])
def test_after_norm_needs_post_ln(lib):
    for make in (lambda: lib.EncoderLayer(D, H, DFF, norm_first=True, dropout_place="after_norm"),
                 lambda: lib.Transformer(11, 11, d_model=8, n_heads=2, d_ff=16, n_layers=1, norm_first=True,
                                         dropout_place="after_norm")):  # fmt: skip
        assert "needs Post-LN" in _message(make, ValueError)


def test_bad_attention_options_refused_alike():
    for cls in ("MultiHeadAttention", "SharedHeadProjectionAttention"):
        a = _message(lambda cls=cls: getattr(tn, cls)(D, H, score_scale="d_v"), ValueError)
        b = _message(lambda cls=cls: getattr(tt, cls)(D, H, score_scale="d_v"), ValueError)
        assert a == b and a.startswith(f"{cls}: score_scale must be one of")
    a = _message(lambda: tn.make_attention("split", D, H), ValueError)
    assert a == _message(lambda: tt.make_attention("split", D, H), ValueError)


# -- checkpoints carry the options ----------------------------------------------------------------------------


def test_checkpoint_round_trip_keeps_the_options(tmp_path):
    """A NumPy model with options, saved; load_model rebuilds it in both tracks; a default model is refused."""
    model = np_model(head_projection="shared", embed_scale="logits", embed_norm=True).eval()
    path = tn.save_checkpoint(tmp_path / "pitfalls.npz", model)
    back = tn.load_model(path, dtype=np.float64).eval()
    assert back.config == model.config and np.array_equal(back(SRC, TGT_IN), model(SRC, TGT_IN))
    twin = tt.load_model(path, dtype=torch.float64).eval()
    with torch.no_grad():
        assert max_abs_diff(twin(T(SRC), T(TGT_IN)), model(SRC, TGT_IN)) < TRACK_TOL
    with pytest.raises(ValueError, match="configured differently"):
        tn.load_checkpoint(path, np_model())


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_after_norm_drops_entries_of_the_layer_output_itself(lib):
    """Where the dropout sits, seen in training: dropout(norm(x + f(x))) zeroes entries of the layer's output
    (about p of them), the default norm(x + dropout(f(x))) none; in evaluation the two are the same layer."""
    x = np.random.default_rng(0).standard_normal((4, 6, D))
    dtype, A = (np.float64, np.asarray) if lib is tn else (torch.float64, torch.from_numpy)
    outputs = {}
    for place in ("after_norm", "sublayer"):
        layer = lib.EncoderLayer(D, H, DFF, 0.5, rng=1, dtype=dtype, dropout_place=place)
        train, test = (to_numpy(layer.train()(A(x))), to_numpy(layer.eval()(A(x))))
        zeros = float((train == 0).mean())
        assert zeros > 0.3 if place == "after_norm" else zeros == 0, (place, zeros)
        outputs[place] = test
    assert max_abs_diff(outputs["after_norm"], outputs["sublayer"]) == 0
