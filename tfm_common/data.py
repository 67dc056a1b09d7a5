"""Data for Part IV, shared by both tracks (NumPy only, never torch): tasks, a vocabulary, batches and masks.

Everything here is generated offline and is deterministic given a seed or a `numpy.random.Generator`.

- Tasks. `copy_task` and `reverse_task`: random strings over a small alphabet, the sanity checks of a
  sequence-to-sequence model. `number_pairs`: numbers written as digits, translated into words with
  `num2words`, e.g. ("21", "einundzwanzig"). German puts the units before the tens (21 = "one-and-twenty"),
  so the model has to reorder, not just transliterate. `number_splits` splits *by number*: a test number
  never appears in training, so test accuracy measures generalization, not memory.
- Tokenization. Character level: the source vocabulary is the ten digits, the target one a few dozen
  letters, so the embeddings and the output softmax stay tiny and training is fast on a CPU; and every
  source token is one digit, so a cross-attention map shows directly which digit each output letter looks
  at (the reordering of units and tens is visible). Word-level vocabularies (lists of tokens) work too.
- Special tokens with fixed ids, the same in every vocabulary: `PAD_ID = 0` (padding, ignored by the loss),
  `BOS_ID = 1` (begin of sequence: the decoder's first input), `EOS_ID = 2` (end of sequence: the last target,
  where decoding stops), `UNK_ID = 3` (a token never seen when the vocabulary was built).
- Batches. `make_batches` groups pairs of similar length (less padding), pads with `PAD_ID`, and shifts the
  target by one position: the decoder reads `tgt_in = [BOS] + y` and is trained to predict `tgt_out = y + [EOS]`
  (teacher forcing). The masks follow the library contract: boolean, True = "may attend".
"""

from __future__ import annotations

import numbers
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .validate import check_size

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "UNK",
    "SPECIAL_TOKENS",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "SYMBOLS",
    "Vocab",
    "copy_task",
    "reverse_task",
    "number_to_words",
    "number_pairs",
    "number_splits",
    "encode_pairs",
    "Batch",
    "make_batches",
    "src_mask",
    "tgt_mask",
]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

# The alphabet of the synthetic tasks: symbol i is SYMBOLS[i].
SYMBOLS = string.ascii_lowercase + string.ascii_uppercase + string.digits

LEVELS = ("char", "word")


