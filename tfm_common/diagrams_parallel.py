"""Diagrams of data parallelism (chapter 20a): the ring all-reduce step by step, and what each ZeRO stage shards.

Each function returns a `matplotlib.figure.Figure` built with the object API (no pyplot state, as
`tfm_common.plotting`), with the library's names on it: `RingMember.reduce_scatter`, `all_gather`, `all_reduce`,
`ring_bytes`, ranks and chunks as `tfm_numpy.parallel` numbers them, `train_data_parallel(..., zero=True)`,
`train_ddp(..., shard=True)`, Adam's `exp_avg` and `exp_avg_sq`. The ring's schedule is computed by `ring_steps`
with RingMember's own index rules; the tests run the real RingMember and compare what each worker sends.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

__all__ = ["ring_steps", "plot_ring_allreduce", "zero_bytes_per_parameter", "plot_zero_sharding"]

_RANKS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _world(owner: str, world, largest: int = 8) -> int:
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or not 2 <= world <= largest:
        raise ValueError(f"{owner}: world expected an integer from 2 to {largest}, got {world!r}")
    return int(world)


def ring_steps(world: int) -> list[dict]:
    """The ring all-reduce of `world` workers, step by step, with RingMember's index rules.

    Worker r starts with its own vector, cut in `world` chunks. Reduce-scatter step s (0 .. W-2): r sends chunk
    (r - s - 1) mod W to r + 1 and adds what it receives from r - 1 into chunk (r - s - 2) mod W. All-gather step s:
    r sends chunk (r - s) mod W (complete) and stores the one it receives in chunk (r - s - 1) mod W.

    Returns one dict per step: "phase" ("reduce-scatter" or "all-gather"), "step" (s + 1), "sends" (per rank, the
    chunk index it sends and the ranks whose contributions that chunk holds, a frozenset), "received" (per rank, the
    chunk it received into), and "state" after the step: state[r][c] = the ranks whose vectors are summed in
    worker r's chunk c.
    """
    w = _world("ring_steps", world, largest=64)
    state = [[frozenset([r]) for _ in range(w)] for r in range(w)]
    steps = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(w - 1):
            if phase == "reduce-scatter":
                chunks = [((r - s - 1) % w, (r - s - 2) % w) for r in range(w)]  # (sent, received into)
            else:
                chunks = [((r - s) % w, (r - s - 1) % w) for r in range(w)]
            sends = [(sent, state[r][sent]) for r, (sent, _) in enumerate(chunks)]
            new = [row[:] for row in state]
            for r, (_, into) in enumerate(chunks):
                got = sends[(r - 1) % w][1]  # from the left neighbor
                new[r][into] = state[r][into] | got if phase == "reduce-scatter" else got
            state = new
            received = [into for _, into in chunks]
            steps.append({"phase": phase, "step": s + 1, "sends": sends, "received": received, "state": state})
    return steps


def _grid(ax, state, world, received=None, title=""):
    """Rows: ranks; columns: chunks. A cell lists the ranks summed in it; darker = more of them; red edge = received."""
    for r in range(world):
        for c in range(world):
            have = state[r][c]
            full = len(have) == world
            face = "#08519c" if full else (*_hex_rgb(_RANKS[r % len(_RANKS)]), 0.15 + 0.6 * (len(have) - 1) / world)
            edge = "firebrick" if received and received[r] == c else "black"
            ax.add_patch(Rectangle((c, world - 1 - r), 1, 1, facecolor=face, edgecolor=edge,
                                   lw=2.4 if edge == "firebrick" else 0.6))  # fmt: skip
            text = "Σ" if full else "+".join(str(i) for i in sorted(have))
            ax.text(c + 0.5, world - 0.5 - r, text, ha="center", va="center", fontsize=8 if len(text) < 4 else 6.5,
                    color="white" if full else "black")  # fmt: skip
    ax.set_xlim(0, world)
    ax.set_ylim(0, world)
    ax.set_xticks(np.arange(world) + 0.5, [str(c) for c in range(world)], fontsize=7)
    ax.set_yticks(np.arange(world) + 0.5, [f"rank {r}" for r in reversed(range(world))], fontsize=7)
    ax.tick_params(length=0)
    ax.set_xlabel("chunk", fontsize=7, labelpad=1)
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=8.5)


def _hex_rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))


def _ring(ax, world):
    """The ring itself: W workers on a circle, each sending to its right neighbor, rank + 1."""
    angle = np.pi / 2 - 2 * np.pi * np.arange(world) / world
    xy = np.stack([np.cos(angle), np.sin(angle)], axis=1)
    for r in range(world):
        ax.add_patch(FancyArrowPatch(xy[r], xy[(r + 1) % world], arrowstyle="-|>", mutation_scale=12, shrinkA=14,
                                     shrinkB=14, connectionstyle="arc3,rad=-0.25", color="dimgray"))  # fmt: skip
        ax.text(*xy[r], f"rank {r}", ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", facecolor=_RANKS[r % len(_RANKS)], alpha=0.35))  # fmt: skip
    ax.text(0, 0, "each sends\nto rank + 1", ha="center", va="center", fontsize=7.5, color="dimgray")
    ax.set_xlim(-1.45, 1.45)
    ax.set_ylim(-1.45, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"a ring of W = {world} workers", fontsize=8.5)


def plot_ring_allreduce(world: int = 4) -> Figure:
    """RingMember.all_reduce for `world` workers: the ring, the starting chunks, then every step of reduce_scatter
    and of all_gather. In each grid a row is a rank, a column a chunk (columns 0 .. W-1 of the flat gradient, cut by
    np.array_split), a cell lists whose gradients it sums (Σ: all W); a red edge marks the chunk a rank received."""
    w = _world("plot_ring_allreduce", world)
    steps = ring_steps(w)
    fig = Figure(figsize=(2.3 * (2 * w) + 0.6, 3.8), layout="constrained")
    axes = fig.subplots(1, 2 * w, width_ratios=(1.15,) + (1,) * (2 * w - 1))
    _ring(axes[0], w)
    _grid(axes[1], [[frozenset([r])] * w for r in range(w)], w, title="start: each rank\nits own gradient")
    for ax, st in zip(axes[2:], steps, strict=True):
        title = f"{st['phase']}\nstep {st['step']} of {w - 1}"
        _grid(ax, st["state"], w, st["received"], title)
    fig.suptitle(
        f"RingMember.all_reduce = reduce_scatter, then all_gather: {2 * (w - 1)} steps, each worker sends one chunk "
        f"(n/W) per step to rank + 1.\nafter reduce_scatter, rank r holds chunk r of the sum: "
        f"2(W − 1) messages and ring_bytes(n_bytes, W) = 2(W − 1)/W · n_bytes per worker",
        fontsize=10,
    )
    return fig


_SCHEMES = {  # which of (weights, gradients, Adam moments) each scheme shards over the W workers
    "DDP (replicated)": (False, False, False),
    "ZeRO-1 (optimizer)": (False, False, True),
    "ZeRO-2 (+ gradients)": (False, True, True),
    "ZeRO-3 / FSDP (+ weights)": (True, True, True),
}
_BYTES = (4, 4, 8)  # float32 bytes per parameter: weights, gradients, Adam's exp_avg and exp_avg_sq
_LIBRARY = {
    "DDP (replicated)": "train_data_parallel(...)\ntrain_ddp(...): DDP\nall_reduce",
    "ZeRO-1 (optimizer)": "(not in the library)\nreduce_scatter + all_gather",
    "ZeRO-2 (+ gradients)": "train_data_parallel(..., zero=True)\nreduce_scatter + all_gather",
    "ZeRO-3 / FSDP (+ weights)": "train_ddp(..., shard=True): fully_shard\nall_gather per layer, fwd and bwd\n"
    "+ reduce_scatter: 1.5× the bytes",
}


def zero_bytes_per_parameter(scheme: str, world: int) -> float:
    """Float32 bytes per parameter held by each of `world` workers: weights 4, gradients 4, Adam's moments 8, each
    divided by world where `scheme` (a key of the chapter's table: "DDP (replicated)", "ZeRO-1 (optimizer)",
    "ZeRO-2 (+ gradients)", "ZeRO-3 / FSDP (+ weights)") shards it."""
    if scheme not in _SCHEMES:
        raise ValueError(f"zero_bytes_per_parameter: scheme expected one of {list(_SCHEMES)}, got {scheme!r}")
    w = _world("zero_bytes_per_parameter", world, largest=10**6)
    return sum(b / w if sharded else b for b, sharded in zip(_BYTES, _SCHEMES[scheme], strict=True))


def plot_zero_sharding(world: int = 4) -> Figure:
    """What each worker holds, scheme by scheme: one row per kind of state (weights, gradients, Adam's exp_avg and
    exp_avg_sq), one bar per rank; a full bar is a replica, a bar filled in its own 1/W is rank r's shard."""
    w = _world("plot_zero_sharding", world)
    fig = Figure(figsize=(14, 4.6), layout="constrained")
    axes = fig.subplots(1, len(_SCHEMES))
    kinds = ["weights (4 B)", "gradients (4 B)", "Adam: exp_avg,\nexp_avg_sq (8 B)"]
    for ax, (scheme, sharded) in zip(axes, _SCHEMES.items(), strict=True):
        for k, (shard, nbytes) in enumerate(zip(sharded, _BYTES, strict=True)):
            y0 = (2 - k) * (w + 1.2)
            height = nbytes / 4  # bar thickness ~ bytes per parameter
            for r in range(w):
                y = y0 + (w - 1 - r) * 1.0
                ax.add_patch(Rectangle((0, y), 1, 0.8 * height / 2, facecolor="white", edgecolor="lightgray", lw=0.6))
                x, width = (r / w, 1 / w) if shard else (0, 1)
                ax.add_patch(Rectangle((x, y), width, 0.8 * height / 2, facecolor=_RANKS[r % len(_RANKS)],
                                       alpha=0.75, edgecolor="black", lw=0.6))  # fmt: skip
            ax.text(-0.04, y0 + (w - 1) / 2 + 0.4, kinds[k], ha="right", va="center", fontsize=8)
            ax.text(1.04, y0 + (w - 1) / 2 + 0.4, "sharded: 1/W each" if shard else "replicated", ha="left",
                    va="center", fontsize=7.5, color="firebrick" if shard else "dimgray")  # fmt: skip
        per = zero_bytes_per_parameter(scheme, w)
        ax.set_title(f"{scheme}\n{per:g} bytes per parameter and worker (W = {w})", fontsize=9)
        ax.text(0.5, -1.0, _LIBRARY[scheme], ha="center", va="top", fontsize=7.5, family="monospace")
        ax.set_xlim(-0.9, 1.45)
        ax.set_ylim(-3.6, 3 * (w + 1.2))
        ax.axis("off")
    fig.suptitle(f"What each of W = {w} workers holds (one bar per rank, rank 0 on top; float32, Adam): "
                 "ZeRO stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the weights",
                 fontsize=10)  # fmt: skip
    return fig
