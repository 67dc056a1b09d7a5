"""The key/value cache without copies: buffers allocated once per sequence and written in place, views of the
written part, growth past the capacity, beam reordering of the buffers, and decoding with tiled attention."""

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff, to_numpy

import tfm_numpy as tn
import tfm_torch as tt

PAD, BOS, EOS = 0, 1, 2
SRC = np.array([[3, 7, 1, 9, 5], [2, 10, 4, 0, 0]])
TGT = np.array([[BOS, 4, 8, 3, 6, 5], [BOS, 6, 3, EOS, PAD, PAD]])


def make(track, attn_impl="explicit", max_len=12):
    m = tn.Transformer(11, 9, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=max_len, dropout=0.0,
                       attn_impl=attn_impl, tile_size=2, rng=0, dtype=np.float64)  # fmt: skip
    if track == "numpy":
        return m, tn, np.asarray
    twin = tt.Transformer(**m.config, attn_impl=attn_impl, tile_size=2, rng=0, dtype=torch.float64)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    return twin.eval(), tt, torch.from_numpy


def shares(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return np.shares_memory(a, b)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_buffers_are_allocated_once_and_written_in_place(track):
    model, lib, A = make(track)
    with torch.no_grad():
        memory, src_mask = model.encode(A(SRC))
        cache = {"capacity": 6}
        bufs = None
        for t in range(TGT.shape[1]):
            model.decode_step(A(TGT[:, t : t + 1]), memory, src_mask, cache)
            sa = cache["layers"][0]["self_attn"]
            assert tuple(sa["k_buf"].shape) == (2, 2, 6, 8) and tuple(sa["k"].shape) == (2, 2, t + 1, 8)
            assert shares(sa["k"], sa["k_buf"]) and shares(cache["keep"], cache["keep_buf"])
            now = [sa["k_buf"], sa["v_buf"], cache["keep_buf"]]
            assert bufs is None or all(a is b for a, b in zip(now, bufs, strict=True))  # the same buffers
            bufs = now


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_cache_append_grows_past_its_capacity_keeping_what_was_written(track):
    lib, A = (tn, np.asarray) if track == "numpy" else (tt, torch.from_numpy)
    cache = {"capacity": 2}
    parts = [np.arange(6.0).reshape(1, 3, 2), np.arange(6.0, 8.0).reshape(1, 1, 2), np.ones((1, 2, 2))]
    for p in parts:
        lib.cache_append(cache, "x", A(p), axis=1)
    assert to_numpy(cache["x"]).tolist() == np.concatenate(parts, axis=1).tolist()
    assert cache["x_buf"].shape[1] == 6  # 3 (the first part, past the capacity 2), then twice that: 6 fits the rest
    assert shares(cache["x"], cache["x_buf"])


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_reordered_buffers_keep_their_capacity_and_copy_only_the_written_part(track):
    model, lib, A = make(track)
    rows = A(np.array([1, 0, 0]))
    with torch.no_grad():
        memory, src_mask = model.encode(A(SRC))
        cache = {"capacity": 9}
        model.decode_step(A(TGT[:, :4]), memory, src_mask, cache)
        cache["layers"][1]["self_attn"]["k_buf"][:, :, 4:] = 1234.5  # the room not written yet: a marker
        new = lib.reorder_cache(cache, rows)
        sa, old = new["layers"][1]["self_attn"], cache["layers"][1]["self_attn"]
        assert tuple(sa["k_buf"].shape) == (3, 2, 9, 8) and shares(sa["k"], sa["k_buf"])
        assert max_abs_diff(sa["k"], old["k"][rows]) == 0 and max_abs_diff(new["keep"], cache["keep"][rows]) == 0
        assert not (sa["k_buf"][:, :, 4:] == 1234.5).all()  # the marker was not copied: only positions 0..3 were
        step = model.decode_step(A(np.array([[5], [3], [6]])), memory[rows], src_mask[rows], new)
        assert sa["k_buf"] is new["layers"][1]["self_attn"]["k_buf"]  # the next step wrote into it, in place
        full = model.decode(A(np.concatenate([TGT[[1, 0, 0], :4], [[5], [3], [6]]], axis=1)), memory[rows],
                            src_mask[rows])  # fmt: skip
    assert max_abs_diff(step[:, 0], full[:, -1]) < 1e-10


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_decoding_with_flash_attention_matches_explicit(track):
    """Greedy and beam search with every attention tiled: the same tokens, and the cached step's logits equal."""
    ex, lib, A = make(track)
    fl = make(track, attn_impl="flash")[0]
    with torch.no_grad():
        for fn in (lib.greedy_decode, lambda *a: lib.beam_search(*a, beam_size=3)):
            assert np.array_equal(to_numpy(fn(ex, A(SRC), BOS, EOS, 10)), to_numpy(fn(fl, A(SRC), BOS, EOS, 10)))
        logits = []
        for m in (ex, fl):
            memory, src_mask = m.encode(A(SRC))
            cache = {}
            logits.append([m.decode_step(A(TGT[:, t : t + 1]), memory, src_mask, cache) for t in range(6)])
    assert max(max_abs_diff(a, b) for a, b in zip(*logits, strict=True)) < 1e-12


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_the_concatenating_cache_kept_for_comparison_gives_the_same_logits(track):
    model, lib, A = make(track)
    with torch.no_grad():
        memory, src_mask = model.encode(A(SRC))
        caches, steps = ({}, {"preallocate": False}), ([], [])
        for t in range(TGT.shape[1]):
            for cache, out in zip(caches, steps, strict=True):
                out.append(model.decode_step(A(TGT[:, t : t + 1]), memory, src_mask, cache))
    assert "k_buf" not in caches[1]["layers"][0]["self_attn"] and "keep_buf" not in caches[1]
    assert max(max_abs_diff(a, b) for a, b in zip(*steps, strict=True)) == 0