def _rng(rng, name: str) -> np.random.Generator:
    """A Generator from a Generator, an int seed or None (seed 0), as `tfm_numpy.module.as_rng`."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, numbers.Integral) and not isinstance(rng, bool)):
        return np.random.default_rng(0 if rng is None else int(rng))
    raise TypeError(f"{name}: rng expected a numpy.random.Generator, an int seed or None, got {type(rng).__name__}")


class Vocab:
    """Tokens <-> ids, with the four special tokens at fixed ids 0..3 and the ordinary tokens after them.

    level="char": a text is a string and every character is a token; `decode` joins with "".
    level="word": a text is a list of tokens, or a string split on whitespace; `decode` joins with " ".
    Build one from sentences with `Vocab.build(sentences)`: the ordinary tokens are sorted, so the ids do not
    depend on the order of the sentences. Unknown tokens encode to `UNK_ID`.
    """

    def __init__(self, tokens: Iterable[str], level: str = "char"):
        if level not in LEVELS:
            raise ValueError(f"Vocab: level expected one of {LEVELS}, got {level!r}")
        self.level = level
        self.itos: list[str] = list(SPECIAL_TOKENS)
        for tok in tokens:
            if not isinstance(tok, str) or not tok:
                raise ValueError(f"Vocab: tokens must be non-empty strings, got {tok!r}")
            if tok in SPECIAL_TOKENS:
                raise ValueError(f"Vocab: token {tok!r} is a special token; list only the ordinary tokens")
            if level == "char" and len(tok) != 1:
                raise ValueError(f"Vocab: a char-level token is one character, got {tok!r}")
            if level == "word" and tok.split() != [tok]:
                raise ValueError(f"Vocab: a word-level token cannot contain whitespace, got {tok!r}")
            self.itos.append(tok)
        self.stoi: dict[str, int] = {}
        for i, tok in enumerate(self.itos):
            if tok in self.stoi:
                raise ValueError(f"Vocab: token {tok!r} is listed twice")
            self.stoi[tok] = i

    @classmethod
    def build(cls, sentences: Iterable, level: str = "char") -> Vocab:
        """The vocabulary of every token in `sentences` (strings, or lists of tokens at word level)."""
        seen = _check_sentences(sentences, level)  # the set of their tokens, none of them special
        return cls(sorted(seen), level)

    def tokenize(self, text) -> list[str]:
        return _tokenize(text, self.level, "Vocab.tokenize")

    def encode(self, text, add_bos: bool = False, add_eos: bool = True) -> list[int]:
        """Token ids of `text`; unknown tokens become `UNK_ID`. With the defaults: ids + [EOS_ID].

        One rule for special tokens, here and in `build`: they are never read from text (a literal "<eos>" word
        would otherwise end a sequence early); encode adds BOS and EOS itself, and a text holding one is refused."""
        toks = self.tokenize(text)
        special = [tok for tok in toks if tok in SPECIAL_TOKENS]
        if special:
            raise ValueError(
                f"Vocab.encode: the text holds the special token {special[0]!r}; special tokens are added by encode "
                "(add_bos, add_eos) and never read from text"
            )
        ids = [self.stoi.get(tok, UNK_ID) for tok in toks]
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def decode(self, ids, strip_special: bool = True) -> str:
        """The text of a 1-D sequence of ids.

        strip_special=True (for model outputs): stop at the first EOS and drop PAD and BOS, so
        `decode(encode(s)) == s` for any s made of known tokens; an unknown token shows as "<unk>".
        strip_special=False: every token, specials included, e.g. "<bos>21<eos><pad>".
        """
        arr = self._check_ids(ids)
        toks = []
        for i in arr.tolist():
            if strip_special:
                if i == EOS_ID:
                    break
                if i in (PAD_ID, BOS_ID):
                    continue
            toks.append(self.itos[i])
        return ("" if self.level == "char" else " ").join(toks)

    def _check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"Vocab.decode: ids expected a 1-D sequence, got shape {arr.shape} (see decode_batch)")
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"Vocab.decode: ids expected integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= len(self))
        if bad.any():
            raise ValueError(f"Vocab.decode: ids must be in [0, {len(self)}), got {arr[bad][0]}")
        return arr

    def decode_batch(self, ids, strip_special: bool = True) -> list[str]:
        """`decode` of each row of a (B, T) array (or list of sequences)."""
        return [self.decode(row, strip_special) for row in ids]

    def to_dict(self) -> dict:
        """A JSON-able description: {"level": ..., "tokens": [all tokens in id order, specials first]}."""
        return {"level": self.level, "tokens": list(self.itos)}

    @classmethod
    def from_dict(cls, d: dict) -> Vocab:
        if not isinstance(d, dict) or set(d) != {"level", "tokens"}:
            raise ValueError(f"Vocab.from_dict: expected a dict with keys 'level' and 'tokens', got {d!r:.80}")
        tokens = list(d["tokens"])
        if tuple(tokens[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(f"Vocab.from_dict: the tokens must start with {SPECIAL_TOKENS}, got {tokens[:4]}")
        return cls(tokens[len(SPECIAL_TOKENS) :], d["level"])

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, tok) -> bool:
        return tok in self.stoi

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.level, tuple(self.itos)))

    def __repr__(self) -> str:
        shown = "".join(self.itos[4:30]) if self.level == "char" else " ".join(self.itos[4:14])
        return f"Vocab(level={self.level!r}, size={len(self)}, tokens={shown!r}{'...' if len(self) > 30 else ''})"


def _check_sentences(sentences: Iterable, level: str) -> set[str]:
    """Vocab.build's tokens: the level checked first, special tokens refused once all sentences are read."""
    if level not in LEVELS:
        raise ValueError(f"Vocab.build: level expected one of {LEVELS}, got {level!r}")
    seen: set[str] = set()
    for s in sentences:
        seen.update(_tokenize(s, level, "Vocab.build"))
    special = sorted(seen & set(SPECIAL_TOKENS))
    if special:
        raise ValueError(f"Vocab.build: the sentences hold the special token {special[0]!r}; special tokens are "
                         "never read from text (see encode)")  # fmt: skip
    return seen


