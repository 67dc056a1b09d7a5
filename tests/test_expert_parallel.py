"""Expert parallelism (chapter 20d): the all-to-all in both tracks, the dispatch bookkeeping, and a MoE layer whose
experts live on 2 processes equal to the single-process layer, forward and every gradient (float64 1e-12, float32
1e-6); the bytes each exchange sends equal their formula; a skewed router loads one process. Few process launches
(one NumPy all-to-all, one NumPy layer, one torch group for every torch check); the rest runs workers as threads."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import tempfile
import threading

import expert_parallel_workers as workers
import numpy as np
import pytest
import torch

import tfm_numpy.expert_parallel as nep
import tfm_torch.expert_parallel as tep
from tfm_common.expert_parallel import (
    all_to_all_bytes,
    balanced_all_to_all_bytes,
    check_expert_split,
    device_load,
    dispatch_plan,
    expert_owner,
    receive_plan,
)
from tfm_common.moe import route
from tfm_common.parallel import run_processes
from tfm_numpy.moe import MoEFeedForward as NumpyMoE
from tfm_torch.moe import MoEFeedForward as TorchMoE

D, D_FF, E, K = 8, 16, 4, 2


def numpy_moe(dtype=np.float64, **kw):
    kw = {"aux_loss_coef": 0.0, "z_loss_coef": 0.0, "rng": 0, **kw}
    return NumpyMoE(D, D_FF, E, K, dtype=dtype, **kw)


def torch_moe(moe: NumpyMoE, dtype=torch.float64) -> TorchMoE:
    twin = TorchMoE(D, D_FF, E, moe.top_k, capacity_factor=moe.capacity_factor, aux_loss_coef=moe.aux_loss_coef,
                    z_loss_coef=moe.z_loss_coef, rng=0, dtype=dtype)  # fmt: skip
    twin.load_state_dict(moe.state_dict())
    return twin


def inputs(dtype=np.float64, shape=(4, 5, D), seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def threads(moe, x, dy, world=2):
    """expert_parallel_step in `world` threads of this process (the same shared memory and barriers)."""
    xs, dys = np.array_split(x, world), np.array_split(dy, world)
    a2a, ring = nep.exchanges_for(moe, xs, world)
    out = [None] * world

    def work(r):
        try:
            out[r] = nep.expert_parallel_step(moe, xs[r], dys[r], r, world, a2a, ring)
        except BaseException:
            a2a.barrier.abort()  # the others stop waiting for this one
            ring.barrier.abort()
            raise

    ts = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
    finally:
        a2a.close()
        ring.close()
    assert all(o is not None for o in out)
    return out


def numpy_reference(moe, x, dy):
    y = moe(x)
    dx = moe.backward(dy)
    return y, dx, moe.grads(), moe.routing


def assert_equal_to_one_process(out, y, dx, grads, tol):
    """Outputs and dL/dx row for row; every parameter's gradient, each from the process that holds it, once."""
    assert np.abs(np.concatenate([o["y"] for o in out]) - y).max() <= tol * max(1.0, np.abs(y).max())
    assert np.abs(np.concatenate([o["dx"] for o in out]) - dx).max() <= tol * max(1.0, np.abs(dx).max())
    held = [k for o in out for k in o["grads"] if k != "router.weight"]
    assert sorted(held) == sorted(k for k in grads if k != "router.weight")  # each expert on exactly one process
    for o in out:
        assert set(o["grads"]) == {"router.weight", *(k for k in o["grads"] if k.startswith("experts."))}
        for k, g in o["grads"].items():
            assert np.abs(g - grads[k]).max() <= tol * max(1.0, np.abs(grads[k]).max()), k


def expected_exchanges(routing, n_tokens, world, row_bytes):
    """Bytes each process sends in dispatch, combine, and the backward's two: from the single-process routing."""
    experts, keep = routing.experts, routing.keep
    cuts = np.cumsum([len(a) for a in np.array_split(np.arange(n_tokens), world)])[:-1]
    plans = [dispatch_plan(e, k, E, world) for e, k in zip(np.split(experts, cuts), np.split(keep, cuts), strict=True)]
    sent = [all_to_all_bytes(p.send_counts, r, row_bytes) for r, p in enumerate(plans)]
    back = [sum(int(p.send_counts[r]) for s, p in enumerate(plans) if s != r) * row_bytes for r in range(world)]
    return [[sent[r], back[r], sent[r], back[r]] for r in range(world)]


