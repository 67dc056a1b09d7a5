"""A byte-level byte-pair encoding (BPE) tokenizer, trained here, in pure Python (no NumPy needed).

Byte-pair encoding (Sennrich et al., 2016, after Gage, 1994) starts from an alphabet and repeatedly adds the most
frequent pair of adjacent symbols as a new symbol. Byte level (GPT-2, Radford et al., 2019): the alphabet is the
256 byte values, so any byte string, valid UTF-8 or not, can be encoded, and nothing is ever "unknown".

- Ids 0..255 are the bytes themselves; merge k (0-based) creates id 256 + k, whose bytes are the bytes of its two
  parts. `vocab_size = 256 + len(merges)`.
- Pretokenization. The text is first cut into chunks by a regular expression (identifiers with a leading space,
  numbers, runs of punctuation, runs of whitespace), and merges never cross a chunk boundary. Why: without it
  frequent pairs across a boundary become tokens ("e ", ", ", "self."), so a word's tokens depend on what follows
  it and the vocabulary spends entries on combinations of a word's end and the next symbol. It also makes
  training and encoding fast: the text is hundreds of thousands of chunks but only tens of thousands of
  *distinct* chunks, and both training and encoding work on the distinct ones. (Chapter 17a measures the cost:
  a little less compression at the same vocabulary size.)
- Training counts distinct chunks once, then keeps a table of pair counts over them (each chunk weighted by how
  often it occurs) and, for each pair, the chunks it occurs in. A merge rewrites only those chunks and updates the
  counts of the pairs they lose and gain. The next pair comes off a heap.
- Tie-breaking, so that merges are deterministic: the highest count wins; among equal counts the smallest pair
  (a, b) of ids, compared as a tuple, wins. Training stops early when no pair occurs at least `min_count` times.
- Special tokens (GPT-2's `<|endoftext|>`): ids after the merges, 256 + len(merges) + j, named by their bytes.
  Training never sees them, so no merge contains one; `encode` never produces one (the text "<|endoftext|>" is
  encoded as its bytes, as tiktoken's `encode_ordinary` does); `encode_documents` puts one between documents, and
  `decode_bytes` gives back its name, so decode_bytes(encode_documents(docs)) == name.join(docs).
- Encoding applies, inside each chunk, the earliest-learned merge present until none applies: the same merges in
  the same order as in training, so a training text is encoded exactly as training segmented it. Encoded chunks
  are cached, so a few MB of text encode in seconds.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path

from tfm_common.validate import check_size

__all__ = ["DEFAULT_PATTERN", "END_OF_TEXT", "ByteBPE", "pretokenize", "merge_pair"]

END_OF_TEXT = b"<|endoftext|>"  # GPT-2's document separator

# The pretokenizer, a bytes pattern (it must work on any byte string, not only on valid UTF-8). Bytes >= 0x80
# count as letters, so a non-ASCII UTF-8 character stays inside the word it belongs to.
DEFAULT_PATTERN = (
    rb" ?[A-Za-z_\x80-\xff][A-Za-z0-9_\x80-\xff]*"  # an identifier or word, with the space before it
    rb"| ?[0-9]+"  # a number
    rb"| ?[^\sA-Za-z0-9_\x80-\xff]+"  # a run of punctuation: ")):" "==" " #"
    rb"|\s+(?!\S)"  # whitespace, less the last space before a word (that space starts the word's chunk)
    rb"|\s+"  # whitespace at the very end
)


def _as_bytes(owner: str, arg: str, data) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{owner}: {arg} expected str or bytes, got {type(data).__name__}")


def pretokenize(data: bytes, pattern: bytes | None = DEFAULT_PATTERN) -> list[bytes]:
    """The chunks of `data`: the matches of `pattern` and whatever lies between them, so b"".join(chunks) == data.

    `pattern=None` keeps the whole text as one chunk. Bytes no match covers become chunks of their own, so a
    pattern that misses some bytes still loses none.
    """
    if pattern is None:
        return [data] if data else []
    chunks = re.findall(pattern, data)
    if sum(map(len, chunks)) == len(data):  # the matches cover every byte (the default pattern always does)
        return [c for c in chunks if c]
    chunks, end = [], 0
    for m in re.finditer(pattern, data):
        if m.start() > end:
            chunks.append(data[end : m.start()])
        if m.end() > m.start():
            chunks.append(m.group())
        end = m.end()
    if end < len(data):
        chunks.append(data[end:])
    return chunks


def merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids`, left to right and without overlap, by `new_id`."""
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _learn_merges(chunk_counts: dict[bytes, int], n_merges: int, min_count: int) -> tuple[list, list]:
    """Up to `n_merges` merges over distinct chunks weighted by their counts: (merges, their pair counts)."""
    words = [list(chunk) for chunk in chunk_counts]  # each distinct chunk as a list of ids, rewritten by merges
    weights = list(chunk_counts.values())
    counts: dict[tuple[int, int], int] = defaultdict(int)  # pair -> occurrences in the whole text
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # pair -> distinct chunks it may occur in
    for w, word in enumerate(words):
        for pair in zip(word, word[1:], strict=False):
            counts[pair] += weights[w]
            where[pair].add(w)
    heap = [(-c, pair) for pair, c in counts.items()]  # highest count first, then the smallest pair
    heapq.heapify(heap)
    merges, merge_counts = [], []
    while len(merges) < n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair) != -neg:
            continue  # a stale entry: this pair's count changed after it was pushed
        if -neg < min_count:
            break
        new_id = 256 + len(merges)
        merges.append(pair)
        merge_counts.append(-neg)
        changed = set()
        for w in where.pop(pair):
            old = words[w]
            new = merge_pair(old, pair, new_id)
            for p in zip(old, old[1:], strict=False):  # the chunk's pairs before the merge leave the table...
                counts[p] -= weights[w]
                changed.add(p)
            for p in zip(new, new[1:], strict=False):  # ...and its pairs after the merge come back in
                counts[p] += weights[w]
                changed.add(p)
                if new_id in p:  # a pair that did not exist before: the others already list this chunk
                    where[p].add(w)
            words[w] = new
        for p in changed:
            if counts[p] > 0:
                heapq.heappush(heap, (-counts[p], p))
            else:
                del counts[p]
    return merges, merge_counts


