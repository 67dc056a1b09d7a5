"""A refused call changes nothing: attention checks its mask (also torch's attn_impl="sdpa", whose kernel would read
a float mask as an additive bias), the rows of a decoding cache and the tiled kernel's dropout refusal BEFORE it
projects, caches or stores anything; decode_step checks its memory and source mask before the cache grows. Both
tracks alike."""

import numpy as np
import pytest
import torch
from helpers_tracks import to_numpy

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.data import make_batches

D, H, T = 8, 2, 4
RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, T, D))
TRACKS = ["numpy", "torch"]


def lib_of(track):
    return (tn, np.asarray, np.float64) if track == "numpy" else (tt, torch.from_numpy, torch.float64)


def attention(track, kind, attn="explicit"):
    lib, _, dt = lib_of(track)
    if kind == "mha":
        return lib.MultiHeadAttention(D, H, attn_impl=attn, rng=0, dtype=dt)
    return lib.GroupedQueryAttention(D, H, n_kv_heads=1, attn_impl=attn, rng=0, dtype=dt)


def call(m, kind, x, mask=None):
    return m(x, x, x, mask) if kind == "mha" else m(x, mask)


def step(m, kind, x, cache, mask=None):
    return m.forward_step(x, x, x, cache, mask) if kind == "mha" else m.forward_step(x, cache, mask)


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("track,attn", [("numpy", "explicit"), ("torch", "explicit"), ("torch", "sdpa")])
def test_a_float_or_misshaped_mask_is_refused_by_every_attention_path(track, attn, kind):
    _, A, _ = lib_of(track)
    m = attention(track, kind, attn)
    causal = np.tril(np.ones((T, T), dtype=bool))
    with pytest.raises(TypeError, match="mask: expected a boolean"):
        call(m, kind, A(X), A(causal.astype(np.float64)))  # sdpa would add it to the scores
    with pytest.raises(ValueError, match=r"does not broadcast to the attention scores' shape \(2, 2, 4, 4\)"):
        call(m, kind, A(X), A(np.ones((3, T), dtype=bool)))


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("track", TRACKS)
def test_a_refused_step_leaves_the_cache_as_it_was(track, kind):
    _, A, _ = lib_of(track)
    m = attention(track, kind).eval()
    cache = {}
    step(m, kind, A(X[:, :1]), cache)
    length = cache["k"].shape[2]
    with pytest.raises(ValueError, match="does not broadcast"):
        step(m, kind, A(X[:, 1:2]), cache, A(np.ones((2, 1, 1, 5), dtype=bool)))  # 5 keys, not 2
    assert cache["k"].shape[2] == length  # not grown by the refused step
    with pytest.raises(ValueError, match="the cache holds 2 rows, the input has 1"):
        step(m, kind, A(X[:1, 1:2]), cache)
    assert cache["k"].shape[2] == length
    step(m, kind, A(X[:, 1:2]), cache)  # the search goes on
    assert cache["k"].shape[2] == length + 1


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_numpy_a_refused_forward_leaves_the_last_forward_to_its_backward(kind):
    m = attention("numpy", kind)
    g = RNG.standard_normal(X.shape)

    def grads():
        return {k: v.copy() for k, v in m.grads().items()}

    m.zero_grad()
    call(m, kind, X)
    m.backward(g)
    expected = grads()
    m.zero_grad()
    call(m, kind, X)
    with pytest.raises(ValueError, match="does not broadcast"):
        call(m, kind, 2 * X, np.ones((3, T), dtype=bool))  # refused before the projections cache 2 X
    m.backward(g)
    assert all(np.array_equal(v, expected[k]) for k, v in grads().items())


