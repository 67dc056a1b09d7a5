"""Targets of the worker processes started by test_expert_parallel.py: importable module-level functions. The
NumPy ones import no torch (a spawned worker starts fast)."""

from __future__ import annotations

import numpy as np


def blocks(rank: int, world: int, row_size: int, dtype=np.float64):
    """Rank `rank`'s rows for an all-to-all test: send_counts drawn from its own seed (some zero), the rows
    numbered so that the receiver can tell where each came from."""
    rng = np.random.default_rng(100 + rank)
    counts = rng.integers(1, 5, size=world)
    counts[(rank + 1) % world] = 0  # one empty block
    x = rng.standard_normal((int(counts.sum()), row_size)).astype(dtype)
    return x, counts


def numpy_all_to_all(rank, world, a2a, row_size):
    comm = a2a.member(rank)
    try:
        x, counts = blocks(rank, world, row_size)
        y, recv_counts = comm.all_to_all(x, counts)
        back, back_counts = comm.all_to_all(y, recv_counts)  # the reverse exchange: every row home again
        return y, recv_counts, back, back_counts, comm.exchanges, comm.count_bytes_sent
    finally:
        comm.close()


def _init_gloo(rank, world, store_path, timeout=60):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))  # fmt: skip


def torch_checks(rank, world, store_path, row_size, cases):
    """One gloo group for all the torch checks (a process launch with torch is slow): the exchange forward and
    backward, then one expert-parallel step per case (moe bytes, xs, grad_outs)."""
    import pickle

    import torch.distributed as dist

    import tfm_torch.expert_parallel as ep

    _init_gloo(rank, world, store_path)
    try:
        steps = [ep.expert_parallel_step(pickle.loads(m), xs[rank], gs[rank], rank, world) for m, xs, gs in cases]
        return torch_all_to_all_in_group(rank, world, row_size), steps
    finally:
        dist.destroy_process_group()


def torch_all_to_all_in_group(rank, world, row_size):
    import torch

    import tfm_torch.expert_parallel as ep

    x, counts = blocks(rank, world, row_size)
    xt = torch.from_numpy(x).requires_grad_()
    comm = ep.AllToAllMember()
    y, recv_counts = comm.all_to_all(xt, counts)
    weights = torch.from_numpy(np.random.default_rng(200 + rank).standard_normal(tuple(y.shape)))
    (y * weights).sum().backward()
    return y.detach().numpy(), recv_counts, weights.numpy(), xt.grad.numpy(), comm.exchanges, comm.count_bytes_sent
