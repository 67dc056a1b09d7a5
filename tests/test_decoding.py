"""Decoding in both tracks: the key/value cache against the uncached decoder (logits at every step, tokens),
greedy search, beam search (beam 1 = greedy, exhaustive with a wide beam, scores), NumPy vs torch, eos and
padding, max_len, bad input. Untrained models with random weights: arbitrary but deterministic tokens."""

import itertools
import math

import numpy as np
import pytest
import torch
from helpers_tracks import max_abs_diff, to_numpy

import tfm_numpy as tn
import tfm_torch as tt

TOL = 1e-10  # float64: cached vs uncached logits, NumPy vs torch
PAD, BOS, EOS = 0, 1, 2  # the ids of tfm_common.data; the functions take them as arguments
SRC = np.array([[3, 7, 1, 9, 5], [2, 10, 4, 0, 0], [5, 5, 5, 5, 5]])  # (3, 5), the second row padded
# Targets as the decoder reads them: bos first; the second row ends early (eos, then padding).
TGT = np.array([[BOS, 4, 8, 3, 6, 5, 7], [BOS, 6, 3, EOS, PAD, PAD, PAD], [BOS, 3, 3, 8, 4, 1, 6]])

VARIANTS = list(itertools.product([False, True], ["sinusoidal", "learned"]))
VARIANT_IDS = [f"{'preLN' if nf else 'postLN'}-{pos}" for nf, pos in VARIANTS]
TRACKS = ["numpy", "torch"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models, one token at a time: threads only add overhead (and stall on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def np_model(norm_first=True, positional="learned", seed=0, max_len=12, tgt_vocab=9, dropout=0.0, dtype=np.float64):
    """A tiny random model whose outputs vary from step to step: LayerNorms moved off (1, 0) and the stacks'
    matrices doubled (at the default initialization, an untrained decoder tends to repeat one token)."""
    m = tn.Transformer(11, tgt_vocab, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=max_len,
                       norm_first=norm_first, positional=positional, tie_output=False, dropout=dropout, pad_id=PAD,
                       rng=seed, dtype=dtype)  # fmt: skip
    rng = np.random.default_rng(seed)
    for name, p in m.named_parameters():
        if name.endswith(("norm1.weight", "norm2.weight", "norm3.weight", "norm.weight")):
            p.data[...] = 1 + 0.3 * rng.standard_normal(p.shape)
        elif name.endswith(("norm1.bias", "norm2.bias", "norm3.bias", "norm.bias")):
            p.data[...] = 0.3 * rng.standard_normal(p.shape)
        elif p.data.ndim == 2 and name.startswith(("encoder", "decoder")):
            p.data *= 2.0
    return m


def torch_twin(m: tn.Transformer) -> tt.Transformer:
    twin = tt.Transformer(**m.config, rng=0, dtype=torch.float64)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    return twin


def make(track: str, **kw):
    """(model, library, array constructor) of one track, the same weights in both."""
    m = np_model(**kw)
    if track == "numpy":
        return m, tn, np.asarray
    return torch_twin(m), tt, lambda a: torch.from_numpy(np.asarray(a))


def no_grad(track):
    return torch.no_grad() if track == "torch" else _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- the key/value cache ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("norm_first,positional", VARIANTS, ids=VARIANT_IDS)
def test_cached_logits_equal_uncached_at_every_step(track, norm_first, positional):
    """decode_step with one new token at a time gives, at every step, the logits of the last position of the
    uncached decoder run on the whole prefix (padding after an eos included: masked as keys in both)."""
    model, lib, A = make(track, norm_first=norm_first, positional=positional)
    with no_grad(track):
        memory, src_mask = model.encode(A(SRC))
        cache, worst = {}, 0.0
        for t in range(TGT.shape[1]):
            step = model.decode_step(A(TGT[:, t : t + 1]), memory, src_mask, cache)  # (B, 1, V)
            full = model.decode(A(TGT[:, : t + 1]), memory, src_mask)  # (B, t + 1, V)
            assert tuple(step.shape) == (3, 1, 9)
            worst = max(worst, max_abs_diff(step[:, 0], full[:, -1]))
            assert cache["length"] == t + 1
            k = cache["layers"][1]["self_attn"]["k"]
            assert tuple(k.shape) == (3, 2, t + 1, 8)  # (B, H, positions so far, dk)
            assert tuple(cache["layers"][1]["cross_attn"]["k"].shape) == (3, 2, 5, 8)  # the memory's: S = 5
    assert worst < TOL, worst


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("norm_first,positional", VARIANTS, ids=VARIANT_IDS)
def test_cached_block_steps_equal_decode(track, norm_first, positional):
    """Several new tokens at once (a prefix, then the rest): the causal mask inside the new block and the
    position offset of the second block are right."""
    model, lib, A = make(track, norm_first=norm_first, positional=positional, seed=1)
    with no_grad(track):
        memory, src_mask = model.encode(A(SRC))
        full = model.decode(A(TGT), memory, src_mask)
        cache = {}
        first = model.decode_step(A(TGT[:, :3]), memory, src_mask, cache)
        rest = model.decode_step(A(TGT[:, 3:]), memory, src_mask, cache)
    assert max_abs_diff(first, full[:, :3]) < TOL
    assert max_abs_diff(rest, full[:, 3:]) < TOL


@pytest.mark.parametrize("track", TRACKS)
def test_reorder_cache_follows_the_rows(track):
    """After reordering (rows repeated and swapped, as beam search does), a step continues the chosen prefixes."""
    model, lib, A = make(track)
    rows = [2, 0, 0, 1]
    with no_grad(track):
        memory, src_mask = model.encode(A(SRC))
        cache = {}
        model.decode_step(A(TGT[:, :4]), memory, src_mask, cache)
        idx = A(np.array(rows))
        cache = lib.reorder_cache(cache, idx)
        nxt = np.array([[5], [3], [6], [8]])
        step = model.decode_step(A(nxt), memory[idx], src_mask[idx], cache)[:, 0]
        tgt = np.concatenate([TGT[rows, :4], nxt], axis=1)
        full = model.decode(A(tgt), memory[idx], src_mask[idx])[:, -1]
    assert max_abs_diff(step, full) < TOL


@pytest.mark.parametrize("track", TRACKS)
def test_decode_step_past_max_len_is_a_clear_error(track):
    model, lib, A = make(track, max_len=5)
    with no_grad(track):
        memory, src_mask = model.encode(A(SRC))
        cache = {}
        model.decode_step(A(TGT[:, :5]), memory, src_mask, cache)  # positions 0..4: the whole table
        with pytest.raises(ValueError, match=r"decode_step: positions up to 5 exceed max_len=5"):
            model.decode_step(A(TGT[:, 5:6]), memory, src_mask, cache)
        with pytest.raises(ValueError, match="memory expected shape"):
            model.decode_step(A(TGT[:2, :1]), memory, src_mask, {})


def test_numpy_decode_step_leaves_training_alone():
    """The training path after decoding: forward and backward give the same gradients as before; a backward
    right after a decode step (nothing cached for it) is an error, not a wrong gradient."""
    model = np_model()
    grad_logits = np.random.default_rng(0).standard_normal((3, 6, 9))

    def grads():
        model.zero_grad()
        model(SRC, TGT[:, :-1])
        model.backward(grad_logits)
        return {k: v.copy() for k, v in model.grads().items()}

    before = grads()
    memory, src_mask = model.encode(SRC)
    model.decode_step(TGT[:, :3], memory, src_mask, {})
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward(np.ones((3, 3, 9)))
    after = grads()
    assert all(np.array_equal(before[k], after[k]) for k in before)


# -- greedy decoding ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("norm_first,positional", VARIANTS, ids=VARIANT_IDS)
def test_cached_greedy_equals_uncached(track, norm_first, positional):
    model, lib, A = make(track, norm_first=norm_first, positional=positional, seed=2)
    cached = to_numpy(lib.greedy_decode(model, A(SRC), BOS, EOS, 12))
    plain = to_numpy(lib.greedy_decode(model, A(SRC), BOS, EOS, 12, use_cache=False))
    np.testing.assert_array_equal(cached, plain)
    assert cached.dtype == np.int64 and cached.shape[0] == 3 and 1 <= cached.shape[1] <= 12


@pytest.mark.parametrize("track", TRACKS)
def test_greedy_is_the_argmax_of_the_uncached_decoder(track):
    """Each token is the argmax (pad left out) of the decoder's logits given the tokens before it."""
    model, lib, A = make(track)
    out = to_numpy(lib.greedy_decode(model, A(SRC), BOS, EOS, 10))
    assert len(set(out[0].tolist())) > 2  # the test model's outputs vary (not one repeated token)
    tgt_in = np.concatenate([np.full((3, 1), BOS), out[:, :-1]], axis=1)
    with no_grad(track):
        logits = to_numpy(model(A(SRC), A(tgt_in)))
    logits[..., PAD] = -np.inf
    expected = logits.argmax(-1)
    alive = (np.cumsum(out == EOS, axis=1) - (out == EOS)) == 0  # up to and including the first eos
    np.testing.assert_array_equal(out[alive], expected[alive])
    assert (out[~alive] == PAD).all()
    assert not (out[alive] == PAD).any()  # pad is never generated


@pytest.mark.parametrize("track", TRACKS)
def test_eos_stops_a_row_and_pads_after_it(track):
    """eos is only a label: calling 'eos' a token that greedy produces cuts each row at its first occurrence and
    pads after it (the tokens before it are unchanged); the output ends with the longest row."""
    model, lib, A = make(track, seed=3)
    free = to_numpy(lib.greedy_decode(model, A(SRC), BOS, EOS, 10))
    assert not (free == EOS).any() and free.shape == (3, 10)  # no eos: every row runs to max_len
    eos = 3
    ends = [int(np.flatnonzero(r == eos)[0]) + 1 if (r == eos).any() else 10 for r in free]  # lengths with eos 3
    assert ends == [3, 6, 10]  # the rows stop at different steps (the third never does)
    for rows in ([0, 1, 2], [0, 1], [0]):
        out = to_numpy(lib.greedy_decode(model, A(SRC[rows]), BOS, eos, 10))
        assert out.shape == (len(rows), max(ends[r] for r in rows))  # as long as its longest row
        for row, r in zip(out, rows, strict=True):
            np.testing.assert_array_equal(row[: ends[r]], free[r, : ends[r]])
            assert (row[ends[r] :] == PAD).all()


@pytest.mark.parametrize("track", TRACKS)
def test_greedy_stops_when_every_row_is_done(track):
    model, lib, A = make(track)
    first = to_numpy(lib.greedy_decode(model, A(SRC), BOS, EOS, 10))[:, 0]
    eos = int(first[0])
    out = to_numpy(lib.greedy_decode(model, A(SRC[first == eos]), BOS, eos, 10))
    assert out.shape == ((first == eos).sum(), 1) and (out == eos).all()  # one step, then stop


@pytest.mark.parametrize("track", TRACKS)
def test_max_len(track):
    """The output never exceeds max_len; max_len may be the model's whole positional table, not more."""
    model, lib, A = make(track, max_len=6)
    for n in (1, 3, 6):
        out = lib.greedy_decode(model, A(SRC), BOS, 8, n)  # 8: never produced, so every row runs to max_len
        assert tuple(out.shape) == (3, n)
        beam = lib.beam_search(model, A(SRC), BOS, 8, n)
        assert beam.shape[0] == 3 and beam.shape[1] <= n
    for fn in (lib.greedy_decode, lib.beam_search):
        with pytest.raises(ValueError, match=r"max_len=7 exceeds the model's max_len=6"):
            fn(model, A(SRC), BOS, EOS, 7)
        with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
            fn(model, A(SRC), BOS, EOS, 0)


@pytest.mark.parametrize("track", TRACKS)
def test_bad_arguments(track):
    model, lib, A = make(track)
    src = A(SRC)
    with pytest.raises(ValueError, match=r"bos_id=0 is the model's pad_id"):
        lib.greedy_decode(model, src, PAD, EOS, 5)
    with pytest.raises(ValueError, match=r"eos_id must be a token id in \[0, 9\)"):
        lib.greedy_decode(model, src, BOS, 9, 5)
    with pytest.raises(ValueError, match="beam_size must be an int >= 1, got 0"):
        lib.beam_search(model, src, BOS, EOS, 5, beam_size=0)
    with pytest.raises(ValueError, match="alpha must be a float >= 0"):
        lib.beam_search(model, src, BOS, EOS, 5, alpha=-0.5)
    with pytest.raises(ValueError, match="tokens expected a"):
        lib.sequence_scores(model, src, A(np.zeros((3, 2))), BOS, EOS)  # float token ids, in the track's own type
    with pytest.raises(ValueError, match="src: values must be in"):
        lib.greedy_decode(model, A(SRC + 20), BOS, EOS, 5)


@pytest.mark.parametrize("track", TRACKS)
def test_decoding_turns_dropout_off_and_restores_the_mode(track):
    m = np_model(dropout=0.3)
    ref = tn.greedy_decode(m.eval(), SRC, BOS, EOS, 8)
    model, lib, A = (m, tn, np.asarray) if track == "numpy" else (torch_twin(m), tt, lambda a: torch.from_numpy(a))
    model.train()
    for _ in range(2):
        np.testing.assert_array_equal(to_numpy(lib.greedy_decode(model, A(SRC), BOS, EOS, 8)), ref)
        lib.beam_search(model, A(SRC), BOS, EOS, 8)
        assert model.training


# -- beam search ----------------------------------------------------------------------------------------------------


def test_length_penalty_known_values():
    for lib in (tn, tt):
        assert lib.length_penalty(1) == 1.0  # ((5 + 1) / 6)^alpha
        assert lib.length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
        assert lib.length_penalty(30, 0.0) == 1.0
    np.testing.assert_allclose(tn.length_penalty(np.array([1, 7])), [1.0, 2.0**0.6])
    np.testing.assert_allclose(tt.length_penalty(torch.tensor([1, 7])).numpy(), [1.0, 2.0**0.6])


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_greedy(track, seed):
    model, lib, A = make(track, seed=seed)
    for eos in (EOS, 5):
        greedy = to_numpy(lib.greedy_decode(model, A(SRC), BOS, eos, 10))
        beam = to_numpy(lib.beam_search(model, A(SRC), BOS, eos, 10, beam_size=1))
        np.testing.assert_array_equal(beam, greedy)


@pytest.mark.parametrize("track", TRACKS)
def test_cached_beam_equals_uncached(track):
    model, lib, A = make(track, seed=3)
    tok, score = lib.beam_search(model, A(SRC), BOS, 5, 10, return_scores=True)
    tok2, score2 = lib.beam_search(model, A(SRC), BOS, 5, 10, use_cache=False, return_scores=True)
    np.testing.assert_array_equal(to_numpy(tok), to_numpy(tok2))
    assert max_abs_diff(score, score2) < TOL


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_scores_are_the_length_penalized_log_probabilities(track, alpha):
    """The returned score of each row is what teacher forcing gives for the returned tokens."""
    model, lib, A = make(track, seed=4)
    tok, score = lib.beam_search(model, A(SRC), BOS, 5, 10, alpha=alpha, return_scores=True)
    assert max_abs_diff(score, lib.sequence_scores(model, A(SRC), tok, BOS, 5, alpha)) < TOL


class RandomPrefixLM:
    """A stand-in for a Transformer with the interface decoding uses (encode, decode, decode_step, pad_id,
    tgt_vocab_size, max_len, train/eval): the next-token logits are a fixed random function of the source row and
    the whole prefix, each drawn from its own seed, eos made likely by `eos_bias`. Unlike a small random network,
    whose outputs tend to repeat one token, every prefix gets a fresh distribution: beams branch, meet eos at many
    lengths and ranks, and every rule of the search shows. `torch=True` speaks tensors (for tfm_torch)."""

    def __init__(self, vocab=7, eos=EOS, eos_bias=1.0, seed=0, max_len=10, torch=False):
        self.tgt_vocab_size, self.max_len, self.pad_id, self.training = vocab, max_len, PAD, False
        self.eos, self.eos_bias, self.seed, self.torch = eos, eos_bias, seed, torch

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def _out(self, a):
        return __import__("torch").from_numpy(a) if self.torch else a

    def encode(self, src):
        src = to_numpy(src)
        return self._out(src[..., None].astype(np.float64)), self._out((src != PAD)[:, None, None, :])

    def next_logits(self, src_row, prefix) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(src_row), *src_row, *prefix])
        logits = 2.0 * rng.standard_normal(self.tgt_vocab_size)
        logits[self.eos] += self.eos_bias
        return logits

    def decode(self, tgt, memory, src_mask):
        tgt, src = to_numpy(tgt), to_numpy(memory)[..., 0].astype(np.int64)
        B, T = tgt.shape
        out = [[self.next_logits(src[b], tgt[b, : t + 1]) for t in range(T)] for b in range(B)]
        return self._out(np.array(out))  # (B, T, V)

    def decode_step(self, tgt_new, memory, src_mask, cache):
        t0 = cache.get("length", 0)
        tokens = to_numpy(tgt_new) if t0 == 0 else np.concatenate([to_numpy(cache["tokens"]), to_numpy(tgt_new)], 1)
        cache["tokens"], cache["length"] = self._out(tokens), tokens.shape[1]  # batch-first: reorder_cache works
        return self.decode(tokens, memory, src_mask)[:, t0:]


