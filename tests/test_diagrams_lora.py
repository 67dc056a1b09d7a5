"""Chapter 22c's diagram: where LoRA's adapters sit, drawn from a real GPT's Linear layers and add_lora's rule."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common.diagrams_lora import adapted_layers, plot_lora  # noqa: E402

CFG = dict(vocab_size=64, d_model=16, n_heads=2, d_ff=48, n_layers=2, max_len=8)


def block_layers(model, block="layers.0."):
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules()
            if type(m) is tnp.Linear and n.startswith(block)]  # fmt: skip


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "out_proj", "linear1", "linear2"]]
)
def test_the_doors_sit_where_add_lora_puts_them(targets):
    model = tnp.GPT(**CFG)
    layers = block_layers(model)
    fig = plot_lora(layers, targets, rank=2, alpha=8)
    drawn = [
        p.get_gid().split(":", 1)[1] for p in fig.findobj(FancyBboxPatch) if (p.get_gid() or "").startswith("adapter:")
    ]
    real = [n for n in tnp.add_lora(model, 2, 8.0, targets) if n.startswith("layers.0.")]
    assert drawn == real == adapted_layers(layers, targets)
    bases = [
        p.get_gid().split(":", 1)[1] for p in fig.findobj(FancyBboxPatch) if (p.get_gid() or "").startswith("base:")
    ]
    assert bases == [n for n, _, _ in layers]


def test_the_figure_carries_the_library_names_and_counts():
    model = tnp.GPT(**CFG)
    layers = block_layers(model)
    fig = plot_lora(layers, ["q_proj", "linear1"], rank=2, alpha=8)
    layer = tnp.LoRALinear(model.layers[0].self_attn.q_proj, 2, 8.0)
    found = texts(fig)
    for label in ("LoRALinear(base, rank=2, alpha=8)", "lora_A  A (2, 16)", "lora_B  B (16, 2)", "base.weight  W",
                  f"× alpha/rank = 8/2 = {layer.scaling:g}", "layers.0.ff.linear1\nLinear(16 → 48)",
                  f"{2 * (16 + 48):,} trained", "frozen"):  # fmt: skip
        assert label in found, label
    assert set(layer.state_dict()) == {"lora_A", "lora_B", "base.weight", "base.bias"}
    assert f"{layer.lora_A.data.size:,} trained" in found
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"
    assert np.isclose(layer.scaling, 4.0)


def test_refuses_as_the_library_does():
    layers = block_layers(tnp.GPT(**CFG))
    with pytest.raises(ValueError, match="matches no Linear layer"):
        plot_lora(layers, ["nope"])
    with pytest.raises(ValueError, match="rank must be <="):
        plot_lora(layers, ["q_proj"], rank=17)
