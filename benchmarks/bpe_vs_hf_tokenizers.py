"""Our byte-level BPE (tfm_common.bpe) against Hugging Face `tokenizers`' ByteLevel BPE trainer, merge by merge.

`tokenizers` is not a dependency of the project; run this in a scratch environment:

    python -m venv /tmp/hf && /tmp/hf/bin/pip install tokenizers==0.23.3 numpy==2.4.6
    PYTHONPATH=. /tmp/hf/bin/python benchmarks/bpe_vs_hf_tokenizers.py [--bytes 200000] [--merges 1000]

Three runs on the same text (the first bytes of the stdlib training corpus), each printing how many of the
first merges agree and where the first difference is:
  1. `tokenizers` as GPT-2 configures it (ByteLevel pre-tokenizer with GPT-2's regex) against ours (our regex);
  2. `tokenizers` given our regex (a Split pre-tokenizer, then ByteLevel without its own regex), so the chunks
     are the same (checked), against ours: what is left is the tie-breaking;
  3. as 2, but ours trained on bytes relabeled in the order `tokenizers` numbers its initial alphabet (sorted by
     the printable character each byte is mapped to), so "the smallest pair" means the same in both.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from tfm_common.bpe import ByteBPE, _learn_merges, pretokenize
from tfm_common.corpus import stdlib_corpus

# Our DEFAULT_PATTERN over characters instead of bytes: every non-ASCII character counts as a letter, as the
# bytes >= 0x80 of its UTF-8 encoding do in the bytes pattern.
OURS_AS_STR = (
    r" ?[A-Za-z_\u0080-\uffff][A-Za-z0-9_\u0080-\uffff]*| ?[0-9]+| ?[^\sA-Za-z0-9_\u0080-\uffff]+|\s+(?!\S)|\s+"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which ByteLevel uses (written out here)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


TO_CHAR = bytes_to_unicode()
TO_BYTE = {c: b for b, c in TO_CHAR.items()}


def hf_merges(text: str, n_merges: int, ours_regex: bool) -> list[tuple[bytes, bytes]]:
    tok = Tokenizer(models.BPE())
    if ours_regex:
        split = pre_tokenizers.Split(Regex(OURS_AS_STR), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])  # fmt: skip
    tok.train_from_iterator([text], trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    return [(to_bytes(a), to_bytes(b)) for a, b in pairs], tok


def to_bytes(s: str) -> bytes:
    return bytes(TO_BYTE[c] for c in s)


def ours_as_bytes(bpe: ByteBPE) -> list[tuple[bytes, bytes]]:
    return [(bpe.token_bytes(a), bpe.token_bytes(b)) for a, b in bpe.merges]


def ours_in_hf_order(data: bytes, n_merges: int) -> list[tuple[bytes, bytes]]:
    """Our training, on ids relabeled so that id order is `tokenizers`' alphabet order; merges mapped back."""
    order = sorted(range(256), key=lambda b: TO_CHAR[b])  # tokenizers' id k is byte order[k]
    relabel = bytes(order.index(b) for b in range(256))
    chunks = Counter(c.translate(relabel) for c in pretokenize(data))
    merges, _ = _learn_merges(chunks, n_merges, 2)
    vocab = [bytes([order[k]]) for k in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    return [(vocab[a], vocab[b]) for a, b in merges]


def compare(name: str, ours, theirs, counts) -> None:
    n = min(len(ours), len(theirs))
    first = next((k for k in range(n) if ours[k] != theirs[k]), None)
    same = sum(o == t for o, t in zip(ours, theirs, strict=False))
    common = len(set(ours) & set(theirs))
    print(f"{name}: {len(ours)} vs {len(theirs)} merges; same position {same}, same set {common}")
    if first is None:
        print("   identical")
        return
    print(f"   first difference at merge {first}: ours {ours[first]} (count {counts[first]}), theirs {theirs[first]}")
    if theirs[first] in ours:
        k = ours.index(theirs[first])
        print(f"   ours learns theirs {theirs[first]} as merge {k} (count {counts[k]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=200_000)
    parser.add_argument("--merges", type=int, default=1000)
    args = parser.parse_args()
    corpus = stdlib_corpus("train", max_bytes=args.bytes)
    data, text = corpus.data, corpus.text
    print(corpus.info())
    bpe = ByteBPE.train(data, 256 + args.merges)
    ours = ours_as_bytes(bpe)
    gpt2, _ = hf_merges(text, args.merges, ours_regex=False)
    compare("1. tokenizers (GPT-2 regex) vs ours", ours, gpt2, bpe.merge_counts)
    same_regex, tok = hf_merges(text, args.merges, ours_regex=True)
    chunks = [to_bytes(s) for s, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
    print(f"   with our regex, tokenizers' chunks equal ours: {chunks == pretokenize(data)}")
    compare("2. tokenizers (our regex) vs ours", ours, same_regex, bpe.merge_counts)
    compare("3. tokenizers (our regex) vs ours in its id order", ours_in_hf_order(data, args.merges), same_regex,
            bpe.merge_counts)  # fmt: skip


if __name__ == "__main__":
    main()
