"""Real text that is already on every machine: the Python standard library's own source files.

Nothing is downloaded. The files are read at run time from the running interpreter's standard library directory
(`sysconfig.get_paths()["stdlib"]`). The list is FIXED, not "every file there": the standard library differs
between Python versions (modules come and go, files become packages), and a fixed list of long-standing modules
keeps the corpus the same wherever the same interpreter version runs.

- `TRAIN_FILES` (48 mid-size modules, about 2.6 MB under 3.11) and `VAL_FILES` (12 other modules, about 190 KB):
  held-out *files*, not a held-out tail of one file, so validation text is code the model never saw.
- `stdlib_corpus(split)` reads them (sorted, as UTF-8 bytes), concatenates them, and returns a `Corpus` with the
  bytes, the file list, the size and the SHA-256 digest. A missing file is an error. Under the Python version the
  book was executed with (3.11.7) the digest is compared with the expected one: a mismatch warns (or raises with
  `strict=True`), because every number printed in the book depends on these exact bytes.
- `Corpus.documents()` gives the files one by one (bytes each), for a tokenizer that puts a separator between
  them (`ByteBPE.encode_documents`), so that no training window runs from one file into the next unmarked.
- `sample_batch` cuts (x, y) pairs for a language model from a token-id array (y is x shifted by one), and
  `split_ids` holds out the tail of an array when no separate file set is wanted.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tfm_common.validate import check_choice, check_flag, check_size

__all__ = ["TRAIN_FILES", "VAL_FILES", "EXPECTED_SHA256", "Corpus", "stdlib_dir", "stdlib_corpus", "sample_batch",
           "lm_batches", "split_ids", "window_starts"]  # fmt: skip

# Paths relative to the standard library directory, sorted: mid-size, pure-Python modules that have long been part
# of the library (none of those PEP 594 removed, none that became a package such as zipfile or pathlib).
TRAIN_FILES = tuple(sorted("""
    argparse.py ast.py asyncio/tasks.py calendar.py codecs.py collections/__init__.py configparser.py contextlib.py
    dataclasses.py datetime.py difflib.py doctest.py email/message.py enum.py fractions.py functools.py gettext.py
    gzip.py heapq.py http/client.py inspect.py ipaddress.py json/decoder.py json/encoder.py locale.py
    logging/__init__.py mailbox.py optparse.py os.py pickle.py platform.py pprint.py random.py shutil.py smtplib.py
    socket.py statistics.py subprocess.py tarfile.py tempfile.py threading.py tokenize.py traceback.py typing.py
    unittest/case.py urllib/parse.py warnings.py weakref.py
""".split()))  # fmt: skip
VAL_FILES = tuple(sorted("""
    bdb.py copy.py csv.py fnmatch.py numbers.py pstats.py queue.py sched.py shlex.py string.py textwrap.py uuid.py
""".split()))  # fmt: skip

# The digest of each full split under the Python version the book's outputs were made with.
EXPECTED_PYTHON = (3, 11, 7)
EXPECTED_SHA256 = {
    "train": "c6205e36c3ed8c9c42d51dd54634edf57f9b8b32b5c49d2365fab92de3f2d71b",
    "val": "cbee09317f5784f5a8f01b8a8432d1bac33f916e8b541af75aac9bbd93a85378",
}
SPLITS = ("train", "val")


@dataclass(frozen=True, repr=False)
class Corpus:
    """The bytes of one split: `data` (bytes), `text` (str), `files`, `n_bytes`, `sha256` of `data`;
    `file_sizes` (bytes of each file, before any `max_bytes` cut) lets `documents()` split `data` into files."""

    split: str
    files: tuple[str, ...]
    data: bytes
    file_sizes: tuple[int, ...] = ()
    sha256: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "sha256", hashlib.sha256(self.data).hexdigest())

    @property
    def n_bytes(self) -> int:
        return len(self.data)

    @property
    def text(self) -> str:
        # Every file is UTF-8 and `max_bytes` cuts at a character boundary, so this never replaces anything.
        return self.data.decode("utf-8")

    def documents(self) -> list[bytes]:
        """The files' bytes, one item per file, in order: b"".join(documents()) == data. After a `max_bytes` cut the
        last item is the part of its file that was kept, and the files after it are left out. Without
        `file_sizes`, the whole data as one document."""
        if not self.file_sizes:
            return [self.data] if self.data else []
        if sum(self.file_sizes) < len(self.data):
            raise ValueError(f"Corpus.documents: file_sizes add up to {sum(self.file_sizes)} bytes, data holds "
                             f"{len(self.data)}")  # fmt: skip
        docs, start = [], 0
        for size in self.file_sizes:
            if start >= len(self.data):
                break
            docs.append(self.data[start : start + size])
            start += size
        return docs

    def info(self) -> str:
        """One line to print in a chapter: split, files, size, digest (first 16 hex digits)."""
        return (f"stdlib corpus '{self.split}': {len(self.files)} files, {self.n_bytes:,} bytes, "
                f"{len(self.text):,} characters, sha256 {self.sha256[:16]}")  # fmt: skip

    def __repr__(self) -> str:
        return f"<Corpus {self.info()}>"


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory (the base one, also inside a virtual environment)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read(split: str, root: Path) -> tuple[tuple[str, ...], bytes, tuple[int, ...]]:
    files = TRAIN_FILES if split == "train" else VAL_FILES
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"stdlib_corpus: {len(missing)} file(s) of the '{split}' list are missing from "
                                f"{root}: {', '.join(missing)}")  # fmt: skip
    contents = [(root / f).read_bytes() for f in files]
    return files, b"".join(contents), tuple(len(c) for c in contents)


def _cut(data: bytes, max_bytes: int) -> bytes:
    """The first `max_bytes` bytes or fewer, never ending inside a UTF-8 character."""
    cut = min(max_bytes, len(data))
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:  # a continuation byte starts the rest: back up
        cut -= 1
    return data[:cut]


def _verify(split: str, data: bytes, strict: bool) -> None:
    if tuple(sys.version_info[:3]) != EXPECTED_PYTHON:
        return  # another Python: other bytes are expected, nothing to compare with
    digest = hashlib.sha256(data).hexdigest()
    if digest != EXPECTED_SHA256[split]:
        msg = (f"stdlib_corpus: the '{split}' files have sha256 {digest[:16]}..., expected "
               f"{EXPECTED_SHA256[split][:16]}... for Python {'.'.join(map(str, EXPECTED_PYTHON))}: "
               "this interpreter's standard library was modified, so the book's numbers will differ")  # fmt: skip
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)


def stdlib_corpus(split: str = "train", max_bytes: int | None = None, *, strict: bool = False) -> Corpus:
    """Read the fixed file list of `split` ("train" or "val") from this interpreter's standard library.

    `max_bytes` keeps only the first bytes (cut at a UTF-8 character boundary), for quick experiments.
    Under Python 3.11.7 a digest that differs from the expected one warns, or raises with `strict=True`.
    """
    max_bytes, strict = _check_corpus_args(split, max_bytes, strict)
    files, data, sizes = _read(split, stdlib_dir())
    _verify(split, data, strict)
    return Corpus(split, files, data if max_bytes is None else _cut(data, max_bytes), sizes)


def _check_corpus_args(split, max_bytes, strict) -> tuple[int | None, bool]:
    """stdlib_corpus's arguments: a known split, a positive byte count or None, a flag."""
    check_choice("stdlib_corpus", "split", split, SPLITS)
    strict = check_flag("stdlib_corpus", "strict", strict)
    return (None if max_bytes is None else check_size("stdlib_corpus", "max_bytes", max_bytes)), strict


