"""The diagram of expert parallelism (chapter 20d): who holds which experts, and what crosses in each exchange.

`plot_expert_parallel` draws `world` processes side by side, each with its tokens, a copy of the router, and the
experts `expert_owner` gives it (contiguous blocks), and between them the rows of each all-to-all: the dispatch
(tokens out to their experts' processes), the combine (the experts' answers back), and in the backward the same
two exchanges reversed. The numbers on the arrows are rows sent from one process to another, computed from the
routing's expert choices with `dispatch_plan` (the library's own bookkeeping); the tests compare them with what a
real run of `ExpertParallelMoE` sends.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from .expert_parallel import check_expert_split, dispatch_plan

__all__ = ["rows_between", "plot_expert_parallel"]

_RANKS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def rows_between(experts_per_process, n_experts: int, world: int) -> np.ndarray:
    """(world, world) int: rows[s, d] = the assignments of process s's tokens that go to process d's experts (the
    diagonal stays home), from each process's (N_s, k) expert choices (no capacity: every assignment kept)."""
    if len(experts_per_process) != world:
        raise ValueError(
            f"rows_between: expected one (N, k) array per process ({world}), got {len(experts_per_process)}"
        )
    return np.stack([dispatch_plan(e, None, n_experts, world).send_counts for e in experts_per_process])


def plot_expert_parallel(experts_per_process, n_experts: int, world: int = 2, d_model: int | None = None,
                         itemsize: int = 8) -> Figure:  # fmt: skip
    """The layout and the exchanges of one expert-parallel forward and backward, for the routing
    `experts_per_process` (per process, its tokens' (N_s, k) expert choices). world: 2 to 4. With d_model, the
    arrows also give the bytes (rows * d_model * itemsize)."""
    n_local = check_expert_split("plot_expert_parallel", n_experts, world)
    if not 2 <= world <= 4:
        raise ValueError(f"plot_expert_parallel: world expected 2 to 4, got {world}")
    rows = rows_between(experts_per_process, n_experts, world)
    fig = Figure(figsize=(4.2 * world + 1.5, 5.2), layout="constrained")
    ax = fig.add_subplot()
    width, gap = 3.0, 1.6
    xs = [r * (width + gap) for r in range(world)]
    for r, x0 in enumerate(xs):
        color = _RANKS[r]
        ax.add_patch(Rectangle((x0, 0), width, 6.2, facecolor="white", edgecolor=color, lw=2))
        ax.text(x0 + width / 2, 6.45, f"process {r} (rank {r})", ha="center", fontsize=10, color=color, weight="bold")
        n_tok, k = np.shape(experts_per_process[r])
        ax.add_patch(Rectangle((x0 + 0.2, 4.9), width - 0.4, 0.9, facecolor="#eeeeee", edgecolor="gray"))
        ax.text(x0 + width / 2, 5.35, f"its tokens: {n_tok}\nrouter (a copy): top-{k}",
                ha="center", va="center", fontsize=8)  # fmt: skip
        for j in range(n_local):
            e = r * n_local + j
            y = 3.6 - j * (2.6 / n_local)
            ax.add_patch(Rectangle((x0 + 0.35, y - 0.1), width - 0.7, 2.6 / n_local - 0.25, facecolor=color,
                                   alpha=0.25, edgecolor=color))  # fmt: skip
            ax.text(x0 + width / 2, y + (2.6 / n_local - 0.25) / 2 - 0.1, f"expert {e}", ha="center", va="center",
                    fontsize=9)  # fmt: skip
        ax.text(x0 + width / 2, 0.3, f"its experts compute {int(rows[:, r].sum())} rows\n(keeps "
                f"{int(rows[r, r])} of its own rows at home)", ha="center", fontsize=8, color="dimgray")  # fmt: skip
    for s in range(world):
        for d in range(world):
            if s == d:
                continue
            lo, hi = (s, d) if s < d else (d, s)
            x_from = xs[s] + (width if s < d else 0)
            x_to = xs[d] + (0 if s < d else width)
            lane = 0.35 * (lo + hi) + (0 if s < d else 0.9)
            y = 4.3 - lane
            n = int(rows[s, d])
            label = f"dispatch {s}→{d}: {n} rows" + (f" ({n * d_model * itemsize} B)" if d_model else "")
            ax.add_patch(FancyArrowPatch((x_from, y), (x_to, y), arrowstyle="-|>", mutation_scale=12,
                                         color=_RANKS[s], lw=1.5))  # fmt: skip
            ax.text((x_from + x_to) / 2, y + 0.08, label, ha="center", va="bottom", fontsize=7.5, color=_RANKS[s])
            ax.add_patch(FancyArrowPatch((x_to, y - 0.35), (x_from, y - 0.35), arrowstyle="-|>", mutation_scale=10,
                                         color=_RANKS[d], lw=1.0, ls="--"))  # fmt: skip
            ax.text((x_from + x_to) / 2, y - 0.3, f"combine {d}→{s}: {n} answers", ha="center", va="bottom",
                    fontsize=7, color=_RANKS[d])  # fmt: skip
    ax.set_xlim(-0.3, xs[-1] + width + 0.3)
    ax.set_ylim(-0.2, 6.9)
    ax.axis("off")
    fig.suptitle(
        f"ExpertParallelMoE: {n_experts} experts over {world} processes ({n_local} each, expert_owner: contiguous "
        "blocks); each process routes its own tokens.\nforward: the dispatch all-to-all (rows out), the experts, "
        "the combine all-to-all (answers back)\nbackward: the combine reversed (dL/d answers out), the experts' "
        "backward, the dispatch reversed (dL/dx home)",
        fontsize=9.5,
    )
    return fig
