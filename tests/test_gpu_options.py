"""The torch track's GPU options, checked on the CPU: attn_impl="sdpa" (torch's fused attention) equals the explicit
attention in float64, outputs and every gradient, masks and empty rows included; the NumPy track refuses it by
name; bfloat16 autocast runs the whole model with the loss in float32; torch.compile traces the model unchanged.
The speed of these options on a GPU is measured in benchmarks/gpu_train.py, not here."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tfm_numpy as tn
import tfm_torch as tt

V, PAD, BOS, EOS = 13, 0, 1, 2
SRC = torch.tensor([[3, 7, 4, 9, 5], [6, 10, 4, PAD, PAD]])
TGT = torch.tensor([[BOS, 4, 8, 3, 6, 5], [BOS, 6, 3, EOS, PAD, PAD]])


def model(attn_impl="explicit", dtype=torch.float64, dropout=0.0):
    m = tt.Transformer(V, V, 16, 4, 32, 2, dropout=dropout, max_len=16, rng=0, dtype=dtype, attn_impl=attn_impl)
    return m.eval()


def grads(m) -> dict:
    m.zero_grad(set_to_none=True)
    loss = tt.CrossEntropyLoss(ignore_index=PAD)(m(SRC, TGT[:, :-1]), TGT[:, 1:])
    loss.backward()
    return {"loss": loss.detach(), **{k: p.grad for k, p in m.named_parameters()}}


def test_sdpa_equals_explicit_attention_on_outputs_and_every_gradient_float64():
    ref, fused = model(), model("sdpa")
    ref.train(), fused.train()  # dropout 0: training mode changes nothing but exercises that path
    a, b = grads(ref), grads(fused)
    assert a.keys() == b.keys() and len(a) > 40
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-12), k
    assert all(m.attn_weights is None for m in fused.modules() if isinstance(m, tt.MultiHeadAttention))


def test_sdpa_gives_zeros_on_rows_with_nothing_to_attend_to_as_explicit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1, 0, 2] = False  # query 2 of the second sequence sees nothing
    outs = []
    for attn_impl in ("explicit", "sdpa"):
        mha = tt.MultiHeadAttention(8, 2, rng=0, dtype=torch.float64, attn_impl=attn_impl)
        y = mha(x, x, x, mask)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        outs.append((y.detach(), gx))
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    out_proj_bias = tt.MultiHeadAttention(8, 2, rng=0, dtype=torch.float64).out_proj.bias
    assert torch.allclose(outs[1][0][1, 2], out_proj_bias.detach())  # zero context: only the output bias


def test_sdpa_decodes_the_same_tokens_with_the_cache():
    ref, fused = model(), model("sdpa")
    for use_cache in (True, False):
        a = tt.greedy_decode(ref, SRC, BOS, EOS, 8, use_cache=use_cache)
        b = tt.greedy_decode(fused, SRC, BOS, EOS, 8, use_cache=use_cache)
        assert torch.equal(a, b)


def test_sdpa_trains_with_attention_dropout(monkeypatch):
    """The fused kernel is given the attention dropout in training and none in evaluation (its mask comes from
    torch's global generator), and the step's gradients are finite."""
    seen, kernel = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("dropout_p", 0.0))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    m = model("sdpa", dropout=0.3).train()
    torch.manual_seed(0)
    grads(m)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert len(seen) == 6 and set(seen) == {0.3}  # 2 encoder + 2 x 2 decoder attentions
    seen.clear()
    with torch.no_grad():
        m.eval()(SRC, TGT[:, :-1])
    assert len(seen) == 6 and set(seen) == {0.0}


def test_sdpa_is_a_torch_only_option_refused_by_numpy_with_its_name():
    assert "sdpa" in tt.ATTN_IMPLS and "sdpa" not in tn.ATTN_IMPLS
    with pytest.raises(ValueError, match=r"MultiHeadAttention: attn_impl='sdpa' .* exists in tfm_torch only"):
        tn.MultiHeadAttention(8, 2, attn_impl="sdpa")
    with pytest.raises(ValueError, match=r"use_attention: attn_impl='sdpa' .* tfm_numpy has attn_impl in"):
        tn.use_attention(tn.MultiHeadAttention(8, 2), "sdpa")
    m = tt.use_attention(model(), "sdpa")
    assert "attn_impl='sdpa'" in repr(m.encoder.layers[0].self_attn)


def test_bfloat16_autocast_runs_the_model_with_a_float32_loss_close_to_float32():
    m = model(dtype=torch.float32, attn_impl="sdpa")
    loss_fn = tt.CrossEntropyLoss(ignore_index=PAD)
    full = loss_fn(m(SRC, TGT[:, :-1]), TGT[:, 1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(SRC, TGT[:, :-1])
        loss = loss_fn(logits, TGT[:, 1:])
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert abs(loss.item() - full.item()) < 0.05 * full.item()
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())  # parameters and gradients stay float32


def test_half_precision_inputs_are_still_refused_outside_autocast():
    mha = tt.MultiHeadAttention(8, 2, rng=0)
    x = torch.zeros(1, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"MultiHeadAttention: query: expected a float32 or float64 tensor"):
        mha(x, x, x)
    with pytest.raises(TypeError, match=r"q must be float32 or float64, got dtype torch.bfloat16"):
        tt.scaled_dot_product_attention(x, x, x)


def test_torch_compile_traces_the_model_to_the_same_logits():
    torch._dynamo.reset()
    m = model(attn_impl="sdpa")
    compiled = torch.compile(m, backend="eager")  # dynamo's tracing without code generation: fast, CPU-only
    assert torch.allclose(compiled(SRC, TGT[:, :-1]), m(SRC, TGT[:, :-1]), rtol=0, atol=0)
    np.testing.assert_array_equal(tt.greedy_decode(compiled, SRC, BOS, EOS, 6), tt.greedy_decode(m, SRC, BOS, EOS, 6))


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_use_attention_refuses_a_model_with_no_attention(lib):
    ff = lib.PositionwiseFeedForward(16, 32)
    with pytest.raises(ValueError, match=r"use_attention: PositionwiseFeedForward has no attention module to switch"):
        lib.use_attention(ff, "flash")


def modern_gpt():
    """A Llama-style GPT (RMSNorm, RoPE, SwiGLU, 2 key/value heads for 4 query heads), dropout 0.1, float64."""
    opts = dict(norm="rmsnorm", positional="rope", activation="swiglu", n_kv_heads=2)
    return tt.GPT(V, 16, 4, 32, 2, 16, 0.1, **opts, rng=0, dtype=torch.float64)


def _training_loss(m, lm: bool):
    loss_fn = tt.CrossEntropyLoss(ignore_index=PAD)
    if lm:  # the GPT: next-token loss on the target rows
        return lambda tgt: loss_fn(m(tgt[:, :-1]), tgt[:, 1:])
    return lambda tgt: loss_fn(m(SRC, tgt[:, :-1]), tgt[:, 1:])


@pytest.mark.parametrize(
    "make, lm",
    [
        (lambda: model("explicit", dropout=0.1), False),
        (lambda: model("sdpa", dropout=0.1), False),
        (lambda: tt.GPT(V, 16, 4, 32, 2, 16, dropout=0.1, rng=0, dtype=torch.float64), True),
        (lambda: tt.use_attention(modern_gpt(), "sdpa"), True),
        (lambda: tt.to_torch_nn_transformer(model(dropout=0.1)), False),  # torch.nn's layers, told the mask is causal
    ],
    ids=["explicit", "sdpa", "gpt", "gpt-modern-sdpa", "torch.nn"],
)
def test_torch_compile_takes_a_training_step_as_one_graph(make, lm):
    # No graph break from the token-id checks (done inside the graph when compiling) nor from dropout (drawn from
    # torch's global generator when compiling): fullgraph=True raises at the first break. With padding, in training.
    torch._dynamo.reset()
    m = make().train()
    step = torch.compile(_training_loss(m, lm), backend="eager", fullgraph=True)
    torch.manual_seed(0)
    loss = step(TGT)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters() if p.requires_grad)
    m.eval()  # no dropout: the compiled function and the eager model give the same loss
    assert torch.allclose(step(TGT), _training_loss(m, lm)(TGT), rtol=1e-12, atol=0)


def test_compiled_dropout_keeps_one_minus_p_of_the_entries_from_the_global_generator():
    torch._dynamo.reset()
    drop = tt.Dropout(0.25, rng=0).train()
    compiled = torch.compile(drop, backend="eager", fullgraph=True)
    x = torch.ones(200, 500, dtype=torch.float64)
    torch.manual_seed(1)
    y = compiled(x)
    kept = (y != 0).double().mean().item()
    assert abs(kept - 0.75) < 0.01 and torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    torch.manual_seed(1)
    assert torch.equal(compiled(x), y)  # reproducible from torch.manual_seed


def test_compiled_model_still_refuses_token_ids_out_of_range():
    torch._dynamo.reset()
    m = model("sdpa")
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    bad = SRC.clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match=r"values must be in \[0, 13\), got 13"):
        m(bad, TGT[:, :-1])  # eager: the offending value in the message
    with pytest.raises(RuntimeError, match=r"values must be in \[0, 13\)"):
        compiled(bad, TGT[:, :-1])  # compiled: checked inside the graph


def test_reference_transformer_states_its_causal_mask_without_changing_a_bit():
    # tgt_is_causal=True spares torch.nn.Transformer reading the mask's values (the compile break above); with the key
    # padding masks it is always given, torch merges the masks and computes exactly what it did without the hint
    ref = tt.to_torch_nn_transformer(model()).train()
    plain, hints = ref.transformer.forward, []

    def recording(*args, **kwargs):
        hints.append(kwargs.get("tgt_is_causal"))
        return plain(*args, **kwargs)

    ref.transformer.forward = recording
    try:
        hinted = ref(SRC, TGT[:, :-1])
    finally:
        del ref.transformer.forward
    assert hints == [True]  # the hint is given
    ref.transformer.forward = lambda *a, tgt_is_causal=None, **k: plain(*a, **k)  # the call without the hint
    try:
        unhinted = ref(SRC, TGT[:, :-1])
    finally:
        del ref.transformer.forward
    assert torch.equal(hinted, unhinted)