@pytest.mark.parametrize("track", TRACKS)
def test_a_refused_decode_step_leaves_the_cache_as_it_was(track):
    lib, A, dt = lib_of(track)
    model = lib.Transformer(9, 9, d_model=D, n_heads=H, d_ff=16, n_layers=2, dropout=0.0, max_len=8, rng=0, dtype=dt)
    model.eval()
    src, tgt = A(np.array([[3, 4, 5], [6, 7, 8]])), A(np.array([[1, 4, 5], [1, 6, 2]]))
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = {}
        model.decode_step(tgt[:, :1], memory, src_mask, cache)
        before = (cache["length"], cache["keep"].shape, cache["layers"][0]["self_attn"]["k"].shape)
        for bad_memory, bad_mask, error in ((memory[..., :4], src_mask, ValueError),
                                            (memory, src_mask[..., :2], ValueError),
                                            (memory, A(np.ones((2, 1, 1, 3))), TypeError)):  # fmt: skip
            with pytest.raises(error):
                model.decode_step(tgt[:, 1:2], bad_memory, bad_mask, cache)
            assert (cache["length"], cache["keep"].shape, cache["layers"][0]["self_attn"]["k"].shape) == before
        step = model.decode_step(tgt[:, 1:2], memory, src_mask, cache)  # the search goes on, and is right
        full = model.decode(tgt[:, :2], memory, src_mask)
    diff = np.abs(np.asarray(step[:, 0]) - np.asarray(full[:, -1])).max()
    assert diff < 1e-12


@pytest.mark.parametrize("track", TRACKS)
def test_a_refused_load_state_dict_changes_nothing(track):
    """torch's own load copies every matching entry before it raises; both tracks now check first, with the same
    errors, and a NumPy state_dict loads into the torch model as it is."""
    lib, A, dt = lib_of(track)
    model = lib.Transformer(9, 9, d_model=D, n_heads=H, d_ff=16, n_layers=1, max_len=8, rng=0, dtype=dt)
    before = {k: to_numpy(v).copy() for k, v in model.state_dict().items()}
    other = tn.Transformer(9, 9, d_model=D, n_heads=H, d_ff=16, n_layers=1, max_len=8, rng=1, dtype=np.float64)
    new = other.state_dict()  # NumPy arrays, for either track
    last = list(new)[-1]
    for bad, error, match in ((new | {last: np.zeros(3)}, ValueError, f"'{last}' expected shape"),
                              ({k: v for k, v in new.items() if k != last}, KeyError, "missing keys"),
                              (new | {"extra.weight": np.zeros(3)}, KeyError, "unexpected keys")):  # fmt: skip
        with pytest.raises(error, match=match):
            model.load_state_dict(bad)
        assert all(np.array_equal(to_numpy(v), before[k]) for k, v in model.state_dict().items())
    model.load_state_dict(new)
    assert all(np.array_equal(to_numpy(v), new[k]) for k, v in model.state_dict().items())


GPT_SIZES = dict(vocab_size=11, d_model=D, n_heads=H, d_ff=16, n_layers=1, max_len=8)
WINDOWS = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])


@pytest.mark.parametrize("track", TRACKS)
def test_lm_train_step_refuses_a_non_finite_step_and_changes_nothing(track):
    """As train_step: a NaN loss or gradient raises before clipping, the lr, Adam's moments or its step count."""
    lib, A, dt = lib_of(track)
    model = lib.GPT(**GPT_SIZES, rng=0, dtype=dt)
    opt, loss_fn = lib.make_adam(model, lr=1e-2), lib.CrossEntropyLoss()
    lib.lm_train_step(model, A(WINDOWS[:, :-1]), A(WINDOWS[:, 1:]), opt, loss_fn, 1e-2)
    with torch.no_grad():
        weight = model.embed.weight
        (weight.data if track == "numpy" else weight)[3, 0] = np.inf  # token 3's embedding: the loss is NaN
    before = {k: to_numpy(v).copy() for k, v in model.state_dict().items()}
    steps = opt.step_count if track == "numpy" else opt.state[weight]["step"].item()
    with np.errstate(all="ignore"), pytest.raises(FloatingPointError, match="not finite, so the update was not"):
        lib.lm_train_step(model, A(WINDOWS[:, :-1]), A(WINDOWS[:, 1:]), opt, loss_fn, 1e-2)  # inf - inf: NaN
    after = {k: to_numpy(v) for k, v in model.state_dict().items()}
    assert all(np.array_equal(after[k], v) for k, v in before.items())  # inf stays inf, nothing became NaN
    assert steps == (opt.step_count if track == "numpy" else opt.state[weight]["step"].item())


