"""The architecture diagrams: each is a Figure carrying the book's names (modules, state_dict prefixes, shapes)."""

import io

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from tfm_common import diagrams  # noqa: E402

EXPECTED = {
    "architecture_figure": [
        "encoder.layers.{i}.self_attn",
        "encoder.layers.{i}.ff",
        "decoder.layers.{i}.self_attn",
        "decoder.layers.{i}.cross_attn",
        "decoder.layers.{i}.ff",
        "src_embed",
        "tgt_embed",
        "output_projection",
        "memory (B, S, d_model)",
        "x (B, S, d_model)",
        "y (B, T, d_model)",
        "logits (B, T, V_tgt)",
        "src_mask (B, 1, 1, S)",
        "tgt_mask (B, 1, T, T)",
        "norm3",
    ],
    "norm_placement_figure": [
        "Post-LN  (norm_first=False)",
        "Pre-LN  (norm_first=True)",
        "x ← norm(x + F(x))",
        "x ← x + F(norm(x))",
        "norm1",
        "norm2",
        "encoder.norm",
    ],
    "encoder_layer_backward_figure": [
        "self_attn",
        "dropout1",
        "norm1",
        "ff",
        "dropout2",
        "norm2",
        "_cache: q, k, v",
        "p, p_drop",
        "_cache: xhat (B,S,d)",
        "ReLU: mask = a > 0",
        "_cache: scale",
        "d_query + d_key + d_value",
    ],
}


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_diagram_is_a_figure_with_the_book_names(name):
    fig = getattr(diagrams, name)()
    assert isinstance(fig, Figure)
    found = texts(fig)
    missing = [label for label in EXPECTED[name] if label not in found]
    assert not missing, f"{name}: labels missing: {missing}"
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)  # it renders (no backend or pyplot needed)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_every_public_diagram_is_tested():
    assert set(diagrams.__all__) == set(EXPECTED)


def test_backward_figure_names_what_the_code_caches():
    """The cache labels must be the code's: the attributes stored by the modules' forward."""
    import numpy as np

    import tfm_numpy as tnp

    layer = tnp.EncoderLayer(8, 2, 16, 0.0, rng=0, dtype=np.float64)
    layer(np.random.default_rng(0).standard_normal((1, 3, 8)))
    assert len(layer.self_attn._cache) == 5  # q, k, v, p, p_drop, as the figure lists
    assert len(layer.norm1._cache) == 3  # xhat, rstd, axes
    found = texts(diagrams.encoder_layer_backward_figure())
    assert "(x.shape, x.dtype)" in found and layer._cache == ((1, 3, 8), np.dtype("float64"))
