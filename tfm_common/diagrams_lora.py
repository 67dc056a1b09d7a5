"""Chapter 22c's diagram: where LoRA's adapters sit. Left, one `LoRALinear`: the frozen W of the base `Linear` and
beside it the low-rank door, A (rank, in) down and B (out, rank) up, scaled by alpha / rank, added to the base's
output, with each part's parameter count. Right, the Linear layers of a model's block (names and shapes as the
caller reads them from a real model), the ones `targets` picks (`tfm_common.lora.match_targets`, the rule
`add_lora` uses) drawn with their door, the others frozen.

Built with the object API (no pyplot state), as `tfm_common.plotting`; the test compares what is drawn with
`add_lora` on a real GPT.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from .lora import check_lora_args, lora_scaling, match_targets

__all__ = ["plot_lora", "adapted_layers"]

_FROZEN, _TRAIN, _EDGE = "#d9d9d9", "#fdd9a6", "dimgray"


def _box(ax, x, y, w, h, text, color, fontsize=9, gid=None):
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", fc=color, ec=_EDGE, lw=1)
    patch.set_gid(gid)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, a, b, text=""):
    ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="-|>", color=_EDGE, lw=1.2))
    if text:
        ax.text((a[0] + b[0]) / 2 + 0.05, (a[1] + b[1]) / 2, text, fontsize=8, va="center", color="dimgray")


def adapted_layers(layers: list[tuple[str, int, int]], targets) -> list[str]:
    """The names among `layers` ((name, in, out) of Linear layers) that `targets` picks: what the figure marks."""
    return match_targets("plot_lora", [(n, "Linear") for n, _, _ in layers], targets)


def _layer_panel(ax, d_in: int, d_out: int, rank: int, alpha: float) -> None:
    s = lora_scaling(rank, alpha)
    ax.text(0.5, 3.55, "x  (…, in)", ha="center", fontsize=9)
    _box(ax, 0.0, 2.2, 1.6, 0.8, f"base.weight  W\n({d_out}, {d_in}): frozen\n{d_out * d_in:,} numbers", _FROZEN)
    _box(ax, 1.6, 2.7, 1.4, 0.55, f"lora_A  A ({rank}, {d_in})\n{rank * d_in:,} trained", _TRAIN)
    _box(ax, 1.6, 1.6, 1.4, 0.55, f"lora_B  B ({d_out}, {rank})\n{d_out * rank:,} trained, starts at 0", _TRAIN)
    _arrow(ax, (0.5, 3.45), (0.0, 2.62))
    _arrow(ax, (0.5, 3.45), (1.6, 2.99))
    _arrow(ax, (1.6, 2.42), (1.6, 1.89), f"x Aᵀ: ({rank})")
    _box(ax, 0.8, 0.6, 0.45, 0.4, "+", "white", fontsize=12)
    _arrow(ax, (0.0, 1.79), (0.68, 0.78))
    _arrow(ax, (1.6, 1.31), (0.92, 0.78), f"× alpha/rank = {alpha:g}/{rank} = {s:g}")
    _arrow(ax, (0.8, 0.39), (0.8, -0.1))
    ax.text(0.8, -0.3, "y = x Wᵀ + b + (alpha/rank) · x Aᵀ Bᵀ", ha="center", fontsize=9)
    ax.text(0.8, -0.65, f"merge(): W + (alpha/rank) · B A, one plain Linear ({d_out}, {d_in})", ha="center",
            fontsize=8.5, color="dimgray")  # fmt: skip
    ax.set_title(f"LoRALinear(base, rank={rank}, alpha={alpha:g})", fontsize=10)
    ax.set_xlim(-1.0, 2.6)
    ax.set_ylim(-0.9, 3.8)


def _block_panel(ax, layers: list[tuple[str, int, int]], adapted: list[str], rank: int) -> None:
    n = len(layers)
    for i, (name, d_in, d_out) in enumerate(layers):
        y = n - 1 - i
        on = name in adapted
        _box(ax, 0.0, y, 2.3, 0.7, f"{name}\nLinear({d_in} → {d_out})", _FROZEN, fontsize=8.5, gid=f"base:{name}")
        if on:
            _box(ax, 1.9, y, 1.2, 0.7, f"+ B A\n{rank * (d_in + d_out):,} trained", _TRAIN, fontsize=8.5,
                 gid=f"adapter:{name}")  # fmt: skip
        else:
            ax.text(1.9, y, "frozen", ha="center", va="center", fontsize=8.5, color="dimgray")
    trained = sum(rank * (i + o) for nm, i, o in layers if nm in adapted)
    frozen = sum(i * o for _, i, o in layers)
    ax.text(0.8, -0.9, f"adapters: {trained:,} trained numbers vs {frozen:,} frozen weights in these layers",
            ha="center", fontsize=8.5)  # fmt: skip
    ax.set_title(f"add_lora(model, rank={rank}, alpha, targets): where the doors sit", fontsize=10)
    ax.set_xlim(-1.4, 2.8)
    ax.set_ylim(-1.3, n - 0.4)


def plot_lora(layers: list[tuple[str, int, int]], targets, rank: int = 4, alpha: float = 16.0) -> Figure:
    """Left: one LoRALinear for the first adapted layer of `layers` ((name, in_features, out_features) of a
    block's Linear layers, as read from a model); right: every layer of `layers`, those `targets` picks with their
    door. rank and alpha are checked as `LoRALinear` checks them."""
    adapted = adapted_layers(layers, targets)
    shapes = {n: (i, o) for n, i, o in layers}
    d_in, d_out = shapes[adapted[0]]
    for n in adapted:
        check_lora_args("plot_lora", *shapes[n], rank, alpha)
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    _layer_panel(left, d_in, d_out, rank, float(alpha))
    _block_panel(right, layers, adapted, rank)
    for ax in (left, right):
        ax.axis("off")
    return fig
