"""The multi-head attention data-flow diagram of chapter 6: a Figure with every array's shape on it."""

import io

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from tfm_common.diagrams_attention import plot_mha_dataflow  # noqa: E402


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_dataflow_is_a_figure_with_symbolic_shapes():
    fig = plot_mha_dataflow()
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    shown = texts(fig)
    for shape in ("(B, Tq, d)", "(B, Tk, d)", "(B, h, Tq, dk)", "(B, h, Tk, dk)", "(B, h, Tq, Tk)"):
        assert shape in shown, shape
    for step in ("split", "merge", "mask, softmax", "Linear d→d"):
        assert step in shown, step
    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot or a display


def test_dataflow_prints_concrete_shapes():
    fig = plot_mha_dataflow(B=2, Tq=5, Tk=7, d_model=8, n_heads=2)
    shown = texts(fig)
    assert "(B, h, Tq, Tk)\n= (2, 2, 5, 7)" in shown
    assert "(B, h, Tk, dk)\n= (2, 2, 7, 4)" in shown
    assert "(B, Tq, d)\n= (2, 5, 8)" in shown
    assert "h=2" in fig.axes[0].get_title()


def test_dataflow_rejects_bad_sizes():
    with pytest.raises(ValueError, match="pass all of B, Tq, Tk, d_model, n_heads or none"):
        plot_mha_dataflow(B=2)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by n_heads \(4\)"):
        plot_mha_dataflow(B=2, Tq=3, Tk=3, d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="positive integers"):
        plot_mha_dataflow(B=0, Tq=3, Tk=3, d_model=8, n_heads=2)
