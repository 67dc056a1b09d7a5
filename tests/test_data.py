"""Data (tfm_common.data): the tasks, the vocabulary, number translation and its splits, batches and masks."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfm_numpy as tn
from tfm_common import data as D
from tfm_common.data import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab


def test_special_tokens_have_fixed_ids():
    assert (D.PAD_ID, D.BOS_ID, D.EOS_ID, D.UNK_ID) == (0, 1, 2, 3)
    v = Vocab.build(["abc"])
    assert [v.stoi[t] for t in D.SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert v.itos[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"] and len(v) == 7


# -- vocabulary ------------------------------------------------------------------------------------------------


def test_vocab_encode_decode():
    v = Vocab.build(["hallo", "welt"])
    assert v.itos[4:] == sorted("halowet") == list("aehlotw")
    ids = v.encode("welt")
    assert ids == [v.stoi[c] for c in "welt"] + [EOS_ID]
    assert v.encode("welt", add_bos=True, add_eos=False) == [BOS_ID] + ids[:-1]
    assert v.decode(ids) == "welt"
    assert v.decode([BOS_ID, *ids, PAD_ID, PAD_ID]) == "welt"
    assert v.decode([*ids, *v.encode("hallo")]) == "welt"  # stops at the first EOS
    assert v.decode([BOS_ID, *ids, PAD_ID], strip_special=False) == "<bos>welt<eos><pad>"
    assert v.encode("wolke!") == [v.stoi["w"], v.stoi["o"], v.stoi["l"], UNK_ID, v.stoi["e"], UNK_ID, EOS_ID]
    assert v.decode(v.encode("wolke")) == "wol<unk>e"
    assert v.decode(np.array(ids)) == "welt"
    assert v.decode_batch(np.array([ids, ids])) == ["welt", "welt"]
    assert "a" in v and "z" not in v


def test_vocab_ids_do_not_depend_on_sentence_order():
    assert Vocab.build(["abc", "xyz"]) == Vocab.build(["zyx", "cba"])


def test_vocab_round_trips_every_training_sentence():
    train, _, _ = D.number_splits(9999, 2000, 100, 100, seed=0)
    for lang in ("de", "en"):
        pairs = D.number_pairs(train, lang)
        src_vocab = Vocab.build(s for s, _ in pairs)
        tgt_vocab = Vocab.build(t for _, t in pairs)
        assert src_vocab.itos[4:] == list("0123456789")
        assert all(src_vocab.decode(src_vocab.encode(s)) == s for s, _ in pairs)
        assert all(tgt_vocab.decode(tgt_vocab.encode(t)) == t for _, t in pairs)
        assert UNK_ID not in {i for _, t in pairs for i in tgt_vocab.encode(t)}


def test_vocab_word_level():
    v = Vocab.build([["the", "cat"], "the dog"], level="word")
    assert v.itos[4:] == ["cat", "dog", "the"]
    assert v.decode(v.encode("the cat")) == "the cat"
    assert v.encode(["the", "bird"]) == [v.stoi["the"], UNK_ID, EOS_ID]
    with pytest.raises(ValueError, match="special token"):
        Vocab(["<eos>"], level="word")
    with pytest.raises(ValueError, match="cannot contain whitespace"):
        Vocab(["a b"], level="word")


def test_vocab_to_dict_from_dict_through_json():
    v = Vocab.build(["einundzwanzig", "dreißig"])
    d = json.loads(json.dumps(v.to_dict()))
    w = Vocab.from_dict(d)
    assert w == v and w.stoi == v.stoi and w.level == "char"
    assert w.encode("drei") == v.encode("drei")
    with pytest.raises(ValueError, match="must start with"):
        Vocab.from_dict({"level": "char", "tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="keys 'level' and 'tokens'"):
        Vocab.from_dict({"tokens": []})


def test_vocab_bad_input():
    v = Vocab.build(["ab"])
    with pytest.raises(ValueError, match=r"ids must be in \[0, 6\), got 6"):
        v.decode([4, 6])
    with pytest.raises(ValueError, match="expected a 1-D sequence"):
        v.decode(np.zeros((2, 2), dtype=int))
    with pytest.raises(TypeError, match="expected integers"):
        v.decode([1.0, 2.0])
    with pytest.raises(TypeError, match="char-level text must be a str"):
        v.encode(["a", "b"])
    with pytest.raises(ValueError, match="level expected one of"):
        Vocab.build(["ab"], level="byte")
    with pytest.raises(ValueError, match="one character"):
        Vocab(["ab"])
    with pytest.raises(ValueError, match="listed twice"):
        Vocab(["a", "a"])


# -- synthetic tasks -------------------------------------------------------------------------------------------


def test_copy_and_reverse_tasks():
    copy = D.copy_task(200, 2, 6, 5, rng=0)
    rev = D.reverse_task(200, 2, 6, 5, rng=0)
    assert len(copy) == len(rev) == 200
    assert all(s == t for s, t in copy)
    assert all(t == s[::-1] for s, t in rev)
    assert [s for s, _ in copy] == [s for s, _ in rev]  # same seed, same sources
    lengths = {len(s) for s, _ in copy}
    assert lengths == {2, 3, 4, 5, 6}
    assert set("".join(s for s, _ in copy)) == set("abcde")


def test_tasks_are_deterministic_given_a_seed_or_generator():
    assert D.reverse_task(50, 1, 8, 10, rng=3) == D.reverse_task(50, 1, 8, 10, rng=np.random.default_rng(3))
    assert D.reverse_task(50, 1, 8, 10, rng=3) != D.reverse_task(50, 1, 8, 10, rng=4)
    g = np.random.default_rng(0)
    first, second = D.copy_task(20, 3, 5, 8, rng=g), D.copy_task(20, 3, 5, 8, rng=g)
    assert first != second  # a Generator moves on


def test_task_exclude_gives_held_out_sequences():
    train = D.reverse_task(500, 3, 5, 4, rng=0)
    test = D.reverse_task(100, 3, 5, 4, rng=1, exclude={s for s, _ in train})
    assert not {s for s, _ in train} & {s for s, _ in test}
    with pytest.raises(ValueError, match="could not draw"):
        D.copy_task(5, 1, 1, 2, rng=0, exclude={"a", "b"})


def test_task_bad_input():
    with pytest.raises(ValueError, match=r"n_symbols must be <= 62"):
        D.copy_task(3, 1, 2, 63)
    with pytest.raises(ValueError, match="max_len must be >= 4"):
        D.copy_task(3, 4, 2, 5)
    with pytest.raises(TypeError, match="n expected an int"):
        D.reverse_task(2.0, 1, 2, 5)
    with pytest.raises(TypeError, match="rng expected a numpy.random.Generator"):
        D.reverse_task(2, 1, 2, 5, rng="seed")


# -- number translation ----------------------------------------------------------------------------------------


def test_number_pairs_german_and_english():
    assert D.number_pairs([21], "de") == [("21", "einundzwanzig")]  # units before tens
    assert D.number_pairs([21, 7, 100], "en") == [("21", "twenty-one"), ("7", "seven"), ("100", "one hundred")]
    assert D.number_pairs(np.array([345]), "de") == [("345", "dreihundertfünfundvierzig")]
    assert D.number_pairs([1234]) == [("1234", "eintausendzweihundertvierunddreißig")]
    assert D.number_to_words(30, "de") == "dreißig"
    with pytest.raises(ValueError, match="not supported by num2words"):
        D.number_to_words(3, "xx")
    with pytest.raises(TypeError, match="n expected an int"):
        D.number_to_words(2.5)


def test_number_splits_are_disjoint_and_deterministic():
    train, valid, test = D.number_splits(9999, 5000, 500, 1000, seed=0)
    assert (len(train), len(valid), len(test)) == (5000, 500, 1000)
    assert all(a.dtype == np.int64 for a in (train, valid, test))
    everything = np.concatenate([train, valid, test])
    assert len(np.unique(everything)) == len(everything)  # disjoint, no repeats
    assert everything.min() >= 0 and everything.max() <= 9999
    again = D.number_splits(9999, 5000, 500, 1000, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip((train, valid, test), again, strict=True))
    other = D.number_splits(9999, 5000, 500, 1000, seed=1)
    assert not np.array_equal(train, other[0])
    # the whole range, split: every number exactly once
    a, b, c = D.number_splits(99, 80, 10, 10, seed=0, min_number=0)
    assert sorted(np.concatenate([a, b, c]).tolist()) == list(range(100))
    a, _, _ = D.number_splits(20, 11, 0, 0, seed=0, min_number=10)
    assert sorted(a.tolist()) == list(range(10, 21))
    # test words never seen as training targets either (one number, one spelling)
    tr = {w for _, w in D.number_pairs(train[:300])}
    assert not tr & {w for _, w in D.number_pairs(test[:300])}


def test_number_splits_bad_input():
    with pytest.raises(ValueError, match="exceeds the 100 numbers in \\[0, 99\\]"):
        D.number_splits(99, 90, 10, 1)
    with pytest.raises(ValueError, match="n_valid must be >= 0"):
        D.number_splits(99, 10, -1, 1)
    with pytest.raises(ValueError, match="min_number must be <= max_number"):
        D.number_splits(9, 1, 1, 1, min_number=10)


# -- batches and masks -----------------------------------------------------------------------------------------


def test_make_batches_pads_and_shifts():
    pairs = [([5, 6, EOS_ID], [7, 8, 9]), ([5, EOS_ID], [7]), ([6, 6, 6, EOS_ID], [])]
    (b,) = D.make_batches(pairs, batch_size=3, shuffle=False, sort_by_length=False)
    np.testing.assert_array_equal(b.src, [[5, 6, 2, 0], [5, 2, 0, 0], [6, 6, 6, 2]])
    np.testing.assert_array_equal(b.tgt_in, [[1, 7, 8, 9], [1, 7, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(b.tgt_out, [[7, 8, 9, 2], [7, 2, 0, 0], [2, 0, 0, 0]])
    assert b.n_tokens == 4 + 2 + 1 and len(b) == 3
    assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == np.int64
    # shifted by one: the input at t+1 is the output at t, wherever both are real
    real = (b.tgt_in[:, 1:] != PAD_ID) & (b.tgt_out[:, :-1] != PAD_ID)
    assert np.array_equal(b.tgt_in[:, 1:][real], b.tgt_out[:, :-1][real])
    assert (b.tgt_in[:, 0] == BOS_ID).all()


def test_masks_shapes_values_and_library_agreement():
    pairs = [([5, 6, EOS_ID], [7, 8, 9]), ([5, EOS_ID], [7])]
    (b,) = D.make_batches(pairs, batch_size=2, shuffle=False, sort_by_length=False)
    sm, tm = b.src_mask, b.tgt_mask
    assert sm.shape == (2, 1, 1, 3) and tm.shape == (2, 1, 4, 4) and sm.dtype == tm.dtype == bool
    np.testing.assert_array_equal(sm[:, 0, 0], [[True, True, True], [True, True, False]])
    causal = np.tril(np.ones((4, 4), dtype=bool))
    np.testing.assert_array_equal(tm[0, 0], causal)
    np.testing.assert_array_equal(tm[1, 0], causal & [True, True, False, False])
    assert tm.any(axis=-1).all()  # no query row with nothing to attend to
    np.testing.assert_array_equal(sm, tn.padding_mask(b.src, PAD_ID))
    np.testing.assert_array_equal(tm, tn.decoder_mask(b.tgt_in, PAD_ID))
    np.testing.assert_array_equal(D.src_mask(b.src), sm)
    np.testing.assert_array_equal(D.tgt_mask(b.tgt_in), tm)
    with pytest.raises(ValueError, match=r"expected a \(B, T\) integer array"):
        D.src_mask(np.zeros(3, dtype=int))


def number_batches(seed, **kw):
    train, _, _ = D.number_splits(999, 300, 0, 0, seed=0)
    pairs = D.number_pairs(train)
    src_vocab, tgt_vocab = Vocab.build(s for s, _ in pairs), Vocab.build(t for _, t in pairs)
    ids = D.encode_pairs(pairs, src_vocab, tgt_vocab)
    return pairs, ids, src_vocab, tgt_vocab, D.make_batches(ids, 32, rng=seed, **kw)


def test_batches_cover_every_pair_once_and_decode_back():
    pairs, ids, src_vocab, tgt_vocab, batches = number_batches(0)
    assert sum(len(b) for b in batches) == len(pairs) and all(len(b) <= 32 for b in batches)
    decoded = [
        (s, t)
        for b in batches
        for s, t in zip(src_vocab.decode_batch(b.src), tgt_vocab.decode_batch(b.tgt_out), strict=True)
    ]
    assert sorted(decoded) == sorted(pairs)
    assert [tgt_vocab.decode(row) for b in batches for row in b.tgt_in] == [t for _, t in decoded]
    assert sum(b.n_tokens for b in batches) == sum(len(t) + 1 for _, t in ids)


def test_sorting_by_length_reduces_padding():
    *_, sorted_batches = number_batches(0)
    *_, unsorted = number_batches(0, sort_by_length=False)

    def pad_fraction(batches):
        return sum((b.tgt_out == PAD_ID).sum() for b in batches) / sum(b.tgt_out.size for b in batches)

    assert pad_fraction(sorted_batches) < pad_fraction(unsorted) / 2


def test_batches_are_deterministic_and_shuffled_by_the_generator():
    *_, a = number_batches(0)
    *_, b = number_batches(0)
    *_, c = number_batches(1)
    assert all(np.array_equal(x.src, y.src) and np.array_equal(x.tgt_out, y.tgt_out) for x, y in zip(a, b, strict=True))
    assert any(not np.array_equal(x.src, y.src) for x, y in zip(a, c, strict=False))
    _, ids, *_ = number_batches(0)
    g = np.random.default_rng(0)
    epoch1, epoch2 = D.make_batches(ids, 32, rng=g), D.make_batches(ids, 32, rng=g)
    assert any(not np.array_equal(x.src, y.src) for x, y in zip(epoch1, epoch2, strict=False))
    fixed1 = D.make_batches(ids, 32, shuffle=False)
    fixed2 = D.make_batches(ids, 32, rng=123, shuffle=False)
    assert all(np.array_equal(x.src, y.src) for x, y in zip(fixed1, fixed2, strict=True))
    lengths = [b.src.shape[1] for b in fixed1]
    assert lengths == sorted(lengths)


def test_make_batches_bad_input():
    with pytest.raises(ValueError, match="tgt contains the special id 2.*add_eos=False"):
        D.make_batches([([5, EOS_ID], [7, EOS_ID])], 2)
    with pytest.raises(ValueError, match="pair 1: src contains the special id 0"):
        D.make_batches([([5], [7]), ([5, PAD_ID], [7])], 2)
    with pytest.raises(ValueError, match="pair 0: src is empty"):
        D.make_batches([([], [7])], 2)
    with pytest.raises(TypeError, match="expected integer ids"):
        D.make_batches([([5.0], [7])], 2)
    with pytest.raises(ValueError, match="expected a \\(src_ids, tgt_ids\\) pair"):
        D.make_batches([[5, 6, 7]], 2)
    with pytest.raises(ValueError, match="pairs_ids is empty"):
        D.make_batches([], 2)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        D.make_batches([([5], [7])], 0)


def test_tfm_common_data_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, tfm_common.data; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
