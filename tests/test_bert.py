"""The BERT-style masked language model in both tracks: identical state_dict keys for every option combination, MLM
logits, hidden states and every gradient equal in float64 (forward/backward and encode/encode_backward), a
whole-model gradient check of the masked loss and of encode, attention in both directions, padding keys masked out,
and bad input refused alike."""

import itertools

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff, to_numpy

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.config import GPT_ACTIVATIONS as ACTIVATIONS
from tfm_common.config import GPT_NORMS as NORMS
from tfm_common.config import GPT_POSITIONAL as POSITIONAL
from tfm_common.mlm import IGNORE_INDEX

GRAD_TOL = 1e-7
TRACK_TOL = 1e-10
V, PAD = 11, 0
TINY = dict(vocab_size=V, d_model=8, n_heads=4, d_ff=12, n_layers=2, max_len=8)
TOKENS = np.array([[3, 7, 1, 9, 5, 2], [2, 10, 4, 6, PAD, PAD]])  # the second row padded
TARGETS = np.array(
    [[IGNORE_INDEX, 4, IGNORE_INDEX, IGNORE_INDEX, 8, IGNORE_INDEX], [IGNORE_INDEX, 3, 5, 1, -100, -100]]
)

COMBOS = list(itertools.product(NORMS, POSITIONAL, ACTIVATIONS, [None, 2]))
IDS = [f"{n}-{p}-{a}-kv{k or 4}" for n, p, a, k in COMBOS]


def perturb(model, seed=0):
    """Norm weights and biases (and the output bias) away from 1 and 0, so that a swapped or dropped one shows."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name == "output_projection.bias":
            p.data[...] += 0.3 * rng.standard_normal(p.shape)
    return model


def np_bert(norm="layernorm", positional="learned", activation="gelu", n_kv_heads=None, seed=0, **kw):
    cfg = {**TINY, "dropout": 0.0, "pad_id": PAD, **kw}
    opts = dict(norm=norm, positional=positional, activation=activation, n_kv_heads=n_kv_heads)
    return perturb(tn.BERT(**cfg, **opts, rng=seed, dtype=np.float64), seed)


def twin(model: tn.BERT) -> tt.BERT:
    t = tt.BERT(**model.config, rng=1, dtype=torch.float64)  # another init, overwritten: the book's one-liner
    t.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return t.train(model.training)


def T(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


# -- the same keys, the same function ---------------------------------------------------------------------------------


def test_state_dict_keys_identical_for_every_option_combination():
    for combo in itertools.product(NORMS, POSITIONAL, ACTIVATIONS, [None, 1, 2], [True, False]):
        norm, pos, act, kv, tie = combo
        opts = dict(norm=norm, positional=pos, activation=act, n_kv_heads=kv, tie_output=tie)
        a, b = tn.BERT(**TINY, **opts), tt.BERT(**TINY, **opts)
        assert list(a.state_dict()) == list(b.state_dict()), combo
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()], combo
        shapes = {k: v.shape for k, v in a.state_dict().items()}
        assert shapes == {k: tuple(v.shape) for k, v in b.state_dict().items()}, combo
        assert a.num_parameters() == b.num_parameters(), combo
        assert ("pos.weight" in shapes) == (pos == "learned")
        assert shapes["output_projection.bias"] == (V,) and shapes["head_dense.weight"] == (8, 8)
        assert (a.output_projection.weight is a.embed.weight) == tie
        assert (b.output_projection.weight is b.embed.weight) == tie


def test_blocks_are_the_gpt_blocks_with_the_gpts_keys():
    """The encoder is the GPT's stack without the causal mask: a GPT's weights load into the BERT's body."""
    bert, gpt = tn.BERT(**TINY, rng=0), tn.GPT(**TINY, rng=1)
    body = {k: v for k, v in bert.state_dict().items() if not k.startswith(("head_", "output_projection"))}
    assert set(body) == set(gpt.state_dict()) - {"output_projection.weight"}


def run_both(model: tn.BERT, t: tt.BERT, tokens=TOKENS, seed: int = 1, method="forward"):
    model.zero_grad()
    out = getattr(model, method)(tokens)
    g = np.random.default_rng(seed).standard_normal(out.shape)
    getattr(model, "backward" if method == "forward" else "encode_backward")(g)
    t.zero_grad(set_to_none=True)
    t_out = getattr(t, method)(T(tokens))
    t_out.backward(T(g))
    t_grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in t.named_parameters()}
    return out, model.grads(), t_out, t_grads


def relative_diffs(out, grads, t_out, t_grads) -> float:
    assert list(grads) == list(t_grads)
    scale = max(np.abs(g).max() for g in grads.values())
    diffs = [max_abs_diff(out, t_out) / np.abs(out).max()]
    diffs += [max_abs_diff(grads[k], t_grads[k]) / scale for k in grads]
    return max(diffs)


