"""The shared plotting helpers: figures with the expected axes, labels and pixels, on the Agg backend."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import tfm_numpy as tn  # noqa: E402
from tfm_common.plotting import plot_attention, plot_mask  # noqa: E402

SRC = ["the", "cat", "sat", "down", "<pad>"]
TGT = ["<bos>", "le", "chat", "assis"]


def tick_texts(labels) -> list[str]:
    return [label.get_text() for label in labels]


def attention(H: int, Tq: int, Tk: int) -> np.ndarray:
    scores = np.random.default_rng(0).standard_normal((H, Tq, Tk))
    e = np.exp(scores)
    return e / e.sum(-1, keepdims=True)


def test_plot_attention_grid_of_heads_with_token_labels():
    w = attention(6, 4, 5)
    fig = plot_attention(w, x_labels=SRC, y_labels=TGT, ncols=4, title="cross-attention")
    assert isinstance(fig, Figure)
    heads, colorbars = fig.axes[:6], fig.axes[6:]
    assert len(heads) == 6 and len(colorbars) == 1  # 2 x 4 grid, the two spare cells removed
    for h, ax in enumerate(heads):
        assert ax.get_title() == f"head {h}"
        assert tick_texts(ax.get_xticklabels()) == SRC
        assert tick_texts(ax.get_yticklabels()) == TGT
        np.testing.assert_array_equal(ax.images[0].get_array(), w[h])  # the right map in the right cell
    assert fig._suptitle.get_text() == "cross-attention"
    rows = {round(ax.get_position().y0, 3) for ax in heads}
    assert len(rows) == 2
    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot or a display


def test_plot_attention_single_map_selected_heads_and_tensors():
    fig = plot_attention(attention(1, 3, 3)[0], colorbar=False)
    assert len(fig.axes) == 1 and fig.axes[0].get_title() == ""
    w = torch.tensor(attention(4, 3, 3), requires_grad=True)  # a tensor that needs grad is fine
    fig = plot_attention(w, heads=[3, 1], x_labels="abc", y_labels="xyz")
    assert len(fig.axes) == 3  # two heads and the colorbar
    assert [ax.get_title() for ax in fig.axes[:2]] == ["head 3", "head 1"]
    assert tick_texts(fig.axes[0].get_xticklabels()) == ["a", "b", "c"]


def test_plot_attention_rejects_bad_input():
    w = attention(2, 4, 5)
    with pytest.raises(ValueError, match="expected 5 labels, got 4"):
        plot_attention(w, x_labels=TGT)
    with pytest.raises(ValueError, match="y_labels .* expected 4 labels, got 5"):
        plot_attention(w, y_labels=SRC)
    with pytest.raises(ValueError, match=r"pass weights\[b\]"):
        plot_attention(w[None])
    with pytest.raises(ValueError, match="heads must be"):
        plot_attention(w, heads=[2])


def test_plot_mask_draws_padding_causal_and_combined_masks():
    tokens = np.array([[5, 6, 7, 0], [8, 9, 0, 0]])
    pad = tn.padding_mask(tokens, 0)  # (2, 1, 1, 4): drawn one row per sequence
    fig = plot_mask(pad, x_labels=["k0", "k1", "k2", "k3"], title="padding")
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), pad[:, 0, 0])
    assert tick_texts(ax.get_xticklabels()) == ["k0", "k1", "k2", "k3"] and ax.get_title() == "padding"
    assert list(ax.get_yticks()) == [0, 1]  # without labels: one tick per row, at the cell centers

    fig = Figure()
    axes = fig.subplots(1, 3)
    masks = [tn.causal_mask(4), tn.decoder_mask(tokens, 0)[1], torch.from_numpy(tn.causal_mask(4))]
    for ax, m in zip(axes, masks, strict=True):
        assert plot_mask(m, ax=ax) is fig  # draws into the given axes
    np.testing.assert_array_equal(axes[0].images[0].get_array(), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(axes[1].images[0].get_array(), tn.decoder_mask(tokens, 0)[1, 0])
    assert len(fig.axes) == 3


def test_plot_mask_rejects_bad_input():
    with pytest.raises(TypeError, match="boolean"):
        plot_mask(np.ones((3, 3)))
    with pytest.raises(ValueError, match="as one grid"):
        plot_mask(np.ones((2, 1, 3, 3), dtype=bool))
    with pytest.raises(ValueError, match="expected 3 labels"):
        plot_mask(np.ones((3, 3), dtype=bool), y_labels="ab")
