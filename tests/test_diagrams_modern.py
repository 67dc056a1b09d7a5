"""Chapter 18's diagrams: RoPE's rotation drawn with the library's angles, GQA's grouping with a GPT's real keys."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.quiver import Quiver  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common.diagrams_modern import kv_head_of, plot_gqa_heads, plot_rope_rotation, rope_frequencies  # noqa: E402


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)  # no pyplot, no display
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_rope_figure_carries_the_library_names_and_formula():
    fig = plot_rope_rotation()
    assert isinstance(fig, Figure)
    found = texts(fig)
    for label in ("apply_rope", "RotaryEmbedding(d_head=8, max_len, base=10000)", "cos, sin: (max_len, d_head/2)",
                  "(x0 cos θ − x1 sin θ, x0 sin θ + x1 cos θ)", "R_2 q", "R_5 k", "R_6 q", "R_9 k", "s − p = 3",
                  "pair 3: (x[6], x[7])"):  # fmt: skip
        assert label in found, label
    renders(fig)


def test_rope_arrows_point_at_the_library_angles():
    """Each arrow of the right panel is (cos, sin) of position p, pair i: RotaryEmbedding's own tables."""
    d_head, positions, base = 8, 16, 10000.0
    fig = plot_rope_rotation(d_head=d_head, positions=positions, base=base)
    (quiver,) = [q for q in fig.findobj(Quiver)]
    cos, sin = tnp.rope_angles(positions, d_head, base, np.float64)  # (positions, d_head / 2)
    np.testing.assert_allclose(quiver.U.reshape(cos.shape), cos, atol=1e-12)
    np.testing.assert_allclose(quiver.V.reshape(sin.shape), sin, atol=1e-12)
    np.testing.assert_allclose(np.cos(rope_frequencies(d_head, base)), cos[1], atol=1e-12)


def test_rope_dot_products_drawn_equal_the_library_rotation():
    """The two pair panels print (R_p q).(R_s k) for the same offset: equal, and equal to RotaryEmbedding's."""
    fig = plot_rope_rotation(p=2, s=5, shift=4)
    shown = [t.get_text().split("= ")[-1] for t in fig.findobj(Text) if ") = " in t.get_text() and "R_" in t.get_text()]
    assert len(shown) == 2 and shown[0] == shown[1]
    rope = tnp.RotaryEmbedding(2, 16, dtype=np.float64)  # d_head 2: one pair, w_0 = 1
    q, k = np.array([0.95, 0.25]), np.array([0.55, 0.75])
    qs, ks = rope(np.tile(q, (16, 1))), rope(np.tile(k, (16, 1)))
    assert f"{qs[2] @ ks[5]:.3f}" == shown[0] == f"{qs[6] @ ks[9]:.3f}"


def test_gqa_figure_names_real_keys_with_their_shapes():
    d_model, n_heads, n_kv = 64, 4, 2
    fig = plot_gqa_heads(d_model, n_heads, n_kv)
    found = texts(fig)
    model = tnp.GPT(50, d_model, n_heads, 128, 2, 32, n_kv_heads=n_kv, positional="rope", norm="rmsnorm",
                    activation="swiglu", rng=0)  # fmt: skip
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    drawn = [t.get_text() for t in fig.findobj(Text) if t.get_text().startswith("layers.{i}.")]
    assert len(drawn) == 4
    for key in drawn:
        real = key.replace("{i}", "0")
        assert real in shapes, key
        assert f"= {shapes[real]}" in found, (key, shapes[real])
    for label in ("GroupedQueryAttention(64, 4, 2)", "GroupedQueryAttention(64, 4, 4)",
                  "GroupedQueryAttention(64, 4, 1)", "(B, n_kv_heads, T, d_head) = (B, 2, T, 16)",
                  "(B, n_heads, T, d_head) = (B, 4, T, 16)", "repeat_kv(k, 2)"):  # fmt: skip
        assert label in found, label
    renders(fig)


def test_gqa_grouping_is_repeat_kv_layout():
    """Query head h reads key/value head h // (n_heads // n_kv_heads): repeat_kv's copies, checked on the data."""
    for n_heads, n_kv in ((4, 2), (8, 2), (6, 3), (4, 1), (4, 4)):
        kv = np.arange(n_kv, dtype=np.float64).reshape(1, n_kv, 1, 1)  # head j holds the number j
        repeated = tnp.repeat_kv(kv, n_heads // n_kv)[0, :, 0, 0]
        assert [kv_head_of(h, n_heads, n_kv) for h in range(n_heads)] == repeated.astype(int).tolist()


def test_refused_sizes():
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        plot_gqa_heads(64, 4, 3)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by n_heads \(4\)"):
        plot_gqa_heads(10, 4, 2)
    with pytest.raises(ValueError, match="n_kv_heads expected a positive integer, got 0"):
        plot_gqa_heads(64, 4, 0)
    with pytest.raises(ValueError, match="d_head must be even"):
        plot_rope_rotation(d_head=7)
    with pytest.raises(ValueError, match="p expected an integer >= 0, got -1"):
        plot_rope_rotation(p=-1)