def _tokenize(text, level: str, name: str) -> list[str]:
    if level == "char":
        if not isinstance(text, str):
            raise TypeError(f"{name}: a char-level text must be a str, got {type(text).__name__}")
        return list(text)
    if isinstance(text, str):
        return text.split()
    if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
        return list(text)
    raise TypeError(f"{name}: a word-level text must be a str or a list of str, got {type(text).__name__}")


# -- synthetic tasks -----------------------------------------------------------------------------------------


def _random_strings(name, n, min_len, max_len, n_symbols, rng, exclude) -> list[str]:
    n = check_size(name, "n", n, 0, say_int=False)
    min_len = check_size(name, "min_len", min_len, 1, say_int=False)
    max_len = check_size(name, "max_len", max_len, min_len, say_int=False)
    n_symbols = check_size(name, "n_symbols", n_symbols, 1, say_int=False)
    if n_symbols > len(SYMBOLS):
        raise ValueError(f"{name}: n_symbols must be <= {len(SYMBOLS)}, got {n_symbols}")
    g = _rng(rng, name)
    excluded = set(exclude)
    out: list[str] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"{name}: could not draw {n} strings outside `exclude`; widen the lengths or alphabet")
        length = int(g.integers(min_len, max_len + 1))
        s = "".join(SYMBOLS[i] for i in g.integers(0, n_symbols, size=length))
        if s not in excluded:
            out.append(s)
    return out


def copy_task(n: int, min_len: int, max_len: int, n_symbols: int, rng=None, *, exclude=()) -> list[tuple[str, str]]:
    """n pairs (s, s): s a random string of length in [min_len, max_len] over SYMBOLS[:n_symbols].

    rng: a numpy Generator or an int seed (None = seed 0). `exclude`: strings never drawn (e.g. the training
    sources, to make a held-out set).
    """
    return [(s, s) for s in _random_strings("copy_task", n, min_len, max_len, n_symbols, rng, exclude)]


def reverse_task(n: int, min_len: int, max_len: int, n_symbols: int, rng=None, *, exclude=()) -> list[tuple[str, str]]:
    """n pairs (s, s reversed), drawn exactly as in `copy_task` (the same seed gives the same sources)."""
    return [(s, s[::-1]) for s in _random_strings("reverse_task", n, min_len, max_len, n_symbols, rng, exclude)]


# -- numbers into words --------------------------------------------------------------------------------------


