"""Chapter 21c's diagram: the band mask with sinks and the rolling cache's slots, drawn from the library's rules and
equal to what a real WindowedGPT's cache holds step by step."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common.diagrams_cache import plot_rolling_cache, slot_table  # noqa: E402


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def test_the_figure_renders_with_the_library_names():
    fig = plot_rolling_cache(window=5, sinks=2, steps=14)
    found = texts(fig)
    labels = ("band_mask(T=14, window=5, sinks=2)", "GPT(..., window=5, sinks=2)", 'cache["slots"]', "sinks",
              "slot 2 + (p - 2) mod 5", "step 13: key of position 13 -> slot 3", 'cache["layers"][i]["k"]')  # fmt: skip
    for label in labels:
        assert label in found, label
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


@pytest.mark.parametrize("window,sinks", [(5, 2), (4, 0), (3, 1)])
def test_the_slot_table_is_what_a_windowed_gpt_caches(window, sinks):
    """Row t of the drawn table: the cache["slots"] of a real WindowedGPT after its forward_step of position t."""
    model = tnp.GPT(vocab_size=7, d_model=8, n_heads=2, d_ff=8, n_layers=1, max_len=4, positional="rope",
                    window=window, sinks=sinks, rng=0)  # fmt: skip
    cache, rows = {}, []
    for t in range(12):
        model.forward_step(np.array([[t % 7]]), cache)
        rows.append(cache["slots"].copy())
    assert (slot_table(12, window, sinks) == np.array(rows)).all()
    fig = plot_rolling_cache(window, sinks, 12)
    right = fig.axes[1]
    drawn = [t.get_text() for t in right.texts if t.get_text().isdigit() or t.get_text() == ""]
    table = slot_table(12, window, sinks)
    assert drawn == ["" if p < 0 else str(p) for p in table.reshape(-1)]


def test_the_mask_panel_is_band_mask():
    fig = plot_rolling_cache(window=4, sinks=1, steps=9)
    cells = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    shaded = np.array([c.get_facecolor() != matplotlib.colors.to_rgba("#f0f0f0") for c in cells]).reshape(9, 9)
    assert (shaded == tnp.band_mask(9, 4, 1)[0, 0]).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="sinks must be < window=3"):
        plot_rolling_cache(window=3, sinks=3)
    with pytest.raises(ValueError, match="window expected an integer >= 1"):
        plot_rolling_cache(window=0)
