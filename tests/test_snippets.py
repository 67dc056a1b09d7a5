"""tfm_common.snippets: the package-classification task's split by file, its determinism and its encoding."""

import hashlib
import sys

import numpy as np
import pytest

from tfm_common import snippets
from tfm_common.corpus import TRAIN_FILES, VAL_FILES, stdlib_dir
from tfm_common.snippets import (
    NUL_PAD,
    PACKAGES,
    SNIPPET_BYTES,
    SPLIT_FILES,
    SPLITS,
    cut_snippets,
    encode_snippets,
    package_of,
    stdlib_snippets,
)

ON_BOOK_PYTHON = tuple(sys.version_info[:3]) == snippets.EXPECTED_PYTHON


@pytest.fixture(scope="module")
def splits():
    return {s: stdlib_snippets(s) for s in SPLITS}


def test_no_file_is_in_two_splits_and_every_class_is_in_every_split():
    seen = [f for s in SPLITS for f in SPLIT_FILES[s]]
    assert len(seen) == len(set(seen))  # disjoint, and no file listed twice within a split
    for s in SPLITS:
        assert SPLIT_FILES[s] == tuple(sorted(SPLIT_FILES[s]))
        assert {package_of(f) for f in SPLIT_FILES[s]} == set(PACKAGES)
        assert all((stdlib_dir() / f).is_file() for f in SPLIT_FILES[s])


def test_held_out_files_are_not_in_the_pretraining_corpus():
    """Validation and test files are text no pretrained model of the book has read; the corpus files of these
    packages are all in the classification train split."""
    corpus_files = set(TRAIN_FILES) | set(VAL_FILES)
    assert not corpus_files & set(SPLIT_FILES["val"] + SPLIT_FILES["test"])
    ours = {f for f in corpus_files if package_of(f) in PACKAGES}
    assert ours == {"asyncio/tasks.py", "email/message.py", "unittest/case.py"} <= set(SPLIT_FILES["train"])


def test_snippets_are_deterministic_and_each_comes_from_its_file(splits):
    again = stdlib_snippets("val")
    assert again.texts == splits["val"].texts and np.array_equal(again.labels, splits["val"].labels)
    for s, sn in splits.items():
        assert len(sn) == len(sn.labels) == len(sn.files) > 1000
        assert set(sn.files) == set(SPLIT_FILES[s])  # every file gives at least one snippet
        assert all(len(t) == SNIPPET_BYTES and t.strip() and b"\x00" not in t for t in sn.texts)
        assert all(PACKAGES[k] == package_of(f) for k, f in zip(sn.labels, sn.files, strict=True))
        assert sn.counts().sum() == len(sn) and (sn.counts() > 0).all()
    first = splits["train"]
    data = (stdlib_dir() / first.files[0]).read_bytes()
    assert first.texts[0] == data[:SNIPPET_BYTES]


@pytest.mark.skipif(not ON_BOOK_PYTHON, reason="the expected digests are those of Python 3.11.7's stdlib")
@pytest.mark.parametrize("split", SPLITS)
def test_digest_is_the_expected_one(split):
    data = b"".join((stdlib_dir() / f).read_bytes() for f in SPLIT_FILES[split])
    assert hashlib.sha256(data).hexdigest() == snippets.EXPECTED_SHA256[split]
    stdlib_snippets(split, strict=True)


def test_a_changed_stdlib_is_refused_when_strict(monkeypatch):
    monkeypatch.setattr(snippets, "EXPECTED_PYTHON", tuple(sys.version_info[:3]))
    monkeypatch.setitem(snippets.EXPECTED_SHA256, "test", "0" * 64)
    with pytest.raises(ValueError, match="'test' files have sha256"):
        stdlib_snippets("test", strict=True)
    with pytest.warns(UserWarning, match="numbers will differ"):
        stdlib_snippets("test")


def test_cut_snippets_starts_at_line_starts():
    data = b"ab\ncd\n" + b"\n" * 4 + b"efgh\nij"
    # after "ab\nc" the next line start is at 6: four blank lines (skipped), then "efgh"; "ij" is a short tail
    assert cut_snippets(data, 4) == [b"ab\nc", b"efgh"]
    assert cut_snippets(b"x" * 10, 4) == [b"xxxx"]  # one long line: one piece
    assert cut_snippets(b"abc", 4) == []


def test_encode_snippets_pads_right_and_cuts():
    enc = lambda t: list(t)  # noqa: E731  bytes as their own ids
    ids = encode_snippets([b"abc", b"abcdefgh"], enc, 6, pad_id=NUL_PAD, prefix=(300,))
    assert ids.dtype == np.int64 and ids.shape == (2, 6)
    assert ids.tolist() == [[300, 97, 98, 99, 0, 0], [300, 97, 98, 99, 100, 101]]
    ids = encode_snippets([b"abcdefgh"], enc, 4, pad_id=1, suffix=(2,))
    assert ids.tolist() == [[97, 98, 99, 2]]


def test_take_and_sample(splits):
    sn = splits["test"]
    sub = sn.sample(50, seed=3)
    assert len(sub) == 50 and sub.texts == sn.sample(50, seed=3).texts
    assert sub.texts != sn.sample(50, seed=4).texts
    idx = [sn.texts.index(t) for t in sub.texts]
    assert idx == sorted(idx) and np.array_equal(sn.labels[idx], sub.labels)
    assert "50 snippets" in sub.info() and "xml" in repr(sub)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: stdlib_snippets("dev"), ValueError, "split must be one of"),
        (lambda: stdlib_snippets("test", 0), ValueError, "length must be an int >= 1"),
        (lambda: stdlib_snippets("test", strict=1), TypeError, "strict expected True or False"),
        (lambda: cut_snippets("text", 4), TypeError, "data expected bytes"),
        (lambda: encode_snippets([b"a"], list, 1, pad_id=0, prefix=(5,)), ValueError, "leaves no room"),
        (lambda: encode_snippets(b"abc", list, 4, pad_id=0), TypeError, "texts expected a sequence of bytes"),
        (lambda: encode_snippets([b"a"], list, 4, pad_id=None), TypeError, "pad_id expected an int"),
    ],
)
def test_refusals(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_sample_and_take_refusals(splits):
    sn = splits["val"]
    with pytest.raises(ValueError, match="is more than"):
        sn.sample(len(sn) + 1, seed=0)
    with pytest.raises(ValueError, match="index values must be in"):
        sn.take([len(sn)])
    with pytest.raises(TypeError, match="1-D integer array"):
        sn.take([0.5])


def test_a_missing_file_is_an_error(monkeypatch):
    monkeypatch.setitem(SPLIT_FILES, "val", SPLIT_FILES["val"] + ("xml/no_such_module.py",))
    with pytest.raises(FileNotFoundError, match="no_such_module.py"):
        stdlib_snippets("val")