@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", COMBOS, ids=IDS)
def test_numpy_and_torch_agree_float64(norm, positional, activation, n_kv_heads):
    model = np_bert(norm, positional, activation, n_kv_heads).eval()
    t = twin(model)
    out, grads, t_out, t_grads = run_both(model, t)
    assert out.shape == (2, 6, V)
    assert relative_diffs(out, grads, t_out, t_grads) < TRACK_TOL
    out, grads, t_out, t_grads = run_both(model, t, method="encode", seed=2)
    assert out.shape == (2, 6, 8)
    assert relative_diffs(out, grads, t_out, t_grads) < TRACK_TOL
    assert not np.any(grads["head_dense.weight"]) and not np.any(grads["output_projection.bias"])  # not on the path


def test_tracks_agree_untied_and_without_padding():
    model = np_bert(tie_output=False, pad_id=None).eval()
    assert relative_diffs(*run_both(model, twin(model))) < TRACK_TOL


def test_tied_output_gets_both_gradients():
    tied = np_bert().eval()
    untied = np_bert(tie_output=False).eval()
    untied.load_state_dict({**tied.state_dict(), "output_projection.weight": tied.embed.weight.data})
    g = np.random.default_rng(3).standard_normal((2, 6, V))
    for m in (tied, untied):
        m.zero_grad()
        m(TOKENS)
        m.backward(g)
    total = untied.embed.weight.grad + untied.output_projection.weight.grad
    assert max_abs_diff(tied.embed.weight.grad, total) < 1e-13


# -- the gradient checks ----------------------------------------------------------------------------------------------


class MaskedLoss(tn.Module):
    """The MLM loss as one module for tn.grad_check: mean cross-entropy over the chosen positions (scaled by the
    check's weight; grad_check's output is this scalar)."""

    def __init__(self, model, targets):
        super().__init__()
        self.model, self.targets, self.loss_fn = model, targets, tn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, tokens):
        return np.asarray(self.loss_fn(self.model(tokens), self.targets))

    def backward(self, grad_out):
        self.model.backward(self.loss_fn.backward() * float(grad_out))


class Encoded(tn.Module):
    """encode / encode_backward as one module for tn.grad_check (a classifier's view of the BERT)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model.encode(tokens)

    def backward(self, grad_out):
        self.model.encode_backward(grad_out)


GRAD_COMBOS = [("layernorm", "learned", "gelu", None), ("rmsnorm", "rope", "swiglu", 2),
               ("layernorm", "sinusoidal", "relu", 1)]  # fmt: skip


@pytest.mark.parametrize("norm,positional,activation,n_kv_heads", GRAD_COMBOS)
def test_gradient_check_masked_loss_and_encode(norm, positional, activation, n_kv_heads):
    """Every parameter against central differences. Without rope the keys' bias shifts every score of a query by
    the same amount, which softmax ignores: its true gradient is zero, and rel_error compares two roundings of 0
    (tests/test_transformer.py explains it); it is checked to be ~0 instead."""
    model = np_bert(norm, positional, activation, n_kv_heads, n_layers=1, max_len=6).eval()
    for wrapped in (MaskedLoss(model, TARGETS), Encoded(model)):
        errors = tn.grad_check(wrapped, (TOKENS,))
        zero = "model.layers.0.self_attn.k_proj.bias"
        if positional != "rope":
            errors.pop(zero)
            wrapped.zero_grad()
            wrapped.backward(np.ones(np.shape(wrapped(TOKENS))))
            assert np.abs(model.layers[0].self_attn.k_proj.bias.grad).max() < 1e-12
        assert len(errors) == len(list(wrapped.named_parameters())) - (positional != "rope")
        assert max(errors.values()) < GRAD_TOL, {k: v for k, v in errors.items() if v >= GRAD_TOL}


def test_gradient_check_catches_a_missing_residual(monkeypatch):
    """The check can fail: a block backward that forgets the residual's own path."""
    model = np_bert(n_layers=1, max_len=6).eval()
    block = model.layers[0]

    def wrong(grad_out):
        dx = block.norm2.backward(block.ff.backward(block.dropout2.backward(grad_out)))
        return dx + block.norm1.backward(block.self_attn.backward(block.dropout1.backward(grad_out + dx)))

    monkeypatch.setattr(block, "backward", wrong)
    errors = tn.grad_check(MaskedLoss(model, TARGETS), (TOKENS,))
    assert max(errors.values()) > 1e-3


