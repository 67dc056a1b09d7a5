"""The lean step of the NumPy searches (tfm_numpy/fast_decode.py, `LeanStep`): the logits and the cache of
`Transformer.decode_step` at every step, for every model option it covers (float64 to 1e-12, float32 to rounding);
beam reordering of its cache; the models it leaves to decode_step; bad input refused as before, in both tracks."""

import itertools

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff, to_numpy

import tfm_numpy as tn
import tfm_torch as tt
from tfm_numpy import decoding
from tfm_numpy.fast_decode import LeanStep

PAD, BOS, EOS = 0, 1, 2
SRC = np.array([[3, 7, 1, 9, 5], [2, 10, 4, 0, 0], [5, 5, 5, 5, 5]])  # (3, 5), the second row padded
# what the decoder reads: bos first; the second row is done after its eos and is fed padding, as greedy_decode does
TGT = np.array([[BOS, 4, 8, 3, 6, 5, 7, 3], [BOS, 6, 3, EOS, PAD, PAD, PAD, PAD], [BOS, 3, 3, 8, 4, 1, 6, 6]])
OPTIONS = {
    "postLN": {},
    "preLN": dict(norm_first=True),
    "learned-d_model-scale": dict(positional="learned", score_scale="d_model"),
    "logits-scale-embed-norm-no-tgt-padding": dict(embed_scale="logits", embed_norm=True, tgt_padding_mask=False),
    "gelu-untied-final-norm": dict(activation="gelu", tie_output=False, final_norm=True),
    "unscaled-embeddings-after-norm-dropout": dict(embed_scale="none", dropout_place="after_norm"),
}


def model(dtype=np.float64, dropout=0.0, **opts):
    """A tiny random model; LayerNorms moved off (1, 0) so that every weight of theirs matters."""
    m = tn.Transformer(11, 11, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=12, dropout=dropout, rng=0,
                       dtype=dtype, **opts)  # fmt: skip
    rng = np.random.default_rng(1)
    for name, p in m.named_parameters():
        if "norm" in name:
            p.data += (0.3 * rng.standard_normal(p.shape)).astype(dtype)
    return m


def lean_and_regular(m, tgt=TGT, src=SRC):
    """Feed `tgt` one token at a time to the searches' step (`_next_logits`) and to decode_step, fresh caches."""
    memory, src_mask = m.encode(src)
    lean_cache, regular_cache = {"capacity": tgt.shape[1]}, {"capacity": tgt.shape[1]}
    lean, regular = [], []
    for t in range(tgt.shape[1]):
        lean.append(decoding._next_logits(m, tgt[:, : t + 1], memory, src_mask, lean_cache))
        regular.append(m.decode_step(tgt[:, t : t + 1], memory, src_mask, regular_cache)[:, -1])
    return np.stack(lean, 1), np.stack(regular, 1), lean_cache, regular_cache


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lean_step_gives_the_logits_and_the_cache_of_decode_step(opts, dtype):
    m = model(dtype, **opts).eval()
    lean, regular, lean_cache, regular_cache = lean_and_regular(m)
    assert isinstance(lean_cache["lean"], LeanStep)  # the lean step ran, not decode_step
    assert lean.dtype == regular.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-5  # float32: the fused q/k/v matmul may round differently
    assert max_abs_diff(lean, regular) < tol
    assert lean_cache["length"] == regular_cache["length"] == TGT.shape[1]
    np.testing.assert_array_equal(lean_cache["keep"], regular_cache["keep"])
    for mine, theirs in zip(lean_cache["layers"], regular_cache["layers"], strict=True):
        for part, name in itertools.product(("self_attn", "cross_attn"), ("k", "v")):
            assert mine[part][name].shape == theirs[part][name].shape
            assert max_abs_diff(mine[part][name], theirs[part][name]) < tol
        assert np.shares_memory(mine["self_attn"]["k"], mine["self_attn"]["k_buf"])  # written in place


def test_lean_step_equals_the_uncached_decoder_in_float64():
    m = model(norm_first=True).eval()
    lean, *_ = lean_and_regular(m)
    memory, src_mask = m.encode(SRC)
    assert max_abs_diff(lean, m.decode(TGT, memory, src_mask)) < 1e-12


def test_beam_reordering_of_the_lean_cache():
    """After reorder_cache, the lean step continues each new row from its parent's keys and values."""
    m = model(norm_first=True).eval()
    memory, src_mask = m.encode(SRC)
    cache = {"capacity": 8}
    for t in range(4):
        decoding._next_logits(m, TGT[:, : t + 1], memory, src_mask, cache)
    rows = np.array([2, 0, 0, 1])
    cache = tn.reorder_cache(cache, rows)
    assert isinstance(cache["lean"], LeanStep)  # carried over as it is
    prefix = np.concatenate([TGT[rows, :4], [[5], [3], [6], [4]]], axis=1)  # (4, 5)
    step = decoding._next_logits(m, prefix, memory[rows], src_mask[rows], cache)
    full = m.decode(prefix, memory[rows], src_mask[rows])[:, -1]
    assert max_abs_diff(step, full) < 1e-12
    assert cache["layers"][0]["self_attn"]["k"].shape == (4, 2, 5, 8)


