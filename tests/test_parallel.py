"""Past one device, both tracks: gradient accumulation and activation recomputation, each equal to the single-device
(single-batch, cached) run; bad input."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import parallel_workers
import pytest
import torch
from helpers_tracks import load_np_into_torch, max_abs_diff

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.data import SYMBOLS, Batch, Vocab, encode_pairs, make_batches, reverse_task
from tfm_common.parallel import run_processes, split_batch

VOCAB = Vocab(SYMBOLS[:8])
TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=32)


def batches(n=64, batch_size=16, seed=0) -> list[Batch]:
    pairs = reverse_task(n, 1, 9, 8, rng=seed)  # lengths 1..9: much padding, unequal tokens per micro-batch
    return make_batches(encode_pairs(pairs, VOCAB, VOCAB), batch_size, rng=seed, sort_by_length=False)


def np_model(dtype=np.float64, dropout=0.0, seed=0, **kw):
    return tn.Transformer(len(VOCAB), len(VOCAB), **{**TINY, **kw}, dropout=dropout, rng=seed, dtype=dtype)


def torch_twin(m, dtype=torch.float64, dropout=0.0, **kw):
    t = tt.Transformer(len(VOCAB), len(VOCAB), **{**TINY, **kw}, dropout=dropout, rng=1, dtype=dtype)
    load_np_into_torch(m, t)
    return t


def loss_fn(track, smoothing=0.1):
    return track.CrossEntropyLoss(ignore_index=0, label_smoothing=smoothing)


def max_param_diff(a, b, key_bias: bool = False) -> float:
    """The largest weight difference; without the attention key biases unless key_bias. A key bias adds q.b to
    every score of a row, which softmax ignores: its exact gradient is 0 and its computed one rounding noise
    (~1e-18) that differs with the summation order; Adam (eps 1e-9) turns that into steps of ~lr * 1e-9."""
    sa, sb = a.state_dict(), b.state_dict()
    return max(max_abs_diff(v, sb[k]) for k, v in sa.items() if key_bias or "k_proj.bias" not in k)


def max_grad_diff(a, b) -> float:
    ga = a.grads() if isinstance(a, tn.Module) else {k: p.grad for k, p in a.named_parameters()}
    gb = b.grads() if isinstance(b, tn.Module) else {k: p.grad for k, p in b.named_parameters()}
    return max(max_abs_diff(v, gb[k]) for k, v in ga.items())


# -- gradient accumulation ------------------------------------------------------------------------------------------


def test_split_batch_keeps_every_row_and_token_and_trims_padding():
    b = batches()[0]
    parts = split_batch(b, 3)
    assert [len(p) for p in parts] == [6, 5, 5]
    assert sum(p.n_tokens for p in parts) == b.n_tokens
    assert len({p.n_tokens for p in parts}) > 1  # the micro-batches hold different numbers of tokens
    for p, rows in zip(parts, np.array_split(np.arange(len(b)), 3), strict=True):
        assert np.array_equal(p.tgt_out, b.tgt_out[rows, : p.tgt_out.shape[1]])
        assert (b.tgt_out[rows, p.tgt_out.shape[1] :] == 0).all()  # only padding was cut
        assert (p.tgt_out[:, -1] != 0).any() and (p.src[:, -1] != 0).any()


@pytest.mark.parametrize("k", [2, 4, 16])
def test_accumulated_gradient_equals_the_full_batch_gradient_numpy_and_torch(k):
    """k micro-batches weighted by tokens: the same loss, gradients and update as one batch, float64."""
    b = batches()[0]
    for track, make in ((tn, np_model), (tt, lambda: torch_twin(np_model()))):
        full, acc = make(), make()
        acc.load_state_dict(full.state_dict())
        r_full = track.train_step(full, b, track.make_adam(full), loss_fn(track), 1e-2)
        r_acc = track.train_step_accumulated(acc, split_batch(b, k), track.make_adam(acc), loss_fn(track), 1e-2)
        assert abs(r_full.loss - r_acc.loss) < 1e-12 and abs(r_full.grad_norm - r_acc.grad_norm) < 1e-12
        assert max_grad_diff(full, acc) < 1e-12  # measured ~1e-16
        assert max_param_diff(full, acc) < 1e-12 and max_param_diff(full, acc, key_bias=True) < 1e-8


def test_normalizing_by_micro_batches_is_wrong_with_padding():
    """Weighting each micro-batch by 1/k (not n_i/N) changes the gradient when the token counts differ."""
    b = batches()[0]
    m1, m2 = np_model(), np_model()
    tn.train_step_accumulated(m1, split_batch(b, 4), tn.make_adam(m1), loss_fn(tn), 1e-2)
    r = tn.train_step_accumulated(m2, split_batch(b, 4), tn.make_adam(m2), loss_fn(tn), 1e-2, normalize="micro_batches")
    m3 = np_model()
    r_full = tn.train_step(m3, b, tn.make_adam(m3), loss_fn(tn), 1e-2)
    assert abs(r.grad_norm - r_full.grad_norm) > 1e-4
    assert max_param_diff(m1, m2) > 1e-6


def test_train_with_accumulate_gives_the_same_history_and_weights_both_tracks():
    data = batches()
    for track, make in ((tn, np_model), (tt, lambda: torch_twin(np_model()))):
        a, b = make(), make()
        kw = dict(steps=6, warmup=4, progress=False)
        h1 = track.train(a, data, track.make_adam(a), **kw)
        h2 = track.train(b, data, track.make_adam(b), accumulate=3, **kw)
        assert max(abs(x - y) for x, y in zip(h1.loss, h2.loss, strict=True)) < 1e-12
        assert max_param_diff(a, b) < 1e-12 and max_param_diff(a, b, key_bias=True) < 1e-8


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_accumulation_bad_input(track):
    b = batches()[0]
    m = np_model() if track is tn else torch_twin(np_model())
    with pytest.raises(ValueError, match="k expected at most the batch size 16, got 17"):
        track.split_batch(b, 17)
    with pytest.raises(TypeError, match="k expected an int"):
        track.split_batch(b, 2.0)
    with pytest.raises(TypeError, match="micro_batches expected a non-empty list"):
        track.train_step_accumulated(m, [], track.make_adam(m), loss_fn(track), 1e-2)
    with pytest.raises(ValueError, match="normalize must be one of"):
        track.train_step_accumulated(m, [b], track.make_adam(m), loss_fn(track), 1e-2, normalize="rows")
    with pytest.raises(ValueError, match="accumulate"):
        track.train(m, [b], track.make_adam(m), steps=1, accumulate=0, progress=False)


# -- activation recomputation -------------------------------------------------------------------------------------


def np_grads(model, b, seed_dropout=None):
    model.zero_grad()
    logits = model(b.src, b.tgt_in)
    lf = loss_fn(tn)
    lf(logits, b.tgt_out)
    model.backward(lf.backward())
    return {k: v.copy() for k, v in model.grads().items()}


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_recompute_numpy_gives_the_cached_gradients_bit_for_bit(norm_first, dropout):
    b = batches()[0]
    cached, rec = np_model(dropout=dropout, norm_first=norm_first), np_model(dropout=dropout, norm_first=norm_first)
    tn.recompute(rec)
    assert list(rec.state_dict()) == list(cached.state_dict())  # keys unchanged
    assert isinstance(rec.encoder.layers[0], tn.Recompute)
    for _ in range(2):  # twice: the dropout generators continue as in the cached run
        g1, g2 = np_grads(cached, b), np_grads(rec, b)
        assert g1.keys() == g2.keys()
        assert all(np.array_equal(g1[k], g2[k]) for k in g1)
    rec(b.src, b.tgt_in)
    assert rec.encoder.layers[0].self_attn._cache is None  # dropped by forward, rebuilt and dropped by backward
    tn.recompute(rec, enabled=False)
    assert not isinstance(rec.encoder.layers[0], tn.Recompute)


def test_recompute_numpy_refuses_a_second_backward():
    layer = tn.Recompute(tn.Linear(4, 3, rng=0, dtype=np.float64))
    y = layer(np.ones((2, 4)))
    layer.backward(np.ones_like(y))
    with pytest.raises(RuntimeError, match="called twice"):
        layer.backward(np.ones_like(y))
    with pytest.raises(TypeError, match="Recompute: module expected"):
        tn.Recompute(layer)
    with pytest.raises(TypeError, match="enabled expected True or False"):
        tn.recompute(np_model(), enabled=1)


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_recompute_torch_gives_the_cached_gradients(dropout):
    b = batches()[0]
    src, tgt_in, tgt_out = (torch.from_numpy(a) for a in (b.src, b.tgt_in, b.tgt_out))
    m = np_model()
    cached, rec = torch_twin(m, dropout=dropout), torch_twin(m, dropout=dropout)
    tt.recompute(rec)
    assert all(isinstance(layer, tt.Recompute) for layer in (*rec.encoder.layers, *rec.decoder.layers))
    assert list(rec.state_dict()) == list(cached.state_dict())
    for _ in range(2):
        grads = []
        for model in (cached, rec):
            model.zero_grad(set_to_none=True)
            loss_fn(tt)(model(src, tgt_in), tgt_out).backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        assert grads[0].keys() == grads[1].keys()
        assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    tt.recompute(rec, enabled=False)
    assert not isinstance(rec.encoder.layers[0], tt.Recompute)


# -- data parallelism: worker processes, the NumPy ring, DDP on gloo ------------------------------------------------


def test_ring_collectives_in_three_processes():
    rng = np.random.default_rng(0)
    world, n = 3, 10  # chunks of 4, 3, 3 elements
    xs = [rng.standard_normal(n) for _ in range(world)]
    ring = tn.Ring(world, n)
    try:
        out = run_processes(parallel_workers.ring, world, (ring, xs), timeout=60)
    finally:
        ring.close()
    total = sum(xs)
    for rank, (shard, gathered, reduced, sent) in enumerate(out):
        assert np.allclose(shard, np.array_split(total, world)[rank], rtol=0, atol=1e-14)
        assert np.allclose(gathered, total, rtol=0, atol=1e-14) and np.allclose(reduced, total, rtol=0, atol=1e-14)
        assert sent > 0
    assert all(np.array_equal(o[2], out[0][2]) for o in out)  # every worker holds the very same sum
    # each worker sends (W - 1) chunks in reduce-scatter and in all-gather: twice in the first two collectives
    assert sum(o[3] for o in out) == 2 * 2 * (world - 1) * n * 8
    assert tn.ring_bytes(n * 8 * world, world) == 2 * (world - 1) * n * 8


def test_run_processes_stops_every_worker_on_failure_and_timeout():
    with pytest.raises(RuntimeError, match="(?s)worker 1 failed:.*worker one fails"):
        run_processes(parallel_workers.failing, 2, timeout=60)
    assert mp.active_children() == []
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=1.0"):
        run_processes(parallel_workers.sleeping, 2, timeout=1.0)
    assert time.monotonic() - start < 30 and mp.active_children() == []


@pytest.mark.parametrize("zero", [False, True], ids=["replicated", "zero"])
def test_numpy_data_parallel_equals_one_process(zero):
    """Two workers with the ring (and with ZeRO: sharded optimizer) give the weights of one process, float64."""
    data = batches()[:3]
    model, ref = np_model(), np_model()
    out = tn.train_data_parallel(model, data, world=2, lr=1e-2, zero=zero, timeout=120)
    opt = tn.Adam(ref.parameters(), lr=1e-2)
    losses = [tn.train_step(ref, b, opt, loss_fn(tn, 0.0), 1e-2).loss for b in data]
    for o in out:
        assert max_param_diff(ref, _FromState(o["state"])) < 1e-12  # measured ~1e-16
        assert max_param_diff(ref, _FromState(o["state"]), key_bias=True) < 1e-8
    assert np.allclose(np.sum([o["losses"] for o in out], axis=0), losses, rtol=0, atol=1e-12)
    n_bytes = ref.num_parameters() * 8
    assert all(o["bytes_sent"] == 3 * tn.ring_bytes(n_bytes, 2) for o in out)  # per step: 2 (W-1)/W of the grads
    moments = 2 * n_bytes // (2 if zero else 1)  # Adam's m and v: all of them, or this worker's half (ZeRO)
    assert [o["optimizer_bytes"] for o in out] == [moments, moments]


class _FromState:
    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


def test_torch_ddp_on_gloo_equals_one_process():
    """DistributedDataParallel, 2 processes, gloo on this CPU, DistributedSampler: after 2 steps the weights of a
    single process trained on the same global batches (float64). Time-limited; no process is left behind."""
    ids = encode_pairs(reverse_task(32, 1, 9, 8, rng=0), VOCAB, VOCAB)
    m = np_model()
    model, ref = torch_twin(m), torch_twin(m)
    start = time.monotonic()
    out = tt.train_ddp(model, ids, batch_size=4, steps=2, world=2, lr=1e-2, timeout=90)
    assert time.monotonic() - start < 90 and mp.active_children() == []
    assert len(out) == 2  # one result per process: the checks below are not over an empty list
    opt = tt.make_adam(ref, lr=1e-2)
    for step in tt.sampler_batches(len(ids), 4, 2, 2):
        b = make_batches([ids[i] for r in step for i in r], 8, shuffle=False, sort_by_length=False)[0]
        tt.train_step(ref, b, opt, loss_fn(tt, 0.0), 1e-2)
    for o in out:
        assert max_param_diff(ref, _FromState(o["state"])) < 1e-12
        assert max_param_diff(ref, _FromState(o["state"]), key_bias=True) < 1e-8
    n_bytes = sum(p.numel() * 8 for p in ref.parameters())
    assert all(sum(o["bucket_bytes"]) == 2 * n_bytes for o in out)  # every gradient all-reduced once per step


# -- mixed precision ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_to_half_rounds_as_torch_does(half):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-9, 9, 1000), [7e4, -7e4, 0.0, 1e-9]])
    x = x.astype(np.float32)
    ours, theirs = tn.to_half(x, half), tt.to_half(torch.from_numpy(x), half).numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert np.isinf(ours[-4]) == (half == "float16")  # 70000 overflows float16, not bfloat16
    assert ours.dtype == np.float32 and np.array_equal(tn.to_half(ours, half), ours)  # already representable


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_loss_scaler_follows_torch_gradscaler_rule(track):
    found = [False, False, True, False, False, False, True, True, False, False, False, False]
    ours = track.LossScaler(init_scale=1024.0, growth_interval=3)
    scale, tracker = torch.tensor([1024.0]), torch.tensor([0], dtype=torch.int32)
    for f in found:
        ours.update(f)
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(f)]), 2.0, 0.5, 3)
        assert ours.scale == scale.item() and ours.good_steps == tracker.item()
    assert ours.overflows == 3
    with pytest.raises(ValueError, match="backoff must be in"):
        track.LossScaler(backoff=2.0)


@pytest.mark.parametrize("track", [tn, tt], ids=["numpy", "torch"])
def test_mixed_step_skips_on_overflow_and_otherwise_tracks_float32(track):
    data = batches()
    m32 = np_model(dtype=np.float32)
    make = (lambda: np_model(dtype=np.float32)) if track is tn else (lambda: torch_twin(m32, dtype=torch.float32))
    model, ref = make(), make()
    opt, opt_ref = track.make_adam(model), track.make_adam(ref)
    scaler = track.LossScaler(init_scale=2.0**40)  # float16 gradients overflow at once
    before = {k: v.clone() if track is tt else v.copy() for k, v in model.state_dict().items()}
    r = track.train_step_mixed(model, data[0], opt, loss_fn(track), 1e-2, scaler, "float16")
    assert r.skipped and scaler.scale == 2.0**39 and scaler.overflows == 1
    assert all((model.state_dict()[k] == v).all() for k, v in before.items())  # nothing changed
    scaler = track.LossScaler(init_scale=2.0**10)
    for b in data:
        r = track.train_step_mixed(model, b, opt, loss_fn(track), 1e-2, scaler, "float16")
        r_ref = track.train_step(ref, b, opt_ref, loss_fn(track), 1e-2)
        # float16 storage: close, not equal (measured: losses within 7e-4). The norm is of the unscaled gradients:
        # Adam hides a missing unscale in the losses (it divides by the gradients' scale), the norm does not.
        assert not r.skipped and abs(r.loss - r_ref.loss) < 5e-3
        assert abs(r.grad_norm - r_ref.grad_norm) < 0.05 * r_ref.grad_norm
    with pytest.raises(TypeError, match="float32 master weights"):
        m64 = np_model() if track is tn else torch_twin(np_model())
        track.train_step_mixed(m64, data[0], track.make_adam(m64), loss_fn(track), 1e-2)
    with pytest.raises(ValueError, match="half must be one of"):
        track.train_step_mixed(model, data[0], opt, loss_fn(track), 1e-2, half="float8")


def test_torch_fsdp_fully_shard_on_gloo_equals_one_process():
    """FSDP2 (`fully_shard`) on gloo, CPU: the same weights as one process; each rank holds half of the parameters
    and of Adam's moments."""
    ids = encode_pairs(reverse_task(32, 1, 9, 8, rng=0), VOCAB, VOCAB)
    m = np_model()
    model, ref = torch_twin(m), torch_twin(m)
    out = tt.train_ddp(model, ids, batch_size=4, steps=2, world=2, lr=1e-2, shard=True, timeout=90)
    assert mp.active_children() == []
    opt = tt.make_adam(ref, lr=1e-2)
    for step in tt.sampler_batches(len(ids), 4, 2, 2):
        b = make_batches([ids[i] for r in step for i in r], 8, shuffle=False, sort_by_length=False)[0]
        tt.train_step(ref, b, opt, loss_fn(tt, 0.0), 1e-2)
    n_bytes = sum(p.numel() * 8 for p in ref.parameters())
    for o in out:
        assert max_param_diff(ref, _FromState(o["state"])) < 1e-12
        assert max_param_diff(ref, _FromState(o["state"]), key_bias=True) < 1e-8
        assert o["optimizer_bytes"] < 2 * n_bytes and o["param_bytes"] < n_bytes  # sharded: about half each
    assert sum(o["param_bytes"] for o in out) == n_bytes and sum(o["optimizer_bytes"] for o in out) == 2 * n_bytes


def test_mixed_steps_agree_across_tracks():
    """The same emulated float16 steps in both tracks: the same losses to float32 rounding, the same scale."""
    data = batches()[:4]
    m_np = np_model(dtype=np.float32)
    m_t = torch_twin(m_np, dtype=torch.float32)
    s_np, s_t = tn.LossScaler(growth_interval=2), tt.LossScaler(growth_interval=2)
    o_np, o_t = tn.make_adam(m_np), tt.make_adam(m_t)
    for b in data:
        r_np = tn.train_step_mixed(m_np, b, o_np, loss_fn(tn), 1e-3, s_np, "float16")
        r_t = tt.train_step_mixed(m_t, b, o_t, loss_fn(tt), 1e-3, s_t, "float16")
        assert abs(r_np.loss - r_t.loss) < 1e-4 and abs(r_np.grad_norm - r_t.grad_norm) < 1e-3 * r_np.grad_norm
        assert (r_np.skipped, r_np.scale) == (r_t.skipped, r_t.scale)