def _check_pattern(owner: str, arg: str, pattern) -> bytes | None:
    """A pretokenizer pattern as bytes (a str must hold only latin-1 characters, one byte each), compiled once
    here so that a broken regular expression is refused by name, not by `re` halfway through encoding."""
    if pattern is None:
        return None
    if isinstance(pattern, str):
        try:
            pattern = pattern.encode("latin-1")
        except UnicodeEncodeError as e:
            raise ValueError(f"{owner}: {arg} as a str must hold only latin-1 characters (one byte each), "
                             f"got {pattern!r:.80}: {e.reason} at {e.start}") from None  # fmt: skip
    if not isinstance(pattern, bytes):
        raise TypeError(f"{owner}: {arg} expected bytes, str or None, got {type(pattern).__name__}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{owner}: {arg} is not a valid regular expression: {e} (got {pattern!r:.80})") from None
    return pattern


def _check_specials(owner: str, specials) -> tuple[bytes, ...]:
    """Special token names: distinct, non-empty, each bytes or str (a str stored as its UTF-8 bytes)."""
    if isinstance(specials, (str, bytes)) or not isinstance(specials, (tuple, list)):
        raise TypeError(f"{owner}: specials expected a tuple or list of names (bytes or str), got {specials!r:.80}")
    names = tuple(_as_bytes(owner, "specials", name) for name in specials)
    if any(not name for name in names) or len(set(names)) != len(names):
        raise ValueError(f"{owner}: specials must be distinct and non-empty, got {list(names)!r:.80}")
    return names


def _check_merge(k: int, pair) -> None:
    """Merge k: a pair of ids (ints, not bools) that exist before it, i.e. below 256 + k."""
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2
    if not ok or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 256 + k for i in pair):
        raise ValueError(
            f"ByteBPE: merge {k} must be a pair of ids below {256 + k} (ints, not bools), got {pair!r:.80}"
        )


