"""Splitting the model, the plumbing both tracks share (`tfm_numpy.model_parallel`, `tfm_torch.model_parallel`):
which slice of each weight a process holds (tensor parallelism), what the all-reduces carry, and the pipeline
schedules as data (GPipe and 1F1B), simulated on a clock of equal slots.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019). In a feed-forward y = act(x W1^T + b1) W2^T + b2, cut W1
by rows (its outputs: the hidden units, "column parallel" in x W1^T) and W2 by columns (its inputs: "row parallel"):
process r computes act(x W1_r^T + b1_r) W2_r^T, a partial sum, and one all-reduce adds the partials (b2 once, after
it). The activation is elementwise, so no hidden unit needs another process's. Attention splits the same way by
heads: q, k, v projections by rows (the rows of a head are contiguous), the output projection by columns. Forward:
one all-reduce per sublayer; backward: one more (the gradient with respect to the sublayer's input is a sum over
the processes' heads / hidden units).

Pipeline parallelism (GPipe, Huang et al. 2019). Stage s holds layers stage_layers(...)[s]; the batch goes in m
micro-batches. A schedule is, per stage, the list of its operations in order: ("F", i) the forward of micro-batch
i, ("B", i) its backward. Stage s can run ("F", i) once stage s - 1 ran it, and ("B", i) once stage s + 1 ran it.
"""

from __future__ import annotations

import numpy as np

from .validate import check_choice, check_real, check_size

__all__ = [
    "SHARD_AXES",
    "shard_axis",
    "check_tensor_split",
    "shard",
    "unshard",
    "tensor_parallel_payload",
    "ring_all_reduce_bytes",
    "SCHEDULES",
    "stage_layers",
    "check_pipeline",
    "pipeline_schedule",
    "simulate_schedule",
    "bubble_fraction",
    "gpipe_bubble",
    "peak_in_flight",
    "schedule_order",
]

# The axis along which each weight of an attention or feed-forward is cut (None: every process holds all of it), by
# the state_dict key's last two parts ("layers.0.self_attn.q_proj.weight" -> "q_proj.weight").
SHARD_AXES = {
    "q_proj.weight": 0, "q_proj.bias": 0, "k_proj.weight": 0, "k_proj.bias": 0, "v_proj.weight": 0,
    "v_proj.bias": 0, "out_proj.weight": 1, "out_proj.bias": None,
    "linear1.weight": 0, "linear1.bias": 0, "linear2.weight": 1, "linear2.bias": None,
}  # fmt: skip


def shard_axis(key: str) -> int | None:
    """The axis along which the parameter `key` (a state_dict key) is split across processes; None: replicated
    (embeddings, norms, the output projection, and the biases added after an all-reduce)."""
    return SHARD_AXES.get(".".join(key.split(".")[-2:]))


def check_tensor_split(owner: str, world: int, *, n_heads=None, n_kv_heads=None, d_ff=None) -> int:
    """world must divide the query heads, the key/value heads and the hidden units: each process holds whole heads
    (a head's softmax needs all of its dimensions) and an equal share of the feed-forward."""
    world = check_size(owner, "world", world)
    for arg, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("d_ff", d_ff)):
        if n is not None and n % world:
            raise ValueError(f"{owner}: world={world} must divide {arg}={n} (each process holds {arg} / world)")
    return world


def shard(x, axis: int | None, rank: int, world: int):
    """Process `rank`'s part of `x` (an array or tensor) along `axis`: the rank-th of `world` equal contiguous
    slices (None: all of x)."""
    if axis is None:
        return x
    n = x.shape[axis]
    if n % world:
        raise ValueError(f"shard: world={world} must divide the size {n} of axis {axis}")
    index = [slice(None)] * x.ndim
    index[axis] = slice(rank * n // world, (rank + 1) * n // world)
    return x[tuple(index)]


def unshard(parts: list, axis: int | None):
    """The inverse of `shard`: the processes' parts (NumPy arrays) joined along `axis`; None: the parts are copies
    and must agree: the first is returned."""
    return parts[0] if axis is None else np.concatenate(parts, axis=axis)


def tensor_parallel_payload(n_tokens: int, d_model: int, itemsize: int, n_layers: int = 1, backward: bool = True):
    """Elements' bytes all-reduced by each process of a tensor-parallel stack of `n_layers` blocks for a batch of
    `n_tokens` positions: per block one (n_tokens, d_model) activation after the attention and one after the
    feed-forward in the forward, and the same two gradients in the backward. Independent of world."""
    per_sublayer = n_tokens * d_model * itemsize
    return per_sublayer * 2 * n_layers * (2 if backward else 1)


def ring_all_reduce_bytes(payload: int, world: int) -> int:
    """What each process sends in a ring all-reduce of `payload` bytes: 2 (W - 1) / W of it (chapter 20a)."""
    return 2 * (world - 1) * payload // world


# -- pipeline schedules -----------------------------------------------------------------------------------------------
SCHEDULES = ("gpipe", "1f1b")


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """The blocks of each stage: contiguous, sizes differing by at most one (the first stages get the extra)."""
    n_layers, n_stages = (
        check_size("stage_layers", "n_layers", n_layers),
        check_size("stage_layers", "n_stages", n_stages),
    )
    if n_stages > n_layers:
        raise ValueError(f"stage_layers: n_stages={n_stages} must be at most n_layers={n_layers}")
    edges = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n_layers), n_stages)])
    return [range(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def check_pipeline(owner: str, n_stages: int, micro_batches: int, batch_size: int | None = None, schedule="gpipe"):
    """n_stages >= 1, micro_batches m >= 1 dividing the batch (equal micro-batches), a known schedule."""
    n_stages = check_size(owner, "n_stages", n_stages)
    m = check_size(owner, "micro_batches", micro_batches)
    check_choice(owner, "schedule", schedule, SCHEDULES)
    if batch_size is not None and batch_size % m:
        raise ValueError(f"{owner}: micro_batches={m} must divide the batch size {batch_size}")
    return n_stages, m


def pipeline_schedule(n_stages: int, micro_batches: int, schedule: str = "gpipe") -> list[list[tuple[str, int]]]:
    """Each stage's operations in order. "gpipe": all m forwards, then all m backwards (last micro-batch first:
    the order the gradients arrive in). "1f1b" (PipeDream-flush, Narayanan et al. 2021): stage s first runs
    p - 1 - s forwards (warm-up), then alternates one forward, one backward, then drains the backwards: at most
    p - s micro-batches' activations held at once, instead of m."""
    p, m = check_pipeline("pipeline_schedule", n_stages, micro_batches, schedule=schedule)
    out = []
    for s in range(p):
        if schedule == "gpipe":
            ops = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        else:
            warm = min(p - 1 - s, m)
            ops = [("F", i) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i), ("B", i)]
            ops += [("B", i) for i in range(m - warm, m)]
        out.append(ops)
    return out


def simulate_schedule(schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> list[list[tuple]]:
    """Run a schedule on a clock: every forward takes t_forward, every backward t_backward, sending takes no
    time; each operation starts when its stage is free and its input has arrived. Returns per stage
    [(op, micro, start, end), ...]."""
    t_forward = check_real("simulate_schedule", "t_forward", t_forward, 0.0)
    t_backward = check_real("simulate_schedule", "t_backward", t_backward, 0.0)
    p = len(schedule)
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * p, [0] * p
    out: list[list[tuple]] = [[] for _ in range(p)]
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(schedule[s]):
                continue
            op, i = schedule[s][pos[s]]
            dep = (op, i, s - 1) if op == "F" else (op, i, s + 1)
            if 0 <= dep[2] < p and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0))
            end = start + (t_forward if op == "F" else t_backward)
            done[(op, i, s)] = free[s] = end
            out[s].append((op, i, start, end))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise ValueError("simulate_schedule: the schedule deadlocks (an operation waits for one never run)")
    return out


def bubble_fraction(timeline) -> float:
    """The share of stage-time spent idle between the first start and the last end: 1 - busy / (p * makespan).
    `timeline`: per stage [(op, micro, start, end), ...] (simulated, or measured from a real run's clock)."""
    t0 = min(e[2] for st in timeline for e in st)
    t1 = max(e[3] for st in timeline for e in st)
    busy = sum(e[3] - e[2] for st in timeline for e in st)
    return 1.0 - busy / (len(timeline) * (t1 - t0))


def gpipe_bubble(n_stages: int, micro_batches: int) -> float:
    """GPipe's bubble, (p - 1) / (m + p - 1): the p - 1 slots at each end where some stage waits."""
    p, m = check_pipeline("gpipe_bubble", n_stages, micro_batches)
    return (p - 1) / (m + p - 1)


def peak_in_flight(ops) -> int:
    """The most micro-batches whose forward ran and backward did not, at any moment of one stage's ops: the
    activations it holds at once."""
    held = peak = 0
    for op, _ in ops:
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak


def schedule_order(timeline) -> list[list[tuple[str, int]]]:
    """The (op, micro) order of a timeline, per stage: to check a real run against its schedule."""
    return [[(e[0], e[1]) for e in st] for st in timeline]
