"""Hostile inputs, both tracks: every case is refused with a clear error that names the argument, or gives a
documented correct result. Never a deep library error, a silent wrong result or a hang.

Each case is a function `case(L)` of the track module (tfm_numpy or tfm_torch), run under both; `T(L, a)` turns a
NumPy array into the track's array type. The tests of the reliability defects (checkpoint configurations, the
crafted metadata, the non-finite step, inputs changed in place, backward twice) follow the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.data import BOS_ID, EOS_ID, PAD_ID, Batch, Vocab, make_batches
from tfm_common.npz_checkpoint import META_KEY

TRACKS = pytest.mark.parametrize("L", [tn, tt], ids=["numpy", "torch"])
TINY = dict(d_model=8, n_heads=2, d_ff=16, n_layers=1, dropout=0.0, max_len=12)


def T(L, a):
    """A NumPy array as the track's array (a tensor for torch)."""
    return torch.from_numpy(np.array(a)) if L is tt else np.array(a)


def model(L, **kw):
    args = {**dict(src_vocab_size=11, tgt_vocab_size=11, **TINY), **kw}
    return L.Transformer(**args, dtype=np.float64 if L is tn else torch.float64)


def f64(L, shape, seed=0):
    return T(L, np.random.default_rng(seed).standard_normal(shape))


def ids(L, a):
    return T(L, np.asarray(a, dtype=np.int64))


def adam(L, m, **kw):
    return L.make_adam(m, **kw)


