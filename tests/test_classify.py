"""SequenceClassifier (chapter 22b) in both tracks, on the GPT's new `encode`: the gradient check in float64 for both
pools, the two tracks' logits and every gradient equal, what "the last non-pad token" means (padding after it changes
nothing, its embedding row gets no gradient), GPT.encode as the forward without the output projection (and its
backward as the backward's), training steps equal step by step, and bad input refused alike."""

import numpy as np
import pytest
import torch
from helpers_tracks import assert_tracks_agree, load_np_into_torch, max_abs_diff, run_numpy, run_torch
from test_sublayers import assert_grad_check  # every k_proj.bias has a true gradient of 0: checked as ~0

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.finetune_recipe import epoch_batches, finetune

GRAD_TOL = 1e-7
TRACK_TOL = 1e-10
V, PAD, K = 13, 0, 3
TINY = dict(vocab_size=V, d_model=8, n_heads=2, d_ff=12, n_layers=2, max_len=8)
# right-padded rows of 7, 3 and 6 tokens (PAD = 0 only at the end of a row)
TOKENS = np.array([[3, 7, 1, 9, 5, 2, 4], [2, 10, 4, 0, 0, 0, 0], [12, 6, 6, 1, 8, 11, 0]])
LABELS = np.array([2, 0, 1])


def perturb(model, seed=0):
    """Norm weights away from 1 and biases away from 0, so that a dropped final norm shows."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data[...] += 0.3 * rng.standard_normal(p.shape)
    return model


def np_classifier(pool="last", n_layers=2, seed=0, **kw):
    gpt = tn.GPT(**{**TINY, "n_layers": n_layers, **kw}, rng=seed, dtype=np.float64)
    return tn.SequenceClassifier(perturb(gpt, seed), K, pool=pool, pad_id=PAD, rng=seed + 1)


def twin(model: tn.SequenceClassifier) -> tt.SequenceClassifier:
    gpt = tt.GPT(**model.backbone.config, rng=5, dtype=torch.float64)
    t = tt.SequenceClassifier(gpt, K, pool=model.pool, pad_id=model.pad_id, rng=6)
    load_np_into_torch(model, t)
    return t


# -- the gradient check and the two tracks ----------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["first", "last"])
def test_gradient_check_float64(pool):
    model = np_classifier(pool, n_layers=1)
    errors = assert_grad_check(model, (TOKENS,), GRAD_TOL)
    assert {"head.weight", "head.bias", "backbone.embed.weight", "backbone.norm.weight"} <= set(errors)


@pytest.mark.parametrize("pool", ["first", "last"])
@pytest.mark.parametrize("options", [{}, dict(norm="rmsnorm", positional="rope", activation="swiglu", n_kv_heads=1)])
def test_tracks_agree_float64_outputs_and_every_gradient(pool, options):
    model = np_classifier(pool, **options)
    grad_out = np.random.default_rng(2).standard_normal((len(TOKENS), K))
    np_result = run_numpy(model, (TOKENS,), grad_out)
    torch_result = run_torch(twin(model), (TOKENS,), grad_out)
    assert assert_tracks_agree(np_result, torch_result, TRACK_TOL) < TRACK_TOL
    assert list(model.state_dict()) == list(twin(model).state_dict())


def test_state_dict_keys_and_head_dtype():
    model = np_classifier()
    keys = list(model.state_dict())
    assert keys[-2:] == ["head.weight", "head.bias"] and all(k.startswith("backbone.") for k in keys[:-2])
    assert model.head.weight.data.shape == (K, TINY["d_model"]) and model.head.weight.data.dtype == np.float64
    f32 = tn.SequenceClassifier(tn.GPT(**TINY, rng=0), K, pad_id=PAD)
    assert f32(TOKENS).dtype == np.float32
    t32 = tt.SequenceClassifier(tt.GPT(**TINY, rng=0), K, pad_id=PAD)
    assert t32(torch.from_numpy(TOKENS)).dtype == torch.float32


# -- what the pools read ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_the_pools_read_position_zero_and_the_last_non_pad_token(lib):
    conv = np.asarray if lib is tn else torch.from_numpy
    assert np.array_equal(np.asarray(lib.last_positions(conv(TOKENS), PAD)), [6, 2, 5])
    assert np.array_equal(np.asarray(lib.last_positions(conv(TOKENS), None)), [6, 6, 6])
    assert np.array_equal(np.asarray(lib.pool_positions(conv(TOKENS), "first", PAD)), [0, 0, 0])
    model = np_classifier("last")
    h = model.backbone.encode(TOKENS)
    at = tn.last_positions(TOKENS, PAD)
    expected = h[np.arange(3), at] @ model.head.weight.data.T + model.head.bias.data
    assert max_abs_diff(model(TOKENS), expected) < 1e-12


def test_padding_after_the_last_token_changes_nothing_and_gets_no_gradient():
    """With a causal backbone, a row's last real token has read no padding: more pad columns, or other pads, give
    the same logits, and the pad's embedding row gets no gradient (it was never read)."""
    model = np_classifier("last")
    wider = np.concatenate([TOKENS, np.full((3, 1), PAD)], axis=1)
    assert max_abs_diff(model(TOKENS), model(wider)[:, :]) < 1e-12
    model.zero_grad()
    model(wider)
    model.backward(np.random.default_rng(0).standard_normal((3, K)))
    assert np.abs(model.backbone.embed.weight.grad[PAD]).max() == 0
    assert np.abs(model.backbone.pos.weight.grad[-1]).max() == 0  # the last position only ever held padding


