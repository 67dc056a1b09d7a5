"""The GPT diagram of chapter 17b: a Figure carrying the library's names, each checked against a real GPT."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
import tfm_torch as tpt  # noqa: E402
from tfm_common import diagrams_gpt  # noqa: E402
from tfm_common.diagrams_gpt import PREFIXES, gpt_figure  # noqa: E402

TINY = dict(vocab_size=11, d_model=8, n_heads=2, d_ff=12, n_layers=2, max_len=8)


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def test_the_figure_carries_the_data_flow_and_the_block():
    fig = gpt_figure()
    assert isinstance(fig, Figure)
    found = texts(fig)
    for label in ("tokens (B, T) int64 ids", "embed(tokens) × √d_model", "+ pos: learned positions",
                  "layers.{i}: GPTBlock", "causal_mask(T), (1, 1, T, T)", "norm: the final LayerNorm",
                  "output_projection: Linear(d_model, vocab_size), no bias", "weight IS embed.weight (tie_output=True)",
                  "logits (B, T, vocab_size)", "logits[:, t] predict tokens[:, t + 1]", "norm1 (LayerNorm)",
                  "self_attn: GroupedQueryAttention", "q_proj, k_proj, v_proj", "out_proj", "dropout1",
                  "norm2 (LayerNorm)", "ff: PositionwiseFeedForward", "linear1 → GELU → linear2", "dropout2",
                  "residual sum", "x ← x + dropout1(self_attn(norm1(x), mask))"):  # fmt: skip
        assert label in found, label
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)  # it renders (no backend or pyplot needed)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_every_prefix_drawn_is_in_the_state_dict_of_both_tracks():
    found = texts(gpt_figure())
    for lib, dtype in ((tnp, np.float64), (tpt, None)):
        keys = list((lib.GPT(**TINY, rng=0) if dtype is None else lib.GPT(**TINY, rng=0, dtype=dtype)).state_dict())
        for prefix in PREFIXES:
            # drawn: the model's own prefixes in full, a block's as its names inside the "layers.{i}" frame
            assert prefix.removeprefix("layers.{i}.").split(".")[-1] in found and "layers.{i}" in found, prefix
            for i in range(TINY["n_layers"]):  # ... and real, for every block
                real = prefix.replace("{i}", str(i))
                assert any(k.startswith(real + ".") for k in keys), f"{lib.__name__}: no state_dict key under {real}"
    # every parameter of the model is under a drawn prefix: nothing the figure leaves out
    drawn = {p.replace("{i}", str(i)) for p in PREFIXES for i in range(TINY["n_layers"])}
    assert all(any(k.startswith(d + ".") for d in drawn) for k in keys)


def test_a_models_config_prints_its_sizes_and_options():
    model = tnp.GPT(**TINY, norm="rmsnorm", tie_output=False, rng=0)
    found = texts(gpt_figure(model.config))
    for label in ("embed.weight (vocab_size=11, d_model=8)", "pos.weight (max_len=8, d_model=8)", "n_layers=2",
                  "logits (B, T, vocab_size=11)", "norm1 (RMSNorm)", "its own weight (tie_output=False)",
                  "n_heads=2", "d_ff=12"):  # fmt: skip
        assert label in found, label


def test_a_config_without_the_sizes_is_refused():
    with pytest.raises(ValueError, match=r"config expected a GPT's config \(model.config\), missing \['max_len'\]"):
        gpt_figure({k: v for k, v in TINY.items() if k != "max_len"})


def test_every_public_name_is_tested():
    assert set(diagrams_gpt.__all__) == {"gpt_figure", "PREFIXES"}
