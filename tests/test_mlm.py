"""Masked language modelling's plumbing (tfm_common.mlm): BERT's special tokens after the BPE's vocabulary without
touching its round trip, BERT's 80/10/10 corruption (its proportions, measured on a large seeded draw with a
tolerance of several standard deviations), special tokens and padding never chosen, and a loss that counts only the
chosen positions, in both tracks."""

import math

import numpy as np
import pytest
import torch

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.bpe import END_OF_TEXT, ByteBPE
from tfm_common.mlm import BERT_SPECIALS, IGNORE_INDEX, bert_tokenizer, mask_tokens, special_ids

TEXT = "def add(x, y):\n    return x + y\n\nclass Point:\n    x: int = 0  # café\n" * 20


@pytest.fixture(scope="module")
def bpe():
    return ByteBPE.train(TEXT, 300)


def test_specials_come_after_the_vocabulary_and_the_round_trip_holds(bpe):
    bert = bert_tokenizer(bpe)
    ids = special_ids(bert)
    assert list(ids) == list(range(bpe.vocab_size, bpe.vocab_size + 4)) and bert.vocab_size == bpe.vocab_size + 4
    assert bert.encode(TEXT) == bpe.encode(TEXT)  # every text: the same ids
    assert bert.decode_bytes(bert.encode(TEXT)) == TEXT.encode()
    sample = "[CLS] x [MASK] y [SEP][PAD]"  # the names as text are only bytes: never a special id
    assert not set(bert.encode(sample)) & set(ids) and bert.decode(bert.encode(sample)) == sample
    assert [bert.token_bytes(i) for i in ids] == list(BERT_SPECIALS)
    assert bert.decode([ids.cls, *bert.encode(" return"), ids.sep]) == "[CLS] return[SEP]"
    assert bpe.vocab_size == 256 + len(bpe.merges) and bpe.specials == ()  # the original is untouched


def test_the_tokenizers_own_specials_stay(bpe):
    with_eot = ByteBPE(bpe.merges, bpe.pattern, (END_OF_TEXT,))
    bert = bert_tokenizer(with_eot)
    assert bert.special_id(END_OF_TEXT) == with_eot.special_id(END_OF_TEXT)
    assert special_ids(bert).pad == with_eot.vocab_size
    with pytest.raises(ValueError, match=r"already has the special tokens \[b'\[PAD\]'"):
        bert_tokenizer(bert)
    with pytest.raises(TypeError, match="bert_tokenizer: bpe expected a ByteBPE, got str"):
        bert_tokenizer("gpt2")


V, PAD, CLS, SEP, MASK = 50, 46, 47, 48, 49
SPECIALS = (PAD, CLS, SEP, MASK)


