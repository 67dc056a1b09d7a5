"""Splitting the model, both tracks: tensor parallelism (Megatron) and pipeline parallelism (GPipe, 1F1B) equal the
single-process model, forward and every gradient; the bytes communicated equal their formulas; the schedules'
bubbles and memory; bad input refused."""

from __future__ import annotations

import threading

import model_parallel_workers
import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.model_parallel import (
    bubble_fraction,
    check_tensor_split,
    gpipe_bubble,
    peak_in_flight,
    pipeline_schedule,
    ring_all_reduce_bytes,
    schedule_order,
    shard,
    shard_axis,
    simulate_schedule,
    stage_layers,
    tensor_parallel_payload,
    unshard,
)
from tfm_common.parallel import run_processes
from tfm_numpy import model_parallel as nmp
from tfm_numpy.parallel import Ring
from tfm_torch import model_parallel as tmp

CFG = dict(vocab_size=40, d_model=16, n_heads=4, d_ff=32, n_layers=2, max_len=16, dropout=0.0)


def tokens(B=4, T=8, seed=0):
    t = np.random.default_rng(seed).integers(0, CFG["vocab_size"], (B, T + 1))
    return t[:, :-1], t[:, 1:]


def np_gpt(dtype=np.float64, **kw):
    return tn.GPT(**{**CFG, **kw}, rng=0, dtype=dtype)


def np_reference(model, x, y):
    """The single-process loss and gradients (a copy: the model's own grads stay zero)."""
    loss_fn = tn.CrossEntropyLoss()
    logits = model(x)
    loss = float(loss_fn(logits, y))
    model.zero_grad()
    model.backward(loss_fn.backward())
    grads = {k: v.copy() for k, v in model.grads().items()}
    model.zero_grad()
    return logits, loss, grads


def joined(results, key="grads"):
    """The whole gradient from the processes' shards."""
    return {k: unshard([r[key][k] for r in results], shard_axis(k)) for k in results[0][key]}


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


def run_threads(target, world, args):
    """The workers of a tensor-parallel run as threads of this process (the ring works between threads too): the
    layer-level cases without process start-up; the model-level ones run in processes below."""
    out, errors = [None] * world, []

    def go(r):
        try:
            out[r] = target(r, world, *args)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


# -- the plumbing ---------------------------------------------------------------------------------------------------


def test_shards_join_back_and_the_axes_follow_megatron():
    w = np.arange(24.0).reshape(4, 6)
    for axis in (0, 1):
        assert np.array_equal(unshard([shard(w, axis, r, 2) for r in range(2)], axis), w)
    assert shard_axis("layers.1.ff.linear1.weight") == 0 and shard_axis("layers.1.ff.linear2.weight") == 1
    assert shard_axis("layers.0.self_attn.out_proj.weight") == 1 and shard_axis("layers.0.self_attn.k_proj.bias") == 0
    assert shard_axis("layers.0.ff.linear2.bias") is None and shard_axis("embed.weight") is None
    with pytest.raises(ValueError, match="world=3 must divide n_heads=4"):
        check_tensor_split("x", 3, n_heads=4)
    with pytest.raises(ValueError, match="world=2 must divide d_ff=5"):
        check_tensor_split("x", 2, d_ff=5)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_simulated_bubble_is_gpipes_formula_for_both_schedules(p):
    for m in (1, 2, 4, 8):
        for schedule in ("gpipe", "1f1b"):
            timeline = simulate_schedule(pipeline_schedule(p, m, schedule), 1.0, 2.0)
            assert bubble_fraction(timeline) == pytest.approx(gpipe_bubble(p, m), abs=1e-12)
            assert schedule_order(timeline) == pipeline_schedule(p, m, schedule)


def test_schedules_hold_m_or_p_minus_s_micro_batches():
    p, m = 4, 8
    assert [peak_in_flight(ops) for ops in pipeline_schedule(p, m, "gpipe")] == [m] * p
    assert [peak_in_flight(ops) for ops in pipeline_schedule(p, m, "1f1b")] == [4, 3, 2, 1]
    assert pipeline_schedule(2, 3, "1f1b")[0] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]


