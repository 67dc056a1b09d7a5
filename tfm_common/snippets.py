"""A classification task on real text that is on every machine: which standard-library package a snippet of Python
source comes from (chapter 22b). Nothing is downloaded: the files are read from the running interpreter's standard
library directory, as `tfm_common.corpus` reads its corpus.

- `PACKAGES`: the six classes, packages with a dozen or more source files each in Python 3.11 (test packages left
  out). Label k is `PACKAGES[k]`.
- `SPLIT_FILES`: a FIXED train / validation / test split BY FILE, so that no file gives snippets to two splits
  (snippets of one file share names and idioms: a split by snippet would test on text the model has nearly seen).
  Made once by a rule and written out: per package, the files of at least 2 KB, the largest first, each to the split
  furthest below its share of the package's bytes (60 / 20 / 20); the files that are in the pretraining corpus
  (`corpus.TRAIN_FILES`: asyncio/tasks.py, email/message.py, unittest/case.py) go to train. So the validation and
  test files are text no pretrained model of this book has read (tested).
- `stdlib_snippets(split)`: each file cut into non-overlapping snippets of `SNIPPET_BYTES` bytes, each starting at a
  line start (the next one at the first line start after the previous one's end), whitespace-only ones skipped; in
  the order of `SPLIT_FILES[split]`, deterministic. Returns `Snippets` (texts as bytes, labels, the file of each).
- `encode_snippets(texts, encode, length, pad_id=...)`: token ids (N, length), right-padded with `pad_id`, cut to
  `length` (after an optional prefix such as BERT's [CLS]).

Under the Python version the book was executed with (3.11.7) the files' digest is compared with the expected one: a
mismatch warns (or raises with `strict=True`), because every number printed in chapter 22b depends on these bytes.
No snippet contains the byte 0 (NUL; checked when read), so `NUL_PAD = 0`, the byte-level tokenizers' id of that
byte, can pad for a model whose vocabulary has no pad token (the GPT of chapter 17b).
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .corpus import stdlib_dir
from .validate import check_choice, check_flag, check_int, check_size

__all__ = ["PACKAGES", "SPLITS", "SPLIT_FILES", "SNIPPET_BYTES", "NUL_PAD", "EXPECTED_SHA256", "Snippets",
           "package_of", "cut_snippets", "stdlib_snippets", "encode_snippets"]  # fmt: skip

PACKAGES = ("asyncio", "email", "importlib", "multiprocessing", "unittest", "xml")
SPLITS = ("train", "val", "test")
SNIPPET_BYTES = 96  # about 47 tokens of chapter 17b's 512-token BPE: most fit a 64-position model
NUL_PAD = 0  # the byte 0: in no snippet, so a byte-level tokenizer's id 0 can mark padding

SPLIT_FILES = {
    "train": tuple(sorted("""
        asyncio/base_events.py asyncio/base_subprocess.py asyncio/locks.py asyncio/protocols.py asyncio/queues.py
        asyncio/selector_events.py asyncio/sslproto.py asyncio/tasks.py asyncio/timeouts.py asyncio/trsock.py
        asyncio/unix_events.py email/_header_value_parser.py email/base64mime.py email/charset.py
        email/contentmanager.py email/errors.py email/headerregistry.py email/message.py email/quoprimime.py
        importlib/_bootstrap.py importlib/_bootstrap_external.py importlib/resources/_common.py
        importlib/resources/_legacy.py multiprocessing/connection.py multiprocessing/context.py
        multiprocessing/dummy/__init__.py multiprocessing/forkserver.py multiprocessing/managers.py
        multiprocessing/pool.py multiprocessing/reduction.py multiprocessing/synchronize.py unittest/case.py
        unittest/mock.py xml/dom/__init__.py xml/dom/minicompat.py xml/dom/minidom.py xml/etree/ElementPath.py
        xml/etree/ElementTree.py xml/sax/_exceptions.py xml/sax/saxutils.py
    """.split())),
    "val": tuple(sorted("""
        asyncio/base_tasks.py asyncio/coroutines.py asyncio/format_helpers.py asyncio/futures.py asyncio/staggered.py
        asyncio/streams.py asyncio/subprocess.py asyncio/windows_events.py email/_encoded_words.py
        email/_parseaddr.py email/_policybase.py email/header.py email/iterators.py email/parser.py
        importlib/metadata/__init__.py importlib/metadata/_text.py importlib/resources/_adapters.py
        importlib/resources/simple.py multiprocessing/popen_forkserver.py multiprocessing/queues.py
        multiprocessing/resource_sharer.py multiprocessing/resource_tracker.py multiprocessing/shared_memory.py
        multiprocessing/sharedctypes.py unittest/__init__.py unittest/async_case.py unittest/loader.py
        unittest/runner.py unittest/signals.py xml/dom/expatbuilder.py xml/dom/xmlbuilder.py
        xml/etree/ElementInclude.py xml/sax/__init__.py
    """.split())),
    "test": tuple(sorted("""
        asyncio/__main__.py asyncio/events.py asyncio/proactor_events.py asyncio/runners.py asyncio/taskgroups.py
        asyncio/transports.py asyncio/windows_utils.py email/feedparser.py email/generator.py email/mime/audio.py
        email/mime/image.py email/policy.py email/utils.py importlib/__init__.py importlib/abc.py
        importlib/metadata/_functools.py importlib/metadata/_itertools.py importlib/resources/abc.py
        importlib/resources/readers.py importlib/util.py multiprocessing/heap.py multiprocessing/popen_fork.py
        multiprocessing/popen_spawn_win32.py multiprocessing/process.py multiprocessing/spawn.py
        multiprocessing/util.py unittest/_log.py unittest/main.py unittest/result.py unittest/suite.py
        unittest/util.py xml/dom/domreg.py xml/dom/pulldom.py xml/sax/expatreader.py xml/sax/handler.py
        xml/sax/xmlreader.py
    """.split())),
}  # fmt: skip

# The digest of each split's files (concatenated in SPLIT_FILES order) under the Python the book ran with.
EXPECTED_PYTHON = (3, 11, 7)
EXPECTED_SHA256 = {
    "train": "cebb56182f8b9d51155a4d58c72a383bc35b0554893ddc78d8ccf42b2417d0f5",
    "val": "1e39e707db5bee03f3a1258103e63e09f19b462f389c8b68b7479e5a226db11d",
    "test": "aaf99591cfddbcf7cb55f1fb3c2b5b2436d2f4dd987e33ce9668650a9130153d",
}


def package_of(path: str) -> str:
    """The class of a file: its top-level package ("xml/dom/minidom.py" -> "xml")."""
    return path.split("/", 1)[0]


@dataclass(frozen=True, repr=False)
class Snippets:
    """The snippets of one split: `texts` (bytes, each `length` long), `labels` (N,) int64 indices into `classes`,
    `files` (the file each snippet was cut from), `classes` (= PACKAGES)."""

    split: str
    texts: tuple[bytes, ...]
    labels: np.ndarray
    files: tuple[str, ...]
    classes: tuple[str, ...] = PACKAGES

    def __len__(self) -> int:
        return len(self.texts)

    def counts(self) -> np.ndarray:
        """How many snippets of each class: (n_classes,) int64."""
        return np.bincount(self.labels, minlength=len(self.classes))

    def take(self, index) -> Snippets:
        """The snippets at `index` (an integer array or list), in that order."""
        index = np.asarray(index)
        if index.ndim != 1 or (index.size and not np.issubdtype(index.dtype, np.integer)):
            raise TypeError(f"Snippets.take: index expected a 1-D integer array, got {index.dtype} {index.shape}")
        if index.size and not (0 <= index.min() and index.max() < len(self)):
            raise ValueError(f"Snippets.take: index values must be in [0, {len(self)}), got {index.min()} .. "
                             f"{index.max()}")  # fmt: skip
        index = index.astype(np.int64)
        return Snippets(self.split, tuple(self.texts[i] for i in index), self.labels[index],
                        tuple(self.files[i] for i in index), self.classes)  # fmt: skip

    def sample(self, n: int, seed: int) -> Snippets:
        """`n` snippets drawn without replacement by np.random.default_rng(seed), kept in the split's order."""
        n = check_size("Snippets.sample", "n", n)
        seed = check_int("Snippets.sample", "seed", seed)
        if n > len(self):
            raise ValueError(f"Snippets.sample: n={n} is more than the {len(self)} snippets of '{self.split}'")
        return self.take(np.sort(np.random.default_rng(seed).choice(len(self), size=n, replace=False)))

    def info(self) -> str:
        """One line to print: split, files, snippets, and the snippets of each class."""
        per_class = ", ".join(f"{c} {n}" for c, n in zip(self.classes, self.counts().tolist(), strict=True))
        return f"snippets '{self.split}': {len(set(self.files))} files, {len(self)} snippets ({per_class})"

    def __repr__(self) -> str:
        return f"<Snippets {self.info()}>"