# -- the table: (build the failing call, exception type, a regex the message must match) ------------------------
REFUSED = {
    # constructors: sizes (one validator for both tracks), options, flags, seeds
    "Linear float size": (lambda L: L.Linear(8.0, 4), TypeError, "Linear: in_features expected an int, got float"),
    "Linear bool size": (lambda L: L.Linear(True, 4), TypeError, "Linear: in_features expected an int, got bool"),
    "Linear str size": (lambda L: L.Linear("8", 4), TypeError, "Linear: in_features expected an int, got str"),
    "Linear zero size": (lambda L: L.Linear(4, 0), ValueError, "Linear: out_features must be an int >= 1, got 0"),
    "Embedding float size": (lambda L: L.Embedding(10.0, 4), TypeError, "Embedding: num_embeddings expected an int"),
    "Embedding padding_idx": (lambda L: L.Embedding(10, 4, padding_idx=10), ValueError, "padding_idx must be in"),
    "LayerNorm float size": (lambda L: L.LayerNorm(8.5), TypeError, "LayerNorm: normalized_shape expected an int"),
    "LayerNorm empty shape": (lambda L: L.LayerNorm([]), ValueError, "LayerNorm: normalized_shape must not be empty"),
    "LayerNorm eps": (lambda L: L.LayerNorm(4, eps=0.0), ValueError, "LayerNorm: eps must be > 0"),
    "FF float d_ff": (
        lambda L: L.PositionwiseFeedForward(8, 16.0),
        TypeError,
        "PositionwiseFeedForward: d_ff expected",
    ),
    "FF activation": (lambda L: L.PositionwiseFeedForward(8, 16, activation="swish"), ValueError, "activation"),
    "MHA float heads": (
        lambda L: L.MultiHeadAttention(8, 2.0),
        TypeError,
        "MultiHeadAttention: n_heads expected an int",
    ),
    "MHA zero heads": (lambda L: L.MultiHeadAttention(8, 0), ValueError, "n_heads must be an int >= 1, got 0"),
    "MHA indivisible": (lambda L: L.MultiHeadAttention(8, 3), ValueError, "d_model=8 must be divisible by n_heads=3"),
    "Dropout p=1": (lambda L: L.Dropout(1.0), ValueError, r"Dropout: p must be in \[0, 1\)"),
    "Dropout p=nan": (lambda L: L.Dropout(float("nan")), ValueError, r"Dropout: p must be in \[0, 1\)"),
    "Encoder no layers": (lambda L: L.Encoder(0, 8, 2, 16), ValueError, "Encoder: n_layers must be an int >= 1"),
    "PE odd d_model": (lambda L: L.sinusoidal_positional_encoding(10, 7), ValueError, "even d_model"),
    "learned PE size": (lambda L: L.LearnedPositionalEmbedding(0, 8), ValueError, "max_len must be an int >= 1"),
    "Transformer float": (lambda L: model(L, d_model=8.0), TypeError, "Transformer: d_model expected an int"),
    "Transformer positional": (lambda L: model(L, positional="rope"), ValueError, "positional must be one of"),
    "Transformer share": (lambda L: model(L, tgt_vocab_size=13, share_embeddings=True), ValueError, "one vocabulary"),
    "Transformer pad_id": (lambda L: model(L, pad_id=-1), ValueError, r"pad_id must be an int in \[0, 11\)"),
    "Transformer flag": (lambda L: model(L, norm_first=1), TypeError, "norm_first expected True or False"),
    "seed str": (lambda L: L.Linear(3, 2, rng="seed"), TypeError, "rng: expected"),
    "seed bool": (lambda L: L.Linear(3, 2, rng=True), TypeError, "rng: expected"),
    "seed negative": (lambda L: L.Linear(3, 2, rng=-1), ValueError, "rng: a seed must be >= 0"),
    "loss smoothing": (lambda L: L.CrossEntropyLoss(label_smoothing=1.5), ValueError, "label_smoothing must be in"),
    "loss ignore_index": (lambda L: L.CrossEntropyLoss(ignore_index=1.0), TypeError, "ignore_index expected an int"),
    # forward inputs
    "Linear int input": (lambda L: L.Linear(3, 2)(ids(L, [[1, 2, 3]])), TypeError, "Linear: expected a float32"),
    "Linear last dim": (
        lambda L: (
            L.Linear(3, 2)(f64(L, (2, 4)).float()) if L is tt else L.Linear(3, 2)(f64(L, (2, 4)).astype(np.float32))
        ),
        ValueError,
        "Linear: expected last dimension 3",
    ),  # fmt: skip
    "Linear dtype": (lambda L: L.Linear(3, 2)(f64(L, (2, 3))), TypeError, "expected dtype"),
    "Linear list": (lambda L: L.Linear(3, 2)([[1.0, 2.0, 3.0]]), TypeError, "Linear: expected a"),
    "Embedding float ids": (lambda L: L.Embedding(5, 2)(f64(L, (2,))), TypeError, "Embedding: ids: expected an int"),
    "Embedding bool ids": (lambda L: L.Embedding(5, 2)(T(L, [True])), TypeError, "Embedding: ids: expected an int"),
    "Embedding big id": (lambda L: L.Embedding(5, 2)(ids(L, [1, 5])), ValueError, r"values must be in \[0, 5\), got 5"),
    "Embedding negative id": (lambda L: L.Embedding(5, 2)(ids(L, [-1])), ValueError, r"in \[0, 5\), got -1"),
    "tokens too long": (lambda L: model(L)(ids(L, np.ones((1, 13))), ids(L, [[1]])), ValueError, "max_len=12"),
    "tokens 1-D": (lambda L: model(L)(ids(L, [1, 2]), ids(L, [[1]])), ValueError, r"src expected shape \(B, T\)"),
    "tokens empty T": (lambda L: model(L)(ids(L, np.ones((1, 0))), ids(L, [[1]])), ValueError, "T >= 1"),
    "tokens out of vocab": (lambda L: model(L)(ids(L, [[11]]), ids(L, [[1]])), ValueError, r"src: values must be"),
    "MHA mask shape": (
        lambda L: L.MultiHeadAttention(8, 2, dtype=np.float64 if L is tn else torch.float64)(
            *[f64(L, (1, 3, 8))] * 3, mask=T(L, np.ones((1, 1, 3, 4), bool))
        ),
        ValueError,
        "mask",
    ),  # fmt: skip
    "LayerNorm last dim": (
        lambda L: L.LayerNorm(4, dtype=np.float64 if L is tn else torch.float64)(f64(L, (2, 5))),
        ValueError,
        r"LayerNorm: expected trailing shape \(4,\), got shape \(2, 5\)",
    ),  # fmt: skip
    # losses
    "loss target shape": (
        lambda L: L.CrossEntropyLoss()(f64(L, (2, 3, 4)), ids(L, [[1, 2]])),
        ValueError,
        r"targets expected shape",
    ),  # fmt: skip
    "loss target range": (
        lambda L: L.CrossEntropyLoss()(f64(L, (2, 4)), ids(L, [1, 4])),
        ValueError,
        r"targets: values must be in \[0, 4\)",
    ),  # fmt: skip
    "loss float target": (lambda L: L.CrossEntropyLoss()(f64(L, (2, 4)), f64(L, (2,))), TypeError, "integer"),
    # optimizers and schedules
    "Adam lr": (lambda L: adam(L, model(L), lr=-1.0), ValueError, "lr"),
    "Adam betas": (lambda L: adam(L, model(L), betas=(0.9,)), ValueError, "betas"),
    "Adam eps nan": (lambda L: adam(L, model(L), eps=float("nan")), ValueError, "eps"),
    "noam step 0": (lambda L: L.noam_lr(0, 8, 10), ValueError, "step"),
    "clip negative": (lambda L: L.clip_grad_norm(model(L).parameters(), -1.0), ValueError, "max_norm"),
    # decoding
    "greedy max_len": (lambda L: L.greedy_decode(model(L), ids(L, [[3, 4]]), BOS_ID, EOS_ID, 0), ValueError, "max_len"),
    "beam size": (
        lambda L: L.beam_search(model(L), ids(L, [[3, 4]]), BOS_ID, EOS_ID, 4, beam_size=0),
        ValueError,
        "beam_size",
    ),  # fmt: skip
    "scores -1": (
        lambda L: L.sequence_scores(model(L), ids(L, [[3, 4]]), ids(L, [[4, 5, -1]]), BOS_ID, EOS_ID),
        ValueError,
        r"sequence_scores: tokens: values must be in \[0, 11\), got -1",
    ),  # fmt: skip
    "scores past vocab": (
        lambda L: L.sequence_scores(model(L), ids(L, [[3, 4]]), ids(L, [[4, 5, 11]]), BOS_ID, EOS_ID),
        ValueError,
        r"got 11",
    ),  # fmt: skip
    "scores bool": (
        lambda L: L.sequence_scores(model(L), ids(L, [[3]]), T(L, [[True]]), BOS_ID, EOS_ID),
        ValueError,
        "sequence_scores: tokens expected a \\(B, L\\) integer",
    ),  # fmt: skip
    "decode_step cache type": (lambda L: _decode_step(L, cache=[]), TypeError, "cache expected a dict"),
    "decode_step batch": (lambda L: _decode_step(L, other_batch=True), ValueError, "the cache holds 2 sequences"),
}