def _check_ids(owner: str, ids, block_size: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{owner}: ids expected a 1-D array of integer token ids, got {ids.dtype} {ids.shape}")
    if len(ids) < block_size + 1:
        raise ValueError(f"{owner}: ids must hold at least block_size + 1 = {block_size + 1} tokens, got {len(ids)}")
    return ids


def sample_batch(ids, batch_size: int, block_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`batch_size` windows of `block_size` tokens at random offsets: x (B, T) and y (B, T) = x shifted by one.

    y[b, t] = ids[start_b + t + 1] is the token that follows x[b, :t + 1]: the target at every position of a
    causal language model. Both are int64.
    """
    batch_size = check_size("sample_batch", "batch_size", batch_size)
    block_size = check_size("sample_batch", "block_size", block_size)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"sample_batch: rng expected a numpy.random.Generator, got {type(rng).__name__}")
    ids = _check_ids("sample_batch", ids, block_size)
    starts = window_starts(len(ids), batch_size, block_size, rng)
    index = starts[:, None] + np.arange(block_size)[None, :]  # (B, T)
    return ids[index].astype(np.int64), ids[index + 1].astype(np.int64)


def window_starts(n_ids: int, batch_size: int, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """The first positions of `sample_batch`'s windows: the same draws from `rng`, so that a copy of the generator
    tells where the windows of a batch started (e.g. to count those that cross a file boundary)."""
    n_ids = check_size("window_starts", "n_ids", n_ids, minimum=block_size + 1)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"window_starts: rng expected a numpy.random.Generator, got {type(rng).__name__}")
    return rng.integers(0, n_ids - block_size, size=batch_size)  # the last start leaves room for y


def lm_batches(ids, batch_size: int, block_size: int, rng: np.random.Generator, n_batches: int | None = None):
    """An iterator of (x, y) from `sample_batch`: `n_batches` of them, or without end when it is None."""
    if n_batches is not None:
        n_batches = check_size("lm_batches", "n_batches", n_batches)
    k = 0
    while n_batches is None or k < n_batches:
        yield sample_batch(ids, batch_size, block_size, rng)
        k += 1


def split_ids(ids, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail): the last `val_fraction` of a token array held out, without shuffling (text is not i.i.d.)."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise TypeError(f"split_ids: ids expected a 1-D array, got shape {ids.shape}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (float, int)) or not 0 < val_fraction < 1:
        raise ValueError(f"split_ids: val_fraction must be a float in (0, 1), got {val_fraction!r}")
    cut = len(ids) - int(round(len(ids) * val_fraction))
    if not 0 < cut < len(ids):  # too few ids for this fraction: one part would be empty, silently
        raise ValueError(
            f"split_ids: val_fraction={val_fraction!r} of {len(ids)} ids leaves {cut} for training and "
            f"{len(ids) - cut} held out; both parts need at least one id (give more ids or another val_fraction)"
        )
    return ids[:cut], ids[cut:]
