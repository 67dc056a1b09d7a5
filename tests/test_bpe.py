"""tfm_common.bpe: a byte-level BPE that round-trips every byte string and learns the same merges every time."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tfm_common.bpe import DEFAULT_PATTERN, END_OF_TEXT, ByteBPE, merge_pair, pretokenize
from tfm_common.corpus import stdlib_corpus

ROOT = Path(__file__).resolve().parents[1]
A, B, C, D = b"abcd"  # 97, 98, 99, 100


@pytest.fixture(scope="module")
def val_text() -> bytes:
    return stdlib_corpus("val").data


@pytest.fixture(scope="module")
def bpe(val_text) -> ByteBPE:
    return ByteBPE.train(val_text[:60_000], 400)


def naive_bpe(data: bytes, n_merges: int, pattern=DEFAULT_PATTERN, min_count=2):
    """The textbook algorithm, written independently: re-count every pair of every chunk before each merge."""
    words = [list(c) for c in pretokenize(data, pattern)]
    merges = []
    for k in range(n_merges):
        counts = Counter(p for w in words for p in zip(w, w[1:], strict=False))
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))  # highest count, then the smallest pair
        if counts[best] < min_count:
            break
        merges.append(best)
        words = [_merge_naive(w, best, 256 + k) for w in words]
    return merges, words


def _merge_naive(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """The merge as a fold, not the library's index loop: a token that completes `pair` with the token before it
    replaces that token. Left to right, no overlap: "aaa" -> [256, a] (new_id never equals pair[0])."""
    out: list[int] = []
    for t in word:
        if out and out[-1] == pair[0] and t == pair[1]:
            out[-1] = new_id
        else:
            out.append(t)
    return out


def test_hand_worked_example():
    # "aaabdaaabac", one chunk. Pairs: aa 4, ab 2, bd da ba ac 1. Merge aa -> 256; "aaa" becomes [256, a]:
    # 256 a b d 256 a b a c. Now (256, a) and (a, b) both occur twice: the smaller pair (97, 98) wins -> 257:
    # 256 257 d 256 257 a c. Then (256, 257) occurs twice -> 258 ("aaab"): 258 d 258 a c. Every pair is now
    # unique, so min_count=2 stops here; min_count=1 goes on with the smallest pair, (a, c) -> 259.
    bpe = ByteBPE.train("aaabdaaabac", 300, pretokenize=False)
    assert bpe.merges == [(A, A), (A, B), (256, 257)] and bpe.merge_counts == [4, 2, 2]
    assert bpe.vocab_size == 259 and bpe.token_bytes(258) == b"aaab"
    assert bpe.encode("aaabdaaabac") == [258, D, 258, A, C]
    assert ByteBPE.train("aaabdaaabac", 260, pretokenize=False, min_count=1).merges[3] == (A, C)


def test_merges_do_not_cross_chunks():
    # "ab.ab." is the chunks ab . ab . : only (a, b) repeats. As one chunk, (ab, .) repeats too and is merged.
    assert ByteBPE.train("ab.ab.", 300).merges == [(A, B)]
    assert ByteBPE.train("ab.ab.", 300, pretokenize=False).merges == [(A, B), (256, ord("."))]


def test_default_pattern_on_a_line_of_code():
    chunks = pretokenize(b"    return self.x + 42\n")
    assert chunks == [b"   ", b" return", b" self", b".", b"x", b" +", b" 42", b"\n"]


@pytest.mark.parametrize(
    "pattern", [DEFAULT_PATTERN, rb"[a-z]+", rb"x*", None], ids=["default", "gaps", "empty", "none"]
)
def test_pretokenize_loses_no_byte(pattern):
    data = bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)) + b"abc  def\n\n x"
    chunks = pretokenize(data, pattern)
    assert b"".join(chunks) == data and all(chunks)


def test_incremental_training_equals_the_naive_algorithm(val_text):
    data = val_text[:20_000]
    bpe = ByteBPE.train(data, 256 + 150)
    merges, words = naive_bpe(data, 150)
    assert bpe.merges == merges
    assert bpe.encode(data) == [i for w in words for i in w]  # encoding reproduces training's segmentation


def test_incremental_training_equals_the_naive_algorithm_with_many_ties():
    # Three symbols, one long chunk: runs such as "aaaa" (overlapping pairs) and many equal counts.
    data = bytes(np.random.default_rng(3).choice(np.frombuffer(b"ab ", np.uint8), 3000))
    bpe = ByteBPE.train(data, 256 + 80, pretokenize=False, min_count=1)
    merges, words = naive_bpe(data, 80, pattern=None, min_count=1)
    assert bpe.merges == merges and len(merges) == 80
    assert bpe.encode(data) == [i for w in words for i in w]  # encoding reproduces training's segmentation


def test_training_is_deterministic_across_processes():
    code = (
        "from tfm_common.bpe import ByteBPE; from tfm_common.corpus import stdlib_corpus; "
        "print(ByteBPE.train(stdlib_corpus('val', max_bytes=30000).data, 400).merges)"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
            cwd=ROOT,
        ).stdout
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1] and outs[0].count("(") == 144


def test_roundtrip_on_arbitrary_bytes(bpe):
    rng = np.random.default_rng(0)
    cases = [b"", bytes(range(256)), bytes(range(255, -1, -1)), b"\xff\xfe\x80\xc3", "caf\u00e9 \u2014 \U0001f600"]
    cases += [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (1, 2, 17, 1000, 5000)]
    cases += [bytes(rng.choice(np.frombuffer(b" \n\tdef self(x):", np.uint8), 2000)) for _ in range(3)]
    for data in cases:
        raw = data.encode() if isinstance(data, str) else data
        ids = bpe.encode(data)
        assert all(isinstance(i, int) and 0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode_bytes(ids) == raw
        assert bpe.decode(ids) == raw.decode("utf-8", errors="replace")
    assert bpe.encode("") == [] and bpe.decode([]) == ""


def test_roundtrip_on_held_out_text_and_compression(bpe):
    text = stdlib_corpus("train", max_bytes=100_000).text
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text and bpe.decode_bytes(np.array(ids)) == text.encode()
    assert len(text.encode()) / len(ids) > 1.5  # about 2.0 bytes per token at 144 merges


def test_decode_replaces_a_cut_character():
    bpe = ByteBPE()
    ids = bpe.encode("\u00e9")  # two bytes, no merges: two tokens
    assert ids == [0xC3, 0xA9] and bpe.decode(ids[:1]) == "\ufffd"


def test_token_bytes_are_the_parts_joined(bpe):
    for k, (a, b) in enumerate(bpe.merges):
        assert bpe.token_bytes(256 + k) == bpe.token_bytes(a) + bpe.token_bytes(b)
    assert [bpe.token_bytes(i) for i in (0, 65, 255)] == [b"\x00", b"A", b"\xff"]


def test_save_and_load(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    bpe.save(path)
    again = ByteBPE.load(path)
    assert again == bpe and again.merge_counts == bpe.merge_counts
    text = "def f(x):\n    return x\n"
    assert again.encode(text) == bpe.encode(text)
    ByteBPE([], pattern=None).save(path)
    assert ByteBPE.load(path).pattern is None
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a saved ByteBPE"):
        ByteBPE.load(path)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"vocab_size": 255}, ValueError, "vocab_size must be an int >= 256, got 255"),
        ({"vocab_size": 300.0}, TypeError, "vocab_size expected an int"),
        ({"vocab_size": True}, TypeError, "vocab_size expected an int"),
        ({"data": 12}, TypeError, "data expected str or bytes, got int"),
        ({"min_count": 0}, ValueError, "min_count must be an int >= 1"),
        ({"pretokenize": 1}, TypeError, "pretokenize expected True, False or a pattern"),
    ],
)
def test_train_refuses_bad_arguments(kwargs, error, match):
    args = {"data": "abc", "vocab_size": 300} | kwargs
    with pytest.raises(error, match=match):
        ByteBPE.train(args.pop("data"), args.pop("vocab_size"), **args)


def test_decode_and_encode_refuse_bad_input(bpe):
    with pytest.raises(ValueError, match=f"unknown token id {bpe.vocab_size}: ids are 0..{bpe.vocab_size - 1}"):
        bpe.decode([1, bpe.vocab_size])
    with pytest.raises(ValueError, match="unknown token id -1"):
        bpe.decode_bytes([-1])
    with pytest.raises(TypeError, match="token id must be an int, got float"):
        bpe.decode([1.0])
    with pytest.raises(TypeError, match="ids expected a sequence of ints, got str"):
        bpe.decode("abc")
    with pytest.raises(TypeError, match="text expected str or bytes, got list"):
        bpe.encode([1, 2])
    with pytest.raises(ValueError, match="unknown token id 999"):
        bpe.token_bytes(999)


def test_constructor_refuses_merges_of_unknown_ids():
    with pytest.raises(ValueError, match="merge 1 must be a pair of ids below 257"):
        ByteBPE([(1, 2), (257, 3)])
    with pytest.raises(TypeError, match="pattern expected bytes, str or None"):
        ByteBPE([], pattern=3)


def test_merge_pair_equals_the_independent_fold_on_runs_and_overlaps():
    rng = np.random.default_rng(0)
    for _ in range(300):
        word = [int(t) for t in rng.integers(0, 3, rng.integers(0, 12))]  # 3 symbols: many runs such as a a a a
        pair = (int(rng.integers(0, 3)), int(rng.integers(0, 3)))
        assert merge_pair(word, pair, 256) == _merge_naive(word, pair, 256), (word, pair)


# -- special tokens: a document separator -----------------------------------------------------------------------------


def test_a_special_token_takes_the_last_id_and_is_kept_out_of_the_merges(val_text):
    plain = ByteBPE.train(val_text[:60_000], 400)
    sep = ByteBPE.train(val_text[:60_000], 401, specials=(END_OF_TEXT,))
    assert sep.merges == plain.merges and sep.vocab_size == 401  # the separator costs no merge
    assert sep.special_id(END_OF_TEXT) == sep.special_id("<|endoftext|>") == 400
    assert sep.token_bytes(400) == END_OF_TEXT
    assert all(400 not in pair for pair in sep.merges)
    # the separator's text is ordinary bytes to encode (never the special id), and it round-trips as such
    assert 400 not in sep.encode(b"x" + END_OF_TEXT + b"y") and sep.encode(END_OF_TEXT) == plain.encode(END_OF_TEXT)


def test_documents_are_joined_by_the_separator_and_round_trip():
    corpus = stdlib_corpus("val")
    docs = corpus.documents()
    bpe = ByteBPE.train(corpus.data[:60_000], 320, specials=(END_OF_TEXT,))
    eot = bpe.special_id(END_OF_TEXT)
    ids = bpe.encode_documents(docs)
    assert ids.count(eot) == len(docs) - 1 == 11
    assert bpe.decode_bytes(ids) == END_OF_TEXT.join(docs)
    pieces, start = [], 0  # split at the separators: each piece is its document's own encoding
    for i, t in enumerate([*ids, eot]):
        if t == eot:
            pieces.append(ids[start:i])
            start = i + 1
    assert pieces == [bpe.encode(d) for d in docs]
    assert [t for t in ids if t != eot] == bpe.encode(corpus.data)  # no chunk of this corpus crosses a file
    assert bpe.encode_documents(["a", b"b"]) == [*bpe.encode("a"), eot, *bpe.encode("b")]
    assert bpe.encode_documents([]) == [] and bpe.encode_documents(["abc"]) == bpe.encode("abc")


def test_special_tokens_survive_save_and_load(tmp_path):
    bpe = ByteBPE.train("abab abab abab", 260, specials=(END_OF_TEXT, "<pad>"))
    bpe.save(tmp_path / "bpe.json")
    again = ByteBPE.load(tmp_path / "bpe.json")
    assert again == bpe and again.specials == (END_OF_TEXT, b"<pad>") and again.special_id("<pad>") == 259
    assert again != ByteBPE(bpe.merges, bpe.pattern)  # the same merges without the specials: another tokenizer


def test_special_tokens_refuse_bad_input():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 257, got 256"):
        ByteBPE.train("abc", 256, specials=(END_OF_TEXT,))
    with pytest.raises(ValueError, match="specials must be distinct and non-empty"):
        ByteBPE([], specials=(b"<a>", b"<a>"))
    with pytest.raises(ValueError, match="specials must be distinct and non-empty"):
        ByteBPE([], specials=(b"",))
    with pytest.raises(TypeError, match="specials expected a tuple or list"):
        ByteBPE([], specials=END_OF_TEXT)
    with pytest.raises(ValueError, match="is not a special token of this tokenizer; it has none"):
        ByteBPE([]).encode_documents(["a", "b"])
    with pytest.raises(TypeError, match="documents expected a list of str or bytes, got str"):
        ByteBPE([], specials=(END_OF_TEXT,)).encode_documents("ab")
    with pytest.raises(TypeError, match=r"documents\[1\] expected str or bytes, got int"):
        ByteBPE([], specials=(END_OF_TEXT,)).encode_documents(["a", 3])
