"""Experts on different devices, PyTorch track: the same names as `tfm_numpy.expert_parallel`, on
`torch.distributed`.

The all-to-all is gloo's `all_to_all_single` with uneven splits (torch 2.13 on CPU: supported; the list form
`all_to_all` refuses blocks of different sizes on gloo). The receiver must know how many rows each source sends
before the rows arrive: a first, tiny all-to-all of the counts (one int64 per pair), then the rows. Autograd sees
the exchange as `AllToAllFunction`, whose backward is the same exchange reversed: the gradient of each received row
goes back to the process that sent it (the counts swapped).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tfm_common.expert_parallel import all_to_all_bytes, check_send_counts

__all__ = ["AllToAllMember", "AllToAllFunction"]


class AllToAllFunction(torch.autograd.Function):
    """rows (n, *tail) -> rows received (m, *tail); backward: the reverse exchange. `member` counts the bytes."""

    @staticmethod
    def forward(ctx, x, send_counts: list[int], recv_counts: list[int], member: AllToAllMember):
        ctx.counts, ctx.member = (send_counts, recv_counts), member
        return member._exchange(x, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return ctx.member._exchange(grad, recv_counts, send_counts), None, None, None


class AllToAllMember:
    """This process's end of an all-to-all on the default process group (gloo): `all_to_all(x, send_counts)` sends
    rows send_counts[0] of x to process 0, the next send_counts[1] to process 1, ...; returns the rows received
    (source 0's block first) and how many came from each source (a NumPy array; send_counts may be (world, g):
    per expert). Differentiable. Counts
    `bytes_sent` (the rows for other processes, forward and backward exchanges alike; the counts exchange, world
    int64 per call, apart in `count_bytes_sent`) and keeps each exchange's bytes in `exchanges`."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.bytes_sent = 0
        self.count_bytes_sent = 0
        self.exchanges: list[int] = []

    def all_to_all(self, x: torch.Tensor, send_counts) -> tuple[torch.Tensor, np.ndarray]:
        """x: (n, *tail) rows grouped by destination; send_counts: (world,) or (world, g) (per expert), n rows in
        all. Returns (received (m, *tail), recv_counts: the shape of send_counts, what each source sent)."""
        if not isinstance(x, torch.Tensor) or x.ndim < 1 or not x.is_floating_point():
            raise TypeError(f"AllToAll.all_to_all: x expected a floating-point tensor, got {type(x).__name__}")
        counts = check_send_counts(send_counts, self.world, x.shape[0])  # (world, g)
        send = torch.from_numpy(counts)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # first the counts: the receiver sizes its buffer
        self.count_bytes_sent += (self.world - 1) * counts.shape[1] * 8
        recv_counts = recv.numpy().copy()
        out = AllToAllFunction.apply(x, counts.sum(axis=1).tolist(), recv_counts.sum(axis=1).tolist(), self)
        return out, recv_counts.reshape(np.shape(send_counts))

    def _exchange(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
        sent = all_to_all_bytes(send_counts, self.rank, row_bytes)
        self.bytes_sent += sent
        self.exchanges.append(sent)
        return out
