"""The full Transformer in both tracks: a gradient check of the whole NumPy model for every option combination,
the NumPy model against the torch model, the torch model against torch.nn.Transformer with converted weights,
weight sharing, parameter counts, masks, dropout, float32, initialization and bad input."""

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff, to_numpy

import tfm_numpy as tn
import tfm_torch as tt

GRAD_TOL = 1e-7  # relative error of the whole model's gradient (float64): the book's standard
TRACK_TOL = 1e-10  # max abs difference between implementations (float64)
PAD = 0
TINY = dict(d_model=8, n_heads=2, d_ff=16, n_layers=2, max_len=6)

# A batch of two, padded on both sides: src lengths 5 and 3; tgt = BOS ... , tgt_in = tgt[:, :-1], tgt_out = tgt[:, 1:]
SRC = np.array([[3, 7, 1, 9, 5], [2, 10, 4, 0, 0]])
TGT = np.array([[1, 12, 5, 8, 2], [1, 6, 11, 0, 0]])
TGT_IN, TGT_OUT = TGT[:, :-1], TGT[:, 1:]

SHARING = [(False, False), (False, True), (True, False), (True, True)]  # (share_embeddings, tie_output)
COMBOS = list(itertools.product([False, True], ["sinusoidal", "learned"], SHARING))
IDS = [f"{'preLN' if nf else 'postLN'}-{pos}-share{int(s)}-tie{int(t)}" for nf, pos, (s, t) in COMBOS]


def config(norm_first=False, positional="sinusoidal", share=False, tie=True, dropout=0.0, **kw) -> dict:
    vocab = dict(src_vocab_size=13 if share else 11, tgt_vocab_size=13)  # shared embeddings need one vocabulary
    opts = dict(norm_first=norm_first, positional=positional, share_embeddings=share, tie_output=tie, pad_id=PAD)
    return {**vocab, **TINY, "dropout": dropout, **opts, **kw}


def perturb_norms(model, seed: int = 0):
    """LayerNorms away from their initial weight 1 and bias 0 (as after training), so that a mix-up of two norms
    (norm1 and norm2 loaded into each other's place, say) shows in every comparison."""
    rng = np.random.default_rng(seed)
    for _, m in model.named_modules():
        if isinstance(m, (tn.LayerNorm, tt.LayerNorm)):
            for p, base in ((m.weight, 1.0), (m.bias, 0.0)):
                new = base + 0.3 * rng.standard_normal(tuple(p.shape))
                if isinstance(p, tn.Parameter):
                    p.data[...] = new
                else:
                    with torch.no_grad():
                        p.copy_(torch.from_numpy(new))
    return model


def np_model(seed=0, dtype=np.float64, **kw) -> tn.Transformer:
    return perturb_norms(tn.Transformer(**config(**kw), rng=seed, dtype=dtype), seed)


def torch_twin(model: tn.Transformer, dtype=torch.float64) -> tt.Transformer:
    """The torch model with the NumPy model's weights: the book's one-liner."""
    twin = tt.Transformer(**model.config, rng=0, dtype=dtype)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return twin.train(model.training)


