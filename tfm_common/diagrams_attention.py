"""Data-flow diagrams of attention, drawn as code (chapter 6).

Like `tfm_common.plotting`, the figures are built with matplotlib's object API (`matplotlib.figure.Figure`),
never through pyplot's global state: the caller displays or saves them.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

__all__ = ["plot_mha_dataflow"]

# colors by the kind of array: model width, per-head width, per-head scores
_WIDE, _HEAD, _SCORE = "#d6e9f8", "#fde2cf", "#e8dff5"


def _box(ax, x, y, name, shape, color, stacked=0, w=1.8, h=0.9):
    """An array as a box centred on (x, y): its name and shape; `stacked` > 0 draws copies behind it (heads)."""
    for s in range(stacked, -1, -1):  # back to front, so the front box carries the text
        dx, dy = 0.09 * s, 0.09 * s
        patch = FancyBboxPatch(
            (x - w / 2 + dx, y - h / 2 + dy), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="black", lw=1
        )
        ax.add_patch(patch)
    ax.text(x, y + 0.22, name, ha="center", va="center", fontsize=9, fontweight="bold")
    ax.text(x, y - 0.12, shape, ha="center", va="center", fontsize=8, linespacing=1.4)


def _arrow(ax, a, b, label="", side="above"):
    ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="->", lw=1.1, color="black"))
    if label:
        dy = 0.16 if side == "above" else -0.18
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, label, ha="center", va="center", fontsize=7.5, color="navy")


def _shape(symbols: str, sizes: dict | None) -> str:
    """'(B, Tq, d)' or, with sizes, '(B, Tq, d)' over '= (2, 5, 8)'."""
    text = f"({symbols})"
    if sizes:
        text += "\n= (" + ", ".join(str(sizes[s.strip()]) for s in symbols.split(",")) + ")"
    return text


def plot_mha_dataflow(B=None, Tq=None, Tk=None, d_model=None, n_heads=None) -> Figure:
    """Multi-head attention as a data-flow diagram: projections, split into heads, attention per head, merge,
    output projection, every array labelled with its shape.

    Pass all five sizes to print the concrete shapes next to the symbolic ones (d_model must be divisible by
    n_heads), or none of them for symbols only. Returns the Figure.
    """
    given = [B, Tq, Tk, d_model, n_heads]
    if any(v is not None for v in given) and any(v is None for v in given):
        raise ValueError(f"plot_mha_dataflow: pass all of B, Tq, Tk, d_model, n_heads or none, got {given}")
    sizes = None
    if B is not None:
        if any(int(v) != v or v < 1 for v in given):
            raise ValueError(f"plot_mha_dataflow: sizes must be positive integers, got {given}")
        if d_model % n_heads:
            raise ValueError(f"plot_mha_dataflow: d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        sizes = {"B": B, "Tq": Tq, "Tk": Tk, "d": d_model, "h": n_heads, "dk": d_model // n_heads}
    heads = 2 if sizes is None else min(sizes["h"] - 1, 3)  # copies drawn behind a per-head box

    fig = Figure(figsize=(14, 5.6), layout="constrained")
    ax = fig.subplots()
    x0, x1, x2, x3, x4, x5 = (2.8 * i for i in range(6))  # the columns
    half = 0.9  # half a box's width: arrows run between box edges
    rows = {"q": 4.0, "k": 2.4, "v": 0.8}
    inputs = {"q": ("query", "B, Tq, d"), "k": ("key", "B, Tk, d"), "v": ("value", "B, Tk, d")}
    for r, (name, shp) in inputs.items():
        y = rows[r]
        t = "Tq" if r == "q" else "Tk"
        _box(ax, x0, y, name, _shape(shp, sizes), _WIDE)
        _box(ax, x1, y, f"{r}_proj({name})", _shape(shp, sizes), _WIDE)
        _box(ax, x2, y, r, _shape(f"B, h, {t}, dk", sizes), _HEAD, stacked=heads)
        _arrow(ax, (x0 + half, y), (x1 - half, y), "Linear d→d")
        _arrow(ax, (x1 + half, y), (x2 - half, y), "split")
    ax.text((x1 + x2) / 2, 4.75, "split: reshape (B, T, h, dk),\nthen transpose(1, 2)", ha="center", fontsize=7.5,
            color="dimgray")  # fmt: skip
    _box(ax, x3, 3.2, "scores S", _shape("B, h, Tq, Tk", sizes), _SCORE, stacked=heads)
    _box(ax, x4, 3.2, "weights P", _shape("B, h, Tq, Tk", sizes), _SCORE, stacked=heads)
    _box(ax, x4, 0.8, "context", _shape("B, h, Tq, dk", sizes), _HEAD, stacked=heads)
    _box(ax, x5, 0.8, "merged", _shape("B, Tq, d", sizes), _WIDE)
    _box(ax, x5, 3.2, "output", _shape("B, Tq, d", sizes), _WIDE)
    _arrow(ax, (x2 + half + 0.2, 3.9), (x3 - half, 3.4))
    ax.text((x2 + x3) / 2 + 0.25, 3.95, "q kᵀ / √dk", ha="center", va="center", fontsize=7.5, color="navy")
    _arrow(ax, (x2 + half + 0.2, 2.5), (x3 - half, 3.0))
    _arrow(ax, (x3 + half + 0.2, 3.2), (x4 - half, 3.2), "mask, softmax")
    _arrow(ax, (x4, 2.75), (x4, 1.25))
    ax.text(x4 + 0.1, 2.0, "P @ v", ha="left", va="center", fontsize=7.5, color="navy")
    _arrow(ax, (x2 + half + 0.2, 0.8), (x4 - half, 0.8), "the values of every head", side="below")
    _arrow(ax, (x4 + half + 0.2, 0.8), (x5 - half, 0.8), "merge")
    _arrow(ax, (x5, 1.25), (x5, 2.75))
    ax.text(x5 + 0.1, 2.0, "out_proj\nLinear d→d", ha="left", va="center", fontsize=7.5, color="navy")
    ax.text(x5, -0.05, "merge: transpose(1, 2),\nthen reshape (B, Tq, d)", ha="center", va="center", fontsize=7.5,
            color="dimgray")  # fmt: skip
    ax.text((x3 + x4) / 2, 4.55, "attention per head: the h heads ride along as a batch axis", ha="center",
            fontsize=8.5)  # fmt: skip
    ax.set_xlim(x0 - 1.1, x5 + 1.3)
    ax.set_ylim(-0.45, 5.2)
    ax.axis("off")
    title = "Multi-head attention, shape by shape (d = d_model, dk = d / h)"
    if sizes:
        title += f": B={B}, Tq={Tq}, Tk={Tk}, d={d_model}, h={n_heads}"
    ax.set_title(title)
    return fig