@pytest.mark.parametrize("track", TRACKS)
def test_an_optimizer_made_for_another_model_is_refused(track):
    """The notebook mistake: the model cell run again, the optimizer cell not. The old optimizer would step the old
    model's parameters and this one would never move; the step functions say so instead."""
    lib, A, dt = lib_of(track)
    old = lib.GPT(**GPT_SIZES, rng=0, dtype=dt)
    opt = lib.make_adam(old)
    model = lib.GPT(**GPT_SIZES, rng=0, dtype=dt)  # rebuilt
    with pytest.raises(ValueError, match=r"lm_train_step: \d+ of the optimizer's \d+ parameters are not this model's"):
        lib.lm_train_step(model, A(WINDOWS[:, :-1]), A(WINDOWS[:, 1:]), opt, lib.CrossEntropyLoss(), 1e-2)
    tr = lib.Transformer(9, 9, d_model=D, n_heads=H, d_ff=16, n_layers=1, max_len=8, rng=0, dtype=dt)
    batch = make_batches([([3, 4, 5], [6, 7])], 1, shuffle=False)[0]
    for step in (lib.train_step, lib.train_step_accumulated):
        arg = batch if step is lib.train_step else [batch]
        with pytest.raises(ValueError, match="parameters are not this model's"):
            step(tr, arg, lib.make_adam(lib.Transformer(9, 9, d_model=D, n_heads=H, d_ff=16, n_layers=1, max_len=8,
                                                        rng=0, dtype=dt)), lib.CrossEntropyLoss(), 1e-2)  # fmt: skip


@pytest.mark.parametrize("search", ["sequence_scores", "greedy_uncached", "beam_uncached"])
def test_numpy_backward_after_a_search_is_refused_not_wrong(search):
    """A search's forwards (eval mode) overwrite the caches of the training forward before it: a backward after it
    would differentiate the search's last forward. It is refused instead, as after GPT.generate."""
    model = tn.Transformer(9, 9, d_model=D, n_heads=H, d_ff=16, n_layers=1, dropout=0.3, max_len=8, rng=0)
    src, tgt = np.array([[3, 4, 5], [6, 7, 8]]), np.array([[1, 4, 5], [1, 6, 2]])
    logits = model(src, tgt)
    run = {"sequence_scores": lambda: tn.sequence_scores(model, src, tgt[:, 1:], 1, 2),
           "greedy_uncached": lambda: tn.greedy_decode(model, src, 1, 2, 4, use_cache=False),
           "beam_uncached": lambda: tn.beam_search(model, src, 1, 2, 4, beam_size=2, use_cache=False)}  # fmt: skip
    run[search]()
    assert model.training  # the caller's mode is back
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward(np.ones_like(logits))


def test_bpe_decode_refuses_a_batch_with_a_clear_message():
    from tfm_common.bpe import ByteBPE

    bpe = ByteBPE.train("abab abab", 260)
    ids = bpe.encode("abab")
    assert bpe.decode(np.array(ids)) == bpe.decode(torch.tensor(ids)) == "abab"
    for batch in (np.array([ids]), torch.tensor([ids])):  # what generate() returns: (B, T)
        with pytest.raises(ValueError, match=r"expected one sequence \(1-D\), got shape \(1, \d+\); decode each row"):
            bpe.decode(batch)


@pytest.mark.parametrize("track", TRACKS)
def test_a_gpt_block_called_directly_refuses_what_its_norm_and_attention_refuse(track):
    lib, A, dt = lib_of(track)
    block = lib.GPTBlock(D, H, 16, n_kv_heads=1, rng=0, dtype=dt).eval()
    causal = A(np.tril(np.ones((T, T), dtype=bool)))
    with pytest.raises(ValueError, match="LayerNorm"):
        block(A(X[..., :-1]), causal)  # d_model - 1 features
    with pytest.raises(TypeError, match="mask: expected a boolean"):
        block(A(X), A(np.ones((T, T))))
    with pytest.raises(ValueError, match="does not broadcast"):
        block(A(X), A(np.ones((3, T), dtype=bool)))
    cache = {}
    block.forward_step(A(X[:, :1]), cache)
    with pytest.raises(ValueError, match="LayerNorm"):
        block.forward_step(A(X[:, 1:2, :-1]), cache)
    with pytest.raises(ValueError, match="does not broadcast"):
        block.forward_step(A(X[:, 1:2]), cache, A(np.ones((2, 1, 1, 5), dtype=bool)))  # 5 keys, not 2
    with pytest.raises(ValueError, match="the cache holds 2 rows, the input has 1"):
        block.forward_step(A(X[:1, 1:2]), cache)