def reference_beam_search(model, src_row, bos, eos, max_len, K, alpha):
    """The algorithm of beam_search written plainly for one source: lists of (log p, tokens), uncached, no
    batching, no -inf placeholder beams. Returns (tokens, score)."""
    beams, complete = [(0.0, [])], []
    for t in range(1, max_len + 1):
        cands = []
        for lp, toks in beams:
            logp = tn.log_softmax(model.next_logits(src_row, [bos, *toks]))
            cands += [(lp + logp[tok], [*toks, tok]) for tok in range(len(logp)) if tok != PAD]
        cands = sorted(cands, key=lambda c: -c[0])[: 2 * K]  # stable: ties keep (beam, token) order
        for lp, toks in cands[:K]:  # complete: eos among the first K; the K best complete ones are kept
            if toks[-1] == eos:
                complete = sorted([*complete, (lp / ((5 + t) / 6) ** alpha, toks)], key=lambda c: -c[0])[:K]
        beams = [c for c in cands if c[1][-1] != eos][:K]  # live: the best K without eos
        best_live = max(lp for lp, _ in beams) / ((5 + t) / 6) ** alpha
        if len(complete) >= K and complete[-1][0] >= best_live:  # done: no live beam scores better now
            break
    else:
        complete += [(lp / ((5 + max_len) / 6) ** alpha, toks) for lp, toks in beams]
    score, toks = max(complete, key=lambda c: c[0])
    return toks, score


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("K,alpha,eos_bias", [(1, 0.6, 1.0), (2, 0.6, 1.0), (4, 0.6, 1.0), (4, 0.0, -1.0),
                                              (3, 1.5, 0.0), (6, 1.0, 2.0)])  # fmt: skip
