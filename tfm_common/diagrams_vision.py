"""Diagrams of the vision models (chapters 19a and 19b), drawn as code with the library's names.

`vit_pipeline_figure` follows an image through `ViT`: patchify, the patch projection, the class token, the learned
positions, the encoder, the class token's output and the head, each box carrying its `state_dict` prefix and each
arrow the shape of the tensor. `swin_figure` draws Swin's three ideas: `window_partition` of a token grid, the
`cyclic_shift` with the regions that `shifted_window_mask` keeps apart, and the stages with `PatchMerging` between
them, named as `Swin.state_dict()` names them. Pass a model's `config` to see its sizes; without one the figures
carry symbols only. Figures use matplotlib's object API (no pyplot state), as `tfm_common.plotting`.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from .config import swin_shift
from .diagrams import _canvas  # the same inch-coordinate canvas as the architecture diagrams

__all__ = ["vit_pipeline_figure", "swin_figure"]

# colors by kind, as in tfm_common.diagrams: data, embeddings/positions/head, attention, norm
_IO, _EMBED, _ATTN, _NORM, _FF = "#e5e5e5", "#f2cfe6", "#fdd9a6", "#fff3b0", "#c6dbef"
_REGIONS = ["#fbb4ae", "#b3cde3", "#ccebc5", "#decbe4", "#fed9a6", "#ffffcc", "#e5d8bd", "#fddaec", "#f2f2f2"]


def _box(ax, x, y, w, h, text, color, fontsize=8.0):
    """A rounded box centered at (x, y) with centered text; returns (left, right, bottom, top)."""
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08")
    patch.set(facecolor=color, edgecolor="#333333", linewidth=1.0)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)
    return x - w / 2, x + w / 2, y - h / 2, y + h / 2


def _arrow(ax, start, end, label="", dy=0.14, fontsize=7.0):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color="black", lw=1.1, shrinkA=0,
                                                          shrinkB=0))  # fmt: skip
    if label:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + dy, label, ha="center", va="bottom",
                fontsize=fontsize, color="navy")  # fmt: skip


def _shape(symbols: str, sizes: dict | None) -> str:
    """'(B, N, d)', or with sizes '(B, N, d)' over '= (B, 4, 64)' (B stays a symbol: any batch)."""
    if not sizes:
        return f"({symbols})"
    values = ", ".join(str(sizes.get(s, s)) for s in symbols.split(", "))  # each symbol's size (B: any batch)
    return f"({symbols})\n= ({values})"


def _check_config(owner: str, config, needed: tuple[str, ...]) -> dict | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(f"{owner}: config expected a dict (a model's .config) or None, got {type(config).__name__}")
    missing = [k for k in needed if k not in config]
    if missing:
        raise ValueError(f"{owner}: config expected the keys {list(needed)}, missing {missing}")
    return config


# -- ViT ----------------------------------------------------------------------------------------------------------

_VIT_KEYS = ("image_size", "patch_size", "in_channels", "n_classes", "d_model", "n_layers")


def vit_pipeline_figure(config: dict | None = None) -> Figure:
    """The ViT from image to class (pool="cls"), with `tfm_numpy.ViT` / `tfm_torch.ViT` names and shapes.

    config: a ViT's `.config` (image_size, patch_size, in_channels, n_classes, d_model, n_layers) to print its
    sizes next to the symbols, or None. Two rows: the image becomes a sequence (top), the encoder reads it and the
    class token's output is classified (bottom).
    """
    c = _check_config("vit_pipeline_figure", config, _VIT_KEYS)
    if c is not None and c.get("pool", "cls") != "cls":
        raise ValueError(f"vit_pipeline_figure: draws pool='cls' (the class token), got pool={c['pool']!r}")
    sizes = None
    if c is not None:
        g = c["image_size"] // c["patch_size"]
        C, P = c["in_channels"], c["patch_size"]
        sizes = {"C": C, "H": c["image_size"], "W": c["image_size"], "P": P, "N": g * g, "1+N": 1 + g * g,
                 "C P²": C * P * P, "d": c["d_model"], "K": c["n_classes"]}  # fmt: skip
    fig, ax = _canvas(14.0, 6.4)
    title = "The ViT from image to class: ViT(image_size, patch_size, in_channels, n_classes, d_model, ...)"
    if c is not None:
        title += f"\nthis chapter's sizes: C={sizes['C']}, H=W={sizes['H']}, P={sizes['P']}, N={sizes['N']}, "
        title += f"d={sizes['d']}, K={sizes['K']} classes, n_layers={c['n_layers']}"
    ax.text(7.0, 6.05, title, ha="center", va="center", fontsize=10.5, weight="bold")

    # the image, cut into a G x G grid of patches numbered row-major
    G = 3 if c is None else c["image_size"] // c["patch_size"]
    side = 1.7
    x0, y0 = 0.5, 3.25
    for i in range(G * G):
        r, col = divmod(i, G)
        cell = side / G
        ax.add_patch(Rectangle((x0 + col * cell, y0 + side - (r + 1) * cell), cell, cell, facecolor="white",
                               edgecolor="#b03030", lw=1.2))  # fmt: skip
        ax.text(x0 + (col + 0.5) * cell, y0 + side - (r + 0.5) * cell, str(i), ha="center", va="center",
                fontsize=9 if G <= 4 else 6, color="#b03030")  # fmt: skip
    ax.text(x0 + side / 2, y0 - 0.15, "images " + _shape("B, C, H, W", sizes), ha="center", va="top", fontsize=7.5)
    ax.text(x0 + side / 2, y0 + side + 0.12, "P x P patches, row-major", ha="center", va="bottom", fontsize=7.5)

    top = 4.1
    _, r1, _, _ = _box(ax, 3.5, top, 1.5, 0.8, "patchify\n(reshape,\ntranspose)", _IO)
    _arrow(ax, (x0 + side + 0.1, top), (3.5 - 0.75, top))
    _, r2, _, _ = _box(ax, 6.0, top, 1.7, 0.8, "patch_embed.proj\nLinear(C P², d)", _EMBED)
    _arrow(ax, (r1, top), (6.0 - 0.85, top), "patches\n" + _shape("B, N, C P²", sizes))
    _, r3, _, _ = _box(ax, 8.55, top, 1.7, 0.8, "cls_token (1, 1, d)\nput in front", _EMBED)
    _arrow(ax, (r2, top), (8.55 - 0.85, top), _shape("B, N, d", sizes))
    _, _, b4, _ = _box(ax, 11.7, top, 2.3, 0.8, "pos_embed\n+ a learned row per position\n(1 + N, d)", _EMBED)
    _arrow(ax, (r3, top), (11.7 - 1.15, top), _shape("B, 1+N, d", sizes))

    low = 1.55
    # from the positions down to the encoder: z0
    ax.plot([11.7, 11.7], [b4, 2.75], color="black", lw=1.1)
    ax.plot([11.7, 1.4], [2.75, 2.75], color="black", lw=1.1)
    _arrow(ax, (1.4, 2.75), (1.4, low + 0.35))
    ax.text(6.5, 2.83, "z₀ = [cls; patch tokens] + positions   " + _shape("B, 1+N, d", sizes).replace("\n", " "),
            ha="center", va="bottom", fontsize=7.5, color="navy")  # fmt: skip
    frame = FancyBboxPatch((0.3, low - 0.5), 4.2, 1.0, boxstyle="round,pad=0,rounding_size=0.1")
    frame.set(facecolor="none", edgecolor="#777777", linestyle="--", lw=1.1)
    ax.add_patch(frame)
    _box(ax, 1.4, low, 1.8, 0.7, "encoder.layers.{i}.self_attn\n(Pre-LN: norm1 first)", _ATTN, fontsize=6.8)
    _box(ax, 3.45, low, 1.7, 0.7, "encoder.layers.{i}.ff\n(norm2 first), GELU", _FF, fontsize=6.8)
    _arrow(ax, (2.3, low), (2.6, low))
    ax.text(2.4, low - 0.68, "Encoder(norm_first=True): × n_layers, i = 0 .. n_layers − 1, no mask", ha="center",
            fontsize=7, color="#555555")  # fmt: skip
    _, r6, _, _ = _box(ax, 6.0, low, 1.3, 0.7, "encoder.norm\nLayerNorm(d)", _NORM)
    _arrow(ax, (4.5, low), (6.0 - 0.65, low), _shape("B, 1+N, d", sizes))
    _, r7, _, _ = _box(ax, 8.3, low, 1.7, 0.7, "pooled = h[:, 0]\nthe class token's row", _IO)
    _arrow(ax, (r6, low), (8.3 - 0.85, low), "h " + _shape("B, 1+N, d", sizes))
    _, r8, _, _ = _box(ax, 10.75, low, 1.6, 0.7, "head\nLinear(d, n_classes)", _EMBED)
    _arrow(ax, (r7, low), (10.75 - 0.8, low), _shape("B, d", sizes))
    _box(ax, 13.0, low, 1.2, 0.7, "logits\n" + _shape("B, K", sizes), _IO, fontsize=7)
    _arrow(ax, (r8, low), (13.0 - 0.6, low))
    ax.text(0.35, 0.25, "N = (H/P)(W/P) patches; T = 1 + N tokens. The other rows of h are computed (they feed the "
            "class token through attention) but the head reads row 0 only.", fontsize=7.5, color="#333333")  # fmt: skip
    return fig


# -- Swin ---------------------------------------------------------------------------------------------------------

_SWIN_KEYS = ("image_size", "patch_size", "in_channels", "n_classes", "d_model", "depths", "n_heads", "window_size")


def _grid(ax, x0, y0, cell, n, colors, labels, window, title):
    """An n x n token grid (row 0 at the top), cells colored and labelled, window borders every `window` cells."""
    for r in range(n):
        for c in range(n):
            ax.add_patch(Rectangle((x0 + c * cell, y0 + (n - 1 - r) * cell), cell, cell, facecolor=colors[r][c],
                                   edgecolor="#999999", lw=0.5))  # fmt: skip
            ax.text(x0 + (c + 0.5) * cell, y0 + (n - 0.5 - r) * cell, labels[r][c], ha="center", va="center",
                    fontsize=6.5)  # fmt: skip
    for k in range(0, n + 1, window):
        ax.plot([x0 + k * cell] * 2, [y0, y0 + n * cell], color="black", lw=2)
        ax.plot([x0, x0 + n * cell], [y0 + k * cell] * 2, color="black", lw=2)
    ax.text(x0 + n * cell / 2, y0 + n * cell + 0.12, title, ha="center", va="bottom", fontsize=8)


def _regions(n: int, window: int, shift: int) -> np.ndarray:
    """The rolled grid's region labels 0..8 (row region * 3 + column region), as shifted_window_mask labels them."""
    label = np.zeros((n, n), dtype=int)
    edges = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, rows in enumerate(edges):
        for j, cols in enumerate(edges):
            label[rows, cols] = 3 * i + j
    return label