def test_schedule_and_stage_refusals():
    with pytest.raises(ValueError, match="micro_batches"):
        pipeline_schedule(2, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_schedule(2, 2, "interleaved")
    with pytest.raises(ValueError, match="n_stages=3 must be at most n_layers=2"):
        stage_layers(2, 3)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate_schedule([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


# -- tensor parallelism -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ff", "attention", "block"])
def test_numpy_tensor_parallel_layer_equals_the_layer_forward_and_every_gradient(kind):
    """In threads: the feed-forward, a grouped-query attention with RoPE (4 query, 2 key/value heads) and a block,
    output, input gradient and every weight gradient within 1e-12 (float64); the bytes equal the ring formula."""
    rng = np.random.default_rng(1)
    d, B, T = 16, 3, 5
    rotary = tn.RotaryEmbedding(4, 16, dtype=np.float64)
    f64 = dict(rng=0, dtype=np.float64)
    layer = {"ff": lambda: tn.PositionwiseFeedForward(d, 32, 0.0, "gelu", **f64),
             "attention": lambda: tn.GroupedQueryAttention(d, 4, 2, 0.0, rotary=rotary, **f64),
             "block": lambda: tn.GPTBlock(d, 4, 32, 0.0, activation="relu", **f64)}[kind]()  # fmt: skip
    x, dy = rng.standard_normal((B, T, d)), rng.standard_normal((B, T, d))
    args = (x,) if kind == "ff" else (x, tn.causal_mask(T))
    y = layer(*args)
    layer.zero_grad()
    dx = layer.backward(dy)
    dx = sum(dx) if isinstance(dx, tuple) else dx
    ring = Ring(2, B * T * d, np.float64)
    try:
        res = run_threads(nmp._tensor_parallel_worker, 2, (layer, x, dy, ring))
    finally:
        ring.close()
    for r in res:
        assert np.abs(r["output"] - y).max() < 1e-12 and np.abs(r["grad_input"] - dx).max() < 1e-12
    assert max_diff(joined(res), layer.grads()) < 1e-12
    n_sublayers = 2 if kind == "block" else 1
    payload = tensor_parallel_payload(B * T, d, 8) // 2 * n_sublayers
    assert res[0]["bytes_sent"] == ring_all_reduce_bytes(payload, 2) and res[0]["forward_bytes"] == payload // 2


def test_numpy_tensor_parallel_gpt_equals_the_gpt_in_two_processes_float64_and_float32():
    x, y = tokens()
    for dtype, tol, kw in ((np.float64, 1e-12, dict(n_kv_heads=2, positional="rope")), (np.float32, 1e-6, {})):
        model = np_gpt(dtype, **kw)
        logits, loss, grads = np_reference(model, x, y)
        res = nmp.tensor_parallel_run(model, x, y, world=2)
        for r in res:
            assert np.abs(r["output"] - logits).max() < tol * max(1.0, np.abs(logits).max())
            assert abs(r["loss"] - loss) < tol
        assert max_diff(joined(res), grads) < tol
        itemsize = np.dtype(dtype).itemsize
        payload = tensor_parallel_payload(x.size, CFG["d_model"], itemsize, CFG["n_layers"])
        assert [r["bytes_sent"] for r in res] == [ring_all_reduce_bytes(payload, 2)] * 2


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["float64", "float32"])
def test_torch_tensor_parallel_gpt_equals_the_gpt_on_gloo(dtype, tol):
    x, y = tokens()
    model = tt.GPT(**CFG, n_kv_heads=2, rng=0, dtype=dtype)
    load_np_into_torch(np_gpt(n_kv_heads=2), model)
    logits = model(torch.from_numpy(x))
    loss = tt.CrossEntropyLoss()(logits, torch.from_numpy(y))
    loss.backward()
    grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    res = tmp.tensor_parallel_run(model, x, y, world=2)
    scale = max(1.0, logits.abs().max().item())  # float32: relative to the largest logit, as the NumPy test
    for r in res:
        assert np.abs(r["output"] - logits.detach().numpy()).max() < tol * scale and abs(r["loss"] - loss.item()) < tol
    assert max_diff(joined(res), grads) < tol
    itemsize = torch.finfo(dtype).bits // 8
    payload = tensor_parallel_payload(x.size, CFG["d_model"], itemsize, CFG["n_layers"])
    assert [r["payload_bytes"] for r in res] == [payload] * 2 and res[0]["forward_bytes"] == payload // 2


@pytest.mark.parametrize("track", [tn, tt])
def test_tensor_parallel_refusals(track):
    mod = nmp if track is tn else tmp
    dt = np.float64 if track is tn else torch.float64
    with pytest.raises(ValueError, match="world=3 must divide n_heads=4"):
        mod.tensor_parallel(track.GPT(**CFG, rng=0, dtype=dt), 0, 3, None)
    with pytest.raises(ValueError, match="world=2 must divide n_kv_heads=1"):
        mod.tensor_parallel(track.GPT(**CFG, n_kv_heads=1, rng=0, dtype=dt), 0, 2, None)
    with pytest.raises(ValueError, match="dropout expected 0"):
        mod.tensor_parallel(track.GPT(**{**CFG, "dropout": 0.1}, rng=0, dtype=dt), 0, 2, None)
    with pytest.raises(ValueError, match="PositionwiseFeedForward"):
        mod.tensor_parallel(track.GPT(**CFG, activation="swiglu", rng=0, dtype=dt), 0, 2, None)
    with pytest.raises(ValueError, match=r"rank expected an int in \[0, 2\)"):
        mod.tensor_parallel(track.GPT(**CFG, rng=0, dtype=dt), 2, 2, None)
    with pytest.raises(ValueError, match="world=3 must divide"):
        mod.tensor_parallel_run(track.GPT(**CFG, rng=0, dtype=dt), *tokens(), world=3)


# -- pipeline parallelism ---------------------------------------------------------------------------------------------


def np_step(model, x, y, lr):
    """The single-process step: loss, gradients, and the weights after one Adam step."""
    _, loss, grads = np_reference(model, x, y)
    m = np_gpt(tie_output=False)
    m.load_state_dict(model.state_dict())
    for k, p in m.named_parameters():
        p.grad[...] = grads[k]
    tn.Adam(m.parameters(), lr=lr).step()
    return loss, grads, m.state_dict()


def merged(results, key):
    """The stages' dicts in one; without the attention key biases for the weights: a key bias adds q.b to every
    score of a row, which softmax ignores, so its exact gradient is 0 and its computed one rounding noise (~1e-18)
    that depends on the summation order; Adam's first step turns any such noise into a step of ~lr."""
    return {k: v for r in results for k, v in r[key].items() if key == "grads" or "k_proj.bias" not in k}


def test_numpy_pipeline_step_equals_the_single_process_step_gpipe_and_1f1b():
    x, y = tokens(B=4)
    model = np_gpt(tie_output=False)
    loss, grads, state = np_step(model, x, y, 1e-2)
    state = {k: v for k, v in state.items() if "k_proj.bias" not in k}
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        res = nmp.train_pipeline_step(model, x, y, micro_batches=4, schedule=schedule, lr=1e-2)
        assert abs(res[1]["loss"] - loss) < 1e-12
        assert max_diff(merged(res, "grads"), grads) < 1e-12 and max_diff(merged(res, "state"), state) < 1e-12
        assert schedule_order([r["timeline"] for r in res]) == pipeline_schedule(2, 4, schedule)
        peaks[schedule] = [r["peak_bytes"] for r in res]
        assert res[0]["bytes_sent"] == res[1]["bytes_sent"] == x.size * CFG["d_model"] * 8  # m times (B/m, T, d)
    # every micro-batch holds the same bytes: GPipe holds m = 4 of them, 1F1B p - s = 2 (stage 0) and 1 (stage 1)
    assert peaks["gpipe"][0] == 2 * peaks["1f1b"][0] and peaks["gpipe"][1] == 4 * peaks["1f1b"][1]


def test_torch_pipeline_step_equals_the_single_process_step_1f1b_on_gloo():
    x, y = tokens(B=4)
    model = tt.GPT(**CFG, tie_output=False, rng=0, dtype=torch.float64)
    load_np_into_torch(np_gpt(tie_output=False), model)
    loss, grads, state = np_step(np_gpt(tie_output=False), x, y, 1e-2)
    state = {k: v for k, v in state.items() if "k_proj.bias" not in k}
    res = tmp.train_pipeline_step(model, x, y, micro_batches=4, schedule="1f1b", lr=1e-2)
    assert abs(res[1]["loss"] - loss) < 1e-12
    assert max_diff(merged(res, "grads"), grads) < 1e-12 and max_diff(merged(res, "state"), state) < 1e-12
    assert schedule_order([r["timeline"] for r in res]) == pipeline_schedule(2, 4, "1f1b")
    assert res[0]["peak_bytes"] > res[1]["peak_bytes"] > 0  # stage 0 holds 2 micro-batches, stage 1 one


@pytest.mark.parametrize("track", [tn, tt])
def test_pipeline_step_float32_equals_the_single_process_gradients(track):
    """float32: the pipeline's loss and every gradient within 1e-6 (relative to the largest) of the single-process
    float32 gradients (the weights after Adam are left out: its first step divides noise by noise)."""
    x, y = tokens(B=4)
    ref = np_gpt(np.float32, tie_output=False)
    _, loss, grads = np_reference(ref, x, y)
    if track is tn:
        model, mod = np_gpt(np.float32, tie_output=False), nmp
    else:
        model, mod = tt.GPT(**CFG, tie_output=False, rng=0, dtype=torch.float32), tmp
        load_np_into_torch(ref, model)
    res = mod.train_pipeline_step(model, x, y, micro_batches=2, schedule="gpipe", lr=1e-2)
    assert abs(res[1]["loss"] - loss) < 1e-6 * max(1.0, abs(loss))
    scale = max(float(np.abs(g).max()) for g in grads.values())
    assert max_diff(merged(res, "grads"), grads) < 1e-6 * scale


@pytest.mark.parametrize("track", [tn, tt])
def test_pipeline_refusals(track):
    mod = nmp if track is tn else tmp
    dt = np.float64 if track is tn else torch.float64
    untied = track.GPT(**CFG, tie_output=False, rng=0, dtype=dt)
    x, y = tokens(B=4)
    with pytest.raises(ValueError, match="tie_output expected False"):
        mod.train_pipeline_step(track.GPT(**CFG, rng=0, dtype=dt), x, y)
    with pytest.raises(ValueError, match="micro_batches=3 must divide the batch size 4"):
        mod.train_pipeline_step(untied, x, y, micro_batches=3)
    with pytest.raises(ValueError, match="micro_batches"):
        mod.train_pipeline_step(untied, x, y, micro_batches=0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        mod.train_pipeline_step(untied, x, y, schedule="zero-bubble")
    with pytest.raises(ValueError, match="n_stages=3 must be at most n_layers=2"):
        mod.train_pipeline_step(untied, x, y, n_stages=3)
    with pytest.raises(ValueError, match="dropout expected 0"):
        mod.PipelineStage(track.GPT(**{**CFG, "dropout": 0.1}, tie_output=False, rng=0, dtype=dt), 0, 2)
    with pytest.raises(TypeError, match="model expected a"):
        mod.train_pipeline_step(np.zeros(3), x, y)


def test_channel_carries_arrays_both_ways_and_times_out():
    there, back = nmp.Channel(3, np.float64, 2), nmp.Channel(3, np.float64, 2)
    try:
        out, sent = run_processes(model_parallel_workers.ping_pong, 2, (there, back, 5))[0]
    finally:
        there.close()
        back.close()
    assert [o.tolist() for o in out] == [[2.0 * i] * 3 for i in range(5)] and sent == 5 * 24
    chan = nmp.Channel(3, np.float64, timeout=0.5)
    try:
        with pytest.raises(RuntimeError, match="no message within timeout=0.5"):
            run_processes(model_parallel_workers.silent, 2, (chan,), timeout=30)
    finally:
        chan.close()
