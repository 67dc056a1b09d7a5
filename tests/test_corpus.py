"""tfm_common.corpus: the fixed stdlib file lists, their digest, and language-model batches."""

import hashlib
import sys

import numpy as np
import pytest

from tfm_common import corpus
from tfm_common.corpus import (
    TRAIN_FILES,
    VAL_FILES,
    lm_batches,
    sample_batch,
    split_ids,
    stdlib_corpus,
    stdlib_dir,
    window_starts,
)

ON_BOOK_PYTHON = tuple(sys.version_info[:3]) == corpus.EXPECTED_PYTHON


def test_file_lists_are_fixed_sorted_disjoint_and_present():
    assert TRAIN_FILES == tuple(sorted(TRAIN_FILES)) and VAL_FILES == tuple(sorted(VAL_FILES))
    assert (len(TRAIN_FILES), len(VAL_FILES)) == (48, 12)
    assert not set(TRAIN_FILES) & set(VAL_FILES)
    root = corpus.stdlib_dir()
    assert all((root / f).is_file() for f in TRAIN_FILES + VAL_FILES)


@pytest.mark.parametrize("split", ["train", "val"])
def test_corpus_is_the_files_concatenated(split):
    c = stdlib_corpus(split)
    root = corpus.stdlib_dir()
    assert c.data == b"".join((root / f).read_bytes() for f in c.files)
    assert c.n_bytes == len(c.data) and c.sha256 == hashlib.sha256(c.data).hexdigest()
    assert c.text.encode("utf-8") == c.data
    assert f"{len(c.files)} files" in c.info() and c.sha256[:16] in repr(c)


@pytest.mark.skipif(not ON_BOOK_PYTHON, reason="the expected digests are those of Python 3.11.7's stdlib")
@pytest.mark.parametrize("split", ["train", "val"])
def test_digest_is_the_expected_one(split):
    assert stdlib_corpus(split, strict=True).sha256 == corpus.EXPECTED_SHA256[split]


def test_a_changed_stdlib_is_refused_when_strict(monkeypatch):
    monkeypatch.setattr(corpus, "EXPECTED_PYTHON", tuple(sys.version_info[:3]))
    monkeypatch.setitem(corpus.EXPECTED_SHA256, "val", "0" * 64)
    with pytest.raises(ValueError, match="'val' files have sha256"):
        stdlib_corpus("val", strict=True)
    with pytest.warns(UserWarning, match="book's numbers will differ"):
        stdlib_corpus("val")


def test_a_missing_file_is_an_error(monkeypatch):
    monkeypatch.setattr(corpus, "VAL_FILES", corpus.VAL_FILES + ("no_such_module.py",))
    with pytest.raises(FileNotFoundError, match="no_such_module.py"):
        stdlib_corpus("val")


def test_max_bytes_cuts_at_a_character_boundary():
    full = stdlib_corpus("val")
    first = full.data.index("\u00e9".encode())  # shlex.py spells a name with an accented e, two bytes in UTF-8
    cut = stdlib_corpus("val", max_bytes=first + 1)
    assert cut.data == full.data[:first] and cut.text == full.text[: len(cut.text)]
    assert stdlib_corpus("val", max_bytes=10**9).data == full.data


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"split": "test"}, ValueError, "split must be one of"),
        ({"max_bytes": 0}, ValueError, "max_bytes must be an int >= 1"),
        ({"max_bytes": 1.5}, TypeError, "max_bytes expected an int"),
        ({"strict": 1}, TypeError, "strict expected True or False"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        stdlib_corpus(**kwargs)


def test_batches_are_windows_shifted_by_one():
    ids = np.arange(1000, 1100)
    x, y = sample_batch(ids, 8, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int64
    assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(y[:, -1], x[:, -1] + 1)
    assert np.all(np.diff(x, axis=1) == 1) and x.min() >= 1000 and y.max() <= 1099
    x2, y2 = sample_batch(ids, 8, 16, np.random.default_rng(0))
    assert np.array_equal(x, x2) and np.array_equal(y, y2)


def test_batches_reach_both_ends():
    ids = np.arange(5)
    xs = np.concatenate([x for x, _ in lm_batches(ids, 4, 4, np.random.default_rng(1), n_batches=10)])
    assert {tuple(r) for r in xs} == {(0, 1, 2, 3)}  # only one window fits, and it is found
    seen = np.concatenate([y for _, y in lm_batches(np.arange(20), 4, 3, np.random.default_rng(1), 50)])
    assert seen.min() == 1 and seen.max() == 19
    endless = lm_batches(np.arange(20), 2, 3, np.random.default_rng(1))
    assert len([next(endless) for _ in range(100)]) == 100
    with pytest.raises(ValueError, match="n_batches must be an int >= 1"):
        next(lm_batches(np.arange(20), 2, 3, np.random.default_rng(1), 0))


def test_batches_refuse_bad_input():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="at least block_size \\+ 1 = 9"):
        sample_batch(np.arange(8), 2, 8, rng)
    with pytest.raises(TypeError, match="1-D array of integer"):
        sample_batch(np.zeros(20), 2, 8, rng)
    with pytest.raises(TypeError, match="rng expected a numpy.random.Generator"):
        sample_batch(np.arange(20), 2, 8, 0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        sample_batch(np.arange(20), 2, 0, rng)


def test_split_ids_holds_out_the_tail():
    head, tail = split_ids(np.arange(100), 0.1)
    assert np.array_equal(head, np.arange(90)) and np.array_equal(tail, np.arange(90, 100))
    with pytest.raises(ValueError, match="val_fraction must be a float in \\(0, 1\\)"):
        split_ids(np.arange(10), 1.0)


@pytest.mark.parametrize("split", ["train", "val"])
def test_documents_are_the_files_one_by_one(split):
    corpus = stdlib_corpus(split)
    docs = corpus.documents()
    root = stdlib_dir()
    assert len(docs) == len(corpus.files) and b"".join(docs) == corpus.data
    assert all(d == (root / f).read_bytes() for d, f in zip(docs, corpus.files, strict=True))


def test_documents_after_a_cut_keep_the_part_that_was_kept():
    corpus = stdlib_corpus("val", max_bytes=40_000)  # bdb.py (32,463 bytes) and the start of copy.py
    docs = corpus.documents()
    assert len(docs) == 2 and b"".join(docs) == corpus.data and len(docs[0]) == corpus.file_sizes[0]


def test_window_starts_are_the_starts_of_sample_batch():
    ids = np.arange(1000)
    starts = window_starts(len(ids), 5, 16, np.random.default_rng(3))
    x, _ = sample_batch(ids, 5, 16, np.random.default_rng(3))
    assert np.array_equal(x[:, 0], starts)
    with pytest.raises(ValueError, match="n_ids must be an int >= 17"):
        window_starts(16, 5, 16, np.random.default_rng(3))