class ByteBPE:
    """A byte-level BPE: `ByteBPE.train(data, vocab_size)` learns one; `ByteBPE(merges, pattern)` rebuilds one.

    `encode(text) -> list[int]`, `decode(ids) -> str` (invalid UTF-8 replaced by U+FFFD), `decode_bytes(ids) ->
    bytes` (exact), `token_bytes(i)`, `merges` (ordered pairs), `vocab_size`, `save(path)` / `load(path)` (JSON).
    `specials` (e.g. `(END_OF_TEXT,)`): special tokens after the merges; `special_id(name)`, `encode_documents`.
    """

    def __init__(self, merges=(), pattern: bytes | str | None = DEFAULT_PATTERN, specials=()):
        self.pattern = _check_pattern("ByteBPE", "pattern", pattern)
        self.merges: list[tuple[int, int]] = []
        self._vocab = [bytes([b]) for b in range(256)]  # id -> its bytes
        for k, pair in enumerate(merges):
            _check_merge(k, pair)
            self.merges.append((int(pair[0]), int(pair[1])))
            self._vocab.append(self._vocab[pair[0]] + self._vocab[pair[1]])
        self.specials = _check_specials("ByteBPE", specials)
        self._special_ids = {name: len(self._vocab) + j for j, name in enumerate(self.specials)}
        self._vocab.extend(self.specials)  # after every merge: no merge can contain one
        self._ranks = {pair: k for k, pair in enumerate(self.merges)}  # pair -> when it was learned
        self._cache: dict[bytes, list[int]] = {}  # chunk -> its ids
        self.merge_counts: list[int] = []  # filled by train(): how often each merged pair occurred

    @classmethod
    def train(cls, data, vocab_size: int, *, pretokenize: bool | bytes | str = True, min_count: int = 2, specials=()):
        """Learn `vocab_size - 256 - len(specials)` merges (fewer if no pair occurs `min_count` times) from `data`
        (str or bytes); the special tokens take the last ids.

        `pretokenize`: True for `DEFAULT_PATTERN`, False for none (merges may cross every boundary; slow on more
        than a few KB), or a regular expression of your own (bytes, or str holding only latin-1 characters).
        """
        data = _as_bytes("ByteBPE.train", "data", data)
        specials = _check_specials("ByteBPE.train", specials)
        vocab_size = check_size("ByteBPE.train", "vocab_size", vocab_size, minimum=256 + len(specials))
        min_count = check_size("ByteBPE.train", "min_count", min_count)
        if pretokenize is True:
            pattern = DEFAULT_PATTERN
        elif pretokenize is False:
            pattern = None
        elif isinstance(pretokenize, (bytes, str)):
            pattern = _check_pattern("ByteBPE.train", "pretokenize", pretokenize)
        else:
            raise TypeError(f"ByteBPE.train: pretokenize expected True, False or a pattern, got {pretokenize!r}")
        chunk_counts = Counter(globals()["pretokenize"](data, pattern))  # the function, not the argument
        merges, merge_counts = _learn_merges(chunk_counts, vocab_size - 256 - len(specials), min_count)
        bpe = cls(merges, pattern, specials)
        bpe.merge_counts = merge_counts
        return bpe

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def token_bytes(self, i: int) -> bytes:
        """The bytes of token `i`."""
        self._check_id(i)
        return self._vocab[i]

    def _check_id(self, i) -> None:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise TypeError(f"ByteBPE: a token id must be an int, got {type(i).__name__} {i!r}")
        if not 0 <= i < len(self._vocab):
            raise ValueError(f"ByteBPE: unknown token id {i}: ids are 0..{len(self._vocab) - 1}")

    def _encode_chunk(self, chunk: bytes) -> list[int]:
        ids = list(chunk)
        while len(ids) > 1:
            # The pair learned earliest among those present; pairs never learned rank last.
            pair = min(zip(ids, ids[1:], strict=False), key=lambda p: self._ranks.get(p, len(self._ranks)))
            if pair not in self._ranks:
                break
            ids = merge_pair(ids, pair, 256 + self._ranks[pair])
        return ids

    def encode(self, text) -> list[int]:
        """Token ids of `text` (str, encoded as UTF-8 first, or bytes)."""
        out: list[int] = []
        for chunk in pretokenize(_as_bytes("ByteBPE.encode", "text", text), self.pattern):
            ids = self._cache.get(chunk)
            if ids is None:
                ids = self._cache[chunk] = self._encode_chunk(chunk)
            out.extend(ids)
        return out

    def special_id(self, name) -> int:
        """The id of special token `name` (bytes or str), e.g. `bpe.special_id(END_OF_TEXT)`."""
        key = _as_bytes("ByteBPE.special_id", "name", name)
        if key not in self._special_ids:
            raise ValueError(f"ByteBPE.special_id: {key!r} is not a special token of this tokenizer; it has "
                             f"{list(self.specials) or 'none'}")  # fmt: skip
        return self._special_ids[key]

    def encode_documents(self, documents, separator=END_OF_TEXT) -> list[int]:
        """The ids of each document (str or bytes), with the special token `separator` between two documents."""
        sep = self.special_id(separator)
        if isinstance(documents, (str, bytes, bytearray, memoryview)) or not hasattr(documents, "__iter__"):
            raise TypeError(f"ByteBPE.encode_documents: documents expected a list of str or bytes, got "
                            f"{type(documents).__name__}")  # fmt: skip
        out: list[int] = []
        for k, doc in enumerate(documents):
            if k:
                out.append(sep)
            out.extend(self.encode(_as_bytes("ByteBPE.encode_documents", f"documents[{k}]", doc)))
        return out

    def decode_bytes(self, ids) -> bytes:
        """The exact bytes of a sequence of token ids (a list, tuple or 1-D integer array)."""
        ids = self._check_sequence(ids)
        return b"".join(self._vocab[i] for i in ids)

    def _check_sequence(self, ids) -> list:
        """One sequence of known ids, as a list."""
        # a dict or a set iterates, but over keys or in no order: not a sequence of ids
        if isinstance(ids, (str, bytes, Mapping, AbstractSet)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ByteBPE.decode: ids expected a sequence of ints, got {type(ids).__name__}")
        # an array or tensor of bools or floats: one by one, its items would pass as ints
        kind = str(getattr(ids, "dtype", ""))
        if any(word in kind for word in ("bool", "float", "complex")):
            raise TypeError(f"ByteBPE.decode: ids expected integer token ids, got dtype {kind}")
        shape = tuple(getattr(ids, "shape", ()))
        if len(shape) > 1:  # e.g. generate()'s (B, T): one row at a time
            raise ValueError(f"ByteBPE.decode: ids expected one sequence (1-D), got shape {shape}; decode each row")
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        return ids

    def decode(self, ids) -> str:
        """The text of token ids; bytes that are not valid UTF-8 (a character cut in two) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, path) -> None:
        """Write the merges and the pattern as JSON (the pattern as a latin-1 string, so any byte survives)."""
        state = {
            "format": "tfm_common.bpe.ByteBPE",
            "version": 1,
            "pattern": None if self.pattern is None else self.pattern.decode("latin-1"),
            "merges": [list(p) for p in self.merges],
            "specials": [name.decode("latin-1") for name in self.specials],
            "merge_counts": self.merge_counts,
        }
        Path(path).write_text(json.dumps(state, indent=0))

    @classmethod
    def load(cls, path) -> ByteBPE:
        try:
            state = json.loads(Path(path).read_text())
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(f"ByteBPE.load: {path} is not a saved ByteBPE (not JSON: {e})") from e
        if not isinstance(state, dict) or state.get("format") != "tfm_common.bpe.ByteBPE":
            raise ValueError(f"ByteBPE.load: {path} is not a saved ByteBPE")
        if state.get("version") != 1:
            raise ValueError(f"ByteBPE.load: expected version 1, got {state.get('version')!r}")
        for key, ok in (("merges", isinstance(state.get("merges"), list)), ("pattern", "pattern" in state)):
            if not ok:
                raise ValueError(f"ByteBPE.load: {path} has no valid {key!r} entry (a damaged or edited file?)")
        merges = [tuple(p) if isinstance(p, list) else p for p in state["merges"]]
        specials = state.get("specials", [])  # absent in files saved before special tokens existed
        if not isinstance(specials, list) or not all(isinstance(n, str) for n in specials):
            raise ValueError(f"ByteBPE.load: {path}: specials must be a list of str, got {specials!r:.80}")
        bpe = cls(merges, state["pattern"], [n.encode("latin-1") for n in specials])
        counts = state.get("merge_counts", [])
        if not isinstance(counts, list) or not all(type(c) is int for c in counts):
            raise ValueError(f"ByteBPE.load: {path}: merge_counts must be a list of ints, got {counts!r:.80}")
        bpe.merge_counts = counts
        return bpe

    def __eq__(self, other) -> bool:
        mine, theirs = (self.merges, self.pattern, self.specials), (other.merges, other.pattern, other.specials)
        return isinstance(other, ByteBPE) and mine == theirs

    __hash__ = None

    def __repr__(self) -> str:
        split = "no pretokenizer" if self.pattern is None else "pretokenized"
        special = f", specials={list(self.specials)}" if self.specials else ""
        return f"ByteBPE(vocab_size={self.vocab_size}, merges={len(self.merges)}{special}, {split})"
