"""The performance chapters' pictures: FlashAttention's tile grid (15b), the roofline and the MFU plot (15a).
Each renders, carries the texts it must, and the names it draws are the library's."""

import inspect
import io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
import tfm_numpy.flash as nflash  # noqa: E402
import tfm_torch as tpt  # noqa: E402
from tfm_common.diagrams_performance import plot_flash_tile_grid  # noqa: E402
from tfm_common.plotting_performance import attainable, plot_mfu_against_batch, plot_roofline  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def texts(fig: Figure) -> str:
    return "\n".join([t.get_text() for ax in fig.axes for t in ax.texts] + [ax.get_title() for ax in fig.axes])


def test_tile_grid_draws_the_library_names():
    fig = plot_flash_tile_grid(Tq=512, Tk=512, tile_size=128, d_k=64)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    shown = texts(fig)
    for name in (
        "q_i",
        "k_j, v_j",
        "s  (Br, Bc)",
        "m  (Br, 1)",
        "l  (Br, 1)",
        "acc  (Br, d_v) = (128, 64)",
        "out[rows] = acc / l",
        "lse[rows] = m + log l",
        "tile_size=128",
        "on chip",
        "written once",
    ):
        assert name in shown, name
    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot or a display
    # the names are real: the keyword of both tracks' flash function, the running quantities of the forward's loop
    for fn in (tnp.flash_attention, tpt.flash_attention):
        assert "tile_size" in inspect.signature(fn).parameters
    source = inspect.getsource(nflash._forward_rows)
    for local in ("q_i", "k_j", "v_j", "m", "l", "acc", "s"):
        assert f"{local} = " in source or f"{local}, " in source, local
    assert "out[..., rows, :], lse[..., rows]" in inspect.getsource(nflash.flash_attention)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T, b", [(512, 128), (300, 64), (1024, 256)])
def test_tile_grid_counts_the_tiles_the_forward_computes(T, b, causal):
    fig = plot_flash_tile_grid(Tq=T, Tk=T, tile_size=b, d_k=16, causal=causal)
    xs = [np.zeros((1, 1, T, 16), dtype=np.float32) for _ in range(3)]
    counts = tnp.flash_attention_counts(*xs, tnp.causal_mask(T) if causal else None, tile_size=b)
    assert fig.tile_counts == {"tiles": counts["tiles"], "tiles_skipped": counts["tiles_skipped"]}
    shown = texts(fig)
    assert f"{counts['tiles']} tiles computed" in shown
    passes = counts["k"] / (T * 16)  # the passes over k that the forward really made
    assert f"= {passes:.3g} passes" in shown
    n = math.ceil(T / b)
    assert f"{n} x {n} tiles" in shown


def test_tile_grid_refuses_bad_sizes():
    with pytest.raises(ValueError, match="tile_size must be a positive integer, got 0"):
        plot_flash_tile_grid(tile_size=0)
    with pytest.raises(ValueError, match="at most 16 x 16 tiles"):
        plot_flash_tile_grid(Tq=4096, Tk=4096, tile_size=64)
    with pytest.raises(ValueError, match=r"row must be a query block in 0..3, got 4"):
        plot_flash_tile_grid(row=4)


def test_roofline_is_the_minimum_of_the_two_roofs():
    assert attainable(0.1, 100e9, 10e9) == pytest.approx(1e9)  # memory-bound: intensity x bandwidth
    assert attainable(50.0, 100e9, 10e9) == 100e9  # compute-bound: the peak
    with pytest.raises(ValueError, match="bandwidth must be a positive finite number"):
        attainable(1.0, 1e9, 0.0)


def test_roofline_figure_shows_every_roof_and_op():
    fig = plot_roofline(
        150e9,
        {"one core, main memory": 10e9, "one core, cache": 40e9},
        {"matmul": 46.5, "LayerNorm": 0.16},
        measured={"LayerNorm": 1.2e9},
        title="t",
    )
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "roof: one core, main memory, 10 GB/s" in labels and "roof: one core, cache, 40 GB/s" in labels
    assert "matmul: 46 FLOP/byte" in labels and "LayerNorm: 0.16 FLOP/byte" in labels
    lo, hi = fig.axes[0].get_xlim()
    assert lo < 0.16 and hi > 46.5  # every op inside the axis
    fig.savefig(io.BytesIO(), format="png")
    top = plot_roofline(10e9, {"m": 1e9}, {"a": 50.0}, measured={"a": 40e9}).axes[0].get_ylim()[1]
    assert top > 40  # a measured rate above the roof (a loaded machine's peak) is still inside the axis
    with pytest.raises(ValueError, match=r"measured names ops that are not drawn: \['GELU'\]"):
        plot_roofline(150e9, {"m": 10e9}, {"matmul": 46.5}, measured={"GELU": 1e9})
    with pytest.raises(ValueError, match="expected at least one bandwidth"):
        plot_roofline(150e9, {}, {"matmul": 46.5})


def test_mfu_plot_of_the_stored_runs():
    names = ["gpu_train_mfu_h200.json", "gpu_train_levers_h200.json", "gpu_train_mfu_h200_second.json"]
    if not all((RESULTS / n).is_file() for n in names):
        pytest.skip("no stored GPU results")
    runs = {n: json.loads((RESULTS / n).read_text()) for n in names}
    fig = plot_mfu_against_batch(runs, title="MFU")
    ax = fig.axes[0]
    ticks = [int(t) for t in ax.get_xticks()]
    assert ticks == sorted(
        {r["batch"] for run in runs.values() for r in run["train_step"] if "step" in r and r["vocab"] == 8000}
    )
    labels = ax.get_legend_handles_labels()[1]
    assert len(labels) == len(set(labels)) == 5  # each series named once, every one drawn
    fig.savefig(io.BytesIO(), format="png")
    with pytest.raises(ValueError, match="expected at least one run"):
        plot_mfu_against_batch({})