def test_reading_the_array_end_instead_reads_padding():
    """The mistake the pool guards against: T - 1 of a padded row is a pad token's state, not the text's."""
    model = np_classifier("last")
    last_col = tn.SequenceClassifier(model.backbone, K, pool="last", pad_id=None, rng=1)
    last_col.head = model.head
    logits, wrong = model(TOKENS), last_col(TOKENS)
    assert max_abs_diff(logits[0], wrong[0]) < 1e-12  # row 0 has no padding: the same
    assert max_abs_diff(logits[1], wrong[1]) > 1e-3  # row 1 does


# -- the GPT's encode ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("window", [None, 3])
def test_encode_is_the_forward_without_the_output_projection(lib, window):
    conv = np.asarray if lib is tn else torch.from_numpy
    dtype = np.float64 if lib is tn else torch.float64
    gpt = lib.GPT(**TINY, window=window, sinks=1 if window else 0, tie_output=False, rng=0, dtype=dtype)
    logits = gpt(conv(TOKENS))
    assert max_abs_diff(gpt.output_projection(gpt.encode(conv(TOKENS))), logits) < 1e-12


def test_encode_backward_is_the_backward_without_the_output_projection():
    gpt = perturb(tn.GPT(**TINY, tie_output=False, rng=0, dtype=np.float64))
    dlogits = np.random.default_rng(1).standard_normal((*TOKENS.shape, V))
    gpt.zero_grad()
    gpt(TOKENS)
    gpt.backward(dlogits)
    full = {k: v.copy() for k, v in gpt.grads().items()}
    gpt.zero_grad()
    gpt.encode(TOKENS)
    gpt.encode_backward(dlogits @ gpt.output_projection.weight.data)  # dL/dhidden through the projection
    enc = gpt.grads()
    assert np.abs(enc["output_projection.weight"]).max() == 0
    assert max(max_abs_diff(full[k], enc[k]) for k in full if k != "output_projection.weight") < 1e-12


def test_encode_refuses_what_forward_refuses_and_backward_twice():
    gpt = tn.GPT(**TINY, rng=0)
    with pytest.raises(ValueError, match="more than max_len=8"):
        gpt.encode(np.ones((1, 9), np.int64))
    gpt.encode(TOKENS)
    gpt.encode_backward(np.zeros((*TOKENS.shape, 8), np.float32))
    with pytest.raises(RuntimeError, match="called twice"):
        gpt.encode_backward(np.zeros((*TOKENS.shape, 8), np.float32))
    gpt.encode(TOKENS)
    with pytest.raises(ValueError, match="grad_out expected shape"):
        gpt.encode_backward(np.zeros((3, 7, 9), np.float32))


# -- training ---------------------------------------------------------------------------------------------------------


def test_twin_training_float64_losses_equal_step_by_step_and_learning_happens():
    model = np_classifier("last")
    t = twin(model)
    opt_a, opt_b = tn.make_adam(model), tt.make_adam(t)
    loss_a, loss_b = tn.CrossEntropyLoss(), tt.CrossEntropyLoss()
    losses = []
    for _ in range(8):
        ra = tn.classifier_train_step(model, TOKENS, LABELS, opt_a, loss_a, lr=1e-2, clip_norm=1.0)
        rb = tt.classifier_train_step(t, TOKENS, LABELS, opt_b, loss_b, lr=1e-2, clip_norm=1.0)
        assert abs(ra.loss - rb.loss) < 1e-12 and abs(ra.grad_norm - rb.grad_norm) < 1e-12
        losses.append(ra.loss)
    assert losses[-1] < 0.5 * losses[0]
    # every k_proj.bias has a true gradient of 0, so Adam's m / sqrt(v) turns its round-off into steps of ~lr: not
    # compared (as tests/test_gpt.py's twin training, whose rope makes that gradient real)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("k_proj.bias")}
    assert max(max_abs_diff(v, t.state_dict()[k]) for k, v in state.items()) < 1e-12
    predicted = tn.predict_classes(model, TOKENS, 2)  # in batches of 2: the same as all at once
    assert np.array_equal(predicted, model(TOKENS).argmax(axis=1)) and predicted.dtype == np.int64
    assert np.array_equal(tt.predict_classes(t, TOKENS, 2), predicted)