def T(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


# -- the gradient check of the whole NumPy model -------------------------------------------------------------------


def model_grad_check(model: tn.Transformer, h: float = 1e-5, seed: int = 0, dropout_seed=None) -> dict[str, float]:
    """Relative errors of backward against central differences, per parameter, for the cross-entropy loss (ignoring
    padding) of the batch above.

    Every entry of every parameter would take ~7000 forwards per model (~10 s); instead each parameter is checked
    three ways (6 forwards): along a random +-1 direction v over ALL its entries (dL/dv = <grad, v>, so any wrong
    entry shows), at its entry of largest analytic gradient, and at one random entry. Errors: |a - n| / sum|grad * v|
    for the direction (the scale of its terms: the sum itself can cancel, e.g. a bias before a LayerNorm has a
    gradient orthogonal to (1, ..., 1)), |a_i - n_i| / max(max|grad|, |n_i|) for the entries (as tn.rel_error).

    Each attention's k_proj.bias has a true gradient of 0 (q.(k + b) = q.k + q.b shifts a whole row of scores,
    which softmax ignores): a relative error would compare round-off noises, so it must be ~0 on both sides instead.
    Parameters that the encoder never sees are checked through `decode` with the memory kept: half the work.
    h = 1e-5, not 1e-6: some gradients (the query biases') are ~1e-2 against a loss of ~2.6, where the rounding error
    ~ 1e-16 L / h dominates; at 1e-5 it drops tenfold (largest error ~4e-8) and the truncation error ~ h^2 stays far
    below. With `dropout_seed`, every Dropout gets a fresh generator of its own before each run: the same masks each
    time.
    """
    loss_fn = tn.CrossEntropyLoss(ignore_index=PAD)
    dropouts = [m for _, m in model.named_modules() if isinstance(m, tn.Dropout)]

    def reseed():
        for i, m in enumerate(dropouts if dropout_seed is not None else []):
            m.rng = np.random.default_rng([dropout_seed, i])

    model.zero_grad()
    reseed()
    memory, src_mask = model.encode(SRC)
    loss_fn(model.decode(TGT_IN, memory, src_mask), TGT_OUT)
    model.backward(loss_fn.backward())
    analytic = {name: g.copy() for name, g in model.grads().items()}
    scale = max(np.abs(g).max() for g in analytic.values())
    src_side = (model.src_embed, model.src_pos, getattr(model, "src_embed_norm", None), model.encoder)
    encoder_side = {id(p) for m in src_side if m is not None for p in m.parameters()}

    rng = np.random.default_rng(seed)
    errors = {}
    for name, p in model.named_parameters():
        if id(p) in encoder_side:

            def loss():
                reseed()
                return float(loss_fn(model(SRC, TGT_IN), TGT_OUT))

        else:

            def loss():
                reseed()  # the decoder's dropouts get their masks back; the encoder's are not called
                return float(loss_fn(model.decode(TGT_IN, memory, src_mask), TGT_OUT))

        def derivative(direction, p=p, loss=loss) -> float:
            original = p.data.copy()
            p.data[...] = original + h * direction
            up = loss()
            p.data[...] = original - h * direction
            down = loss()
            p.data[...] = original
            return (up - down) / (2 * h)

        g = analytic[name]
        v = rng.choice([-1.0, 1.0], size=p.shape)
        a, n = float((g * v).sum()), derivative(v)
        if name.endswith("k_proj.bias"):
            assert abs(a) < 1e-12 * scale and abs(n) < 1e-8, (name, a, n)
            continue
        err = [abs(a - n) / np.abs(g * v).sum()]  # the terms' scale, not |a|: the sum can cancel
        for i in {int(np.abs(g).argmax()), int(rng.integers(g.size))}:
            e = np.zeros(g.size)
            e[i] = 1
            n = derivative(e.reshape(g.shape))
            err.append(abs(g.flat[i] - n) / max(np.abs(g).max(), abs(n)))
        errors[name] = max(err)
    return errors


@pytest.mark.parametrize("norm_first,positional,sharing", COMBOS, ids=IDS)
def test_whole_model_gradient_check(norm_first, positional, sharing):
    share, tie = sharing
    model = np_model(norm_first=norm_first, positional=positional, share=share, tie=tie).eval()
    errors = model_grad_check(model)
    checked = set(errors) | {n for n, _ in model.named_parameters() if n.endswith("k_proj.bias")}
    assert checked == {n for n, _ in model.named_parameters()}, "every parameter must be checked"
    assert ("src_pos.weight" in errors) == (positional == "learned")
    assert ("output_projection.weight" in errors) == (not tie) and ("tgt_embed.weight" in errors) == (not share)
    assert max(errors.values()) < GRAD_TOL, {k: v for k, v in errors.items() if v >= GRAD_TOL}


def test_whole_model_gradient_check_with_dropout_on():
    """Training mode, p = 0.2 everywhere, every Dropout re-seeded before each forward: the same masks every time."""
    model = np_model(norm_first=True, positional="learned", share=True, tie=True, dropout=0.2).train()
    errors = model_grad_check(model, dropout_seed=7)
    assert any(not m.mask.all() for _, m in model.named_modules() if isinstance(m, tn.Dropout) and m.p > 0)
    assert max(errors.values()) < GRAD_TOL, {k: v for k, v in errors.items() if v >= GRAD_TOL}


def test_gradient_check_catches_an_untied_gradient(monkeypatch):
    """The check can fail: an output projection whose backward forgets to add into the tied weight's gradient."""
    original = tn.Linear.backward

    def forgetful(self, grad_out):
        saved = self.weight.grad.copy()
        dx = original(self, grad_out)
        if self.out_features == 13 and self.bias is None:
            self.weight.grad[...] = saved  # BUG: the output projection's use is lost
        return dx

    monkeypatch.setattr(tn.Linear, "backward", forgetful)
    errors = model_grad_check(np_model(tie=True).eval())
    assert errors["tgt_embed.weight"] > 1e-2


def test_tied_weight_gradient_is_the_sum_of_every_use():
    """Shared + tied: one matrix, three uses (source lookup, target lookup, output projection). Its gradient equals
    the sum of the three separate gradients of an untied model holding three copies of the same matrix."""
    tied = np_model(share=True, tie=True).eval()
    untied = np_model(share=False, tie=False, src_vocab_size=13).eval()
    shared_state = tied.state_dict()
    untied.load_state_dict({k: shared_state.get(k, shared_state["src_embed.weight"]) for k in untied.state_dict()})
    grads = []
    for m in (tied, untied):
        m.zero_grad()
        logits = m(SRC, TGT_IN)
        m.backward(np.random.default_rng(1).standard_normal(logits.shape))
        grads.append(m.grads())
    g_tied, g = grads
    assert "tgt_embed.weight" not in g_tied and "output_projection.weight" not in g_tied
    total = g["src_embed.weight"] + g["tgt_embed.weight"] + g["output_projection.weight"]
    assert max_abs_diff(g_tied["src_embed.weight"], total) < 1e-12
    assert tied.src_embed.weight is tied.tgt_embed.weight is tied.output_projection.weight


# -- NumPy model vs torch model --------------------------------------------------------------------------------------


def run_both(model: tn.Transformer, twin: tt.Transformer, seed: int = 1):
    """Logits and every gradient (unique parameters) from a random dL/dlogits, in both tracks."""
    model.zero_grad()
    logits = model(SRC, TGT_IN)
    g = np.random.default_rng(seed).standard_normal(logits.shape).astype(logits.dtype)
    model.backward(g)
    twin.zero_grad(set_to_none=True)
    t_logits = twin(T(SRC), T(TGT_IN))
    t_logits.backward(T(g))
    return logits, model.grads(), t_logits, {k: p.grad for k, p in twin.named_parameters()}


@pytest.mark.parametrize("norm_first,positional,sharing", COMBOS, ids=IDS)
def test_numpy_and_torch_models_agree_float64(norm_first, positional, sharing):
    share, tie = sharing
    model = np_model(norm_first=norm_first, positional=positional, share=share, tie=tie).eval()
    twin = torch_twin(model)
    assert list(model.state_dict()) == list(twin.state_dict())
    logits, grads, t_logits, t_grads = run_both(model, twin)
    assert logits.shape == (2, 4, 13)
    assert list(grads) == list(t_grads), "the same unique parameters, in the same order"
    diffs = [max_abs_diff(logits, t_logits)] + [max_abs_diff(grads[k], t_grads[k]) for k in grads]
    assert max(diffs) < TRACK_TOL, max(diffs)
    assert all(np.abs(g).max() > 0 for k, g in grads.items() if not k.endswith("k_proj.bias"))


def test_numpy_and_torch_models_agree_with_dropout_on_and_shared_masks():
    """Training mode, p = 0.3: each NumPy Dropout's mask handed to the torch Dropout of the same name."""
    model = np_model(norm_first=False, positional="learned", share=True, tie=True, dropout=0.3).train()
    twin = torch_twin(model)
    model(SRC, TGT_IN)  # draws the masks
    masks = {n: m.mask for n, m in model.named_modules() if isinstance(m, tn.Dropout) and m.mask is not None}
    assert len(masks) == 2 + 2 * 4 + 2 * 6  # embeddings, 2 encoder layers (4 each), 2 decoder layers (6 each)
    for name, m in twin.named_modules():
        if name in masks:
            m.forward = functools.partial(tt.Dropout.forward, m, mask=torch.from_numpy(masks[name]))
    for name, m in model.named_modules():
        if name in masks:
            m.forward = functools.partial(tn.Dropout.forward, m, mask=masks[name])
    logits, grads, t_logits, t_grads = run_both(model, twin)
    assert max_abs_diff(logits, t_logits) < TRACK_TOL
    assert max(max_abs_diff(grads[k], t_grads[k]) for k in grads) < TRACK_TOL
    model.eval()
    assert max_abs_diff(logits, model(SRC, TGT_IN)) > 1e-3  # the masks did something


def test_encode_then_decode_is_forward_and_attention_weights_are_kept():
    model = np_model(norm_first=True).eval()
    twin = torch_twin(model)
    memory, src_mask = model.encode(SRC)
    assert memory.shape == (2, 5, 8) and src_mask.shape == (2, 1, 1, 5) and src_mask.dtype == bool
    assert np.array_equal(model.decode(TGT_IN, memory, src_mask), model(SRC, TGT_IN))
    t_memory, t_src_mask = twin.encode(T(SRC))
    assert torch.equal(twin.decode(T(TGT_IN), t_memory, t_src_mask), twin(T(SRC), T(TGT_IN)))
    for m in (model, twin):
        w = m.attention_weights()
        assert [tuple(a.shape) for a in w["encoder"]] == [(2, 2, 5, 5)] * 2
        assert [tuple(a.shape) for a in w["decoder"]] == [(2, 2, 4, 4)] * 2
        assert [tuple(a.shape) for a in w["cross"]] == [(2, 2, 4, 5)] * 2
        assert np.all(to_numpy(w["cross"][0])[1, :, :, 3:] == 0)  # source padding gets no attention
        assert np.all(to_numpy(w["decoder"][1])[1, :, :, 3] == 0)  # nor does target padding


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_padding_and_the_future_do_not_leak(lib):
    """More padding changes nothing at real positions; a later target token changes nothing before it."""
    model = np_model(positional="sinusoidal") if lib is tn else torch_twin(np_model())
    model.eval()
    run = (lambda s, t: model(s, t)) if lib is tn else (lambda s, t: model(T(s), T(t)).detach().numpy())
    base = run(SRC, TGT_IN)
    more_src_pad = run(np.pad(SRC, ((0, 0), (0, 1))), TGT_IN)
    assert max_abs_diff(base, more_src_pad) < 1e-12
    more_tgt_pad = run(SRC, np.pad(TGT_IN, ((0, 0), (0, 1))))
    assert max_abs_diff(base, more_tgt_pad[:, :4]) < 1e-12
    changed = TGT_IN.copy()
    changed[:, 2] = 9
    out = run(SRC, changed)
    assert max_abs_diff(base[:, :2], out[:, :2]) < 1e-12 and max_abs_diff(base[:, 2:], out[:, 2:]) > 1e-3


# -- our torch model vs torch.nn.Transformer -----------------------------------------------------------------------

REF_CASES = [
    (nf, pos, s, t, fn)
    for nf in (False, True)
    for pos in ("sinusoidal", "learned")
    for s, t in ((False, False), (True, True))
    for fn in (None,)
] + [(False, "sinusoidal", False, True, True), (True, "learned", False, True, False)]
REF_IDS = [f"{'preLN' if c[0] else 'postLN'}-{c[1]}-share{int(c[2])}-tie{int(c[3])}-final{c[4]}" for c in REF_CASES]


def torch_model(seed=0, dtype=torch.float64, **kw) -> tt.Transformer:
    return perturb_norms(tt.Transformer(**config(**kw), rng=seed, dtype=dtype), seed)


@pytest.mark.parametrize("norm_first,positional,share,tie,final_norm", REF_CASES, ids=REF_IDS)
def test_torch_model_matches_torch_nn_transformer(norm_first, positional, share, tie, final_norm):
    ours = torch_model(norm_first=norm_first, positional=positional, share=share, tie=tie, final_norm=final_norm)
    ref = tt.to_torch_nn_transformer(ours)
    assert isinstance(ref.transformer, torch.nn.Transformer)
    assert (ref.transformer.encoder.norm is None) == (ours.encoder.norm is None)
    assert ref.num_parameters() == ours.num_parameters()

    # training mode (dropout 0: deterministic) with autograd: logits and every gradient
    g = torch.randn(2, 4, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for m in (ours, ref):
        m.train().zero_grad(set_to_none=True)
        m(T(SRC), T(TGT_IN)).backward(g)
    assert max_abs_diff(ours(T(SRC), T(TGT_IN)), ref(T(SRC), T(TGT_IN))) < TRACK_TOL
    ours_grads = tt.to_reference_state_dict({k: p.grad for k, p in ours.named_parameters()})
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    assert set(ours_grads) == set(ref_grads)
    assert max(max_abs_diff(ours_grads[k], ref_grads[k]) for k in ref_grads) < TRACK_TOL

    # eval mode without autograd: torch's encoder layers may take their fused fast path
    ours.eval(), ref.eval()
    with torch.no_grad():
        assert max_abs_diff(ours(T(SRC), T(TGT_IN)), ref(T(SRC), T(TGT_IN))) < TRACK_TOL

    # and back: the same weights, bit for bit
    back = tt.from_torch_nn_transformer(ref)
    assert back.config == ours.config and not back.training
    state, back_state = ours.state_dict(), back.state_dict()
    assert list(state) == list(back_state) and all(torch.equal(state[k], back_state[k]) for k in state)


def test_a_final_layer_norm_with_weight_one_and_bias_zero_is_not_the_identity():
    """Why a Post-LN model without final norms needs custom encoder/decoder in torch.nn.Transformer: the default
    final LayerNorm, even at weight 1 and bias 0, changes the output (it normalizes each position). (At
    initialization it nearly is the identity, because the last layer's own norm3 is still at weight 1 and bias 0
    too; our LayerNorms are perturbed, as after training.)"""
    ours = torch_model(norm_first=False).eval()
    with_norms = tt.ReferenceTransformer(**{**ours.config, "final_norm": True}, dtype=torch.float64).eval()
    with_norms.load_state_dict(tt.to_reference_state_dict(ours.state_dict()), strict=False)
    assert torch.equal(with_norms.transformer.encoder.norm.weight, torch.ones(8, dtype=torch.float64))
    with torch.no_grad():
        assert max_abs_diff(ours(T(SRC), T(TGT_IN)), with_norms(T(SRC), T(TGT_IN))) > 1e-2


def test_conversion_leaves_the_global_torch_generator_alone_and_keeps_dtype():
    ours = torch_model(dtype=torch.float32)
    state = torch.random.get_rng_state()
    ref = tt.to_torch_nn_transformer(ours)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(p.dtype == torch.float32 for p in ref.parameters())


def test_numpy_weights_into_torch_nn_transformer():
    """The book's path: NumPy weights -> our torch model -> torch.nn.Transformer, logits within TRACK_TOL."""
    model = np_model(norm_first=True, positional="learned").eval()
    ref = tt.to_torch_nn_transformer(torch_twin(model)).eval()
    with torch.no_grad():
        assert max_abs_diff(model(SRC, TGT_IN), ref(T(SRC), T(TGT_IN))) < TRACK_TOL


def test_reference_state_dict_mapping():
    ours = torch_model(norm_first=True)
    mapped = tt.to_reference_state_dict(ours.state_dict())
    w = mapped["transformer.encoder.layers.0.self_attn.in_proj_weight"]
    layer = ours.encoder.layers[0].self_attn
    assert torch.equal(w, torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
    assert "transformer.decoder.layers.1.multihead_attn.in_proj_bias" in mapped
    assert "transformer.encoder.layers.1.linear2.weight" in mapped and "transformer.decoder.norm.bias" in mapped
    assert set(mapped) == set(tt.ReferenceTransformer(**ours.config).state_dict())
    back = tt.from_reference_state_dict(mapped)
    assert set(back) == set(ours.state_dict()) and all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


# -- parameters ------------------------------------------------------------------------------------------------------


def expected_count(src_vocab, tgt_vocab, d, d_ff, n, share, tie, learned, max_len, final_norm) -> int:
    """The count by hand: attention 4 (d^2 + d), feed-forward 2 d d_ff + d_ff + d, LayerNorm 2 d."""
    attn, ff, ln = 4 * (d * d + d), 2 * d * d_ff + d_ff + d, 2 * d
    enc_layer, dec_layer = attn + ff + 2 * ln, 2 * attn + ff + 3 * ln
    embeddings = src_vocab * d + (0 if share else tgt_vocab * d) + (0 if tie else tgt_vocab * d)
    return embeddings + 2 * learned * max_len * d + n * (enc_layer + dec_layer) + 2 * final_norm * ln


@pytest.mark.parametrize("norm_first,positional,sharing", COMBOS[::3], ids=IDS[::3])
def test_parameter_counts(norm_first, positional, sharing):
    share, tie = sharing
    model = np_model(norm_first=norm_first, positional=positional, share=share, tie=tie)
    twin = torch_twin(model)
    n = model.num_parameters()
    assert n == twin.num_parameters() == sum(p.numel() for p in twin.parameters())
    assert n == tt.to_torch_nn_transformer(twin).num_parameters()
    c = model.config
    assert n == expected_count(
        c["src_vocab_size"], 13, 8, 16, 2, share, tie, positional == "learned", 6, norm_first
    )  # tied parameters counted once
    assert list(model.state_dict()) == list(twin.state_dict())
    assert "output_projection.weight" in model.state_dict() and "tgt_embed.weight" in model.state_dict()  # each name


def test_paper_base_configuration_count_matches_the_formula():
    """Base: d_model 512, 8 heads, d_ff 2048, 6 + 6 layers, a shared 37000-token vocabulary, shared embeddings and
    tied output: 63,082,496 with our modules (the paper reports 65M). Built in float32 (~250 MB, a few seconds)."""
    model = tn.Transformer(37000, 37000, share_embeddings=True, tie_output=True, dropout=0.1, rng=0)
    assert model.num_parameters() == expected_count(37000, 37000, 512, 2048, 6, True, True, False, 0, False)
    assert model.num_parameters() == 63_082_496


# -- modes, dtypes, state, initialization ----------------------------------------------------------------------------


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_dropout_train_differs_from_eval_and_eval_is_deterministic(lib):
    dt = np.float64 if lib is tn else torch.float64
    model = lib.Transformer(**config(dropout=0.1), rng=5, dtype=dt)
    src, tgt = (SRC, TGT_IN) if lib is tn else (T(SRC), T(TGT_IN))
    out = lambda: to_numpy(model(src, tgt))  # noqa: E731
    model.train()
    a, b = out(), out()
    assert max_abs_diff(a, b) > 1e-3  # fresh masks each forward
    model.eval()
    c, d = out(), out()
    assert np.array_equal(c, d) and max_abs_diff(a, c) > 1e-3
    again = lib.Transformer(**config(dropout=0.1), rng=5, dtype=dt).train()
    assert np.array_equal(to_numpy(again(src, tgt)), a)  # the same seed: the same weights and masks
    if lib is tn:
        model.train()
        logits = model(src, tgt)
        model.backward(np.ones_like(logits))
        assert all(np.isfinite(g).all() for g in model.grads().values())


def test_float32_end_to_end():
    model64 = np_model(norm_first=True, positional="learned", share=True, tie=True)
    model = np_model(norm_first=True, positional="learned", share=True, tie=True, dtype=np.float32)
    model.load_state_dict(model64.state_dict())
    twin = torch_twin(model, dtype=torch.float32)
    logits, grads, t_logits, t_grads = run_both(model, twin)
    logits64, grads64, _, _ = run_both(model64, torch_twin(model64))
    assert logits.dtype == np.float32 and t_logits.dtype == torch.float32
    assert all(g.dtype == np.float32 for g in grads.values()) and all(
        g.dtype == torch.float32 for g in t_grads.values()
    )
    assert max_abs_diff(logits, logits64) < 1e-4 and max_abs_diff(t_logits, logits64) < 1e-4
    assert max(tn.rel_error(grads[k], grads64[k]) for k in grads if not k.endswith("k_proj.bias")) < 1e-3
    model.double()  # converting keeps the ties
    assert model.output_projection.weight is model.tgt_embed.weight is model.src_embed.weight
    assert model(SRC, TGT_IN).dtype == np.float64


def test_state_dict_round_trip_numpy_torch_numpy():
    model = np_model(positional="learned", share=False, tie=True)
    twin = torch_twin(model)
    back = np_model(seed=9, positional="learned", share=False, tie=True)
    back.load_state_dict({k: v.numpy() for k, v in twin.state_dict().items()})
    assert all(np.array_equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    assert back.output_projection.weight is back.tgt_embed.weight  # loading keeps the tie
    assert np.array_equal(back(SRC, TGT_IN), model(SRC, TGT_IN))


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_initialization(lib):
    def to_numpy(p):
        return p.data if isinstance(p, tn.Parameter) else p.detach().numpy()

    d, V = 64, 400
    model = lib.Transformer(V, V, d_model=d, n_heads=4, d_ff=128, n_layers=1, tie_output=False, rng=3)
    emb = to_numpy(model.src_embed.weight)
    assert np.all(emb[PAD] == 0)
    assert abs(emb[1:].std() * math.sqrt(d) - 1) < 0.05  # N(0, 1/d): times sqrt(d), unit variance
    for name, p in [*model.encoder.named_parameters(), *model.decoder.named_parameters(), ("out", None)]:
        w = to_numpy(model.output_projection.weight if p is None else p)
        if w.ndim == 2:
            a = math.sqrt(6 / sum(w.shape))  # Xavier-uniform: U(-a, a), std a / sqrt(3)
            assert np.abs(w).max() <= a and abs(w.std() * math.sqrt(3) / a - 1) < 0.1, name
    again = lib.Transformer(V, V, d_model=d, n_heads=4, d_ff=128, n_layers=1, tie_output=False, rng=3)
    other = lib.Transformer(V, V, d_model=d, n_heads=4, d_ff=128, n_layers=1, tie_output=False, rng=4)
    same = to_numpy(again.decoder.layers[0].ff.linear1.weight)
    assert np.array_equal(same, to_numpy(model.decoder.layers[0].ff.linear1.weight))
    assert not np.array_equal(same, to_numpy(other.decoder.layers[0].ff.linear1.weight))


# -- bad input -------------------------------------------------------------------------------------------------------

BAD_CONFIG = {
    "share with two vocabularies": (dict(share_embeddings=True), ValueError, "src_vocab_size=11 and tgt_vocab_size=13"),
    "unknown positional": (dict(positional="rotary"), ValueError, "positional must be one of"),
    "unknown activation": (dict(activation="swish"), ValueError, "activation must be one of"),
    "heads": (dict(n_heads=3), ValueError, "d_model=8 must be divisible by n_heads=3"),
    "odd d_model": (dict(d_model=9, n_heads=3), ValueError, "sinusoidal positions need an even d_model"),
    "pad_id": (dict(pad_id=11), ValueError, r"pad_id must be an int in \[0, 11\)"),
    "dropout": (dict(dropout=1.5), ValueError, r"dropout must be in \[0, 1\)"),
    "norm_first": (dict(norm_first=None), TypeError, "norm_first expected True or False"),
    "tie_output": (dict(tie_output="yes"), TypeError, "tie_output expected True or False"),
    "n_layers": (dict(n_layers=0), ValueError, "n_layers must be an int >= 1, got 0"),
    "max_len": (dict(max_len=0), ValueError, "max_len must be an int >= 1, got 0"),
}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD_CONFIG)
def test_bad_configuration(lib, case):
    kw, exc, match = BAD_CONFIG[case]
    args = {**dict(src_vocab_size=11, tgt_vocab_size=13, **TINY), **kw}
    with pytest.raises(exc, match=match):
        lib.Transformer(**args)
    if lib is tt:
        with pytest.raises(exc, match=match):
            tt.ReferenceTransformer(**args)


BAD_TOKENS = {
    "src too long": (np.ones((2, 7), dtype=np.int64), TGT_IN, ValueError, "src has length 7, more than max_len=6"),
    "tgt too long": (SRC, np.ones((2, 7), dtype=np.int64), ValueError, "tgt_in has length 7, more than max_len=6"),
    "float tokens": (SRC.astype(np.float32), TGT_IN, TypeError, "src: expected an integer"),
    "bool tokens": (SRC, TGT_IN > 0, TypeError, "tgt_in: expected an integer"),
    "src id too large": (SRC + 5, TGT_IN, ValueError, r"src: values must be in \[0, 11\), got 12"),
    "negative id": (SRC, TGT_IN - 2, ValueError, r"tgt_in: values must be in \[0, 13\), got -1"),
    "rank 1": (SRC[0], TGT_IN, ValueError, r"src expected shape \(B, T\)"),
    "rank 3": (SRC, TGT_IN[None], ValueError, r"tgt_in expected shape \(B, T\)"),
    "empty": (SRC[:, :0], TGT_IN, ValueError, r"T >= 1"),
    "batch sizes": (SRC, TGT_IN[:1], ValueError, r"memory expected shape \(B=1, S, 8\)"),
}


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD_TOKENS)
def test_bad_tokens(lib, case):
    src, tgt, exc, match = BAD_TOKENS[case]
    model = (np_model() if lib is tn else torch_model()).eval()
    if lib is tt:
        src, tgt = T(src), T(tgt)
    with pytest.raises(exc, match=match):
        model(src, tgt)


def test_numpy_backward_misuse():
    model = np_model()
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward(np.ones((2, 4, 13)))
    logits = model(SRC, TGT_IN)
    with pytest.raises(ValueError, match=r"Transformer.backward: grad_out expected shape \(2, 4, 13\)"):
        model.backward(np.ones((2, 4, 11)))
    with pytest.raises(TypeError, match="expected dtype float64"):
        model.backward(np.ones_like(logits, dtype=np.float32))
    _, src_mask = model.encode(SRC)
    with pytest.raises(TypeError, match="memory: expected dtype float64"):
        model.decode(TGT_IN, np.ones((2, 5, 8), dtype=np.float32), src_mask)
