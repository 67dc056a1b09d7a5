"""The diagram of a mixture-of-experts layer (chapter 20c): the router's probabilities, each token's top_k choices,
the experts' capacity slots filled in service order, and the assignments dropped past the capacity.

The function returns a `matplotlib.figure.Figure` built with the object API (no pyplot state, as
`tfm_common.plotting`), with the library's names on it: `MoEFeedForward(d_model, d_ff, n_experts, top_k,
capacity_factor=...)`, its `router.weight` and `experts.{e}.linear1.weight` with their shapes, the capacity
C = ceil(capacity_factor N k / E). What it draws is the library's routing: `tfm_common.moe.route` of the
probabilities given (the tests compare every slot and every dropped assignment with it).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from .moe import check_capacity_factor, expert_capacity, route
from .validate import check_size

__all__ = ["plot_moe_routing", "example_router_probs"]

_EXPERTS = ["#c6dbef", "#fdd9a6", "#c7e9c0", "#e8dff5", "#f2cfe6", "#fff3b0", "#d9d9d9", "#bfe3e0"]
_DROP = "tab:red"


def example_router_probs(n_tokens: int = 8, n_experts: int = 4, seed: int = 0, skew: float = 1.5) -> np.ndarray:
    """(n_tokens, n_experts) softmax rows of random logits N(0, skew^2), expert 0 favoured by +skew / 2: a router
    with a mild preference, so that a capacity factor of 1 drops something."""
    logits = skew * np.random.default_rng(seed).standard_normal((n_tokens, n_experts))
    logits[:, 0] += skew / 2
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _box(ax, x, y, w, h, face, text="", gid=None, fontsize=8.5, edge="black", lw=1.0, **kw):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=face, edgecolor=edge, lw=lw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, gid=gid, **kw)


def plot_moe_routing(probs: np.ndarray | None = None, top_k: int = 2, capacity_factor: float | None = 1.0,
                     d_model: int = 64, d_ff: int = 256) -> Figure:  # fmt: skip
    """Left: the router's probabilities (N tokens x E experts), each token's top_k choices framed and numbered
    (1 = best). Right: each expert's C capacity slots, filled by `route` in its service order (every token's first
    choice, in token order, then the second choices, ...), and under it, in red, the assignments it dropped.
    `probs` (N, E) rows of probabilities (default: `example_router_probs()`); capacity_factor None: no limit."""
    owner = "plot_moe_routing"
    probs = example_router_probs() if probs is None else np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] < 1 or not 1 <= probs.shape[1] <= len(_EXPERTS):
        raise ValueError(f"{owner}: probs expected shape (N, E) with N >= 1 and 1 <= E <= {len(_EXPERTS)}, "
                         f"got {probs.shape}")  # fmt: skip
    N, E = probs.shape
    top_k = check_size(owner, "top_k", top_k)
    if top_k > E:
        raise ValueError(f"{owner}: top_k must be <= n_experts={E}, got top_k={top_k}")
    cf = check_capacity_factor(owner, capacity_factor)
    C = expert_capacity(N, E, top_k, cf)
    r = route(probs, top_k, C)
    slots = C if C is not None else int(r.kept.max(initial=1))

    fig = Figure(figsize=(14, 6.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1, 1.7))

    # -- the router -------------------------------------------------------------------------------------------------
    left.imshow(probs, cmap="Greys", vmin=0, vmax=1.6, aspect="auto")
    for n in range(N):
        for e in range(E):
            left.text(e, n, f"{probs[n, e]:.2f}", ha="center", va="center", fontsize=8)
        for j, e in enumerate(r.experts[n]):
            color = "black" if r.keep[n, j] else _DROP
            left.add_patch(Rectangle((e - 0.45, n - 0.45), 0.9, 0.9, fill=False, edgecolor=color, lw=2.2))
            left.text(
                e + 0.42, n - 0.42, str(j + 1), ha="right", va="top", fontsize=7, color=color, gid=f"rank {n} {j}"
            )
    left.set_xticks(range(E), [f"expert {e}" for e in range(E)], fontsize=8)
    left.set_yticks(range(N), [f"token {n}" for n in range(N)], fontsize=8)
    left.set_title(f"router: p = softmax(x · router.weightᵀ), (N, E) = ({N}, {E})\nframed: the top_k = {top_k} "
                   "choices (1 = best); red: dropped", fontsize=9.5)  # fmt: skip

    # -- the experts and their slots ----------------------------------------------------------------------------------
    w, h, gap = 1.5, 0.52, 0.4
    for e in range(E):
        x0 = e * (w + gap)
        tokens, ranks = r.groups[e]
        right.text(x0 + w / 2, slots + 1.15, f"expert {e}", ha="center", fontsize=9.5, fontweight="bold")
        right.text(x0 + w / 2, slots + 0.72, f"FFN {e}: {d_model}→{d_ff}→{d_model}", ha="center", fontsize=7.5)
        for i in range(slots):
            y = slots - 1 - i + (1 - h) / 2
            if i < len(tokens):
                label = f"token {tokens[i]} (choice {ranks[i] + 1})"
                _box(right, x0, y, w, h, _EXPERTS[e], label, gid=f"slot {e} {i}", fontsize=7.5)
            else:
                _box(right, x0, y, w, h, "white", "(empty)", gid=f"slot {e} {i}", fontsize=7, color="gray", edge="gray")
        lost = [(n, j) for n, j in zip(*np.nonzero(~r.keep), strict=True) if r.experts[n, j] == e]
        for i, (n, j) in enumerate(lost):
            right.text(x0 + w / 2, -0.45 - 0.42 * i, f"✗ token {n} (choice {j + 1})", ha="center", va="center",
                       fontsize=7.5, color=_DROP, gid=f"dropped {e} {i}")  # fmt: skip
    n_lost = max([int(((~r.keep) & (r.experts == e)).sum()) for e in range(E)], default=0)
    limit = (
        "no capacity limit (capacity_factor=None)"
        if C is None
        else (f"capacity C = ceil(capacity_factor · N · top_k / E) = ceil({cf:g} · {N} · {top_k} / {E}) = {C} slots")
    )
    right.text((E * (w + gap) - gap) / 2, slots + 1.75, limit, ha="center", fontsize=9.5)
    right.text(0, -0.75 - 0.42 * n_lost,
               f"y_n = Σ_j keep[n, j] · g[n, j] · FFN_e(n, j)(x_n);  dropped: {r.dropped} of {r.keep.size} assignments"
               f" ({r.dropped_share:.0%})\nstate_dict: router.weight ({E}, {d_model}); experts.{{e}}.linear1.weight "
               f"({d_ff}, {d_model}), experts.{{e}}.linear2.weight ({d_model}, {d_ff})", ha="left", va="top",
               fontsize=8.5)  # fmt: skip
    right.set_xlim(-0.2, E * (w + gap))
    right.set_ylim(-1.6 - 0.42 * n_lost, slots + 2.1)
    right.axis("off")
    right.set_title(f"MoEFeedForward({d_model}, {d_ff}, n_experts={E}, top_k={top_k}, capacity_factor={cf}): "
                    "each expert's slots, served first choices first", fontsize=9.5)  # fmt: skip
    return fig