# -- refusals, alike in both tracks ---------------------------------------------------------------------------------


def _build(lib, **kw):
    dtype = np.float64 if lib is tn else torch.float64
    return lib.SequenceClassifier(lib.GPT(**TINY, rng=0, dtype=dtype), **{"n_classes": K, "pad_id": PAD, **kw})


BAD_BUILD = {
    "backbone": (lambda lib: lib.SequenceClassifier(object(), K), TypeError, "backbone expected a model of this track"),
    "other track": (lambda lib: (tt if lib is tn else tn).SequenceClassifier(lib.GPT(**TINY), K), TypeError,
                    "backbone expected a model of this track"),
    "n_classes": (lambda lib: _build(lib, n_classes=0), ValueError, "n_classes must be an int >= 1"),
    "n_classes float": (lambda lib: _build(lib, n_classes=2.0), TypeError, "n_classes expected an int"),
    "pool": (lambda lib: _build(lib, pool="mean"), ValueError, r"pool must be one of \('first', 'last'\)"),
    "pad big": (lambda lib: _build(lib, pad_id=V), ValueError, r"pad_id must be a token of the backbone's vocabulary"),
    "pad negative": (lambda lib: _build(lib, pad_id=-1), ValueError, "pad_id must be an int >= 0"),
    "keyword": (lambda lib: _build(lib, pooling="last"), TypeError, "SequenceClassifier.__init__.. got an unexpected"),
}  # fmt: skip


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD_BUILD)
def test_bad_construction(lib, case):
    build, exc, match = BAD_BUILD[case]
    with pytest.raises(exc, match=match):
        build(lib)


LEFT_PADDED = np.array([[0, 0, 5, 6]])
BAD_CALLS = {
    "all pad": (lambda m, c: m(c(np.array([[4, 5], [0, 0]]))), ValueError, "row 1 of tokens is all padding"),
    "left padded": (lambda m, c: m(c(LEFT_PADDED)), ValueError, "row 0 has the token 5 at position 2, after a pad"),
    "too long": (lambda m, c: m(c(np.ones((1, 9), np.int64))), ValueError, "more than max_len=8"),
    "float ids": (lambda m, c: m(c(np.ones((1, 3)))), TypeError, "expected an integer"),
    "big id": (lambda m, c: m(c(np.full((1, 3), V))), ValueError, r"values must be in \[0, 13\)"),
    "rank 1": (lambda m, c: m(c(np.ones(3, np.int64))), ValueError, r"expected shape \(B, T\)"),
    "labels shape": (lambda m, c: _step(m, c, TOKENS, LABELS[:2]), ValueError, r"labels expected .* shape \(3,\)"),
    "labels range": (lambda m, c: _step(m, c, TOKENS, LABELS + 1), ValueError, r"labels must be in \[0, 3\)"),
    "labels float": (lambda m, c: _step(m, c, TOKENS, LABELS * 1.0), TypeError, "labels expected integer class ids"),
    "tokens list": (lambda m, c: _step(m, c, TOKENS.tolist(), LABELS), TypeError, r"tokens expected a numpy.ndarray"),
    "batch_size": (lambda m, c: m.__class__ and _predict(m, c, 0), ValueError, "batch_size must be an int >= 1"),
}


def _step(model, conv, tokens, labels):
    lib = tn if isinstance(model, tn.Module) else tt
    tokens = conv(tokens) if isinstance(tokens, np.ndarray) else tokens
    labels = conv(labels)
    return lib.classifier_train_step(model, tokens, labels, lib.make_adam(model), lib.CrossEntropyLoss(), 1e-3)


def _predict(model, conv, batch_size):
    lib = tn if isinstance(model, tn.Module) else tt
    return lib.predict_classes(model, conv(TOKENS), batch_size)


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls(lib, case):
    call, exc, match = BAD_CALLS[case]
    model, conv = (_build(lib), np.asarray) if lib is tn else (_build(lib), torch.from_numpy)
    with pytest.raises(exc, match=match):
        call(model, conv)