def _decode_step(L, cache=None, other_batch=False):
    m = model(L).eval()
    src = ids(L, [[3, 4], [5, 6]])
    memory, src_mask = m.encode(src)
    if cache is None:
        cache = {}
        m.decode_step(ids(L, [[BOS_ID], [BOS_ID]]), memory, src_mask, cache)
    if other_batch:
        return m.decode_step(ids(L, [[BOS_ID]]), memory[:1], src_mask[:1], cache)
    return m.decode_step(ids(L, [[BOS_ID], [BOS_ID]]), memory, src_mask, cache)


@contextlib.contextmanager
def refused_before_allocating(limit=64 * 2**20):
    """The refusal comes before any large allocation: at most `limit` bytes at the peak (NumPy's allocations are
    traced; a timing would say the same less reliably, and no test here fails on a timing)."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{peak / 2**20:.0f} MiB allocated before the refusal"


@TRACKS
@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_a_clear_error(L, case):
    build, exc, match = REFUSED[case]
    with refused_before_allocating():
        with pytest.raises(exc, match=match):
            build(L)


# -- accepted, with a documented result ------------------------------------------------------------------------------


@TRACKS
def test_numpy_integers_are_sizes_and_seeds_alike(L):
    lin = L.Linear(np.int64(8), np.int32(4), rng=np.int64(3))
    assert lin.in_features == 8 and type(lin.in_features) is int
    m = model(L, d_model=np.int64(8), src_vocab_size=np.int32(11), pad_id=np.int64(0))
    assert json.loads(json.dumps(m.config)) == m.config  # Python values only: a checkpoint records them


@TRACKS
@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64"])
def test_every_integer_token_dtype_gives_the_same_logits(L, dtype):
    m = model(L).eval()
    src, tgt = np.array([[3, 4, 5]]), np.array([[1, 6]])
    ref = m(ids(L, src), ids(L, tgt))
    got = m(T(L, src.astype(dtype)), T(L, tgt.astype(dtype)))
    assert np.array_equal(np.asarray(got.detach() if L is tt else got), np.asarray(ref.detach() if L is tt else ref))


@TRACKS
def test_beam_search_on_an_empty_batch_returns_what_greedy_does(L):
    m, src = model(L), ids(L, np.zeros((0, 3)))
    greedy = L.greedy_decode(m, src, BOS_ID, EOS_ID, 5)
    out, scores = L.beam_search(m, src, BOS_ID, EOS_ID, 5, return_scores=True)
    assert tuple(out.shape) == tuple(greedy.shape) == (0, 1) and tuple(scores.shape) == (0,)


@TRACKS
def test_all_ignored_targets_give_zero_loss(L):
    loss = L.CrossEntropyLoss(ignore_index=0)(f64(L, (2, 3)), ids(L, [0, 0]))
    assert float(loss) == 0.0


def test_adam_skips_parameters_without_gradient_alike_in_both_tracks():
    m, tm = model(tn), model(tt)
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    for p, tp in zip(m.parameters(), tm.parameters(), strict=True):
        p.grad[...] = 0.5
        tp.grad = torch.full_like(tp, 0.5)
    m.parameters()[0].grad = None  # torch's idiom for "no gradient", in both
    next(tm.parameters()).grad = None
    before = m.parameters()[0].data.copy()
    opt, topt = tn.make_adam(m, lr=0.1), tt.make_adam(tm, lr=0.1)
    assert tn.clip_grad_norm(m.parameters(), 1.0) == pytest.approx(tt.clip_grad_norm(tm.parameters(), 1.0), rel=1e-12)
    opt.step()
    topt.step()
    assert np.array_equal(m.parameters()[0].data, before) and np.all(opt.exp_avg[0] == 0)
    for (k, v), tv in zip(m.state_dict().items(), tm.state_dict().values(), strict=True):
        assert np.allclose(v, tv.numpy(), rtol=0, atol=1e-12), k
    opt.zero_grad()  # and back to zeros, so the next backward can add into it
    assert m.parameters()[0].grad is not None and np.all(m.parameters()[0].grad == 0)


def test_vocab_reads_no_special_token_from_text():
    v = Vocab(["a", "b"], level="word")
    with pytest.raises(ValueError, match="special token '<eos>'"):
        v.encode("a <eos> b")
    with pytest.raises(ValueError, match="special token '<unk>'"):
        Vocab.build(["a <unk>"], level="word")
    assert v.encode("a c") == [4, 3, EOS_ID]  # an unknown word is <unk>, not an error


def test_make_batches_refuses_a_zero_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        make_batches([([3, 4], [5])], 0)


# -- 1. checkpoints that know their model -------------------------------------------------------------------------


def _save(L, m, path, opt=None):
    return L.save_checkpoint(path, m, opt) if L is tn else tt.save_checkpoint(path, m, opt)


@TRACKS
@pytest.mark.parametrize(
    "written, loaded, named",
    [
        (dict(tie_output=False), dict(tie_output=True), "tie_output=False in the file, True in the model"),
        (dict(share_embeddings=True), dict(share_embeddings=False), "share_embeddings=True in the file"),
        (dict(norm_first=False), dict(norm_first=True, final_norm=False), "norm_first=False in the file"),
        (dict(d_ff=16), dict(d_ff=32), "d_ff=16 in the file, 32 in the model"),
    ],
)
def test_a_checkpoint_refuses_a_model_configured_differently(L, tmp_path, written, loaded, named):
    src = model(L, **written)
    path = _save(L, src, tmp_path / ("c.npz" if L is tn else "c.pt"))
    dst = model(L, **loaded)
    before = {k: v.clone() if L is tt else v.copy() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError, match=named):
        L.load_checkpoint(path, dst)
    after = dst.state_dict()
    assert all((after[k] == v).all() for k, v in before.items())  # nothing changed


@TRACKS
def test_load_model_builds_the_recorded_configuration(L, tmp_path):
    src = model(L, tie_output=False, norm_first=True, positional="learned")
    for writer, name in [(tn, "n.npz"), (tt, "t.pt")]:
        if writer is tn and L is tt:
            path = tt.export_npz(tmp_path / name, src)
        elif writer is tt and L is tn:
            continue  # the NumPy track never reads a torch pickle
        else:
            path = _save(L, src, tmp_path / name)
        got = L.load_model(path)
        assert type(got) is type(src) and got.config == src.config
        assert all((got.state_dict()[k] == v).all() for k, v in src.state_dict().items())


def test_a_numpy_checkpoint_builds_the_same_model_in_torch(tmp_path):
    src = model(tn, tie_output=False)
    path = tn.save_checkpoint(tmp_path / "c.npz", src)
    got = tt.load_model(path)
    assert got.config == src.config and next(got.parameters()).dtype == torch.float64
    assert all(np.array_equal(v.numpy(), src.state_dict()[k]) for k, v in got.state_dict().items())


def _as_version_1(path):
    """Rewrite a checkpoint as the format before this change wrote it: no model description, version 1."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META_KEY][()]))
    meta.pop("model"), meta.pop("library_version")
    meta["version"] = 1
    arrays[META_KEY] = np.array(json.dumps(meta))
    np.savez(path, **arrays)