def corpus_batch(shape=(400, 500), seed=0):
    """Ordinary ids with [CLS] first, [SEP] and then padding at the end of each row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 46, shape)
    lengths = rng.integers(shape[1] // 2, shape[1] - 1, shape[0])
    for row, n in zip(ids, lengths, strict=True):
        row[0], row[n], row[n + 1 :] = CLS, SEP, PAD
    return ids


def test_proportions_of_the_80_10_10_rule():
    """On ~150,000 ordinary positions: 15% chosen; of the chosen, 80% [MASK], 10% another token, 10% unchanged
    (a random draw may hit the original token: 1/45 of the 10%). Tolerances: 5 standard deviations."""
    ids = corpus_batch()
    out = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, p=0.15, rng=np.random.default_rng(1))
    ordinary = ~np.isin(ids, SPECIALS)
    n, k = int(ordinary.sum()), int(out.chosen.sum())
    assert abs(k / n - 0.15) < 5 * math.sqrt(0.15 * 0.85 / n)
    c = out.chosen
    masked, kept = (out.inputs[c] == MASK).mean(), (out.inputs[c] == ids[c]).mean()
    replaced = ((out.inputs[c] != MASK) & (out.inputs[c] != ids[c])).mean()
    expected = {"masked": 0.8, "replaced": 0.1 * 44 / 45, "kept": 0.1 + 0.1 / 45}
    for name, got in (("masked", masked), ("replaced", replaced), ("kept", kept)):
        q = expected[name]
        assert abs(got - q) < 5 * math.sqrt(q * (1 - q) / k), (name, got, q)


def test_specials_and_padding_are_never_chosen_nor_drawn():
    ids = corpus_batch((50, 80), seed=3)
    out = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, p=0.9, rng=np.random.default_rng(2))
    special = np.isin(ids, SPECIALS)
    assert not (out.chosen & special).any()
    assert np.array_equal(out.inputs[special], ids[special])  # untouched
    assert np.array_equal(out.targets, np.where(out.chosen, ids, IGNORE_INDEX))
    replaced = out.chosen & (out.inputs != MASK)
    assert not np.isin(out.inputs[replaced], SPECIALS).any()  # a random token is an ordinary one
    assert np.array_equal(out.inputs[~out.chosen], ids[~out.chosen])


def test_mask_id_is_never_a_target_even_if_not_listed():
    ids = np.full((4, 10), MASK)
    out = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=(), p=1.0, rng=np.random.default_rng(0))
    assert not out.chosen.any()


def test_seeded_and_independent_of_the_values():
    """The same seed gives the same choice on any ids without specials: the draws depend only on the shape."""
    a, b = np.arange(60).reshape(3, 20) % 40, (np.arange(60).reshape(3, 20) * 7) % 40
    ra = mask_tokens(a, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, rng=np.random.default_rng(5))
    rb = mask_tokens(b, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, rng=np.random.default_rng(5))
    assert np.array_equal(ra.chosen, rb.chosen) and ra.chosen.any()
    again = mask_tokens(a, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, rng=np.random.default_rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(ra, again, strict=True))


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_the_loss_counts_only_the_chosen_positions(lib):
    ids = corpus_batch((3, 12), seed=4)
    out = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, p=0.5, rng=np.random.default_rng(6))
    logits = np.random.default_rng(7).standard_normal((3, 12, V))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, ids[..., None], -1)[..., 0][out.chosen].mean()
    loss_fn = lib.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    wrap = (lambda a: a) if lib is tn else torch.from_numpy
    assert abs(float(loss_fn(wrap(logits), wrap(out.targets))) - expected) < 1e-12


BAD = [
    (dict(ids=np.array([[1.0, 2.0]])), TypeError, "ids expected a numpy integer array"),
    (dict(ids=[[1, 2]]), TypeError, "ids expected a numpy integer array of token ids, got list"),
    (dict(ids=np.array([[1, V]])), ValueError, "ids must be in [0, 50)"),
    (dict(mask_id=V), ValueError, "mask_id must be an int in [0, 50)"),
    (dict(vocab_size=1), ValueError, "vocab_size must be an int >= 2"),
    (dict(special_ids=(1, 99)), ValueError, "special_ids must be ints in [0, 50)"),
    (dict(special_ids=5), TypeError, "special_ids expected a sequence of ints"),
    (dict(p=0.0), ValueError, "p must be in (0, 1]"),
    (dict(p=1.5), ValueError, "p"),
    (dict(rng=0), TypeError, "rng expected a numpy.random.Generator, got int"),
]


@pytest.mark.parametrize("change,error,words", BAD, ids=[f"{next(iter(c))}-{i}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_arguments_refused(change, error, words):
    args = dict(ids=np.array([[1, 2, 3]]), mask_id=MASK, vocab_size=V, special_ids=SPECIALS, p=0.15,
                rng=np.random.default_rng(0)) | change  # fmt: skip
    with pytest.raises(error) as info:
        mask_tokens(args.pop("ids"), **args)
    assert str(info.value).startswith("mask_tokens: ") and words in str(info.value), str(info.value)


def test_mask_rule_at_its_boundaries():
    """u_choose < p chooses (p itself does not); u_fate < 0.8 masks, [0.8, 0.9) replaces, 0.9 and above keep."""
    from tfm_common.mlm import mask_rule

    ids = np.array([5, 6, 7, 8, 9, CLS])
    u_choose = np.array([0.0, 0.1, 0.1, 0.1, 0.15, 0.0])
    u_fate = np.array([0.79, 0.8, 0.8999, 0.9, 0.0, 0.0])
    random_ids = np.array([1, 2, 3, 4, 5, 6])
    out = mask_rule(ids, u_choose, u_fate, random_ids, mask_id=MASK, special_ids=SPECIALS, p=0.15)
    assert out.chosen.tolist() == [True, True, True, True, False, False]
    assert out.inputs.tolist() == [MASK, 2, 3, 8, 9, CLS]
    assert out.targets.tolist() == [5, 6, 7, 8, IGNORE_INDEX, IGNORE_INDEX]
    with pytest.raises(ValueError, match=r"mask_rule: u_fate expected a numpy array of the shape of ids \(6,\)"):
        mask_rule(ids, u_choose, u_fate[:3], random_ids, mask_id=MASK, special_ids=SPECIALS)