def test_a_refused_call_leaves_the_forward_to_differentiate():
    model = np_classifier("last")
    grad_out = np.random.default_rng(0).standard_normal((3, K))
    expected = run_numpy(model, (TOKENS,), grad_out)[2]
    model.zero_grad()
    model(TOKENS)
    with pytest.raises(ValueError, match="all padding"):
        model(np.zeros((1, 3), np.int64))
    model.backward(grad_out)
    assert max(max_abs_diff(v, expected[k]) for k, v in model.grads().items()) == 0


# -- on the BERT (chapter 22a): [CLS] at position 0, padding masked ---------------------------------------------------

CLS = 12  # a token id standing for [CLS] in these tiny tests (PAD = 0 is the BERT's pad_id)


def np_bert_classifier(n_layers=2, seed=0):
    bert = tn.BERT(**{**TINY, "n_layers": n_layers}, dropout=0.0, pad_id=PAD, rng=seed, dtype=np.float64)
    return tn.SequenceClassifier(perturb(bert, seed), K, pool="first", rng=seed + 1)  # pad_id: the BERT's


def with_cls(tokens):
    return np.concatenate([np.full((len(tokens), 1), CLS), tokens[:, :-1]], axis=1)


def test_bert_classifier_gradient_check_and_tracks():
    model = np_bert_classifier(n_layers=1)
    assert model.pad_id == PAD  # taken from the backbone
    assert_grad_check(model, (with_cls(TOKENS),), GRAD_TOL)
    model = np_bert_classifier()
    bert = tt.BERT(**model.backbone.config, rng=5, dtype=torch.float64)
    t = tt.SequenceClassifier(bert, K, pool="first", rng=6)
    load_np_into_torch(model, t)
    grad_out = np.random.default_rng(2).standard_normal((len(TOKENS), K))
    result = run_numpy(model, (with_cls(TOKENS),), grad_out), run_torch(t, (with_cls(TOKENS),), grad_out)
    assert assert_tracks_agree(*result, TRACK_TOL) < TRACK_TOL


def test_bert_padding_is_masked_so_more_padding_changes_nothing():
    model = np_bert_classifier()
    tokens = with_cls(TOKENS)
    wider = np.concatenate([tokens, np.full((3, 1), PAD)], axis=1)
    assert max_abs_diff(model(tokens), model(wider)) < 1e-12
    with pytest.raises(ValueError, match="pad_id must be a token"):
        tn.SequenceClassifier(model.backbone, K, pad_id=V + 4)


# -- the fine-tuning recipe (tfm_common.finetune_recipe) ---------------------------------------------------------------


def test_epoch_batches_cover_every_row_once_per_epoch():
    batches = epoch_batches(10, 3, 6, np.random.default_rng(0))
    first_epoch = np.concatenate(batches[:3])  # 3 batches of 3 rows; the 4th would cross the end: a new epoch
    assert len(set(first_epoch.tolist())) == 9 and all(len(b) == 3 for b in batches)
    assert np.array_equal(np.concatenate(epoch_batches(10, 3, 6, np.random.default_rng(0))), np.concatenate(batches))


def test_finetune_gives_the_same_run_in_both_tracks():
    rng = np.random.default_rng(1)
    ids = np.where(np.arange(7) < rng.integers(2, 8, (12, 1)), rng.integers(1, V, (12, 7)), PAD)  # right-padded
    labels = rng.integers(0, K, 12)
    model = np_classifier("last")
    t = twin(model)
    recipe = dict(steps=4, batch_size=5, peak=1e-2, warmup=2, seed=3, eval_ids=ids[:6], eval_labels=labels[:6],
                  eval_every=2)  # fmt: skip
    a, b = finetune(model, tn, ids, labels, **recipe), finetune(t, tt, ids, labels, **recipe)
    assert np.abs(a.losses - b.losses).max() < 1e-12 and a.losses.shape == (4,)
    assert a.eval_steps.tolist() == [0, 2, 4] and np.array_equal(a.eval_accuracy, b.eval_accuracy)
    with pytest.raises(ValueError, match="give eval_ids, eval_labels and eval_every together"):
        finetune(model, tn, ids, labels, steps=2, batch_size=5, peak=1e-2, warmup=1, seed=0, eval_every=1)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        finetune(model, tn, ids, labels, steps=0, batch_size=5, peak=1e-2, warmup=1, seed=0)
