"""Chapter 20b's diagrams: the slices drawn are the ones the tensor-parallel layers hold; the timelines' bubbles are
the schedule's."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tn  # noqa: E402
from tfm_common.diagrams_model_parallel import (  # noqa: E402
    WEIGHTS,
    plot_pipeline_timeline,
    plot_tensor_split,
    tensor_split_layout,
)
from tfm_common.model_parallel import gpipe_bubble, pipeline_schedule, simulate_schedule  # noqa: E402


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_the_drawn_slices_are_the_ones_each_rank_holds():
    """The layout's slice of every weight, cut from the block's real weight, equals the weight of the rank's
    tensor-parallel layer."""
    block = tn.GPTBlock(16, 4, 32, 0.0, n_kv_heads=2, rng=0, dtype=np.float64)
    layout = tensor_split_layout(16, 4, 2, 32, 2)
    full = block.state_dict()
    for rank in range(2):
        part = tn.tensor_parallel(block, rank, 2, None).state_dict()
        for key in WEIGHTS:
            (r0, r1), (c0, c1) = layout[key][1][rank]
            assert np.array_equal(full[key][r0:r1, c0:c1], part[key])
    assert layout["ff.linear2.weight"][1][1] == ((0, 16), (16, 32))


def test_tensor_split_diagram_names_the_weights_and_the_all_reduce():
    fig = plot_tensor_split(16, 4, 4, 32, 2)
    renders(fig)
    t = texts(fig)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj", "linear1", "linear2", "all_reduce", "rank 1",
                 "2 per rank", "16 per rank", "by rows", "by columns"):  # fmt: skip
        assert name in t


@pytest.mark.parametrize("m", [1, 4])
def test_pipeline_timeline_shows_every_operation_and_the_bubble(m):
    timeline = simulate_schedule(pipeline_schedule(2, m, "gpipe"))
    fig = plot_pipeline_timeline({"GPipe": timeline})
    renders(fig)
    t = texts(fig)
    assert f"bubble {gpipe_bubble(2, m):.2f}" in t
    assert all(f"{op}{i}" in t for op in "FB" for i in range(m)) and "stage 1" in t
