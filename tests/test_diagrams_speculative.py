"""The speculative-decoding diagram draws the round it is given: the proposals, the rule's verdicts in order until
the first rejection, the accepted prefix and the target's own token; and it draws what speculative_generate did."""

import numpy as np
import pytest

import tfm_numpy as tn
from tfm_common.diagrams_speculative import ROUND_COLORS, plot_speculative_round


def _texts(ax, gid=None):
    return [t.get_text() for t in ax.texts if gid is None or t.get_gid() == gid]


def test_a_rejected_round_keeps_the_prefix_and_draws_from_the_residual():
    fig = plot_speculative_round(["def", " f"], ["(", "x", ")", ":"], 2, "y", accept_probs=[1.0, 0.93, 0.2, 0.5])
    (ax,) = fig.axes
    assert _texts(ax, "context") == ["def", " f"]
    assert _texts(ax, "proposed") == ["(", "x", ")", ":"]
    assert _texts(ax, "accepted") == ["(", "x"] and _texts(ax, "target") == ["y"]
    texts = _texts(ax)
    assert "accept\n1.00" in texts and "accept\n0.93" in texts and "reject\n0.20" in texts
    assert "not looked at" in texts and not any("0.50" in t for t in texts)  # after the rejection: no verdict
    assert any("residual" in t for t in texts) and "output: 3 tokens" in texts
    assert "target: ONE forward\nover 5 positions: p_1 .. p_5" in texts
    colors = {t.get_text(): t.get_bbox_patch().get_facecolor() for t in ax.texts if t.get_gid() == "accepted"}
    assert all(np.allclose(c[:3], _rgb(ROUND_COLORS["accepted"][0])) for c in colors.values())


def _rgb(hex_color):
    return [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]


def test_an_accepted_round_ends_with_the_bonus_token():
    (ax,) = plot_speculative_round(["a"], ["b", "c"], 2, "d").axes
    assert _texts(ax, "accepted") == ["b", "c"] and _texts(ax, "target") == ["d"]
    assert any("bonus" in t for t in _texts(ax)) and "reject" not in " ".join(_texts(ax))


def test_refusals():
    with pytest.raises(ValueError, match=r"accepted must be in \[0, 2\]"):
        plot_speculative_round(["a"], ["b", "c"], 3, "d")
    with pytest.raises(ValueError, match="accept_probs expected 2 numbers, got 1"):
        plot_speculative_round(["a"], ["b", "c"], 1, "d", accept_probs=[0.5])
    with pytest.raises(ValueError, match="context and drafted expected tokens, got 1 and 0"):
        plot_speculative_round(["a"], [], 0, "d")


def test_it_draws_a_real_round_of_speculative_generate():
    cfg = dict(vocab_size=6, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=16)
    target, draft = tn.GPT(**cfg, rng=0, dtype=np.float64), tn.GPT(**cfg, rng=1, dtype=np.float64)
    prompt = np.array([[1, 2]])
    out = tn.speculative_generate(target, draft, prompt, 4, k=3, temperature=0, rng=0)
    a = int(out.accepted[0])  # the first round: the draft's greedy proposals against the target's greedy tokens
    drafted = draft.generate(prompt, 3, temperature=0)[0, 2:]
    assert np.array_equal(out.tokens[0, 2 : 2 + a], drafted[:a])
    names = [str(t) for t in drafted]
    (ax,) = plot_speculative_round(["1", "2"], names, a, str(out.tokens[0, 2 + a])).axes
    assert _texts(ax, "accepted") == names[:a] and _texts(ax, "target") == [str(out.tokens[0, 2 + a])]