def test_beam_search_equals_a_plain_reference(track, K, alpha, eos_bias):
    """The vectorized search (B * K rows, the cache gathered from the parents) against the same algorithm written
    with lists, on a model where every prefix has its own random distribution: the same tokens and scores."""
    lib, use_torch = (tn, False) if track == "numpy" else (tt, True)
    src = np.array([[3, 4, 5], [6, 3, 0], [5, 5, 5], [4, 3, 6]])
    lengths = set()
    for seed in range(3):
        model = RandomPrefixLM(eos_bias=eos_bias, seed=seed, torch=use_torch)
        S = torch.from_numpy(src) if use_torch else src
        tok, score = lib.beam_search(model, S, BOS, EOS, 8, beam_size=K, alpha=alpha, return_scores=True)
        tok, score = to_numpy(tok), to_numpy(score)
        for b in range(len(src)):
            ref_tok, ref_score = reference_beam_search(model, src[b], BOS, EOS, 8, K, alpha)
            assert tok[b].tolist() == ref_tok + [PAD] * (tok.shape[1] - len(ref_tok)), (seed, b)
            assert abs(score[b] - ref_score) < TOL
            lengths.add(len(ref_tok))
    assert len(lengths) >= 3  # the outputs end at several lengths


class ConfidentLM(RandomPrefixLM):
    """A confident model over {pad, bos, eos, a=3, b=4}: before 6 tokens p(a) = 0.99, p(eos) = 0.006,
    p(b) = 0.004; after 6 tokens p(eos) = 0.99. Prefix + eos ranks among the 4 best candidates at every step."""

    def next_logits(self, src_row, prefix) -> np.ndarray:
        p = {3: 0.99, EOS: 0.006, 4: 0.004} if len(prefix) - 1 < 6 else {EOS: 0.99, 3: 0.006, 4: 0.004}
        logits = np.full(self.tgt_vocab_size, -1e9)
        for tok, q in p.items():
            logits[tok] = math.log(q)
        return logits

    def __call__(self, src, tgt_in):  # teacher forcing, for sequence_scores
        return self.decode(tgt_in, *self.encode(src))