def cut_snippets(data: bytes, length: int = SNIPPET_BYTES) -> list[bytes]:
    """Non-overlapping `length`-byte pieces of `data`, each starting at a line start: the first at 0, the next at
    the first line start at or after the previous one's end; a piece of whitespace only is skipped, and so is a
    tail shorter than `length`."""
    length = check_size("cut_snippets", "length", length)
    if not isinstance(data, bytes):
        raise TypeError(f"cut_snippets: data expected bytes, got {type(data).__name__}")
    out, start = [], 0
    while start + length <= len(data):
        piece = data[start : start + length]
        if piece.strip():
            out.append(piece)
        end = start + length
        start = end if data[end - 1 : end] == b"\n" else data.find(b"\n", end) + 1  # the next line start
        if start == 0:  # no newline after: the rest is one line, already cut
            break
    return out


def _verify(split: str, data: bytes, strict: bool) -> None:
    if tuple(sys.version_info[:3]) != EXPECTED_PYTHON:
        return  # another Python: other bytes are expected
    digest = hashlib.sha256(data).hexdigest()
    if digest != EXPECTED_SHA256[split]:
        msg = (f"stdlib_snippets: the '{split}' files have sha256 {digest[:16]}..., expected "
               f"{EXPECTED_SHA256[split][:16]}... for Python {'.'.join(map(str, EXPECTED_PYTHON))}: this "
               "interpreter's standard library was modified, so chapter 22b's numbers will differ")  # fmt: skip
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)