@TRACKS
def test_version_1_files_load_into_a_model_the_caller_builds(L, tmp_path):
    src = model(tn)
    path = tn.save_checkpoint(tmp_path / "v1.npz", src)
    _as_version_1(path)
    dst = model(L)
    L.load_checkpoint(path, dst)
    assert all(np.array_equal(np.asarray(v), src.state_dict()[k]) for k, v in dst.state_dict().items())
    with pytest.raises(ValueError, match="records no model configuration.*load_checkpoint"):
        L.load_model(path)


@TRACKS
def test_a_version_1_file_with_untied_values_is_refused_by_a_tied_model(L, tmp_path):
    src = model(tn, tie_output=False)  # output projection and target embedding: two different matrices
    path = tn.save_checkpoint(tmp_path / "v1.npz", src)
    _as_version_1(path)
    with pytest.raises(ValueError, match="one tied parameter in this model"):
        L.load_checkpoint(path, model(L, tie_output=True))


# -- 2. crafted metadata is checked before anything is allocated ------------------------------------------------


def _craft(path, **optim_fields):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META_KEY][()]))
    meta["optim"].update(optim_fields)
    arrays[META_KEY] = np.array(json.dumps(meta))
    np.savez(path, **arrays)


@TRACKS
@pytest.mark.parametrize(
    "fields, exc, match",
    [
        (dict(n_params=10**10), KeyError, "n_params=10000000000, but the file holds"),
        (dict(n_params="many"), ValueError, "n_params must be an int >= 0, got 'many'"),
        (dict(n_params=-1), ValueError, "n_params must be an int >= 0"),
        (dict(lr="fast"), ValueError, "lr='fast' must be a finite float >= 0"),
        (dict(betas=[2.0, 0.9]), ValueError, r"betas=\[2.0, 0.9\] must be two floats"),
        (dict(step=-3), ValueError, "step=-3 must be an int >= 0"),
        (dict(eps=0), ValueError, "eps=0 must be a finite float > 0"),
    ],
)
def test_crafted_optimizer_metadata_is_refused_before_allocating(L, tmp_path, fields, exc, match):
    m = model(tn)
    path = tn.save_checkpoint(tmp_path / "c.npz", m, tn.make_adam(m))
    _craft(path, **fields)
    target = model(L), adam(L, model(L))
    with refused_before_allocating():
        with pytest.raises(exc, match=match):
            L.load_checkpoint(path, *target)


