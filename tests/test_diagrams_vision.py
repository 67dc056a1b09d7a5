"""The vision diagrams (chapters 19a, 19b): Figures whose names are the models' real `state_dict` prefixes and whose
sizes are the models' real shapes."""

import io
import re

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
import tfm_torch as tpt  # noqa: E402
from tfm_common import diagrams_vision  # noqa: E402
from tfm_common.diagrams_vision import swin_figure, vit_pipeline_figure  # noqa: E402

VIT = dict(image_size=8, patch_size=4, in_channels=1, n_classes=10, d_model=64, n_heads=4, d_ff=128, n_layers=2)
SWIN = dict(image_size=8, patch_size=2, in_channels=1, n_classes=10, d_model=32, depths=(2, 2), n_heads=(2, 4),
            window_size=2, mlp_ratio=2)  # fmt: skip
PREFIX = re.compile(r"\b(?:patch_embed|cls_token|pos_embed|encoder|stages|merges|head)(?:\.[\w{}]+)*(?![\w(])")


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def drawn_prefixes(fig: Figure) -> set[str]:
    """Every state_dict-like name on the figure, with the index placeholders {i}, {j} read as 0."""
    return {m.replace("{i}", "0").replace("{j}", "0") for m in PREFIX.findall(texts(fig))}


def assert_real_prefixes(fig: Figure, keys: list[str]) -> None:
    names = drawn_prefixes(fig)
    assert names, "no state_dict name found on the figure"
    fake = [n for n in names if not any(k == n or k.startswith(n + ".") for k in keys)]
    assert not fake, f"names drawn that are no state_dict prefix: {fake}"


def renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)  # no backend or pyplot needed
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_every_public_diagram_is_tested():
    assert set(diagrams_vision.__all__) == {"vit_pipeline_figure", "swin_figure"}


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_vit_pipeline_names_and_shapes_are_the_models(track):
    model = tnp.ViT(**VIT, rng=0) if track == "numpy" else tpt.ViT(**VIT)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fig = vit_pipeline_figure(model.config)
    assert isinstance(fig, Figure)
    found = texts(fig)
    for label in ("patchify", "patch_embed.proj", "cls_token", "pos_embed", "encoder.layers.{i}.self_attn",
                  "encoder.layers.{i}.ff", "encoder.norm", "head", "h[:, 0]", "logits"):  # fmt: skip
        assert label in found, label
    assert_real_prefixes(fig, list(sd))
    d, n = sd["patch_embed.proj.weight"]  # (d, C P^2)
    T = sd["pos_embed.weight"][0]
    K = sd["head.weight"][0]
    assert f"(B, N, C P²)\n= (B, {T - 1}, {n})" in found  # the patches, as patch_embed.proj reads them
    assert f"(B, 1+N, d)\n= (B, {T}, {d})" in found and sd["cls_token"] == (1, 1, d)
    assert f"(B, K)\n= (B, {K})" in found
    renders(fig)


def test_vit_pipeline_symbols_only_and_its_refusals():
    found = texts(vit_pipeline_figure())
    assert "(B, 1+N, d)" in found and "= (B" not in found
    with pytest.raises(TypeError, match="config expected a dict"):
        vit_pipeline_figure([8, 4])
    with pytest.raises(ValueError, match=r"missing \['n_layers'\]"):
        vit_pipeline_figure({k: v for k, v in VIT.items() if k != "n_layers"})
    with pytest.raises(ValueError, match="pool='cls'"):
        vit_pipeline_figure(tnp.ViT(**VIT, pool="mean", rng=0).config)


@pytest.mark.parametrize("track", ["numpy", "torch"])
def test_swin_figure_names_stages_and_shifts_of_the_model(track):
    model = tnp.Swin(**SWIN, rng=0) if track == "numpy" else tpt.Swin(**SWIN)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fig = swin_figure(model.config)
    found = texts(fig)
    for label in ("window_partition(x, 4)", "cyclic_shift(x, 2)", "shifted_window_mask(8, 8, 4, 2)", "merges.0",
                  "PatchMerging", "stages.0.{j}", "stages.1.{j}", "patch_embed"):  # fmt: skip
        assert label in found, label
    assert_real_prefixes(fig, list(sd))
    for stage in model.stages:  # the shifts drawn are the blocks' own
        assert f"shifts {[int(b.shift) for b in stage]}" in found
    out_f, in_f = sd["merges.0.reduction.weight"]
    assert f"reduction Linear({in_f}, {out_f})" in found and f"norm ({in_f})" in found
    renders(fig)


def test_swin_figure_regions_are_the_masks():
    """The middle panel's colors: two tokens share a color iff shifted_window_mask lets them attend."""
    n, M, s = 8, 4, 2
    region = diagrams_vision._regions(n, M, s)  # the rolled grid's labels, as drawn
    windows = tnp.window_partition(region.reshape(1, n, n, 1).astype(float), M)[..., 0]  # (nW, M M)
    same = windows[:, :, None] == windows[:, None, :]
    np.testing.assert_array_equal(same, tnp.shifted_window_mask(n, n, M, s))


def test_swin_figure_symbols_only_and_its_refusals():
    found = texts(swin_figure())
    assert "stages.0.{j}" in found and "merges.0" in found
    with pytest.raises(ValueError, match="multiple of window_size"):
        swin_figure(grid=6, window_size=4)
    with pytest.raises(ValueError, match="integer >= 2"):
        swin_figure(window_size=1)
    with pytest.raises(ValueError, match=r"missing \['window_size'\]"):
        swin_figure({k: v for k, v in SWIN.items() if k != "window_size"})