def stdlib_snippets(split: str = "train", length: int = SNIPPET_BYTES, *, strict: bool = False) -> Snippets:
    """The snippets of `split` ("train", "val" or "test"): every file of SPLIT_FILES[split], read from this
    interpreter's standard library and cut by `cut_snippets(data, length)`, in file order. A missing file, or one
    holding a NUL byte, is an error; under Python 3.11.7 a digest that differs from the expected one warns (raises
    with `strict=True`)."""
    check_choice("stdlib_snippets", "split", split, SPLITS)
    length = check_size("stdlib_snippets", "length", length)
    strict = check_flag("stdlib_snippets", "strict", strict)
    root, files = stdlib_dir(), SPLIT_FILES[split]
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"stdlib_snippets: {len(missing)} file(s) of the '{split}' list are missing from "
                                f"{root}: {', '.join(missing)}")  # fmt: skip
    contents = [(root / f).read_bytes() for f in files]
    _verify(split, b"".join(contents), strict)
    texts, labels, owners = [], [], []
    for f, data in zip(files, contents, strict=True):
        if b"\x00" in data:
            raise ValueError(f"stdlib_snippets: {f} holds a NUL byte, which marks padding (NUL_PAD)")
        pieces = cut_snippets(data, length)
        texts += pieces
        labels += [PACKAGES.index(package_of(f))] * len(pieces)
        owners += [f] * len(pieces)
    return Snippets(split, tuple(texts), np.array(labels, dtype=np.int64), tuple(owners))


def encode_snippets(texts: Sequence[bytes], encode: Callable, length: int, *, pad_id: int, prefix=(),
                    suffix=()) -> np.ndarray:  # fmt: skip
    """Token ids (N, length) int64: row i is prefix + encode(texts[i]) + suffix, the encoded text cut so that the row
    fits in `length`, then right-padded with `pad_id` (the padding is at the end: a causal model's last real token
    has seen no padding). `encode` maps bytes to a list of ids (`ByteBPE.encode`); `prefix` / `suffix` are ids
    (e.g. BERT's [CLS] / [SEP])."""
    length = check_size("encode_snippets", "length", length)
    pad_id = check_int("encode_snippets", "pad_id", pad_id)
    prefix, suffix = [int(i) for i in prefix], [int(i) for i in suffix]
    room = length - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(f"encode_snippets: length={length} leaves no room for text after {len(prefix)} prefix and "
                         f"{len(suffix)} suffix ids")  # fmt: skip
    if isinstance(texts, (str, bytes)) or not callable(encode):
        raise TypeError("encode_snippets: texts expected a sequence of bytes and encode a function bytes -> ids, "
                        f"got {type(texts).__name__} and {type(encode).__name__}")  # fmt: skip
    out = np.full((len(texts), length), pad_id, dtype=np.int64)
    for i, text in enumerate(texts):
        row = prefix + list(encode(text))[:room] + suffix
        out[i, : len(row)] = row
    return out
