"""The bookkeeping of expert parallelism, shared by both tracks (`tfm_numpy.expert_parallel`,
`tfm_torch.expert_parallel`): which process holds which experts, which of a process's (token, slot) assignments go
to which process and in what order, the inverse permutation that puts the answers back, the grouping of received
rows by local expert, and the bytes the exchanges move.

The layout. `world` processes, `n_experts` experts, `n_experts / world` of them on each process, in contiguous
blocks: process r holds experts r * n_local ... (r + 1) * n_local - 1 (`expert_owner`). Each process also holds a
share of the tokens (the rows of its part of the batch) and a copy of the router.

One exchange (an all-to-all). A process sorts its kept assignments by expert (`dispatch_plan`): the rows for
process 0 come first, then those for process 1, ..., and within a process's block, expert by expert, each expert's
rows in the order the router serves them (`tfm_common.moe.route`: first choices in token order, then second
choices). `send_counts[d]` rows go to process d. Process d receives, from each source s in turn, the rows s sent it;
`receive_plan` says which received row goes to which local expert, and its `inverse` puts the experts' answers
back in the order received. The combine sends every answer back along the same path reversed, and the dispatch
plan's `inverse` finds each assignment's answer. The backward runs the same two
exchanges in reverse order: the gradient of the outputs travels like the dispatch, the gradient of the inputs like
the combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .validate import check_size

__all__ = [
    "check_expert_split",
    "check_expert_parallel",
    "split_rows",
    "expert_owner",
    "DispatchPlan",
    "dispatch_plan",
    "ReceivePlan",
    "receive_plan",
    "check_send_counts",
    "all_to_all_bytes",
    "balanced_all_to_all_bytes",
    "device_load",
]


def check_expert_split(owner: str, n_experts, world) -> int:
    """n_experts experts over `world` processes, as many on each: returns n_local = n_experts / world, or refuses."""
    n_experts = check_size(owner, "n_experts", n_experts)
    world = check_size(owner, "world", world)
    if n_experts % world:
        raise ValueError(
            f"{owner}: n_experts must be divisible by world (each process holds as many experts), "
            f"got n_experts={n_experts}, world={world}"
        )
    return n_experts // world


def check_expert_parallel(owner: str, moe, kind: type, world) -> int:
    """A MoEFeedForward (`kind`: the track's) whose experts split evenly over `world` processes, as this book's
    expert parallelism runs it: no capacity (a global capacity needs every process's choices before any row
    leaves) and no auxiliary losses (their fractions are the whole batch's: one more all-reduce). Returns n_local."""
    if not isinstance(moe, kind):
        raise TypeError(f"{owner}: moe expected a {kind.__module__}.{kind.__name__}, got {type(moe).__name__}")
    n_local = check_expert_split(owner, moe.n_experts, world)
    if moe.capacity_factor is not None:
        raise ValueError(f"{owner}: moe.capacity_factor expected None (expert parallelism runs here without a "
                         f"capacity), got {moe.capacity_factor}")  # fmt: skip
    if moe.aux_loss_coef or moe.z_loss_coef:
        raise ValueError(f"{owner}: moe.aux_loss_coef and moe.z_loss_coef expected 0 (the auxiliary losses are not "
                         f"split here), got {moe.aux_loss_coef} and {moe.z_loss_coef}")  # fmt: skip
    return n_local


def split_rows(owner: str, arg: str, x, world: int, d_model: int, dtype) -> list[np.ndarray]:
    """x (B, ..., d_model) cut by rows of its first axis into `world` parts (np.array_split): each process's tokens.
    At least one row per process."""
    if not isinstance(x, np.ndarray) or x.ndim < 2 or x.shape[-1] != d_model or x.dtype != dtype:
        raise ValueError(f"{owner}: {arg} expected a {np.dtype(dtype)} array (B, ..., {d_model}), got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")  # fmt: skip
    if x.shape[0] < world:
        raise ValueError(f"{owner}: {arg} expected at least world={world} rows on its first axis, got {x.shape[0]}")
    return [part.copy() for part in np.array_split(x, world)]


def expert_owner(experts, n_experts: int, world: int) -> np.ndarray:
    """The process that holds each expert id in `experts`: experts // (n_experts / world) (contiguous blocks)."""
    n_local = check_expert_split("expert_owner", n_experts, world)
    experts = _expert_ids("expert_owner", experts, n_experts)
    return experts // n_local


def _expert_ids(owner: str, experts, n_experts: int) -> np.ndarray:
    experts = np.asarray(experts)
    if not np.issubdtype(experts.dtype, np.integer):
        raise TypeError(f"{owner}: experts expected integer expert ids, got dtype {experts.dtype}")
    if experts.size and (experts.min() < 0 or experts.max() >= n_experts):
        raise ValueError(
            f"{owner}: experts expected ids in [0, {n_experts}), got values from {experts.min()} to {experts.max()}"
        )
    return experts.astype(np.int64)


@dataclass(frozen=True)
class DispatchPlan:
    """How one process sends its assignments: R rows, one per kept (token, slot) assignment of its N tokens.

    tokens, slots: (R,) the token and the slot (0 .. k-1: its first, second, ... choice) of each row of the send
        buffer x[tokens]: sorted by expert, and within an expert in service order (every token's first choice in
        token order, then every second choice, ...: `tfm_common.moe.route`'s `groups`, concatenated).
    inverse: (N, k) the row of the send buffer that holds each assignment, -1 where it was dropped (over capacity):
        the answers come back in send order, and answers[inverse[n, j]] is the one for token n's j-th choice.
    send_counts: (world,) rows sent to each process (the blocks of the send buffer, in process order).
    expert_counts: (n_experts,) rows sent to each expert.
    """

    tokens: np.ndarray
    slots: np.ndarray
    inverse: np.ndarray
    send_counts: np.ndarray
    expert_counts: np.ndarray


def dispatch_plan(experts, keep, n_experts: int, world: int) -> DispatchPlan:
    """The send order of one process's assignments. experts: (N, k) int, the experts of each token (best first);
    keep: (N, k) bool, whether the assignment fits under its expert's capacity (None: all kept)."""
    n_local = check_expert_split("dispatch_plan", n_experts, world)
    experts = _expert_ids("dispatch_plan", experts, n_experts)
    if experts.ndim != 2:
        raise ValueError(f"dispatch_plan: experts expected shape (N, k), got {experts.shape}")
    keep = np.ones(experts.shape, bool) if keep is None else np.asarray(keep)
    if keep.shape != experts.shape or keep.dtype != bool:
        raise ValueError(f"dispatch_plan: keep expected a bool array of shape {experts.shape}, got "
                         f"{keep.dtype} {keep.shape}")  # fmt: skip
    N, k = experts.shape
    flat, kept = experts.T.reshape(-1), keep.T.reshape(-1)  # slot-major: a = j N + n, the order of service
    rows = np.flatnonzero(kept)
    rows = rows[np.argsort(flat[rows], kind="stable")]  # by expert; within an expert, service order
    inverse = np.full(N * k, -1, dtype=np.int64)
    inverse[rows] = np.arange(rows.size)
    expert_counts = np.bincount(flat[rows], minlength=n_experts)
    send_counts = expert_counts.reshape(world, n_local).sum(axis=1)
    return DispatchPlan(rows % N, rows // N, inverse.reshape(k, N).T.copy(), send_counts, expert_counts)


@dataclass(frozen=True)
class ReceivePlan:
    """How one process groups the rows it received (from source 0, then source 1, ...; within each source, by
    expert) by its local experts.

    order: (R,) the received rows, regrouped: expert 0's rows (from every source, in source order), then expert
    1's, ...; inverse: (R,) where each received row sits in that regrouped order; expert_counts: (n_local,) rows
    per local expert; recv_counts: (world,) rows received from each source.
    """

    order: np.ndarray
    inverse: np.ndarray
    expert_counts: np.ndarray
    recv_counts: np.ndarray


def receive_plan(counts) -> ReceivePlan:
    """`counts`: (world, n_local) int, counts[s, j] = rows source s sent to local expert j (the rank's block of each
    source's `expert_counts`, exchanged before the rows themselves)."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ValueError(f"receive_plan: counts expected a (world, n_local) array of counts >= 0, got {counts!r}")
    world, n_local = counts.shape
    local = np.repeat(np.tile(np.arange(n_local), world), counts.reshape(-1))  # each received row's local expert
    order = np.argsort(local, kind="stable")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return ReceivePlan(order, inverse, counts.sum(axis=0), counts.sum(axis=1))


def check_send_counts(send_counts, world: int, n_rows: int, groups: int | None = None) -> np.ndarray:
    """An all-to-all's counts: (world,) or (world, g) ints >= 0 (g <= groups where a table limits it) summing to
    the n_rows rows sent; returned as an int64 (world, g) array."""
    counts = np.asarray(send_counts)
    ok = counts.ndim in (1, 2) and counts.shape[0] == world and np.issubdtype(counts.dtype, np.integer)
    if not ok or (counts < 0).any() or (counts.ndim == 2 and groups is not None and counts.shape[1] > groups):
        limit = "" if groups is None else f" (g <= {groups})"
        raise ValueError(f"AllToAll.all_to_all: send_counts expected ({world},) or ({world}, g){limit} counts >= 0, "
                         f"got {counts.tolist()!r}")  # fmt: skip
    if counts.sum() != n_rows:
        raise ValueError(f"AllToAll.all_to_all: send_counts expected to sum to the {n_rows} rows of x, "
                         f"got {counts.tolist()}")  # fmt: skip
    return counts.reshape(world, -1).astype(np.int64)


def all_to_all_bytes(send_counts, rank: int, row_bytes: int) -> int:
    """Bytes process `rank` sends in one all-to-all: the rows for every other process, row_bytes each (the rows it
    keeps cross no link)."""
    send_counts = np.asarray(send_counts, dtype=np.int64)
    rank = check_size("all_to_all_bytes", "rank", rank, 0)
    if rank >= send_counts.size:
        raise ValueError(f"all_to_all_bytes: rank expected < world={send_counts.size}, got {rank}")
    return int(send_counts.sum() - send_counts[rank]) * check_size("all_to_all_bytes", "row_bytes", row_bytes)


def balanced_all_to_all_bytes(n_tokens: int, top_k: int, d_model: int, itemsize: int, world: int) -> float:
    """Bytes one process sends in one exchange when its router spreads its n_tokens * top_k assignments evenly over
    the experts: the (world - 1) / world of them that live elsewhere, d_model * itemsize bytes each. A layer's
    training step makes four such exchanges (dispatch, combine; their two reverses in backward)."""
    sizes = dict(n_tokens=n_tokens, top_k=top_k, d_model=d_model, itemsize=itemsize, world=world)
    s = {k: check_size("balanced_all_to_all_bytes", k, v) for k, v in sizes.items()}
    return s["n_tokens"] * s["top_k"] * (s["world"] - 1) / s["world"] * s["d_model"] * s["itemsize"]


def device_load(expert_counts, world: int) -> np.ndarray:
    """Rows each process's experts compute: `expert_counts` (n_experts,) summed over the processes' blocks."""
    expert_counts = np.asarray(expert_counts)
    check_expert_split("device_load", expert_counts.size, world)
    return expert_counts.reshape(world, -1).sum(axis=1)
