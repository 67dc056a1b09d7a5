"""Diagrams of two parts the models since 2017 changed (chapter 18): RoPE's rotation and GQA's head grouping.

Each function returns a `matplotlib.figure.Figure` built with the object API (no pyplot state, as
`tfm_common.plotting`), with the library's names on it: `RotaryEmbedding(d_head, max_len, base)`, `apply_rope`,
the `(max_len, d_head / 2)` tables of cos and sin; `GroupedQueryAttention`'s `n_heads`, `n_kv_heads`, `d_head`,
`repeat_kv` and the `state_dict` keys of a GPT layer (`layers.{i}.self_attn.k_proj.weight`, ...) with their shapes.
The angles are computed with the library's formula, w_i = base^(-2i / d_head); the tests compare them with
`tfm_numpy.rope_angles` and the drawn keys and shapes with a real GPT's `state_dict()`.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Arc, FancyBboxPatch

__all__ = ["plot_rope_rotation", "plot_gqa_heads", "rope_frequencies", "kv_head_of"]

_Q, _K = "tab:blue", "tab:orange"  # queries and keys, the same in every panel
_GROUPS = ["#c6dbef", "#fdd9a6", "#c7e9c0", "#e8dff5", "#f2cfe6", "#fff3b0", "#d9d9d9", "#bfe3e0"]


def _positive_int(owner: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{owner}: {name} expected {kind}, got {value!r}")
    return int(value)


def rope_frequencies(d_head: int, base: float = 10000.0) -> np.ndarray:
    """w_i = base^(-2i / d_head) for the d_head / 2 pairs (x[2i], x[2i+1]): the angle per position of pair i."""
    d_head = _positive_int("rope_frequencies", "d_head", d_head)
    if d_head % 2:
        raise ValueError(f"rope_frequencies: d_head must be even (the columns rotate in pairs), got {d_head}")
    return base ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)


def _rotate(v, theta):
    c, s = np.cos(theta), np.sin(theta)
    return np.array([v[0] * c - v[1] * s, v[0] * s + v[1] * c])


def _pair_panel(ax, q, k, p, s, omega, title):
    """One pair's plane: q rotated by p w, k by s w, the unrotated vectors dashed, the angle between them marked."""
    qr, kr = _rotate(q, p * omega), _rotate(k, s * omega)
    for v, color, ls in ((q, _Q, ":"), (k, _K, ":"), (qr, _Q, "-"), (kr, _K, "-")):
        ax.annotate("", xy=v, xytext=(0, 0), arrowprops=dict(arrowstyle="-|>", color=color, lw=1.6, ls=ls))
    ax.text(*(1.13 * q), "q", color=_Q, ha="center", va="center", fontsize=9)
    ax.text(*(1.13 * k), "k", color=_K, ha="center", va="center", fontsize=9)
    ax.text(*(1.2 * qr), f"R_{p} q", color=_Q, ha="center", va="center", fontsize=10, fontweight="bold")
    ax.text(*(1.2 * kr), f"R_{s} k", color=_K, ha="center", va="center", fontsize=10, fontweight="bold")
    a_q, a_k = np.degrees(np.arctan2(qr[1], qr[0])), np.degrees(np.arctan2(kr[1], kr[0]))
    lo, hi = (a_q, a_k) if (a_k - a_q) % 360 < 180 else (a_k, a_q)
    ax.add_patch(Arc((0, 0), 0.7, 0.7, theta1=lo, theta2=hi if hi > lo else hi + 360, color="dimgray", lw=1.2))
    ax.add_patch(Arc((0, 0), 2.0, 2.0, theta1=0, theta2=360, color="lightgray", lw=0.8, ls="--"))
    ax.text(0, -1.38, f"angle between them: (s − p)·ω₀ + angle(q, k)\n(R_{p} q)·(R_{s} k) = {qr @ kr:.3f}",
            ha="center", va="center", fontsize=8.5)  # fmt: skip
    ax.set_title(title, fontsize=10)
    ax.set_xlim(-1.45, 1.45)
    ax.set_ylim(-1.7, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")


def plot_rope_rotation(d_head: int = 8, base: float = 10000.0, positions: int = 16, p: int = 2, s: int = 5,
                       shift: int = 4) -> Figure:  # fmt: skip
    """RoPE in three panels. Left and middle: the plane of pair 0, a query at position p and a key at s, then both
    moved by `shift` positions: each vector turns by its own position times w_0, the angle between them (and so
    their dot product) depends only on s - p. Right: every pair's rotation at positions 0 .. positions - 1, one
    arrow per (position, pair) at the angle position * w_i (what `RotaryEmbedding`'s cos and sin tables hold).
    """
    owner = "plot_rope_rotation"
    positions = _positive_int(owner, "positions", positions)
    for name, value in (("p", p), ("s", s), ("shift", shift)):
        _positive_int(owner, name, value, minimum=0)
    omega = rope_frequencies(d_head, base)
    q, k = np.array([0.95, 0.25]), np.array([0.55, 0.75])  # one pair of a query and of a key, any contents

    fig = Figure(figsize=(14, 5.0), layout="constrained")
    left, middle, right = fig.subplots(1, 3, width_ratios=(1, 1, 1.6))
    title = f"pair 0 (x[0], x[1]), ω₀ = {omega[0]:g}:\nquery at p = {p}, key at s = {s}"
    _pair_panel(left, q, k, p, s, omega[0], title)
    title = f"both {shift} positions later:\np = {p + shift}, s = {s + shift}, the same offset s − p = {s - p}"
    _pair_panel(middle, q, k, p + shift, s + shift, omega[0], title)

    pos = np.arange(positions)
    angle = pos[:, None] * omega[None, :]  # (positions, d_head / 2): what RotaryEmbedding's tables hold
    X, Y = np.meshgrid(pos, np.arange(len(omega)), indexing="ij")
    right.quiver(X, Y, np.cos(angle), np.sin(angle), angles="uv", pivot="middle", scale=1.25, scale_units="xy",
                 width=0.005, color=_Q)  # fmt: skip
    right.set_yticks(range(len(omega)), [f"pair {i}: (x[{2 * i}], x[{2 * i + 1}])\nω{i} = {w:.3g}"
                                         for i, w in enumerate(omega)], fontsize=8)  # fmt: skip
    right.set_xticks(pos[:: max(1, positions // 8)])
    right.set_xlim(-0.8, positions - 0.2)
    right.set_ylim(-0.7, len(omega) - 0.3)
    right.set_xlabel("position p: each arrow points at the angle p·ωᵢ (pair 0 turns fastest, the last pair barely)")
    right.set_title(f"RotaryEmbedding(d_head={d_head}, max_len, base={base:g})\n"
                    "cos, sin: (max_len, d_head/2), ωᵢ = base^(−2i/d_head)", fontsize=10)  # fmt: skip
    fig.suptitle("RoPE: apply_rope turns each pair (x0, x1) → (x0 cos θ − x1 sin θ, x0 sin θ + x1 cos θ), θ = p·ωᵢ\n"
                 "q and k are both rotated (after the split into heads), so q·k depends on the offset s − p only",
                 fontsize=10.5)  # fmt: skip
    return fig


def kv_head_of(h: int, n_heads: int, n_kv_heads: int) -> int:
    """The key/value head that query head h reads: h // (n_heads // n_kv_heads), repeat_kv's layout."""
    return h // (n_heads // n_kv_heads)


def _head_box(ax, x, y, text, color, w=0.86, h=0.6):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", facecolor=color,
                                edgecolor="black", lw=1))  # fmt: skip
    ax.text(x, y, text, ha="center", va="center", fontsize=8)


def _grouping_panel(ax, n_heads, n_kv, d_head, title):
    n_rep = n_heads // n_kv
    for h in range(n_heads):
        _head_box(ax, h, 2.0, f"q\nhead {h}", _GROUPS[kv_head_of(h, n_heads, n_kv) % len(_GROUPS)])
    for j in range(n_kv):
        x = j * n_rep + (n_rep - 1) / 2  # under the middle of its group
        _head_box(ax, x, 0.0, f"k, v\nhead {j}", _GROUPS[j % len(_GROUPS)])
        for h in range(j * n_rep, (j + 1) * n_rep):
            ax.annotate("", xy=(h, 1.68), xytext=(x, 0.32), arrowprops=dict(arrowstyle="-|>", color="dimgray", lw=1))
    ax.text((n_heads - 1) / 2, 2.55, f"q: (B, n_heads, T, d_head) = (B, {n_heads}, T, {d_head})", ha="center",
            fontsize=8.5)  # fmt: skip
    ax.text((n_heads - 1) / 2, -0.6, f"k, v: (B, n_kv_heads, T, d_head) = (B, {n_kv}, T, {d_head})\n"
            f"the cache holds these: 2·n_kv_heads·d_head = {2 * n_kv * d_head} numbers per token and layer",
            ha="center", va="top", fontsize=8.5)  # fmt: skip
    note = f"repeat_kv(k, {n_rep}),\nrepeat_kv(v, {n_rep}):\nn_heads // n_kv_heads = {n_rep}"
    ax.text(n_heads - 0.45, 1.0, note, ha="left", va="center", fontsize=8, color="dimgray")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(-0.6, n_heads + 1.6)
    ax.set_ylim(-1.5, 2.9)
    ax.axis("off")


def plot_gqa_heads(d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2) -> Figure:
    """Grouped-query attention's head grouping for `GroupedQueryAttention(d_model, n_heads, n_kv_heads)`, beside
    its two ends: multi-head (n_kv_heads = n_heads) and multi-query (n_kv_heads = 1). Query head h reads key/value
    head h // (n_heads // n_kv_heads); below, the projections' `state_dict` keys in a GPT layer and their shapes.
    """
    owner = "plot_gqa_heads"
    d_model = _positive_int(owner, "d_model", d_model)
    n_heads = _positive_int(owner, "n_heads", n_heads)
    n_kv_heads = _positive_int(owner, "n_kv_heads", n_kv_heads)
    if d_model % n_heads:
        raise ValueError(f"{owner}: d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    if n_heads % n_kv_heads:
        raise ValueError(f"{owner}: n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
    d_head = d_model // n_heads
    fig = Figure(figsize=(15, 5.2), layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=(3.2, 1))
    ends = [
        (n_heads, "multi-head: n_kv_heads = n_heads"),
        (n_kv_heads, "grouped-query"),
        (1, "multi-query: n_kv_heads = 1"),
    ]
    for col, (n_kv, name) in enumerate(ends):
        ax = fig.add_subplot(grid[0, col])
        _grouping_panel(ax, n_heads, n_kv, d_head, f"{name}\nGroupedQueryAttention({d_model}, {n_heads}, {n_kv})")
    ax = fig.add_subplot(grid[1, :])
    ax.axis("off")
    d_kv = n_kv_heads * d_head
    rows = [
        ("layers.{i}.self_attn.q_proj.weight", "(n_heads·d_head, d_model)", (d_model, d_model)),
        ("layers.{i}.self_attn.k_proj.weight", "(n_kv_heads·d_head, d_model)", (d_kv, d_model)),
        ("layers.{i}.self_attn.v_proj.weight", "(n_kv_heads·d_head, d_model)", (d_kv, d_model)),
        ("layers.{i}.self_attn.out_proj.weight", "(d_model, n_heads·d_head)", (d_model, d_model)),
    ]
    ax.text(0.0, 1.0, f"GPT(..., n_kv_heads={n_kv_heads}), d_model = {d_model}, n_heads = {n_heads}, "
            f"d_head = d_model / n_heads = {d_head}: the projections of each layer", ha="left", va="top",
            fontsize=9, fontweight="bold", transform=ax.transAxes)  # fmt: skip
    for r, (key, symbols, shape) in enumerate(rows):
        y = 0.72 - 0.22 * r
        ax.text(0.0, y, key, ha="left", va="top", fontsize=9, family="monospace", transform=ax.transAxes)
        ax.text(0.3, y, symbols, ha="left", va="top", fontsize=9, transform=ax.transAxes)
        ax.text(0.47, y, f"= {shape}", ha="left", va="top", fontsize=9, transform=ax.transAxes)
    ax.text(0.6, 0.72, f"k_proj and v_proj shrink by n_kv_heads / n_heads = {n_kv_heads}/{n_heads};\n"
            "the backward of repeat_kv sums each group's gradients:\n"
            "grad.reshape(B, n_kv_heads, n_heads // n_kv_heads, T, d_head).sum(axis=2)", ha="left", va="top",
            fontsize=9, transform=ax.transAxes)  # fmt: skip
    return fig
