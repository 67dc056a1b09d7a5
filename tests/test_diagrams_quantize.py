"""Chapter 21a's diagram: the int4 group layout, drawn with the codes and scales tfm_numpy.quantize gives."""

import io
import re

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common.diagrams_quantize import int4_group_codes, plot_int4_groups  # noqa: E402


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text)]


def test_figure_renders_and_carries_the_library_names():
    fig = plot_int4_groups()
    assert isinstance(fig, Figure)
    found = "\n".join(texts(fig))
    for label in ("codes, scales = quantize(w, 4, axis=1, group_size=4)", "scales: (4, in_features / group_size)",
                  "codes: (out_features, in_features) = (4, 16)", "codes in [-7, 7]", "max |w| / 7",
                  "= 96, against 256 in float32: 12 bits per weight"):  # fmt: skip
        assert label in found, label
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


@pytest.mark.parametrize("shape, group", [((4, 16), 4), ((3, 64), 32), ((5, 128), 128)])
def test_the_diagram_codes_are_the_library_codes(shape, group):
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    codes, scales = int4_group_codes(w, group)
    lib_codes, lib_scales = tnp.quantize(w, 4, axis=1, group_size=group)
    assert np.array_equal(codes, lib_codes) and np.array_equal(scales, lib_scales)


def test_the_drawn_numbers_are_the_codes_and_scales():
    fig = plot_int4_groups(out_features=3, in_features=8, group_size=4, seed=2)
    w = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    w[1, 2] = 4.0  # the diagram's outlier
    codes, scales = tnp.quantize(w, 4, axis=1, group_size=4)
    shown = texts(fig)
    cells = [t for t in shown if t.lstrip("-").isdigit()]
    assert cells == [str(c) for c in codes.reshape(-1)]  # row by row, left to right
    drawn_scales = [t for t in shown if re.fullmatch(r"\d+\.\d{3}", t)]
    assert drawn_scales == [f"{s:.3f}" for s in scales.reshape(-1)]  # row by row
    assert codes[1, 2] == 7  # the outlier takes its group's largest code


def test_refuses_a_group_that_does_not_divide():
    with pytest.raises(ValueError, match="group_size must divide the length 16"):
        plot_int4_groups(in_features=16, group_size=5)