@pytest.mark.parametrize("track", TRACKS)
def test_beam_does_not_stop_on_early_eos_hypotheses(track):
    """Regression: stopping once K complete hypotheses exist (fairseq's rule) returned a short early-eos output
    scoring far below greedy's "aaaaaa<eos>" on this model. Beam 4 must now score at least as well as greedy."""
    lib, use_torch = (tn, False) if track == "numpy" else (tt, True)
    model = ConfidentLM(vocab=5, max_len=20, torch=use_torch)
    src = torch.tensor([[5]]) if use_torch else np.array([[5]])
    greedy = lib.greedy_decode(model, src, BOS, EOS, 20)
    greedy_score = to_numpy(lib.sequence_scores(model, src, greedy, BOS, EOS, 0.6))[0]
    tok, score = lib.beam_search(model, src, BOS, EOS, 20, beam_size=4, alpha=0.6, return_scores=True)
    assert to_numpy(score)[0] >= greedy_score - TOL
    assert to_numpy(tok)[0].tolist() == [3] * 6 + [EOS]


def all_outputs(vocab: int, max_len: int, eos: int) -> list[list[int]]:
    """Every output a search can return: tokens other than pad and eos, then eos, at most max_len in all; or
    max_len tokens without eos (truncated)."""
    words = [t for t in range(vocab) if t not in (PAD, eos)]
    out = []
    for n in range(max_len):
        out += [[*p, eos] for p in itertools.product(words, repeat=n)]
    return out + [list(p) for p in itertools.product(words, repeat=max_len)]


@pytest.mark.parametrize("track", TRACKS)
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_a_wide_beam_is_exhaustive(track, alpha):
    """With 4 words, max_len 3 and beam 80, no candidate is ever pruned (80 = 4^2 beams x 5 tokens): the search
    must find the best of all 85 possible outputs, and beat (or tie) greedy and beam 4."""
    model, lib, A = make(track, seed=5, tgt_vocab=6)  # pad, bos, eos, 3 more: 4 words besides pad and eos
    cands = all_outputs(6, 3, EOS)
    assert len(cands) == 1 + 4 + 16 + 64
    padded = np.array([c + [PAD] * (3 - len(c)) for c in cands])  # (85, 3)
    best = []
    for b in range(len(SRC)):
        src = A(np.repeat(SRC[b : b + 1], len(cands), axis=0))
        scores = to_numpy(lib.sequence_scores(model, src, A(padded), BOS, EOS, alpha))
        best.append((scores.max(), padded[scores.argmax()]))
    tok, score = lib.beam_search(model, A(SRC), BOS, EOS, 3, beam_size=80, alpha=alpha, return_scores=True)
    np.testing.assert_allclose(to_numpy(score), [s for s, _ in best], rtol=0, atol=TOL)
    for row, (_, expected) in zip(to_numpy(tok), best, strict=True):
        np.testing.assert_array_equal(np.pad(row, (0, 3 - len(row))), expected)
    for k in (1, 4):
        _, s_k = lib.beam_search(model, A(SRC), BOS, EOS, 3, beam_size=k, alpha=alpha, return_scores=True)
        assert (to_numpy(s_k) <= to_numpy(score) + TOL).all()


# -- the two tracks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first,positional", VARIANTS, ids=VARIANT_IDS)
def test_numpy_and_torch_decode_the_same_tokens(norm_first, positional):
    m = np_model(norm_first=norm_first, positional=positional, seed=6)
    twin, S = torch_twin(m), torch.from_numpy(SRC)
    np.testing.assert_array_equal(tn.greedy_decode(m, SRC, BOS, 5, 12), tt.greedy_decode(twin, S, BOS, 5, 12).numpy())
    a, sa = tn.beam_search(m, SRC, BOS, 5, 12, return_scores=True)
    b, sb = tt.beam_search(twin, S, BOS, 5, 12, return_scores=True)
    np.testing.assert_array_equal(a, b.numpy())
    assert max_abs_diff(sa, sb) < TOL


def test_float32_models_decode():
    m = np_model(dtype=np.float32)
    out = tn.greedy_decode(m, SRC, BOS, EOS, 6)
    assert out.dtype == np.int64
    twin = tt.Transformer(**m.config, rng=0)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    tok, score = tt.beam_search(twin, torch.from_numpy(SRC), BOS, EOS, 6, return_scores=True)
    assert tok.dtype == torch.long and score.dtype == torch.float64 and math.isfinite(score.sum().item())
