"""The masked-language-model diagram of chapter 22a: it renders, carries the library's names, and draws what
mask_tokens, padding_mask and causal_mask really give."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common import diagrams_bert  # noqa: E402
from tfm_common.diagrams_bert import FATE_COLORS, attention_allowed, mlm_figure  # noqa: E402
from tfm_common.mlm import FATES, SpecialIds, mask_fates, mask_tokens  # noqa: E402

V = 30
SPECIAL = SpecialIds(pad=26, cls=27, sep=28, mask=29)
IDS = np.array([27, 3, 8, 15, 4, 22, 9, 11, 28, 26, 26])


def label(i: int) -> str:
    return {26: "[PAD]", 27: "[CLS]", 28: "[SEP]", 29: "[MASK]"}.get(i, f"t{i}")


def batch(seed=5, p=0.6):
    return mask_tokens(
        IDS, mask_id=SPECIAL.mask, vocab_size=V, special_ids=SPECIAL, p=p, rng=np.random.default_rng(seed)
    )


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text)]


def test_renders_with_the_rows_and_the_library_names():
    fig = mlm_figure(IDS, batch(), label, SPECIAL)
    found = "\n".join(texts(fig))
    for words in (
        "text",
        "inputs",
        "targets",
        "GPTBlocks WITHOUT the causal mask",
        "head_dense → GELU → head_norm",
        "output_projection (tied, + bias)",
        "IGNORE_INDEX = -100",
        "GPT: causal",
        "BERT: all but [PAD]",
    ):
        assert words in found, words
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_the_fates_drawn_are_mask_tokens_own():
    b = batch()
    fate = mask_fates(IDS, b, SPECIAL.mask)
    assert all((fate == k).any() for k in range(4)), "the seed must show every fate"
    fig = mlm_figure(IDS, b, label, SPECIAL)
    found = texts(fig)
    for k, name in enumerate(FATES):
        assert f"{name}: {int((fate == k).sum())}" in found
    # the input row's boxes in their fate's colour, labelled with what the model reads; the targets row
    boxes = {p.get_gid(): p for p in fig.findobj(FancyBboxPatch) if p.get_gid()}
    words = {t.get_gid(): t.get_text() for t in fig.findobj(Text) if t.get_gid()}
    T = len(IDS)
    assert [to_hex(boxes[f"inputs:{t}"].get_facecolor()) for t in range(T)] == [FATE_COLORS[f] for f in fate]
    assert [words[f"inputs:{t}"] for t in range(T)] == [label(int(i)) for i in b.inputs]
    assert [words[f"text:{t}"] for t in range(T)] == [label(int(i)) for i in IDS]
    assert [words[f"targets:{t}"] for t in range(T)] == [
        label(int(i)) if c else "–" for i, c in zip(b.targets, b.chosen, strict=True)
    ]


@pytest.mark.parametrize("causal", [True, False])
def test_the_attention_pictures_are_the_librarys_masks(causal):
    b = batch()
    allowed = attention_allowed(b.inputs, SPECIAL.pad, causal)
    mask = tnp.padding_mask(b.inputs[None], SPECIAL.pad)[0, 0]  # (1, T): broadcast over the queries
    expected = np.broadcast_to(mask, allowed.shape) & (tnp.causal_mask(len(IDS))[0, 0] if causal else True)
    assert np.array_equal(allowed, expected)
    fig = mlm_figure(IDS, b, label, SPECIAL)
    cells = {p.get_gid(): p for p in fig.findobj(Rectangle) if p.get_gid()}
    T, name = len(IDS), "gpt" if causal else "bert"
    drawn = np.array([[to_hex(cells[f"{name}:{q},{k}"].get_facecolor()) == "#1f5fa8" for k in range(T)]
                      for q in range(T)])  # fmt: skip
    assert np.array_equal(drawn, allowed)


def test_attention_allowed_without_padding_is_full_or_causal():
    assert attention_allowed(IDS, None, False).all()
    assert np.array_equal(attention_allowed(IDS, None, True), np.tri(len(IDS), dtype=bool))


def test_bad_shapes_refused():
    b = batch()
    with pytest.raises(ValueError, match=r"mlm_figure: ids expected one sequence \(T,\)"):
        mlm_figure(IDS[None], b, label, SPECIAL)
    with pytest.raises(ValueError, match="mask_fates: ids expected the batch's shape"):
        mask_fates(IDS[:-1], b, SPECIAL.mask)


def test_every_public_name_is_tested():
    assert set(diagrams_bert.__all__) == {"FATE_COLORS", "mlm_figure", "attention_allowed"}