# -- bookkeeping ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [None, 3, 5])
def test_dispatch_plan_is_the_routers_service_order(capacity):
    """The send buffer is route's groups concatenated (expert by expert, each in service order); inverse finds
    every kept assignment's row, -1 for a dropped one; send_counts are the owners' blocks."""
    probs = np.random.default_rng(0).dirichlet(np.ones(E), size=11)
    routing = route(probs, K, capacity)
    plan = dispatch_plan(routing.experts, routing.keep, E, 2)
    assert np.array_equal(plan.tokens, np.concatenate([t for t, _ in routing.groups]))
    assert np.array_equal(plan.slots, np.concatenate([s for _, s in routing.groups]))
    assert np.array_equal(plan.expert_counts, routing.kept)
    n, j = np.nonzero(routing.keep)
    assert np.array_equal(plan.tokens[plan.inverse[n, j]], n) and np.array_equal(plan.slots[plan.inverse[n, j]], j)
    assert (plan.inverse[~routing.keep] == -1).all() and plan.send_counts.sum() == routing.keep.sum()
    assert np.array_equal(plan.send_counts, device_load(routing.kept, 2))
    owners = expert_owner(routing.experts[plan.tokens, plan.slots], E, 2)
    assert np.array_equal(owners, np.repeat([0, 1], plan.send_counts))  # contiguous blocks, process 0's first


def test_receive_plan_groups_rows_by_local_expert_and_back():
    counts = np.array([[2, 0, 1], [1, 3, 0]])  # source s sent counts[s, j] rows for local expert j
    rows = np.arange(7)
    local = np.array([0, 0, 2, 0, 1, 1, 1])  # each received row's expert, in received order
    plan = receive_plan(counts)
    assert np.array_equal(local[plan.order], np.sort(local)) and np.array_equal(plan.order, [0, 1, 3, 4, 5, 6, 2])
    assert np.array_equal(rows[plan.order][plan.inverse], rows)
    assert plan.expert_counts.tolist() == [3, 3, 1] and plan.recv_counts.tolist() == [3, 4]


