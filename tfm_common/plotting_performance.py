"""Plots of chapter 15a (performance): the roofline of a machine with the step's operations on it, and the GPU
training step's model FLOP utilization against the batch.

Like `tfm_common.plotting`, the figures are built with matplotlib's object API (`matplotlib.figure.Figure`),
never through pyplot's global state: the caller displays or saves them.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

__all__ = ["attainable", "plot_mfu_against_batch", "plot_roofline"]


def attainable(intensity: float, peak: float, bandwidth: float) -> float:
    """The roofline: the most FLOP/s an operation of `intensity` FLOPs per byte can reach on a machine that does
    `peak` FLOP/s and moves `bandwidth` bytes/s, min(peak, intensity * bandwidth)."""
    for name, v in (("intensity", intensity), ("peak", peak), ("bandwidth", bandwidth)):
        if not (isinstance(v, (int, float, np.floating, np.integer)) and math.isfinite(v) and v > 0):
            raise ValueError(f"attainable: {name} must be a positive finite number, got {v!r}")
    return min(peak, intensity * bandwidth)


def plot_roofline(
    peak: float,
    bandwidths: dict[str, float],
    ops: dict[str, float],
    measured: dict[str, float] | None = None,
    title: str = "",
) -> Figure:
    """A roofline (log-log): attainable FLOP/s against arithmetic intensity (FLOPs per byte moved), one roof per
    bandwidth in `bandwidths` (label -> bytes/s) under the flat `peak` (FLOP/s). `ops` (label -> FLOPs per byte)
    are drawn as vertical lines at their intensity; `measured` (label of an op -> its measured FLOP/s) adds a
    point for an op. Returns the Figure."""
    if not bandwidths:
        raise ValueError("plot_roofline: expected at least one bandwidth, got none")
    for b in bandwidths.values():
        attainable(1.0, peak, b)  # validates peak and every bandwidth
    for i in ops.values():
        attainable(i, peak, 1.0)
    measured = measured or {}
    unknown = sorted(set(measured) - set(ops))
    if unknown:
        raise ValueError(f"plot_roofline: measured names ops that are not drawn: {unknown}; ops are {sorted(ops)}")
    lo = min(min(ops.values()), min(peak / b for b in bandwidths.values())) / 4
    hi = max(max(ops.values()), max(peak / b for b in bandwidths.values())) * 4
    x = np.geomspace(lo, hi, 200)
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    for (label, b), ls in zip(bandwidths.items(), ["-", "--", "-.", ":"] * 4, strict=False):
        ax.plot(x, np.minimum(peak, x * b) / 1e9, ls, color="black", lw=1.4, label=f"roof: {label}, {b / 1e9:.0f} GB/s")
        ax.plot([peak / b], [peak / 1e9], "o", color="black", ms=4)
    ax.text(hi / 1.2, peak / 1e9 * 1.08, f"peak {peak / 1e9:.0f} GFLOP/s", ha="right", va="bottom", fontsize=8)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]
    for (label, i), color in zip(ops.items(), colors * 4, strict=False):
        ax.axvline(i, color=color, lw=1.2, ls=":", label=f"{label}: {i:.2g} FLOP/byte")
        if label in measured:
            ax.plot([i], [measured[label] / 1e9], "D", color=color, ms=7, markeredgecolor="black")
    if measured:
        ax.plot([], [], "D", color="white", markeredgecolor="black", label="measured rate (diamond)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    floor = min([x[0] * min(bandwidths.values())] + [v for v in measured.values()])
    ax.set_ylim(floor / 1e9 / 2, max([peak, *measured.values()]) / 1e9 * 2.5)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved to or from memory)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title or "Roofline")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def plot_mfu_against_batch(runs: dict[str, dict], title: str = "") -> Figure:
    """Model FLOP utilization of the GPU training step against the batch, from `benchmarks/gpu_train.py` results
    (`runs`: a name -> the JSON of one run; rows with vocabulary 8000 only): ours and `torch.nn.Transformer`,
    eager, compiled (model + loss) and compiled with CUDA graphs and a fused Adam, with the rate of the model's
    largest product alone (a dotted line, from the first run's bf16 matmuls) and 40% (dashed). Returns the Figure."""
    if not runs:
        raise ValueError("plot_mfu_against_batch: expected at least one run, got none")
    series = [  # label, style, color, which rows
        (
            "ours, compiled, CUDA graphs, fused Adam",
            "-o",
            "tab:blue",
            lambda r: r["model"] == "ours" and r["compiled"] == "model+loss cudagraphs",
        ),
        (
            "ours, compiled (model+loss)",
            "s",
            "tab:cyan",
            lambda r: r["model"] == "ours" and r["compiled"] == "model+loss",
        ),
        (
            "torch.nn, compiled, CUDA graphs, fused Adam",
            "-^",
            "tab:red",
            lambda r: r["model"] == "torch.nn" and r["compiled"] == "model+loss cudagraphs",
        ),
        (
            "torch.nn, compiled (model+loss)",
            "v",
            "tab:orange",
            lambda r: r["model"] == "torch.nn" and r["compiled"] == "model+loss",
        ),
        ("torch.nn, eager", "-D", "tab:gray", lambda r: r["model"] == "torch.nn" and not r["compiled"]),
    ]
    fig = Figure(figsize=(8.5, 4.4), layout="constrained")
    ax = fig.subplots()
    batches = set()
    for label, style, color, pick in series:
        for run in runs.values():
            rows = sorted(
                (r for r in run["train_step"] if "step" in r and r["vocab"] == 8000 and pick(r)),
                key=lambda r: r["batch"],
            )
            if rows:
                batches.update(r["batch"] for r in rows)
                shown = label in ax.get_legend_handles_labels()[1]
                ax.plot(
                    [r["batch"] for r in rows],
                    [100 * r["mfu"] for r in rows],
                    style,
                    color=color,
                    alpha=0.8,
                    label=None if shown else label,
                )
    first = next(iter(runs.values()))["matmul_bf16"]
    alone = 100 * first[1]["tflops"] / first[0]["tflops"]
    ticks = sorted(batches)
    ax.axhline(alone, color="k", ls=":", lw=1)
    ax.text(ticks[0], alone + 1, "the model's largest product alone", fontsize=8)
    ax.axhline(40, color="k", ls="--", lw=0.8)
    ax.text(ticks[0], 41, "40%", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.minorticks_off()
    ax.set_xlabel("batch (sequences of 256 tokens per side)")
    ax.set_ylabel("MFU, % of the measured bf16 8192^3 rate")
    ax.set_ylim(0, 75)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return fig
