"""Diagrams of model parallelism (chapter 20b): which slice of each weight a process holds under tensor parallelism
(Megatron's split of a GPT block) and what crosses between them; a pipeline schedule as a timeline per stage.

Each function returns a `matplotlib.figure.Figure` built with the object API, with the library's names on it:
`q_proj`, `k_proj`, `v_proj`, `out_proj`, `linear1`, `linear2` (the GPT block's state_dict keys), `all_reduce`,
`pipeline_schedule`, `simulate_schedule`. The slices drawn are `tfm_common.model_parallel.shard`'s, along
`shard_axis`'s axes; the pipeline diagram draws any timeline: simulated or measured in a real run.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from .model_parallel import bubble_fraction, shard, shard_axis

__all__ = ["tensor_split_layout", "plot_tensor_split", "plot_pipeline_timeline"]

_RANKS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.out_proj.weight", "ff.linear1.weight", "ff.linear2.weight")  # fmt: skip


def tensor_split_layout(d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, world: int) -> dict:
    """{key: (shape, [per rank: (row slice, column slice)])}: the part of each block weight that each rank holds,
    found by applying `shard` along `shard_axis(key)` to an index grid of the weight."""
    kv = n_kv_heads * (d_model // n_heads)
    shapes = dict(zip(WEIGHTS, [(d_model, d_model), (kv, d_model), (kv, d_model), (d_model, d_model),
                                (d_ff, d_model), (d_model, d_ff)], strict=True))  # fmt: skip
    out = {}
    for key, (rows, cols) in shapes.items():
        grid_r, grid_c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        parts = []
        for r in range(world):
            sr, sc = shard(grid_r, shard_axis(key), r, world), shard(grid_c, shard_axis(key), r, world)
            parts.append(((int(sr.min()), int(sr.max()) + 1), (int(sc.min()), int(sc.max()) + 1)))
        out[key] = ((rows, cols), parts)
    return out


def plot_tensor_split(d_model: int = 16, n_heads: int = 4, n_kv_heads: int = 4, d_ff: int = 32, world: int = 2):
    """Each weight of a GPT block drawn as a rectangle (rows = outputs, as stored), the part each rank holds
    colored by rank; between the sublayers, the all-reduce that sums the ranks' partial outputs (forward) and the
    one that sums the partial input gradients (backward)."""
    layout = tensor_split_layout(d_model, n_heads, n_kv_heads, d_ff, world)
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_axes([0.01, 0.02, 0.98, 0.86])
    ax.set_axis_off()
    scale, x, gap = 1.6 / max(d_model, d_ff), 0.0, 0.35
    ax.text(-0.2, 1.45, "x (B, T, d)\nthe same on\nevery rank", ha="right", va="center", fontsize=8)
    for i, key in enumerate(WEIGHTS):
        (rows, cols), parts = layout[key]
        w, h = cols * scale, rows * scale
        y0 = 1.45 - h / 2
        ax.add_patch(Rectangle((x, y0), w, h, fill=False, lw=1.0))
        for r, ((r0, r1), (c0, c1)) in enumerate(parts):
            ax.add_patch(Rectangle((x + c0 * scale, y0 + (rows - r1) * scale), (c1 - c0) * scale, (r1 - r0) * scale,
                                   color=_RANKS[r % 4], alpha=0.55, lw=0))  # fmt: skip
        axis = "rows" if shard_axis(key) == 0 else "columns"
        ax.text(x + w / 2, y0 + h + 0.08, f"{key.split('.')[1]}\n{rows} x {cols}\nby {axis}", ha="center",
                va="bottom", fontsize=8)  # fmt: skip
        x += w + gap
        if i in (3, 5):
            ax.add_patch(FancyArrowPatch((x - gap + 0.02, 1.45), (x + 0.35, 1.45), arrowstyle="-|>", mutation_scale=10))
            ax.text(x + 0.16, 0.35, "all_reduce\n(B, T, d)\nforward;\nand its twin\nin backward", ha="center",
                    va="bottom", fontsize=8, color="#d62728")  # fmt: skip
            x += 0.6
    for r in range(world):
        ax.add_patch(Rectangle((0.0 + 0.9 * r, -0.25), 0.12, 0.12, color=_RANKS[r % 4], alpha=0.55, lw=0))
        ax.text(0.15 + 0.9 * r, -0.19, f"rank {r}", va="center", fontsize=8)
    ax.text(1.0 + 0.9 * world, -0.19, "norms, embeddings and the biases added after an all-reduce: on every rank",
            va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(-1.2, x + 0.2)
    ax.set_ylim(-0.4, 3.3)
    fig.suptitle(f"Tensor parallelism over world={world}: attention by heads ({n_heads // world} per rank), "
                 f"feed-forward by hidden units ({d_ff // world} per rank)", fontsize=10)  # fmt: skip
    return fig


def plot_pipeline_timeline(timelines: dict, t_unit: str = "slots") -> Figure:
    """{title: timeline} -> one panel per timeline: per stage, every forward ("F i", light) and backward
    ("B i", dark) as a bar over its start..end; the idle time left blank, its share (`bubble_fraction`) in the
    panel's title."""
    fig = Figure(figsize=(10, 1.0 + 1.3 * len(timelines)))
    axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
    for ax, (title, timeline) in zip(axes, timelines.items(), strict=True):
        p = len(timeline)
        t0 = min(e[2] for st in timeline for e in st)
        for s, ops in enumerate(timeline):
            for op, i, start, end in ops:
                color = _RANKS[i % 4]
                ax.barh(p - 1 - s, end - start, left=start - t0, color=color, alpha=0.45 if op == "F" else 0.9,
                        edgecolor="black", lw=0.4)  # fmt: skip
                ax.text((start + end) / 2 - t0, p - 1 - s, f"{op}{i}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(p), [f"stage {s}" for s in reversed(range(p))])
        ax.set_title(f"{title}: bubble {bubble_fraction(timeline):.2f}", fontsize=9)
        ax.set_xlabel(t_unit, fontsize=8)
    fig.tight_layout()
    return fig
