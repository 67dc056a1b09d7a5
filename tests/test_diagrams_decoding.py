"""The decoding diagrams draw what they are given: one box per token, one node per candidate, edges to parents."""

import pytest
from matplotlib.patches import FancyArrowPatch

from tfm_common.diagrams_decoding import plot_beam_tree, plot_forcing_vs_decoding


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_forcing_vs_decoding_reads_the_reference_then_its_own_output():
    reference, forced, generated = ["a", "b", "<eos>"], ["a", "x", "<eos>"], ["a", "c", "d", "<eos>"]
    fig = plot_forcing_vs_decoding(reference, forced, generated)
    top, bottom = fig.axes
    assert _texts(top).count("<bos>") == 1 and "x" in _texts(top)  # reads <bos> a b, writes a x <eos>
    assert "c" in _texts(bottom) and "d" in _texts(bottom)
    # Feedback arrows only when decoding: one from each written token to the next input
    arrows_top = [p for p in top.patches if isinstance(p, FancyArrowPatch)]
    arrows_bottom = [p for p in bottom.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows_top) == 2 * len(reference)
    assert len(arrows_bottom) == 2 * len(generated) + len(generated) - 1
    with pytest.raises(ValueError, match="forced expected 3 tokens"):
        plot_forcing_vs_decoding(reference, forced[:2], generated)
    with pytest.raises(ValueError, match="generated expected at least one token"):
        plot_forcing_vs_decoding(reference, forced, [])


def test_beam_tree_has_one_node_and_one_edge_per_candidate():
    steps = [
        [dict(token="a", logp=-0.1, parent=0, status="kept"), dict(token="b", logp=-2.3, parent=0, status="kept")],
        [
            dict(token="<eos>", logp=-0.2, parent=0, status="complete"),
            dict(token="c", logp=-0.5, parent=0, status="kept"),
            dict(token="d", logp=-2.5, parent=1, status="kept"),
            dict(token="e", logp=-3.0, parent=1, status="pruned"),
        ],
    ]
    fig = plot_beam_tree(steps, best=[(1, 0), (2, 0)])
    (ax,) = [a for a in fig.axes if a.texts]
    assert _texts(ax) == ["<bos>", "a  -0.10", "b  -2.30", "<eos>  -0.20", "c  -0.50", "d  -2.50", "e  -3.00"]
    assert len([p for p in ax.patches if isinstance(p, FancyArrowPatch)]) == 6  # one edge per candidate
    with pytest.raises(ValueError, match="status must be one of"):
        plot_beam_tree([[dict(token="a", logp=0.0, parent=0, status="alive")]])
    with pytest.raises(ValueError, match="at least one step"):
        plot_beam_tree([])