def swin_figure(config: dict | None = None, grid: int = 8, window_size: int = 4) -> Figure:
    """Swin's windows, shift and stages, with `tfm_numpy.Swin` / `tfm_torch.Swin` names.

    Left: `window_partition` of a grid x grid token grid into windows of window_size (token ids row-major).
    Middle: the same grid after `cyclic_shift` by s = window_size // 2, colored by the nine regions that
    `shifted_window_mask` keeps apart (a pair may attend iff both tokens are in the same region).
    Right: the stages of `Swin(**config)` (default: symbols), blocks `stages.{i}.{j}` with their shifts and
    `merges.{i}` (PatchMerging) between stages.
    """
    c = _check_config("swin_figure", config, _SWIN_KEYS)
    for name, v in (("grid", grid), ("window_size", window_size)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 2:
            raise ValueError(f"swin_figure: {name} expected an integer >= 2, got {v!r}")
    if grid % window_size or grid == window_size:
        raise ValueError(f"swin_figure: grid ({grid}) expected a multiple of window_size ({window_size}) with at "
                         "least two windows per row")  # fmt: skip
    n, M, s = grid, window_size, window_size // 2
    fig, ax = _canvas(15.0, 5.7)
    cell = min(0.42, 3.6 / n)
    ids = np.arange(n * n).reshape(n, n)
    win = (ids // n // M) * (n // M) + (ids % n) // M  # window index of each token, row-major
    shades = ["#f7f7f7", "#dddddd"]
    colors = [[shades[(w // (n // M) + w % (n // M)) % 2] for w in row] for row in win]
    _grid(ax, 0.4, 1.4, cell, n, colors, [[str(v) for v in row] for row in ids], M,
          f"window_partition(x, {M}): {n} x {n} tokens, {(n // M) ** 2} windows of {M} x {M}")  # fmt: skip
    ax.text(0.4, 1.15, "(B, H, W, C) -> (B nW, M M, C): windows row-major,\ntokens row-major inside each window",
            fontsize=7.5, va="top")  # fmt: skip

    rolled = np.roll(ids, (-s, -s), axis=(0, 1))
    region = _regions(n, M, s)
    _grid(ax, 5.0, 1.4, cell, n, [[_REGIONS[v] for v in row] for row in region],
          [[str(v) for v in row] for row in rolled], M,
          f"cyclic_shift(x, {s}): rolled up and left by s = {s}")  # fmt: skip
    ax.text(5.0, 1.15, f"colors: the 9 regions of shifted_window_mask({n}, {n}, {M}, {s}); a pair may attend\n"
            "iff same region (token ids of the image: wrapped tokens sit at the right and bottom)",
            fontsize=7.5, va="top")  # fmt: skip

    # the stage hierarchy, bottom to top
    xs = 12.6
    if c is None:
        stages = [("stages.0.{j}  (H/P) x (W/P) grid, width d", "shift 0, M/2, 0, ...")]
        stages += [("stages.1.{j}  half the grid, width 2d", "shift 0, M/2, 0, ... (0 if one window)")]
        merges = ["merges.0  PatchMerging: norm (4d), reduction Linear(4d, 2d)"]
        head_text = "norm, mean over tokens, head Linear(width, n_classes)"
        in_text = "images (B, C, H, W) -> patch_embed (B, N, d)"
    else:
        g, d = c["image_size"] // c["patch_size"], c["d_model"]
        stages, merges = [], []
        for i, depth in enumerate(c["depths"]):
            shifts = [swin_shift(j, c["window_size"], g) for j in range(depth)]  # what SwinDoor gives each block
            stages.append(
                (
                    f"stages.{i}.{{j}}, j = 0..{depth - 1}: {g} x {g} grid, width {d}, {c['n_heads'][i]} heads",
                    f"shifts {shifts}" + ("  (one window: no shift)" if c["window_size"] >= g else ""),
                )
            )
            if i < len(c["depths"]) - 1:
                merges.append(f"merges.{i}  PatchMerging: {g} x {g} -> {g // 2} x {g // 2}, "
                              f"norm ({4 * d}), reduction Linear({4 * d}, {2 * d})")  # fmt: skip
                g, d = g // 2, 2 * d
        head_text = f"norm, mean over the {g * g} tokens, head Linear({d}, {c['n_classes']})"
        ch, H = c["in_channels"], c["image_size"]
        in_text = f"images (B, {ch}, {H}, {H}) -> patch_embed (B, {(H // c['patch_size']) ** 2}, {c['d_model']})"
    rows = [("io", in_text, "")]
    for i, (stage, shift) in enumerate(stages):
        rows.append(("attn", stage, shift))
        if i < len(merges):
            rows.append(("merge", merges[i], ""))
    rows.append(("io", head_text, ""))
    y, step = 0.7, 5.0 / len(rows)
    kinds = {"io": _IO, "attn": _ATTN, "merge": _NORM}
    for k, (kind, text, note) in enumerate(rows):
        label = text if not note else f"{text}\n{note}"
        _box(ax, xs, y, 4.4, min(0.75, step * 0.7), label, kinds[kind], fontsize=6.8)
        if k:
            _arrow(ax, (xs, y - step + min(0.75, step * 0.7) / 2), (xs, y - min(0.75, step * 0.7) / 2))
        y += step
    ax.text(xs, 5.35, "Swin's stages (bottom to top)", ha="center", fontsize=9, weight="bold")
    ax.text(5.0, 5.35, "Windows, the cyclic shift and its mask regions", ha="center", fontsize=9, weight="bold")
    return fig
