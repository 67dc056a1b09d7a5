"""Experts on different devices, PyTorch track: the same names as `tfm_numpy.expert_parallel`, on
`torch.distributed`.

The all-to-all is gloo's `all_to_all_single` with uneven splits (torch 2.13 on CPU: supported; the list form
`all_to_all` refuses blocks of different sizes on gloo). The receiver must know how many rows each source sends
before the rows arrive: a first, tiny all-to-all of the counts (one int64 per pair), then the rows. Autograd sees
the exchange as `AllToAllFunction`, whose backward is the same exchange reversed: the gradient of each received row
goes back to the process that sent it (the counts swapped).
"""

from __future__ import annotations

import copy
import pickle
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from tfm_common.expert_parallel import (
    all_to_all_bytes,
    check_expert_parallel,
    check_send_counts,
    dispatch_plan,
    receive_plan,
    split_rows,
)
from tfm_common.parallel import run_processes
from tfm_common.validate import check_size

from .module import Module
from .moe import MoEFeedForward

__all__ = ["AllToAllMember", "AllToAllFunction", "ExpertParallelMoE", "expert_parallel_step", "run_expert_parallel"]


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


# -- the layer: one process's router (a copy) and experts ----------------------------------------------------------
class ExpertParallelMoE(Module):
    """Process `rank`'s part of the MoEFeedForward `moe` (twin of tfm_numpy's: see its docstring): a copy of the
    router, its n_local experts, the two all-to-alls of `comm` (an `AllToAllMember`, set before the first call).
    Autograd runs the backward: each exchange's backward is the reverse exchange."""

    def __init__(self, moe: MoEFeedForward, rank: int, world: int):
        super().__init__()
        n_local = check_expert_parallel("ExpertParallelMoE", moe, MoEFeedForward, world)
        rank = check_size("ExpertParallelMoE", "rank", rank, 0)
        if rank >= world:
            raise ValueError(f"ExpertParallelMoE: rank expected < world={world}, got {rank}")
        moe = copy.deepcopy(moe)  # this process's copy: the router, and (below) its own experts only
        self.rank, self.world, self.n_local = rank, world, n_local
        self.expert_ids = list(range(rank * n_local, (rank + 1) * n_local))
        self.router = moe.router
        self.experts = torch.nn.ModuleList([moe.experts[e] for e in self.expert_ids])
        moe.experts = torch.nn.ModuleList()  # the other processes' experts are not held here
        object.__setattr__(self, "moe", moe)  # its route and combine pieces (they use no expert)
        object.__setattr__(self, "comm", None)
        object.__setattr__(self, "load", None)

    def _run_experts(self, rows: torch.Tensor, plan) -> torch.Tensor:
        grouped = torch.split(rows[torch.from_numpy(plan.order)], plan.expert_counts.tolist())
        outs = [expert(r) for expert, r in zip(self.experts, grouped, strict=True)]
        return torch.cat(outs)[torch.from_numpy(plan.inverse)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.moe.d_model)  # (N, d): this process's tokens
        logits, probs, routing, gates = self.moe.route(x2)
        plan = dispatch_plan(routing.experts, routing.keep, self.moe.n_experts, self.world)
        counts = plan.expert_counts.reshape(self.world, self.n_local)  # rows to each process, per expert
        received, recv_counts = self.comm.all_to_all(x2[torch.from_numpy(plan.tokens)], counts)  # dispatch
        here = receive_plan(recv_counts)
        answers, _ = self.comm.all_to_all(self._run_experts(received, here), recv_counts)  # combine
        outs = torch.split(answers, plan.expert_counts.tolist())  # [rows of expert e], as route serves them
        object.__setattr__(self, "load", here.expert_counts)  # rows each local expert computed
        return self.moe.combine(list(outs), routing, gates).reshape(x.shape)

    def global_state(self, attr: str = "data") -> dict[str, np.ndarray]:
        """This process's parameters (attr "data") or gradients ("grad") under the whole layer's names."""
        out = {}
        for name, p in self.named_parameters():
            if name.startswith("experts."):
                j, rest = name.split(".", 2)[1:]
                name = f"experts.{self.expert_ids[int(j)]}.{rest}"
            t = p.detach() if attr == "data" else p.grad
            out[name] = t.numpy().copy()
        return out

    def extra_repr(self) -> str:
        return f"rank={self.rank}, world={self.world}, experts={self.expert_ids}"


def expert_parallel_step(moe: MoEFeedForward, x: np.ndarray, grad_out: np.ndarray, rank: int, world: int) -> dict:
    """In process `rank` of an initialized default process group of `world` processes: this process's
    `ExpertParallelMoE` of `moe`, one forward of its tokens x and one backward of dL/dy = grad_out (NumPy arrays),
    the router's gradient all-reduced. Returns the dict `run_expert_parallel` describes."""
    layer = ExpertParallelMoE(moe, rank, world)
    layer.zero_grad(set_to_none=True)  # this step's gradients only (moe's .grad may hold an earlier backward's)
    comm = AllToAllMember()
    object.__setattr__(layer, "comm", comm)
    xt = torch.from_numpy(x).requires_grad_()
    y = layer(xt)
    (y * torch.from_numpy(grad_out)).sum().backward()  # dL/dy = grad_out
    router = layer.router.weight
    dist.all_reduce(router.grad)  # the whole batch's router gradient
    return {
        "y": y.detach().numpy().copy(),
        "dx": xt.grad.numpy().copy(),
        "grads": layer.global_state("grad"),
        "load": layer.load,
        "exchanges": list(comm.exchanges),
        "bytes_sent": comm.bytes_sent,
        "count_bytes_sent": comm.count_bytes_sent,
        "router_bytes_sent": 2 * (world - 1) * router.numel() * router.element_size() // world,
        "param_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
    }


def _expert_parallel_worker(rank, world, store_path, moe_bytes, xs, grad_outs, timeout):
    import datetime

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    try:
        return expert_parallel_step(pickle.loads(moe_bytes), xs[rank], grad_outs[rank], rank, world)
    finally:
        dist.destroy_process_group()


def run_expert_parallel(moe: MoEFeedForward, x, grad_out, *, world: int = 2, timeout: float = 60.0) -> list[dict]:
    """One forward and backward of `moe` with its experts spread over `world` processes on gloo (twin of
    tfm_numpy's run_expert_parallel, the same dicts; x and grad_out tensors). "router_bytes_sent" is the ring
    formula's bytes of the router gradient's all-reduce (gloo's own algorithm is not counted here). Rendezvous
    through a temporary file; the workers are stopped and the file removed, always."""
    check_expert_parallel("run_expert_parallel", moe, MoEFeedForward, world)
    dtype = moe.router.weight.dtype
    if not isinstance(x, torch.Tensor) or not isinstance(grad_out, torch.Tensor):
        raise ValueError(f"run_expert_parallel: x and grad_out expected tensors, got {type(x).__name__} and "
                         f"{type(grad_out).__name__}")  # fmt: skip
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    xs = split_rows("run_expert_parallel", "x", x.detach().numpy(), world, moe.d_model, np_dtype)
    grad_outs = split_rows("run_expert_parallel", "grad_out", grad_out.detach().numpy(), world, moe.d_model, np_dtype)
    if grad_out.shape != x.shape:
        raise ValueError(f"run_expert_parallel: grad_out expected the shape of x {tuple(x.shape)}, got "
                         f"{tuple(grad_out.shape)}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tfm_ep_") as tmp:
        args = (f"{tmp}/store", pickle.dumps(moe), xs, grad_outs, timeout)
        return run_processes(_expert_parallel_worker, world, args, timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})