@pytest.mark.parametrize("opts", [{}, dict(norm_first=True, positional="learned")])
def test_beam_search_with_the_lean_step_equals_the_uncached_search(opts):
    m = model(**opts)
    tok, score = tn.beam_search(m, SRC, BOS, EOS, 10, beam_size=3, return_scores=True)
    tok2, score2 = tn.beam_search(m, SRC, BOS, EOS, 10, beam_size=3, use_cache=False, return_scores=True)
    np.testing.assert_array_equal(tok, tok2)
    assert max_abs_diff(score, score2) < 1e-10


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_greedy_decode_runs_the_lean_step_and_matches_the_uncached_search(dtype, monkeypatch):
    m = model(dtype)
    expected = tn.greedy_decode(m, SRC, BOS, EOS, 11, use_cache=False)

    def refuse(*args, **kwargs):
        raise AssertionError("decode_step called: the lean step should have run")

    monkeypatch.setattr(m, "decode_step", refuse)  # an instance attribute: the class's method is untouched
    np.testing.assert_array_equal(tn.greedy_decode(m, SRC, BOS, EOS, 11), expected)


def test_a_model_in_training_mode_with_dropout_decodes_as_in_eval_mode():
    """The searches switch dropout off for the call (the lean step then applies) and restore the mode after."""
    m = model(dropout=0.3).train()
    out = tn.greedy_decode(m, SRC, BOS, EOS, 11)
    assert m.training and all(sub.training for _, sub in m.named_modules())
    np.testing.assert_array_equal(out, tn.greedy_decode(m.eval(), SRC, BOS, EOS, 11, use_cache=False))


def _decides(m, src=SRC, cache=None):
    memory, src_mask = m.encode(src)
    cache = {} if cache is None else cache
    decoding._next_logits(m, TGT[:, :1], memory, src_mask, cache)
    return cache["lean"]


def test_what_the_lean_step_leaves_to_decode_step():
    assert _decides(model().eval()) is not None
    assert _decides(model(dropout=0.1).train()) is None  # training: dropout is on
    assert _decides(model(dropout=0.1).eval()) is not None  # eval: dropout is the identity
    assert _decides(model().eval(), cache={"preallocate": False}) is None  # the concatenating cache, on purpose
    assert _decides(model(attn_impl="flash").eval()) is None  # tiled attention: its own arithmetic
    assert _decides(model(head_projection="shared").eval()) is None  # chapter 16a's pitfall
    empty = SRC.copy()
    empty[1] = PAD
    assert _decides(model().eval(), src=empty) is None  # a source row with nothing to attend to
    m = model().eval()
    m.decoder.layers[0].train()
    assert _decides(m) is None  # one module left in training mode


@pytest.mark.parametrize("opts", [dict(attn_impl="flash"), dict(head_projection="shared")])
def test_the_models_left_to_decode_step_still_decode_as_uncached(opts):
    m = model(**opts)
    expected = tn.greedy_decode(m, SRC, BOS, EOS, 11, use_cache=False)
    np.testing.assert_array_equal(tn.greedy_decode(m, SRC, BOS, EOS, 11), expected)


def test_an_all_padding_source_row_decodes_as_uncached():
    src = SRC.copy()
    src[1] = PAD
    m = model()
    np.testing.assert_array_equal(tn.greedy_decode(m, src, BOS, EOS, 11), tn.greedy_decode(m, src, BOS, EOS, 11, False))


BAD = {
    "bos is pad": (dict(bos_id=PAD), ValueError, "bos_id=0 is the model's pad_id"),
    "eos out of range": (dict(eos_id=11), ValueError, r"eos_id must be a token id in \[0, 11\)"),
    "max_len too long": (dict(max_len=13), ValueError, "max_len=13 exceeds the model's max_len=12"),
    "max_len zero": (dict(max_len=0), ValueError, "max_len must be an int >= 1"),
    "src out of range": (dict(src=np.array([[3, 11]])), ValueError, r"src: values must be in \[0, 11\)"),
    "src floats": (dict(src=np.ones((1, 3))), TypeError, "src: expected an integer (array|tensor)"),
}


@pytest.mark.parametrize("track", ["numpy", "torch"])
@pytest.mark.parametrize("search", ["greedy_decode", "beam_search"])
@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_is_refused_as_before_in_both_tracks(track, search, case):
    kwargs, error, message = case
    m = model()
    args = dict(src=SRC, bos_id=BOS, eos_id=EOS, max_len=11) | kwargs
    if track == "torch":
        m = tt.Transformer(**m.config, rng=0, dtype=torch.float64)
        args["src"] = torch.from_numpy(args["src"])
    lib = tn if track == "numpy" else tt
    with pytest.raises(error, match=message):
        getattr(lib, search)(m, args["src"], args["bos_id"], args["eos_id"], args["max_len"])


def test_both_tracks_decode_the_same_tokens():
    m = model(norm_first=True)
    twin = tt.Transformer(**m.config, rng=0, dtype=torch.float64)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    out = tt.greedy_decode(twin, torch.from_numpy(SRC), BOS, EOS, 11)
    np.testing.assert_array_equal(tn.greedy_decode(m, SRC, BOS, EOS, 11), to_numpy(out))


def test_an_empty_batch_decodes_to_an_empty_array():
    m = model()
    out = tn.greedy_decode(m, SRC[:0], BOS, EOS, 5)
    np.testing.assert_array_equal(out, tn.greedy_decode(m, SRC[:0], BOS, EOS, 5, use_cache=False))
    assert out.shape == (0, 1)
