"""Pictures shared by both tracks: attention maps and masks.

Figures are built with matplotlib's object API (`matplotlib.figure.Figure`), never through pyplot's global
state, so they work under any backend (Agg included), are not shown twice in a notebook, and the caller
decides what to do with them (display, `fig.savefig(...)`). Inputs may be NumPy arrays or CPU tensors.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

__all__ = ["plot_attention", "plot_mask"]


def _as_array(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, maybe requiring grad; no torch import needed
        x = x.detach().cpu()
    return np.asarray(x)


def _check_labels(name: str, labels, n: int):
    if labels is not None and len(labels) != n:
        raise ValueError(f"{name}: expected {n} labels, got {len(labels)}")
    return labels


def _label_axes(ax, shape: tuple[int, int], x_labels, y_labels) -> None:
    """Token labels on the cells, or the cell indices (never fractional ticks)."""
    rows, cols = shape
    if x_labels is not None:
        ax.set_xticks(range(cols), [str(t) for t in x_labels], rotation=90)
    elif cols <= 32:
        ax.set_xticks(range(cols))
    if y_labels is not None:
        ax.set_yticks(range(rows), [str(t) for t in y_labels])
    elif rows <= 32:
        ax.set_yticks(range(rows))


def plot_attention(
    weights,
    x_labels=None,
    y_labels=None,
    heads=None,
    ncols: int = 4,
    title: str | None = None,
    cmap: str = "viridis",
    vmax: float | None = 1.0,
    colorbar: bool = True,
    cell_size: float = 0.35,
) -> Figure:
    """A grid of attention maps, one per head: rows are queries, columns are keys.

    weights: (Tq, Tk) for one map or (H, Tq, Tk) for heads (take one batch element: `weights[b]`).
    x_labels: Tk key tokens; y_labels: Tq query tokens. heads: which heads to draw (default all).
    The color scale runs from 0 to `vmax` (1 by default, so maps are comparable; None: each map's max).
    Returns the Figure: one axes per head drawn, plus one for the shared colorbar.
    """
    w = _as_array(weights)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"plot_attention: weights must be (Tq, Tk) or (H, Tq, Tk), got shape {w.shape}; "
                         "for (B, H, Tq, Tk) pass weights[b]")  # fmt: skip
    H, Tq, Tk = w.shape
    heads = list(range(H)) if heads is None else [int(h) for h in heads]
    if not heads or any(not 0 <= h < H for h in heads):
        raise ValueError(f"plot_attention: heads must be a non-empty list of indices in [0, {H}), got {heads}")
    _check_labels("plot_attention: x_labels (keys)", x_labels, Tk)
    _check_labels("plot_attention: y_labels (queries)", y_labels, Tq)

    ncols = max(1, min(ncols, len(heads)))
    nrows = math.ceil(len(heads) / ncols)
    fig = Figure(figsize=(ncols * (1.2 + cell_size * Tk), nrows * (1.0 + cell_size * Tq)), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(heads) :]:  # the unused cells of the last row
        ax.remove()
    for ax, h in zip(axes, heads, strict=False):
        image = ax.imshow(w[h], cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
        _label_axes(ax, (Tq, Tk), x_labels, y_labels)
        if H > 1:
            ax.set_title(f"head {h}")
    if colorbar:
        fig.colorbar(image, ax=list(axes[: len(heads)]), shrink=0.8)
    if title:
        fig.suptitle(title)
    return fig


def plot_mask(mask, x_labels=None, y_labels=None, title: str | None = None, ax=None) -> Figure:
    """Draw a boolean mask (True = may attend, dark) as a (Tq, Tk) grid; leading size-1 axes are dropped.

    A padding mask (B, 1, 1, Tk) is drawn as B rows (one per sequence), a causal mask (1, 1, T, T) as T x T.
    Pass `ax` to draw into an existing axes (e.g. masks side by side); returns the axes' Figure.
    """
    m = _as_array(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"plot_mask: expected a boolean mask, got dtype {m.dtype}")
    if m.ndim == 4 and m.shape[1:3] == (1, 1):  # padding mask (B, 1, 1, Tk): one row per sequence
        m = m[:, 0, 0, :]
    while m.ndim > 2 and m.shape[0] == 1:
        m = m[0]
    if m.ndim == 1:
        m = m[None]
    if m.ndim != 2:
        raise ValueError(f"plot_mask: cannot draw a mask of shape {_as_array(mask).shape} as one grid")
    _check_labels("plot_mask: x_labels", x_labels, m.shape[1])
    _check_labels("plot_mask: y_labels", y_labels, m.shape[0])
    if ax is None:
        fig = Figure(figsize=(1.0 + 0.35 * m.shape[1], 1.0 + 0.35 * m.shape[0]), layout="constrained")
        ax = fig.subplots()
    ax.imshow(m, cmap="Greys", vmin=0, vmax=1.6, aspect="equal")  # True: grey-black, False: white
    ax.set_xticks(np.arange(-0.5, m.shape[1]), minor=True)
    ax.set_yticks(np.arange(-0.5, m.shape[0]), minor=True)
    ax.grid(which="minor", color="lightgray", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    _label_axes(ax, m.shape, x_labels, y_labels)
    if title:
        ax.set_title(title)
    return ax.figure