def number_to_words(n: int, lang: str = "de") -> str:
    """`num2words(n, lang=lang)`: 21 -> "einundzwanzig" (de), "twenty-one" (en). Needs the `num2words` package."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"number_to_words: n expected an int, got {type(n).__name__}")
    try:
        from num2words import num2words
    except ImportError as e:  # an optional dependency (the book's extra), so import it only here
        raise ImportError("number_to_words needs the num2words package: pip install num2words") from e
    try:
        return num2words(int(n), lang=lang)
    except NotImplementedError as e:
        raise ValueError(f"number_to_words: lang {lang!r} is not supported by num2words") from e


def number_pairs(numbers: Iterable[int], lang: str = "de") -> list[tuple[str, str]]:
    """[(digits, words)] for each number, e.g. number_pairs([21]) == [("21", "einundzwanzig")].

    German and English are tested; any language num2words knows works. Note the target alphabets: German
    words are lowercase letters with umlauts and "ß"; English adds " ", "-" and "," ("one thousand, two
    hundred and thirty-four").
    """
    return [(str(int(n)), number_to_words(n, lang)) for n in numbers]


def number_splits(
    max_number: int, n_train: int, n_valid: int, n_test: int, seed=0, *, min_number: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three disjoint int64 arrays (train, valid, test) of distinct numbers drawn from [min_number, max_number].

    Split by number: a random permutation of the range, cut into consecutive pieces, so no number is in two
    splits. Deterministic given `seed` (an int or a Generator); each array is in the drawn (random) order.
    """
    name = "number_splits"
    max_number, min_number, sizes = _check_splits(max_number, min_number, n_train, n_valid, n_test)
    available = max_number - min_number + 1
    perm = _rng(seed, name).permutation(available)[: sum(sizes)].astype(np.int64) + min_number
    a, b = sizes[0], sizes[0] + sizes[1]
    return perm[:a], perm[a:b], perm[b:]


def _check_splits(max_number, min_number, n_train, n_valid, n_test) -> tuple[int, int, list[int]]:
    name = "number_splits"
    max_number = check_size(name, "max_number", max_number, 0, say_int=False)
    min_number = check_size(name, "min_number", min_number, 0, say_int=False)
    if min_number > max_number:
        raise ValueError(f"{name}: min_number must be <= max_number, got {min_number} > {max_number}")
    sizes = [
        check_size(name, arg, v, 0, say_int=False)
        for arg, v in (("n_train", n_train), ("n_valid", n_valid), ("n_test", n_test))
    ]
    available = max_number - min_number + 1
    if sum(sizes) > available:
        raise ValueError(
            f"{name}: n_train + n_valid + n_test = {sum(sizes)} exceeds the {available} numbers "
            f"in [{min_number}, {max_number}]"
        )
    return max_number, min_number, sizes


def encode_pairs(pairs, src_vocab: Vocab, tgt_vocab: Vocab) -> list[tuple[list[int], list[int]]]:
    """Text pairs -> id pairs ready for `make_batches`: the source ends with EOS, the target has no specials
    (`make_batches` adds BOS and EOS to it)."""
    return [(src_vocab.encode(s, add_eos=True), tgt_vocab.encode(t, add_eos=False)) for s, t in pairs]


# -- batches and masks ---------------------------------------------------------------------------------------


def src_mask(src: np.ndarray, pad_id: int = PAD_ID) -> np.ndarray:
    """(B, S) tokens -> (B, 1, 1, S) bool, True at real tokens: what every query may attend to in the source.

    The same as `tfm_numpy.padding_mask(src, pad_id)` (written here so tfm_common does not import a track).
    """
    src = _check_tokens("src_mask", "src", src)
    return (src != pad_id)[:, None, None, :]


def tgt_mask(tgt_in: np.ndarray, pad_id: int = PAD_ID) -> np.ndarray:
    """(B, T) decoder inputs -> (B, 1, T, T) bool: position i may attend to j <= i, and never to padding.

    The same as `tfm_numpy.decoder_mask(tgt_in, pad_id)`. No row is empty: position 0 holds BOS, never PAD.
    """
    tgt_in = _check_tokens("tgt_mask", "tgt_in", tgt_in)
    T = tgt_in.shape[1]
    causal = np.tril(np.ones((T, T), dtype=bool))
    return (tgt_in != pad_id)[:, None, None, :] & causal[None, None]


def _check_tokens(name: str, arg: str, x) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{name}: {arg} expected a (B, T) integer array, got shape {x.shape}, dtype {x.dtype}")
    return x


@dataclass(eq=False)
class Batch:
    """One padded batch. src (B, S), tgt_in = [BOS] + y (B, T), tgt_out = y + [EOS] (B, T), all int64 and padded
    with PAD_ID; n_tokens = the number of non-pad target tokens (what a per-token loss averages over)."""

    src: np.ndarray
    tgt_in: np.ndarray
    tgt_out: np.ndarray
    n_tokens: int

    @property
    def src_mask(self) -> np.ndarray:
        """(B, 1, 1, S) bool: the encoder's self-attention mask and the decoder's cross-attention mask."""
        return src_mask(self.src)

    @property
    def tgt_mask(self) -> np.ndarray:
        """(B, 1, T, T) bool: the decoder's self-attention mask (causal and not padding)."""
        return tgt_mask(self.tgt_in)

    def __len__(self) -> int:
        return self.src.shape[0]


def _as_ids(name: str, seq, what: str, i: int) -> np.ndarray:
    a = np.asarray(seq)
    if a.ndim != 1:
        raise ValueError(f"{name}: pair {i}: {what} expected a 1-D sequence of ids, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":  # signed or unsigned integers (bool is kind "b")
        raise TypeError(f"{name}: pair {i}: {what} expected integer ids, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_ids(name: str, what: str, seqs: list[np.ndarray], forbidden: tuple[int, ...]) -> None:
    """All sequences at once (one concatenation, not a check per pair); the message names the first bad pair."""
    flat = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
    bad = (flat < 0) | np.isin(flat, forbidden)
    if bad.any():
        k = int(np.argmax(bad))
        i = int(np.searchsorted(np.cumsum([len(s) for s in seqs]), k, side="right"))
        if flat[k] < 0:
            raise ValueError(f"{name}: pair {i}: {what} ids must be >= 0, got {flat[k]}")
        raise ValueError(
            f"{name}: pair {i}: {what} contains the special id {flat[k]}; ids {list(forbidden)} are not "
            f"allowed there (the target gets BOS/EOS from make_batches: encode it with add_eos=False)"
        )


def _pad(seqs: Sequence[np.ndarray], pad_id: int) -> np.ndarray:
    lengths = np.array([len(s) for s in seqs])
    out = np.full((len(seqs), lengths.max()), pad_id, dtype=np.int64)
    out[np.arange(out.shape[1]) < lengths[:, None]] = np.concatenate(seqs)  # row by row, left-aligned
    return out


def _check_pairs(pairs_ids, batch_size) -> tuple[int, list[np.ndarray], list[np.ndarray]]:
    name = "make_batches"
    batch_size = check_size(name, "batch_size", batch_size, 1, say_int=False)
    pairs = list(pairs_ids)
    if not pairs:
        raise ValueError(f"{name}: pairs_ids is empty")
    srcs, tgts = [], []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{name}: pair {i} expected a (src_ids, tgt_ids) pair, got {pair!r:.60}")
        src = _as_ids(name, pair[0], "src", i)
        if src.size == 0:
            raise ValueError(f"{name}: pair {i}: src is empty (the encoder would have nothing to attend to)")
        srcs.append(src)
        tgts.append(_as_ids(name, pair[1], "tgt", i))
    _check_ids(name, "src", srcs, (PAD_ID,))
    _check_ids(name, "tgt", tgts, (PAD_ID, BOS_ID, EOS_ID))
    return batch_size, srcs, tgts


def make_batches(
    pairs_ids, batch_size: int, rng=None, shuffle: bool = True, sort_by_length: bool = True
) -> list[Batch]:
    """Pairs of id sequences -> a list of padded `Batch`es of at most `batch_size` pairs.

    pairs_ids: [(src_ids, tgt_ids)] as from `encode_pairs`: src_ids non-empty, without PAD; tgt_ids without
    PAD, BOS or EOS (added here: tgt_in = [BOS] + tgt, tgt_out = tgt + [EOS]).
    sort_by_length: pairs of similar (source, target) length share a batch, so little padding is needed.
    shuffle: the pairs (ties between equal lengths included) and the order of the batches are drawn from `rng`
    (a numpy Generator or an int seed; None = seed 0). Pass the same Generator every epoch for a new,
    reproducible order each epoch. With shuffle=False the order is deterministic without any rng.
    """
    name = "make_batches"
    batch_size, srcs, tgts = _check_pairs(pairs_ids, batch_size)  # id arrays, one per pair
    g = _rng(rng, name) if shuffle else None
    order = g.permutation(len(srcs)) if shuffle else np.arange(len(srcs))
    if sort_by_length:
        src_len = np.array([len(srcs[i]) for i in order])
        tgt_len = np.array([len(tgts[i]) for i in order])
        order = order[np.lexsort((tgt_len, src_len))]  # stable: equal lengths keep their shuffled order
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle and sort_by_length:
        chunks = [chunks[j] for j in g.permutation(len(chunks))]
    batches = []
    for idx in chunks:
        src = _pad([srcs[i] for i in idx], PAD_ID)
        tgt = _pad([tgts[i] for i in idx], PAD_ID)  # (B, T - 1)
        lengths = np.array([len(tgts[i]) for i in idx])
        tgt_in = np.concatenate([np.full((len(idx), 1), BOS_ID, dtype=np.int64), tgt], axis=1)  # BOS, then y
        tgt_out = np.concatenate([tgt, np.full((len(idx), 1), PAD_ID, dtype=np.int64)], axis=1)
        tgt_out[np.arange(len(idx)), lengths] = EOS_ID  # y, then EOS right after its last token
        batches.append(Batch(src, tgt_in, tgt_out, int((tgt_out != PAD_ID).sum())))
    return batches