def test_byte_formulas():
    counts = np.array([3, 5, 0])
    assert all_to_all_bytes(counts, 1, 64) == 3 * 64 and all_to_all_bytes(counts, 2, 64) == 8 * 64
    # an even router: every expert gets N k / E rows from each process; (W-1)/W of them leave
    n_tokens, world = 12, 2
    even = np.full(E, n_tokens * K // E)
    assert all_to_all_bytes(device_load(even, world), 0, D * 8) == balanced_all_to_all_bytes(n_tokens, K, D, 8, world)
    assert balanced_all_to_all_bytes(10, 2, 8, 4, 4) == 10 * 2 * 3 / 4 * 8 * 4


def test_bookkeeping_refusals():
    with pytest.raises(ValueError, match="n_experts must be divisible by world.*n_experts=6, world=4"):
        check_expert_split("f", 6, 4)
    with pytest.raises(ValueError, match="experts expected ids in \\[0, 4\\)"):
        dispatch_plan(np.array([[0, 4]]), None, 4, 2)
    with pytest.raises(TypeError, match="experts expected integer expert ids"):
        dispatch_plan(np.zeros((2, 2)), None, 4, 2)
    with pytest.raises(ValueError, match="keep expected a bool array of shape \\(1, 2\\)"):
        dispatch_plan(np.array([[0, 1]]), np.ones((2, 2), bool), 4, 2)
    with pytest.raises(ValueError, match="counts expected a \\(world, n_local\\) array"):
        receive_plan(np.array([1, 2]))
    with pytest.raises(ValueError, match="rank expected < world=2, got 2"):
        all_to_all_bytes([1, 2], 2, 8)


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_layer_refusals_both_tracks(track):
    np_moe = numpy_moe()
    moe = np_moe if track == "numpy" else torch_moe(np_moe)
    ep = nep if track == "numpy" else tep
    make = (lambda **kw: numpy_moe(**kw)) if track == "numpy" else (lambda **kw: torch_moe(numpy_moe(**kw)))
    x, dy = inputs()
    if track == "torch":
        x, dy = torch.from_numpy(x), torch.from_numpy(dy)
    with pytest.raises(ValueError, match="n_experts must be divisible by world.*n_experts=4, world=3"):
        ep.ExpertParallelMoE(moe, 0, 3)
    with pytest.raises(ValueError, match="rank expected < world=2, got 2"):
        ep.ExpertParallelMoE(moe, 2, 2)
    with pytest.raises(ValueError, match="capacity_factor expected None"):
        ep.ExpertParallelMoE(make(capacity_factor=1.25), 0, 2)
    with pytest.raises(ValueError, match="aux_loss_coef and moe.z_loss_coef expected 0"):
        ep.run_expert_parallel(make(aux_loss_coef=0.01), x, dy)
    with pytest.raises(TypeError, match="moe expected a tfm_.*MoEFeedForward, got Linear"):
        ep.run_expert_parallel(moe.router, x, dy)
    with pytest.raises(ValueError, match="x expected at least world=2 rows on its first axis, got 1"):
        ep.run_expert_parallel(moe, x[:1], dy[:1])
    with pytest.raises(ValueError, match="grad_out expected"):
        ep.run_expert_parallel(moe, x, dy[:, :2])
    assert mp.active_children() == []  # refused before any process started


def test_numpy_all_to_all_refusals():
    a2a = nep.AllToAll(2, 3, 4)
    try:
        comm = a2a.member(0)
        with pytest.raises(ValueError, match="send_counts expected to sum to the 2 rows of x"):
            comm.all_to_all(np.zeros((2, 4)), [1, 2])
        with pytest.raises(ValueError, match="at most max_rows=3"):
            comm.all_to_all(np.zeros((4, 4)), [4, 0])
        with pytest.raises(ValueError, match="rows of 4 elements"):
            comm.all_to_all(np.zeros((2, 3)), [1, 1])
        with pytest.raises(TypeError, match="x expected a float64 array"):
            comm.all_to_all(np.zeros((2, 4), np.float32), [1, 1])
        comm.close()
        with pytest.raises(ValueError, match="rank expected < world=2, got 2"):
            a2a.member(2)
    finally:
        a2a.close()


# -- the exchange ---------------------------------------------------------------------------------------------------


def test_numpy_all_to_all_among_three_workers():
    """Each worker gets, from every source in rank order, the block that source addressed to it; the same call
    with the received counts sends every row home; the bytes are the rows for other workers. (Threads here; the
    layer's test below runs the same exchange between processes.)"""
    world, row = 3, 5
    a2a = nep.AllToAll(world, 8, row)
    out = [None] * world

    def work(r):
        try:
            out[r] = workers.numpy_all_to_all(r, world, a2a, row)
        except BaseException:
            a2a.barrier.abort()
            raise

    ts = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
    finally:
        a2a.close()
    ins = [workers.blocks(r, world, row) for r in range(world)]
    for r, (y, recv_counts, back, back_counts, exchanges, count_bytes) in enumerate(out):
        expected = np.concatenate([np.split(x, np.cumsum(c)[:-1])[r] for x, c in ins])
        assert np.array_equal(y, expected)
        assert recv_counts.tolist() == [int(c[r]) for _, c in ins]
        assert np.array_equal(back, ins[r][0]) and np.array_equal(back_counts, ins[r][1])
        assert exchanges == [all_to_all_bytes(ins[r][1], r, row * 8), all_to_all_bytes(recv_counts, r, row * 8)]
        assert count_bytes == 2 * (world - 1) * 8
    assert mp.active_children() == []


# -- the layer ------------------------------------------------------------------------------------------------------


def test_numpy_expert_parallel_equals_one_process_float64_in_processes():
    moe = numpy_moe()
    x, dy = inputs()
    moe(x)
    moe.backward(dy)  # gradients left in .grad: the step must report its own, not add to these
    out = nep.run_expert_parallel(moe, x, dy, world=2, timeout=60)
    moe.zero_grad()
    assert mp.active_children() == []
    y, dx, grads, routing = numpy_reference(moe, x, dy)
    assert_equal_to_one_process(out, y, dx, grads, 1e-12)
    assert [o["exchanges"] for o in out] == expected_exchanges(routing, 20, 2, D * 8)
    loads = [o["load"] for o in out]
    assert np.array_equal(np.concatenate(loads), routing.kept)  # the rows each expert computed, on its process
    n_router = E * D * 8
    assert all(o["router_bytes_sent"] == n_router for o in out)  # ring all-reduce: 2 (W-1)/W of the bytes
    assert all(o["count_bytes_sent"] == 4 * (E // 2) * 8 for o in out)  # 4 exchanges, n_local counts to 1 peer


@pytest.mark.parametrize("top_k", [1, 2])
def test_numpy_expert_parallel_float32_and_top1_threads(top_k):
    """Workers as threads (the same shared memory and barriers): float32 within 1e-6, and top-1 routing."""
    moe = NumpyMoE(D, D_FF, E, top_k, aux_loss_coef=0.0, z_loss_coef=0.0, rng=3, dtype=np.float32)
    x, dy = inputs(np.float32, (5, 3, D), seed=4)
    out = threads(moe, x, dy)
    y, dx, grads, _ = numpy_reference(moe, x, dy)
    assert_equal_to_one_process(out, y, dx, grads, 1e-6)
    assert all(o["y"].dtype == np.float32 and o["dx"].dtype == np.float32 for o in out)


def test_skewed_router_loads_one_process():
    """A router that prefers the first process's experts: that process computes most rows; the loads are the
    routing's counts per expert, and the bytes follow the rows (process 1 sends nearly all its rows away)."""
    moe = numpy_moe()
    moe.router.weight.data[: E // 2] += 3.0 * np.sign(moe.router.weight.data[: E // 2].sum(axis=0))  # skew
    x, dy = inputs(shape=(6, 4, D), seed=5)
    x = x + np.sign(moe.router.weight.data[0])  # tokens aligned with the skew
    out = threads(moe, x, dy)
    y, dx, grads, routing = numpy_reference(moe, x, dy)
    assert_equal_to_one_process(out, y, dx, grads, 1e-12)
    load = [int(o["load"].sum()) for o in out]
    assert load == device_load(routing.kept, 2).tolist() and sum(load) == 24 * K
    assert load[0] > 3 * load[1]
    assert out[1]["exchanges"][0] > 3 * out[0]["exchanges"][0]


def test_torch_expert_parallel_on_gloo_equals_one_process():
    """One gloo group (2 processes): the exchange and its backward (each row's gradient goes home); the layer in
    float64 (1e-12) and float32 (1e-6) equal to the single-process torch layer, and to the NumPy one."""
    world, row = 2, 5
    np64 = numpy_moe()
    t64, t32 = torch_moe(np64), torch_moe(np64, torch.float32)
    x, dy = inputs()
    cases = [(pickle.dumps(m), np.array_split(a.astype(dt), 2), np.array_split(g.astype(dt), 2))
             for m, dt in ((t64, np.float64), (t32, np.float32)) for a, g in [(x, dy)]]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = run_processes(workers.torch_checks, world, (f"{tmp}/store", row, cases), timeout=90,
                            env={"GLOO_SOCKET_IFNAME": "lo"})  # fmt: skip
    assert mp.active_children() == []
    # the exchange
    ins = [workers.blocks(r, world, row) for r in range(world)]
    for r, ((y, recv_counts, _, grad, exchanges, count_bytes), _) in enumerate(out):
        assert np.array_equal(y, np.concatenate([np.split(a, np.cumsum(c)[:-1])[r] for a, c in ins]))
        home = []  # the gradient of my rows sent to d: the weights d applied to them
        for d in range(world):
            first = int(out[d][0][1][:r].sum())
            home.append(out[d][0][2][first : first + ins[r][1][d]])
        assert np.array_equal(grad, np.concatenate(home))
        assert exchanges == [all_to_all_bytes(ins[r][1], r, row * 8), all_to_all_bytes(recv_counts, r, row * 8)]
        assert count_bytes == 8
    # the layer
    y_np, dx_np, grads_np, routing = numpy_reference(np64, x, dy)
    for (model, dt), tol, case in zip(((t64, torch.float64), (t32, torch.float32)), (1e-12, 1e-6), range(2),
                                      strict=True):  # fmt: skip
        xt = torch.from_numpy(x).to(dt).requires_grad_()
        yt = model(xt)
        (yt * torch.from_numpy(dy).to(dt)).sum().backward()
        grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
        steps = [o[1][case] for o in out]
        assert_equal_to_one_process(steps, yt.detach().numpy(), xt.grad.numpy(), grads, tol)
        itemsize = 8 if dt == torch.float64 else 4
        assert [s["exchanges"] for s in steps] == expected_exchanges(routing, 20, 2, D * itemsize)
    steps64 = [o[1][0] for o in out]
    assert_equal_to_one_process(steps64, y_np, dx_np, grads_np, 1e-10)  # the tracks agree
