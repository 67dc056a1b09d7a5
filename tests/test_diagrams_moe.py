"""Chapter 20c's diagram: the slots and drops it draws are tfm_common.moe.route's, for the layer's real router."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common.diagrams_moe import example_router_probs, plot_moe_routing  # noqa: E402
from tfm_common.moe import expert_capacity, route  # noqa: E402


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def by_gid(fig: Figure) -> dict[str, str]:
    return {t.get_gid(): t.get_text() for t in fig.findobj(Text) if t.get_gid()}


def renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_figure_names_the_layer_its_keys_and_the_capacity():
    fig = plot_moe_routing(top_k=2, capacity_factor=1.0)
    found = texts(fig)
    layer = tnp.MoEFeedForward(64, 256, 4, 2, capacity_factor=1.0)
    shapes = {k: v.shape for k, v in layer.state_dict().items()}
    assert f"router.weight {shapes['router.weight']}" in found
    assert f"experts.{{e}}.linear1.weight {shapes['experts.0.linear1.weight']}" in found
    assert f"experts.{{e}}.linear2.weight {shapes['experts.0.linear2.weight']}" in found
    for label in ("MoEFeedForward(64, 256, n_experts=4, top_k=2, capacity_factor=1.0)",
                  "ceil(1 · 8 · 2 / 4) = 4 slots", "y_n = Σ_j keep[n, j] · g[n, j]"):  # fmt: skip
        assert label in found, label
    renders(fig)


@pytest.mark.parametrize("top_k, cf", [(1, 1.0), (2, 1.0), (2, 0.5), (1, None), (3, 0.75)])
def test_slots_and_drops_drawn_are_the_librarys_routing(top_k, cf):
    """With a real layer's router probabilities: every slot's text and every dropped assignment come from route()."""
    layer = tnp.MoEFeedForward(8, 4, 4, top_k, capacity_factor=cf, rng=3, dtype=np.float64)
    x = np.random.default_rng(top_k).standard_normal((10, 8))
    layer(x)
    _, probs, r, _ = layer.route(x)
    assert np.array_equal(r.keep, layer.routing.keep)
    fig = plot_moe_routing(probs, top_k, cf, d_model=8, d_ff=4)
    drawn = by_gid(fig)
    slots = expert_capacity(10, 4, top_k, cf) or int(r.kept.max())
    for e, (tokens, ranks) in enumerate(r.groups):
        for i in range(slots):
            want = f"token {tokens[i]} (choice {ranks[i] + 1})" if i < len(tokens) else "(empty)"
            assert drawn[f"slot {e} {i}"] == want
        lost = [(n, j) for n, j in zip(*np.nonzero(~r.keep), strict=True) if r.experts[n, j] == e]
        assert [drawn[f"dropped {e} {i}"] for i in range(len(lost))] == [
            f"✗ token {n} (choice {j + 1})" for n, j in lost
        ]
        assert f"dropped {e} {len(lost)}" not in drawn
    for n in range(10):
        assert [drawn[f"rank {n} {j}"] for j in range(top_k)] == [str(j + 1) for j in range(top_k)]
    assert f"dropped: {r.dropped} of {r.keep.size} assignments" in texts(fig)


def test_default_probabilities_are_rows_of_a_distribution_and_bad_arguments_refused():
    p = example_router_probs()
    assert p.shape == (8, 4) and np.allclose(p.sum(axis=1), 1)
    assert route(p, 2, 4).dropped >= 1  # the default drops something at capacity factor 1
    with pytest.raises(ValueError, match="top_k must be <= n_experts=4"):
        plot_moe_routing(p, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        plot_moe_routing(p, capacity_factor=0)
    with pytest.raises(ValueError, match="probs expected shape"):
        plot_moe_routing(p[0])
