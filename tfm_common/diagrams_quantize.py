"""The diagram of chapter 21a: how group-wise int4 quantization lays out a Linear weight.

`plot_int4_groups` draws a small weight (out_features, in_features) as the codes `quantize(w, 4, axis=1,
group_size=g)` gives it, each run of g inputs of a row shaded as one group with its scale, beside the scales
array (out_features, in_features / g) and the bytes the layer takes. The codes are computed here with the shared
layout of `tfm_common.quantize` (this package cannot import a track); the test compares them with
`tfm_numpy.quantize`'s.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .quantize import check_quantize_args, group_shapes, q_max

__all__ = ["plot_int4_groups", "int4_group_codes"]

_GROUPS = ["#c6dbef", "#fdd9a6", "#c7e9c0", "#e8dff5", "#f2cfe6", "#fff3b0", "#d9d9d9", "#bfe3e0"]


def int4_group_codes(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of a (rows, cols) float array, int4 along axis 1 in groups of group_size: the formula of
    `tfm_common.quantize` (scale = max |w| / 7 per group, code = round(w / scale))."""
    axis, group = check_quantize_args("int4_group_codes", w.shape, 4, 1, group_size)
    grouped, _, scales_shape = group_shapes(w.shape, axis, group)
    wg = w.reshape(grouped)
    scales = np.abs(wg).max(axis=2, keepdims=True) / q_max(4)
    codes = np.clip(np.round(wg / np.where(scales > 0, scales, 1)), -7, 7).astype(np.int8)
    return codes.reshape(w.shape), scales.reshape(scales_shape)


def plot_int4_groups(out_features: int = 4, in_features: int = 16, group_size: int = 4, seed: int = 0) -> Figure:
    """Codes of a random (out_features, in_features) weight, int4 in groups of group_size along the inputs (one
    colour per group index), the scales array, and the layer's bytes: codes at 4 bits, scales at float32."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    w[1, 2] = 4.0  # one large weight: its group's step is large, the other groups of its row keep theirs
    codes, scales = int4_group_codes(w, group_size)
    n_groups = in_features // group_size
    fig = Figure(figsize=(12.5, 4.6), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    for r in range(out_features):
        y = out_features - 1 - r  # row 0 at the top, as the matrix is written
        for c in range(in_features):
            ax.add_patch(Rectangle((c, y), 1, 1, facecolor=_GROUPS[(c // group_size) % len(_GROUPS)],
                                   edgecolor="white", lw=1))  # fmt: skip
            ax.text(c + 0.5, y + 0.5, f"{codes[r, c]:d}", ha="center", va="center", fontsize=9,
                    fontweight="bold" if abs(codes[r, c]) == 7 else "normal")  # fmt: skip
        for g in range(n_groups):
            ax.add_patch(Rectangle((g * group_size, y), group_size, 1, fill=False, edgecolor="black", lw=1.2))
            x = in_features + 1.5 + g * 1.6
            ax.add_patch(Rectangle((x, y), 1.5, 1, facecolor=_GROUPS[g % len(_GROUPS)], edgecolor="white", lw=1))
            ax.text(x + 0.75, y + 0.5, f"{scales[r, g]:.3f}", ha="center", va="center", fontsize=8.5)
        ax.text(-0.3, y + 0.5, f"row {r}", ha="right", va="center", fontsize=8.5, color="dimgray")
    top = out_features + 0.25
    ax.text(in_features / 2, top + 0.55, f"codes: (out_features, in_features) = ({out_features}, {in_features}), "
            "int8 in memory, 4 bits each stored", ha="center", fontsize=9.5)  # fmt: skip
    ax.text(in_features / 2, top + 0.1, f"group_size = {group_size}: one scale per {group_size} inputs of a row, "
            "codes in [-7, 7]", ha="center", fontsize=9)  # fmt: skip
    sx = in_features + 1.5 + n_groups * 0.8
    ax.text(sx, top + 0.55, f"scales: ({out_features}, in_features / group_size) = ({out_features}, {n_groups})",
            ha="center", fontsize=9.5)  # fmt: skip
    ax.text(sx, top + 0.1, "scale = max |w| / 7 over the group", ha="center", fontsize=9)
    code_bytes, scale_bytes = out_features * in_features // 2, 4 * out_features * n_groups
    ax.text(in_features / 2, -0.55, f"codes, scales = quantize(w, 4, axis=1, group_size={group_size});   "
            f"w[i, j] ≈ codes[i, j] · scales[i, j // {group_size}]", ha="center", va="top", fontsize=9.5,
            family="monospace")  # fmt: skip
    ax.text(in_features / 2, -1.25, f"bytes: {out_features}·{in_features}·4/8 = {code_bytes} (codes) + "
            f"{out_features}·{n_groups}·4 = {scale_bytes} (float32 scales) = {code_bytes + scale_bytes}, against "
            f"{4 * out_features * in_features} in float32: {4 + 32 / group_size:g} bits per weight",
            ha="center", va="top", fontsize=9)  # fmt: skip
    ax.text(in_features / 2, -1.95, "row 1 holds a large weight (code 7 in its group): only that group's step "
            "grows; per channel (one group per row) the whole row would pay for it", ha="center", va="top",
            fontsize=9, color="dimgray")  # fmt: skip
    ax.set_xlim(-1.6, in_features + 2 + n_groups * 1.6)
    ax.set_ylim(-2.5, out_features + 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig
