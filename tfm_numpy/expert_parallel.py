"""Experts on different devices, NumPy track: the all-to-all exchange over shared memory (the same ideas as chapter
20a's `Ring`), and a mixture-of-experts layer whose experts are spread over the worker processes.

An all-to-all: every process has one block of rows for every process (itself included) and receives one block
from every process. Process r writes its block for process d into slot (r, d) of a shared-memory table (and the
block's row count into a shared table of counts), everyone waits, process r reads slot (s, r) from every source s
in rank order, and everyone waits again (so nobody overwrites a slot before it was read). Unlike the ring's
neighbor-to-neighbor steps, each pair of processes exchanges directly, once: on a real network the blocks cross
the links in parallel, and only the rows for other processes cross a link at all.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
from multiprocessing import shared_memory

import numpy as np

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

from .module import Module, ModuleList
from .moe import MoEFeedForward
from .parallel import Ring

__all__ = ["AllToAll", "AllToAllMember", "ExpertParallelMoE", "expert_parallel_step", "exchanges_for",
           "run_expert_parallel"]  # fmt: skip


class AllToAll:
    """The shared part of an all-to-all among `world` workers: a (world, world, groups) table of counts (rows per
    pair, split in up to `groups` counts: per expert) and a (world, world) table of slots, each slot large enough
    for `max_rows` rows of `row_size` elements of `dtype`, and a barrier. Make it in the parent, pass it to the
    workers, and in each worker take `a2a.member(rank)`. `close()` (the parent, in a finally) frees the block."""

    def __init__(self, world: int, max_rows: int, row_size: int, dtype=np.float64, *, groups: int = 1, context=None):
        self.world = check_size("AllToAll", "world", world)
        self.max_rows = check_size("AllToAll", "max_rows", max_rows)
        self.row_size = check_size("AllToAll", "row_size", row_size)
        self.groups = check_size("AllToAll", "groups", groups)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"AllToAll: dtype expected float32 or float64, got {self.dtype}")
        self.counts_bytes = self.world * self.world * self.groups * 8  # int64 counts first, then the slots
        size = self.counts_bytes + self.world * self.world * self.max_rows * self.row_size * self.dtype.itemsize
        ctx = context or mp.get_context("spawn")
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.name = self.shm.name
        self.barrier = ctx.Barrier(self.world)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "shm"}  # workers attach by name

    def member(self, rank: int) -> AllToAllMember:
        return AllToAllMember(self, rank)

    def close(self) -> None:
        """Free the shared block (the parent, once every worker is done)."""
        shm = self.__dict__.pop("shm", None)
        if shm is not None:
            shm.close()
            shm.unlink()


class AllToAllMember:
    """One worker's end of an `AllToAll`. `all_to_all(x, send_counts)` sends rows send_counts[0] of x to process 0,
    the next send_counts[1] to process 1, ...; returns the rows received (source 0's block first) and how many came
    from each source. send_counts may be (world, g) (g <= groups): the rows for each process split in g counts (per
    expert); the receiver gets them as recv_counts (world, g). Counts `bytes_sent` (the rows for other processes;
    the counts, world * g int64 per call, apart in `count_bytes_sent`) and keeps each call's bytes in
    `exchanges`."""

    def __init__(self, a2a: AllToAll, rank: int):
        rank = check_size("AllToAll.member", "rank", rank, 0)
        if rank >= a2a.world:
            raise ValueError(f"AllToAll.member: rank expected < world={a2a.world}, got {rank}")
        self.a2a, self.rank, self.world = a2a, rank, a2a.world
        self._shm = shared_memory.SharedMemory(name=a2a.name)
        w = a2a.world
        self.counts = np.ndarray((w, w, a2a.groups), dtype=np.int64, buffer=self._shm.buf)  # [s, d]: s sends d
        shape = (w, w, a2a.max_rows, a2a.row_size)
        self.slots = np.ndarray(shape, dtype=a2a.dtype, buffer=self._shm.buf, offset=a2a.counts_bytes)
        self.bytes_sent = 0
        self.count_bytes_sent = 0
        self.exchanges: list[int] = []

    def all_to_all(self, x: np.ndarray, send_counts) -> tuple[np.ndarray, np.ndarray]:
        """x: (n, *tail) rows grouped by destination (prod(tail) = row_size); send_counts: (world,) or (world, g),
        n rows in all. Returns (received (m, *tail): source 0's rows, then source 1's, ...; recv_counts, the shape
        of send_counts: what each source sent)."""
        x, counts = self._check(x, send_counts)  # counts: (world, g)
        r, w, g = self.rank, self.world, counts.shape[1]
        rows, send = x.reshape(x.shape[0], self.a2a.row_size), counts.sum(axis=1)
        offsets = np.concatenate([[0], np.cumsum(send)])
        self.counts[r, :, :g] = counts
        for d in range(w):
            self.slots[r, d, : send[d]] = rows[offsets[d] : offsets[d + 1]]
        self.a2a.barrier.wait()  # every block written
        recv_counts = self.counts[:, r, :g].copy()  # (world, g): what each source sent here
        out = np.concatenate([self.slots[s, r, :n] for s, n in enumerate(recv_counts.sum(axis=1))])
        self.a2a.barrier.wait()  # every block read: the slots may be written again
        sent = all_to_all_bytes(send, r, self.a2a.row_size * self.a2a.dtype.itemsize)
        self.bytes_sent += sent
        self.count_bytes_sent += (w - 1) * g * 8
        self.exchanges.append(sent)
        return out.reshape(-1, *x.shape[1:]), recv_counts.reshape(np.shape(send_counts))

    def _check(self, x, send_counts) -> tuple[np.ndarray, np.ndarray]:
        a2a = self.a2a
        if not isinstance(x, np.ndarray) or x.ndim < 1 or x.dtype != a2a.dtype:
            raise TypeError(f"AllToAll.all_to_all: x expected a {a2a.dtype} array, got {type(x).__name__} "
                            f"{getattr(x, 'dtype', '')}")  # fmt: skip
        if int(np.prod(x.shape[1:])) != a2a.row_size:
            raise ValueError(f"AllToAll.all_to_all: x expected rows of {a2a.row_size} elements, got shape {x.shape}")
        counts = check_send_counts(send_counts, self.world, x.shape[0], a2a.groups)
        if counts.sum(axis=1).max() > a2a.max_rows:
            raise ValueError(f"AllToAll.all_to_all: send_counts expected at most max_rows={a2a.max_rows} rows per "
                             f"process, got {counts.sum(axis=1).tolist()}")  # fmt: skip
        return x, counts

    def close(self) -> None:
        self.counts = self.slots = None
        self._shm.close()


# -- the layer: one process's router (a copy) and experts ----------------------------------------------------------
class ExpertParallelMoE(Module):
    """Process `rank`'s part of the MoEFeedForward `moe`: a copy of its router, and its experts
    rank * n_local ... (rank + 1) * n_local - 1 only (n_local = n_experts / world; state_dict keys router.weight,
    experts.<j>.* for local expert j = expert `expert_ids[j]`). Its forward takes this process's tokens; the rows
    travel to their experts' processes and back through `comm` (an `AllToAllMember`, set before the first call).

    forward: route (the layer's own `route`: logits, probabilities, top-k, gates), `dispatch_plan`, the dispatch
    all-to-all (x's rows out, with the counts per expert), the local experts on the rows received, grouped by
    expert (`receive_plan`), the combine all-to-all (the answers back, in send order), and the layer's own
    `combine` (gates times answers, added into each token's row). backward: the same in reverse: the gradients of
    the answers travel out like the dispatch, the experts' backward, the gradients of their inputs travel home
    like the combine; the router's backward is local. The router's gradient is this process's tokens' share: sum it
    over the processes (an all-reduce) for the whole batch's.
    """

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
        self.experts = ModuleList([moe.experts[e] for e in self.expert_ids])
        moe.experts = ModuleList()  # the other processes' experts are not held here
        object.__setattr__(self, "moe", moe)  # its route, combine and backward pieces (they use no expert)
        object.__setattr__(self, "comm", None)
        object.__setattr__(self, "load", None)

    def _run_experts(self, rows: np.ndarray, plan, method: str) -> np.ndarray:
        """The local experts on the rows received (source by source, expert by expert within each): regrouped by
        expert, each expert's `method` (forward or backward) on its rows, the answers back in the received order."""
        grouped = np.split(rows[plan.order], np.cumsum(plan.expert_counts)[:-1])
        outs = [getattr(expert, method)(r) for expert, r in zip(self.experts, grouped, strict=True)]
        return np.concatenate(outs)[plan.inverse]

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.moe.d_model)  # (N, d): this process's tokens
        logits, probs, routing, gates = self.moe.route(x2)
        plan = dispatch_plan(routing.experts, routing.keep, self.moe.n_experts, self.world)
        counts = plan.expert_counts.reshape(self.world, self.n_local)  # rows to each process, per expert
        received, recv_counts = self.comm.all_to_all(x2[plan.tokens], counts)  # dispatch
        here = receive_plan(recv_counts)
        answers, _ = self.comm.all_to_all(self._run_experts(received, here, "forward"), recv_counts)  # combine
        outs = np.split(answers, np.cumsum(plan.expert_counts)[:-1])  # [rows of expert e], as route serves them
        y2 = self.moe.combine(outs, routing, gates)
        _, _, lse = self.moe.losses(logits, probs, routing)
        object.__setattr__(self, "load", here.expert_counts)  # rows each local expert computed
        self._cache = (x.shape, probs, routing, gates, outs, lse, plan, counts, here, recv_counts)
        return y2.reshape(x.shape)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        x_shape, probs, routing, gates, outs, lse, plan, counts, here, recv_counts = self._saved()
        dy2 = grad_out.reshape(-1, self.moe.d_model)
        douts, dgates = self.moe.combine_backward(dy2, routing, gates, outs)
        d_answers, _ = self.comm.all_to_all(np.concatenate(douts), counts)  # the combine, reversed
        d_received = self._run_experts(d_answers, here, "backward")
        d_rows, _ = self.comm.all_to_all(d_received, recv_counts)  # the dispatch, reversed
        dx2 = np.zeros_like(dy2)
        np.add.at(dx2, plan.tokens, d_rows)  # a token's k rows add up
        dlogits = self.moe.router_backward(dgates, probs, routing, gates, lse)
        return (dx2 + self.router.backward(dlogits)).reshape(x_shape)

    def global_state(self, attr: str = "data") -> dict[str, np.ndarray]:
        """This process's parameters (attr "data") or gradients ("grad") under the whole layer's names:
        router.weight, experts.<e>.* with e the global expert id."""
        out = {}
        for name, p in self.named_parameters():
            if name.startswith("experts."):
                j, rest = name.split(".", 2)[1:]
                name = f"experts.{self.expert_ids[int(j)]}.{rest}"
            out[name] = getattr(p, attr).copy()
        return out

    def extra_repr(self) -> str:
        return f"rank={self.rank}, world={self.world}, experts={self.expert_ids}"


def expert_parallel_step(
    moe: MoEFeedForward, x: np.ndarray, grad_out: np.ndarray, rank: int, world: int, a2a: AllToAll, ring: Ring
) -> dict:
    """In worker `rank` of `world` (a process, or a thread): this worker's `ExpertParallelMoE` of `moe`, one forward
    of its tokens x and one backward of dL/dy = grad_out, the all-to-alls through `a2a`, the router's gradient
    all-reduced through `ring`. Returns the dict `run_expert_parallel` describes (gradients of this step alone)."""
    layer = ExpertParallelMoE(moe, rank, world)
    layer.zero_grad()  # this step's gradients only (moe's .grad may hold an earlier backward's)
    comm, reduce = a2a.member(rank), ring.member(rank)
    object.__setattr__(layer, "comm", comm)
    try:
        y = layer(x)
        dx = layer.backward(grad_out)
        router = layer.router.weight
        router.grad = reduce.all_reduce(router.grad.ravel()).reshape(router.shape)  # the whole batch's gradient
        return {
            "y": y,
            "dx": dx,
            "grads": layer.global_state("grad"),
            "load": layer.load,
            "exchanges": list(comm.exchanges),
            "bytes_sent": comm.bytes_sent,
            "count_bytes_sent": comm.count_bytes_sent,
            "router_bytes_sent": reduce.bytes_sent,
            "param_bytes": sum(p.data.nbytes for p in layer.parameters()),
        }
    finally:
        comm.close()
        reduce.close()


def _expert_parallel_worker(rank, world, moe, xs, grad_outs, a2a, ring):
    return expert_parallel_step(moe, xs[rank], grad_outs[rank], rank, world, a2a, ring)


def exchanges_for(moe: MoEFeedForward, xs: list[np.ndarray], world: int) -> tuple[AllToAll, Ring]:
    """The shared memory of one `expert_parallel_step` per worker (tokens xs[r] on worker r): an `AllToAll` large
    enough for every assignment of the largest share, and a `Ring` for the router's gradient. Close both after."""
    dtype = moe.router.weight.dtype
    max_rows = max(a.size // moe.d_model for a in xs) * moe.top_k  # every assignment to one process, at most
    a2a = AllToAll(world, max_rows, moe.d_model, dtype, groups=moe.n_experts // world)
    return a2a, Ring(world, moe.router.weight.data.size, dtype)


def run_expert_parallel(moe: MoEFeedForward, x, grad_out, *, world: int = 2, timeout: float = 60.0) -> list[dict]:
    """One forward and backward of `moe` with its experts spread over `world` processes (expert parallelism): x and
    grad_out (B, ..., d_model) split by rows of their first axis (`np.array_split`), process r holding part r of the
    tokens, a copy of the router and experts r * n_local ... (r + 1) * n_local - 1.

    Returns one dict per process: "y" and "dx" (its rows of the layer's output and of dL/dx), "grads" (the gradients
    of the parameters it holds, under the whole layer's names; the router's summed over the processes by a ring
    all-reduce), "load" (rows each of its experts computed), "exchanges" (bytes it sent in each all-to-all: dispatch,
    combine, then the backward's two), "bytes_sent", "count_bytes_sent" (the counts that precede the rows),
    "router_bytes_sent" (the ring's), "param_bytes" (what it holds). `moe` is not changed. The workers are
    stopped and the shared memory freed, always."""
    check_expert_parallel("run_expert_parallel", moe, MoEFeedForward, world)
    dtype = moe.router.weight.dtype
    xs = split_rows("run_expert_parallel", "x", x, world, moe.d_model, dtype)
    grad_outs = split_rows("run_expert_parallel", "grad_out", grad_out, world, moe.d_model, dtype)
    if [g.shape for g in grad_outs] != [a.shape for a in xs]:
        raise ValueError(f"run_expert_parallel: grad_out expected the shape of x {np.shape(x)}, got "
                         f"{np.shape(grad_out)}")  # fmt: skip
    a2a, ring = exchanges_for(moe, xs, world)
    try:
        return run_processes(_expert_parallel_worker, world, (moe, xs, grad_outs, a2a, ring), timeout=timeout)
    finally:
        a2a.close()
        ring.close()
