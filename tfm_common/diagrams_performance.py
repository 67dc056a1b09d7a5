"""Diagrams of the performance chapters, drawn as code (chapter 15b): FlashAttention's tile grid and what stays on
chip while it runs.

Like `tfm_common.plotting`, the figures are built with matplotlib's object API (`matplotlib.figure.Figure`),
never through pyplot's global state: the caller displays or saves them. The names drawn are the library's:
`flash_attention(q, k, v, mask, tile_size=...)` and the running quantities of its online softmax
(`tfm_numpy.flash`: `q_i`, `k_j`, `v_j`, `s`, `m`, `l`, `acc`, `out`, `lse`).
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

__all__ = ["plot_flash_tile_grid"]

# colors by where an array lives: read from main memory, kept on chip, written back, a tile never computed
_READ, _CHIP, _WRITE, _SKIP, _TILE = "#d6e9f8", "#fde2cf", "#d9f0d3", "#eeeeee", "#e8dff5"


def _box(ax, x, y, w, h, color, lines, bold=None, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.03", facecolor=color, edgecolor="black", lw=1))
    text = "\n".join(lines)
    ax.text(
        x + w / 2,
        y + h / 2,
        text,
        ha="center",
        va="center",
        fontsize=fontsize,
        linespacing=1.35,
        fontweight=bold or "normal",
    )


def plot_flash_tile_grid(
    Tq: int = 512,
    Tk: int = 512,
    tile_size: int = 128,
    d_k: int = 64,
    d_v: int | None = None,
    causal: bool = False,
    row: int | None = None,
) -> Figure:
    """The grid of tiles that `flash_attention(q, k, v, mask, tile_size=tile_size)` walks for one head: query
    blocks of Br = tile_size rows by key blocks of Bc = tile_size columns, ceil(Tq / b) x ceil(Tk / b) tiles.

    One query block (`row`, 0-based; default the last) is drawn in progress: its q_i is read from main memory once,
    each tile of its row reads one block k_j, v_j, its scores s (Br, Bc) and the running max m, sum l and output
    accumulator acc stay on chip, and out and lse are written once at the end of the row. With `causal`, the
    tiles above the diagonal (nothing allowed) are drawn as skipped. Returns the Figure.
    """
    d_v = d_k if d_v is None else d_v
    sizes = {"Tq": Tq, "Tk": Tk, "tile_size": tile_size, "d_k": d_k, "d_v": d_v}
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plot_flash_tile_grid: {name} must be a positive integer, got {v!r}")
    n_q, n_k = math.ceil(Tq / tile_size), math.ceil(Tk / tile_size)
    if n_q > 16 or n_k > 16:
        raise ValueError(
            f"plot_flash_tile_grid: at most 16 x 16 tiles can be drawn, got {n_q} x {n_k} "
            f"(Tq={Tq}, Tk={Tk}, tile_size={tile_size})"
        )
    row = n_q - 1 if row is None else row
    if not (isinstance(row, int) and 0 <= row < n_q):
        raise ValueError(f"plot_flash_tile_grid: row must be a query block in 0..{n_q - 1}, got {row!r}")

    def allowed(i, j):  # a causal tile has an allowed entry iff its first key is at or before its last query
        return not causal or j * tile_size <= min((i + 1) * tile_size, Tq) - 1

    fig = Figure(figsize=(13, 6.4), layout="constrained")
    ax = fig.subplots()
    cell = 6.0 / max(n_q, n_k)  # the grid fits a 6 x 6 square
    gx, gy = 2.6, 0.6  # bottom-left corner of the grid; query block 0 at the top
    top = gy + n_q * cell
    skipped = 0
    for i in range(n_q):
        for j in range(n_k):
            x, y = gx + j * cell, top - (i + 1) * cell
            ok = allowed(i, j)
            skipped += not ok
            color = _SKIP if not ok else (_TILE if i == row else "white")
            ax.add_patch(
                Rectangle((x, y), cell, cell, facecolor=color, edgecolor="gray", lw=0.8, hatch="//" if not ok else None)
            )
            if i == row and ok:
                ax.text(x + cell / 2, y + cell / 2, f"tile\n({i + 1}, {j + 1})", ha="center", va="center", fontsize=8)
        if i != row:
            ax.text(gx - 0.15, top - (i + 0.5) * cell, f"{i + 1}", ha="right", va="center", fontsize=7)
    computed = n_q * n_k - skipped
    # the query blocks, read once each (left) and the key/value blocks, read once per tile (top)
    ax.text(
        gx - 0.15,
        top - (row + 0.5) * cell,
        f"q_i  (Br, d_k)\n= ({tile_size}, {d_k})\nread once",
        ha="right",
        va="center",
        fontsize=8,
        color="navy",
    )
    ax.add_patch(Rectangle((gx - 0.1, top - (row + 1) * cell), 0.08, cell, facecolor=_READ, edgecolor="black"))
    ax.text(
        gx + n_k * cell / 2,
        top + 0.55,
        f"k_j, v_j  (Bc, d_k), (Bc, d_v) = ({tile_size}, {d_k}), ({tile_size}, {d_v}): one block read per tile",
        ha="center",
        va="bottom",
        fontsize=8,
        color="navy",
    )
    for j in range(n_k):
        ax.add_patch(Rectangle((gx + j * cell, top + 0.1), cell, 0.3, facecolor=_READ, edgecolor="black", lw=0.8))
        ax.text(gx + (j + 0.5) * cell, top + 0.25, f"{j + 1}", ha="center", va="center", fontsize=7)
    ax.text(
        gx + n_k * cell / 2,
        gy - 0.15,
        f"key blocks: {n_k} of Bc = tile_size = {tile_size} (Tk = {Tk})",
        ha="center",
        va="top",
        fontsize=8,
    )
    ax.text(
        gx - 1.6,
        top - n_q * cell / 2 + 1.2,
        f"query blocks:\n{n_q} of Br = tile_size\n= {tile_size} (Tq = {Tq})",
        ha="center",
        va="center",
        fontsize=8,
    )
    # on chip while the row runs, and written once at its end
    cx = gx + n_k * cell + 0.9
    ax.add_patch(Rectangle((cx - 0.2, gy + 0.9), 3.4, 4.9, facecolor="none", edgecolor="darkorange", lw=1.5, ls="--"))
    ax.text(
        cx + 1.5,
        gy + 5.95,
        "on chip while query block i runs",
        ha="center",
        fontsize=9,
        color="darkorange",
        fontweight="bold",
    )
    _box(ax, cx, gy + 4.3, 3.0, 1.05, _TILE, ["s  (Br, Bc)", "scores, then p = exp(s - m)", "one tile at a time"])
    _box(ax, cx, gy + 3.05, 3.0, 0.95, _CHIP, ["m  (Br, 1)", "running max of the row"])
    _box(ax, cx, gy + 1.95, 3.0, 0.85, _CHIP, ["l  (Br, 1)", "running sum of exp(s - m)"])
    _box(ax, cx, gy + 1.05, 3.0, 0.7, _CHIP, [f"acc  (Br, d_v) = ({tile_size}, {d_v})", "output accumulator"])
    wx = cx + 3.7
    _box(
        ax, wx, gy + 3.0, 2.5, 1.2, _WRITE, ["out[rows] = acc / l", f"(Br, d_v) = ({tile_size}, {d_v})", "written once"]
    )
    _box(ax, wx, gy + 1.4, 2.5, 1.2, _WRITE, ["lse[rows] = m + log l", f"(Br,) = ({tile_size},)", "written once"])
    ax.annotate("", xy=(wx, gy + 3.6), xytext=(cx + 3.2, gy + 3.6), arrowprops=dict(arrowstyle="->", lw=1.1))
    ax.annotate("", xy=(wx, gy + 2.0), xytext=(cx + 3.2, gy + 2.0), arrowprops=dict(arrowstyle="->", lw=1.1))
    keys_read = sum(
        min((j + 1) * tile_size, Tk) - j * tile_size for i in range(n_q) for j in range(n_k) if allowed(i, j)
    )
    passes = f"{keys_read / Tk:.3g}"  # rows of k (and of v) read, in units of the whole k: the passes over k, v
    ax.text(
        wx + 1.25,
        gy + 0.45,
        f"never in memory: any (Tq, Tk) array\nk, v: {computed} blocks read = {passes} passes",
        ha="center",
        va="center",
        fontsize=8,
        color="firebrick",
    )
    legend = (
        [
            (_READ, "read from main memory"),
            (_TILE, f"query block i = {row + 1}: its tiles, left to right"),
            (_SKIP, "skipped (causal: nothing allowed)"),
        ]
        if causal
        else [(_READ, "read from main memory"), (_TILE, f"query block i = {row + 1}: its tiles, left to right")]
    )
    for n, (color, label) in enumerate(legend):
        y = gy - 0.75 - 0.4 * n
        ax.add_patch(
            Rectangle((gx, y), 0.3, 0.25, facecolor=color, edgecolor="gray", hatch="//" if color == _SKIP else None)
        )
        ax.text(gx + 0.45, y + 0.12, label, va="center", fontsize=8)
    per_tile = f"{computed} tiles computed" + (f", {skipped} skipped" if causal else "")
    ax.set_title(
        f"flash_attention(q, k, v, mask, tile_size={tile_size}): one head, Tq = {Tq}, Tk = {Tk}, "
        f"d_k = {d_k}{', causal' if causal else ''}; {n_q} x {n_k} tiles, {per_tile}",
        fontsize=10,
    )
    ax.set_xlim(0, wx + 2.8)
    ax.set_ylim(gy - 0.75 - 0.4 * len(legend), top + 1.0)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tile_counts = {"tiles": computed, "tiles_skipped": skipped}  # what the picture shows, for its test
    return fig