# -- what the model sees --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_every_position_sees_the_later_ones(lib):
    """No causal mask: changing the last token changes the first position's logits (a GPT's would not change)."""
    model = lib.BERT(**TINY, dropout=0.0, rng=0).eval()
    a, b = TOKENS[:1].copy(), TOKENS[:1].copy()
    b[0, -1] = (b[0, -1] + 1) % V
    wrap = (lambda x: x) if lib is tn else T
    with torch.no_grad():
        assert max_abs_diff(model(wrap(a))[:, 0], model(wrap(b))[:, 0]) > 1e-4


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("positional", POSITIONAL)
def test_padding_keys_change_nothing_at_real_positions(lib, positional):
    """A padded sequence gives its real positions the hidden states of the sequence alone: pad keys are masked."""
    model = lib.BERT(**TINY, dropout=0.0, pad_id=PAD, positional=positional, rng=0)
    model = model.eval() if lib is tn else model.double().eval()
    if lib is tn:
        model = tn.BERT(**model.config, rng=0, dtype=np.float64).eval()
    wrap = (lambda x: x) if lib is tn else T
    with torch.no_grad():
        padded = model.encode(wrap(TOKENS[1:]))[:, :4]
        alone = model.encode(wrap(TOKENS[1:, :4]))
        unmasked = lib.BERT(**{**model.config, "pad_id": None}, rng=0)
        unmasked.load_state_dict(model.state_dict())
        unmasked = unmasked.eval() if lib is tn else unmasked.double().eval()
        leaked = unmasked.encode(wrap(TOKENS[1:]))[:, :4]
    assert max_abs_diff(padded, alone) < 1e-12
    assert max_abs_diff(leaked, alone) > 1e-4  # without pad_id the padding is attended to


def test_dropout_is_on_in_training_and_defaults_to_0_1():
    model = tn.BERT(**TINY, rng=0)
    assert model.config["dropout"] == 0.1 and tt.BERT(**TINY).config["dropout"] == 0.1
    assert max_abs_diff(model(TOKENS), model.eval()(TOKENS)) > 1e-4


def test_float32_by_default_and_dtype_follows():
    assert tn.BERT(**TINY)(TOKENS).dtype == np.float32
    assert tt.BERT(**TINY)(T(TOKENS)).dtype == torch.float32


# -- refusals, alike in both tracks -----------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(d_model=9), ValueError, "d_model=9 must be divisible by n_heads=4"),
    (dict(pad_id=V), ValueError, "pad_id must be None or an int in [0, 11)"),
    (dict(pad_id=True), ValueError, "pad_id must be None"),
    (dict(norm="batchnorm"), ValueError, "norm must be one of"),
    (dict(positional="alibi"), ValueError, "positional must be one of"),
    (dict(dropout=1.0), ValueError, "dropout must be in [0, 1)"),
    (dict(tie_output=1), TypeError, "tie_output expected True or False"),
    (dict(n_layers=0), ValueError, "n_layers must be an int >= 1"),
]


@pytest.mark.parametrize("change,error,words", BAD_CONFIGS, ids=[next(iter(c)) for c, _, _ in BAD_CONFIGS])
def test_bad_configs_refused_alike(change, error, words):
    messages = []
    for lib in (tn, tt):
        with pytest.raises(error, match=None) as info:
            lib.BERT(**{**TINY, **change})
        messages.append(str(info.value))
        assert words in str(info.value) and str(info.value).startswith("BERT")
    assert messages[0] == messages[1]


def test_unknown_argument_names_bert():
    for lib in (tn, tt):
        with pytest.raises(TypeError, match="BERT.__init__"):
            lib.BERT(**TINY, window=4)


BAD_TOKENS = [
    (np.array([[1, 2, V]]), ValueError, "values must be in [0, 11)"),
    (np.array([[1, -1]]), ValueError, "values must be in [0, 11)"),
    (np.array([[1.0, 2.0]]), TypeError, "integer"),
    (np.arange(9)[None] % V, ValueError, "more than max_len=8"),
    (np.array([1, 2, 3]), ValueError, "tokens expected shape (B, T)"),
]


@pytest.mark.parametrize("method", ["forward", "encode"])
@pytest.mark.parametrize("tokens,error,words", BAD_TOKENS, ids=["too-big", "negative", "float", "too-long", "1-d"])
def test_bad_tokens_refused_alike(method, tokens, error, words):
    messages = []
    for lib, wrap in ((tn, lambda x: x), (tt, T)):
        model = lib.BERT(**TINY, rng=0)
        before = {k: to_numpy(v).copy() for k, v in model.state_dict().items()}
        with pytest.raises(error) as info:
            getattr(model, method)(wrap(tokens))
        assert words in str(info.value), str(info.value)
        assert str(info.value).startswith("BERT"), str(info.value)
        messages.append(str(info.value))
        assert all(np.array_equal(before[k], to_numpy(v)) for k, v in model.state_dict().items())
    same = [m.replace("torch.", "").replace("tensor", "array") for m in messages]  # each track names its own type
    assert same[0] == same[1]


def test_numpy_backward_refuses_wrong_order_and_shapes():
    model = np_bert()
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward(np.zeros((2, 6, V)))
    model(TOKENS)
    with pytest.raises(ValueError, match="BERT"):
        model.backward(np.zeros((2, 6, 8)))  # the hidden states' shape, not the logits'
    model.backward(np.zeros((2, 6, V)))  # the refused call left the forward usable
    with pytest.raises(RuntimeError, match="twice"):
        model.backward(np.zeros((2, 6, V)))
    model.encode(TOKENS)
    with pytest.raises(ValueError, match="BERT"):
        model.encode_backward(np.zeros((2, 6, V)))
    model.encode_backward(np.zeros((2, 6, 8)))