@TRACKS
@pytest.mark.parametrize(
    "model_meta, match",
    [
        ({"class": "os.system", "config": {}, "dtype": "float64"}, "model class must be a class name"),
        ({"class": "Transformer", "config": [], "dtype": "float64"}, "model config must be a dict"),
        ({"class": "Transformer", "config": {}, "dtype": "int8"}, "model dtype must be one of"),
        ({"class": "Linear", "config": {}, "dtype": "float64"}, "holds a Linear, the model is a Transformer"),
        ("Transformer", "model must be a dict with keys"),
    ],
)
def test_crafted_model_metadata_is_refused(L, tmp_path, model_meta, match):
    path = tn.save_checkpoint(tmp_path / "c.npz", model(tn))
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META_KEY][()]))
    meta["model"] = model_meta
    arrays[META_KEY] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match):
        L.load_checkpoint(path, model(L))


@TRACKS
def test_load_model_only_builds_the_track_s_own_classes(L, tmp_path):
    path = tn.save_checkpoint(tmp_path / "c.npz", model(tn))
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META_KEY][()]))
    meta["model"]["class"] = "Popen"
    arrays[META_KEY] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="names a model class 'Popen' that"):
        L.load_model(path)


@TRACKS
@pytest.mark.parametrize("kind", ["directory", "missing", "garbage", "truncated"])
def test_bad_checkpoint_paths(L, tmp_path, kind):
    path = {"directory": tmp_path, "missing": tmp_path / "none.npz"}.get(kind, tmp_path / "bad.npz")
    if kind == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    if kind == "truncated":
        full = tn.save_checkpoint(tmp_path / "full.npz", model(tn)).read_bytes()
        path.write_bytes(full[: len(full) // 2])
    exc, match = {"directory": (IsADirectoryError, "is a directory"), "missing": (FileNotFoundError, "no such")}.get(
        kind, (ValueError, "cannot read")
    )
    with pytest.raises(exc, match=match):
        L.load_checkpoint(path, model(L))


def test_numpy_refuses_a_torch_pickle(tmp_path):
    path = tt.save_checkpoint(tmp_path / "c.pt", model(tt))
    assert zipfile.is_zipfile(path)
    with pytest.raises(ValueError, match="is a torch checkpoint"):
        tn.load_checkpoint(path, model(tn))


# -- 3. a non-finite loss leaves everything as it was ------------------------------------------------------------


def _batch():
    return Batch(np.array([[3, 4, 5]]), np.array([[BOS_ID, 6, 7]]), np.array([[6, 7, EOS_ID]]), 3)


def _state(L, m, opt):
    weights = {k: np.array(v) if L is tn else v.detach().numpy().copy() for k, v in m.state_dict().items()}
    if L is tn:
        return weights, opt.step_count, [a.copy() for a in opt.exp_avg]
    return weights, opt.step_count, {k: v["exp_avg"].clone() for k, v in opt.state.items()}


@TRACKS
@pytest.mark.parametrize("poison", ["loss", "gradient"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy warns of the inf and nan on the way
def test_a_non_finite_step_changes_nothing_and_raises(L, poison):
    m = model(L)
    opt = adam(L, m)
    loss_fn = L.CrossEntropyLoss(ignore_index=PAD_ID)
    L.train_step(m, _batch(), opt, loss_fn, 1e-3)  # one real step: the optimizer has state to keep
    before = _state(L, m, opt)
    weight = m.output_projection.weight.data
    if poison == "loss":  # an infinite logit weight: the loss is nan
        weight[6, 0] = np.inf
    else:  # a finite loss whose gradient is not finite
        loss_fn = _PoisonedGradient(L)
    with pytest.raises(FloatingPointError, match="not finite, so the update was not applied"):
        L.train_step(m, _batch(), opt, loss_fn, 1e-3)
    weight[6, 0] = before[0]["output_projection.weight"][6, 0]
    after = _state(L, m, opt)
    assert after[1] == before[1]
    assert all(np.array_equal(after[0][k], v) for k, v in before[0].items())
    if L is tn:
        assert all(np.array_equal(a, b) for a, b in zip(after[2], before[2], strict=True))
    else:
        assert all(torch.equal(after[2][k], v) for k, v in before[2].items())


class _PoisonedGradient:
    """The cross-entropy, with a finite value and a NaN in its gradient (what an overflow in backward gives)."""

    def __init__(self, L):
        self.inner, self.L = L.CrossEntropyLoss(ignore_index=PAD_ID), L

    def __call__(self, logits, targets):
        loss = self.inner(logits, targets)
        if self.L is tt:  # sqrt at 0: value 0, gradient inf * 0 = nan
            loss = loss + torch.sqrt((logits - logits.detach()).sum().abs())
        return loss

    def backward(self):
        d = self.inner.backward()
        d[0, 0, 0] = np.nan
        return d


@TRACKS
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_train_names_the_step_of_a_non_finite_loss(L):
    m = model(L)
    opt = adam(L, m)
    m.output_projection.weight.data[6, 0] = np.inf
    with pytest.raises(FloatingPointError, match="train: at step 1"):
        L.train(m, [_batch()], opt, steps=1, progress=False, warmup=10)
    assert opt.step_count == 0


# -- 4. and 5. NumPy: inputs changed in place, backward twice -----------------------------------------------------


def _grads(m):
    return {k: v.copy() for k, v in m.grads().items()}


@pytest.mark.parametrize("layer", ["Linear", "GELU", "Embedding", "Transformer", "MultiHeadAttention"])
def test_numpy_inputs_changed_in_place_after_forward_do_not_change_the_gradients(layer):
    rng = np.random.default_rng(0)
    if layer == "Transformer":
        m, args = model(tn), [np.array([[3, 4, 5]]), np.array([[1, 6, 7]])]
    elif layer == "Embedding":
        m, args = tn.Embedding(9, 4, dtype=np.float64), [np.array([[1, 2, 3]])]
    elif layer == "MultiHeadAttention":
        m, args = tn.MultiHeadAttention(8, 2, dtype=np.float64), [rng.standard_normal((1, 3, 8)) for _ in range(3)]
    else:
        m = tn.Linear(4, 3, dtype=np.float64) if layer == "Linear" else tn.GELU()
        args = [rng.standard_normal((2, 4))]
    out = m(*args)
    g = rng.standard_normal(out.shape)
    clean_dx, clean = m.backward(g), _grads(m)
    m.zero_grad()
    m(*args)
    for a in args:  # the caller reuses its buffers before backward
        a[...] = 1 if a.dtype.kind == "i" else a * 3 + 1
    dx = m.backward(g)
    assert all(np.array_equal(v, clean[k]) for k, v in _grads(m).items())
    for a, b in zip(dx if isinstance(dx, tuple) else [dx], clean_dx if isinstance(clean_dx, tuple) else [clean_dx],
                    strict=True):  # fmt: skip
        assert (a is None and b is None) or np.array_equal(a, b)


def test_numpy_gelu_input_gradient_survives_an_in_place_change():
    x = np.random.default_rng(1).standard_normal((3, 5))
    g = np.ones_like(x)
    gelu = tn.GELU()
    gelu(x)
    clean = gelu.backward(g)
    gelu(x)
    x *= 10
    assert np.array_equal(gelu.backward(g), clean)


def test_numpy_activations_are_not_copied_inside_a_model():
    """The copy is made once, of what the caller passed: the model's own activations are cached by reference."""
    m = model(tn)
    m(np.array([[3, 4, 5]]), np.array([[1, 6, 7]]))
    layer = m.encoder.layers[0].self_attn
    x_q = layer.q_proj._cache[0]
    assert layer.k_proj._cache[0].base is x_q.base or layer.k_proj._cache[0] is x_q  # one array, three views


@pytest.mark.parametrize("what", ["Linear", "Transformer"])
def test_numpy_backward_twice_is_refused_and_adds_nothing(what):
    m = tn.Linear(4, 3, dtype=np.float64) if what == "Linear" else model(tn)
    args = [np.ones((2, 4))] if what == "Linear" else [np.array([[3, 4]]), np.array([[1, 6]])]
    out = m(*args)
    m.backward(np.ones_like(out))
    once = _grads(m)
    with pytest.raises(RuntimeError, match="backward\\(\\) called twice after one forward.*run forward again"):
        m.backward(np.ones_like(out))
    assert all(np.array_equal(v, once[k]) for k, v in _grads(m).items())
    m(*args)
    m.backward(np.ones_like(out))  # a new forward: accumulation, as torch's .grad
    assert all(np.allclose(v, 2 * once[k]) for k, v in _grads(m).items())


def test_numpy_a_failed_backward_can_be_retried_with_a_correct_gradient():
    lin = tn.Linear(4, 3, dtype=np.float64)
    lin(np.ones((2, 4)))
    with pytest.raises(ValueError, match="grad_out expected shape"):
        lin.backward(np.ones((2, 5)))
    lin.backward(np.ones((2, 3)))  # not "called twice": the failed call used nothing
    assert np.all(lin.weight.grad == 2)


def test_numpy_layers_without_parameters_may_run_backward_again():
    """Documented: nothing is added into a .grad, so a second backward (e.g. with another grad_out) is correct."""
    ce = tn.CrossEntropyLoss()
    ce(np.zeros((2, 3)), np.array([0, 1]))
    assert np.allclose(ce.backward(2.0), 2 * ce.backward())


def test_torch_refuses_a_second_backward_too():
    m = model(tt)
    out = m(torch.tensor([[3, 4]]), torch.tensor([[1, 6]])).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


@pytest.mark.skipif(os.name != "posix", reason="posix only")
def test_the_hostile_table_has_at_least_sixty_cases():
    assert len(REFUSED) * 2 >= 60 and len(REFUSED) >= 40
