"""The pooling diagram of chapter 22b: it renders, names the library's pools and head, and highlights exactly the
position `SequenceClassifier` reads (tfm_numpy.pool_positions) on real padded rows."""

import io

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
from tfm_common import diagrams_finetune  # noqa: E402
from tfm_common.bpe import ByteBPE  # noqa: E402
from tfm_common.diagrams_finetune import HEAD_LABEL, pooling_figure  # noqa: E402
from tfm_common.mlm import bert_tokenizer, special_ids  # noqa: E402
from tfm_common.snippets import NUL_PAD, encode_snippets  # noqa: E402

TEXT = b"    async def run(self):\n        await self._loop.run()\n"


def rows():
    """A snippet as each model reads it (12 positions, right-padded), the token strings and the pooled positions."""
    bpe = bert_tokenizer(ByteBPE.train(TEXT * 4, vocab_size=280))
    sp = special_ids(bpe)
    bert = encode_snippets([TEXT[:24]], bpe.encode, 12, pad_id=sp.pad, prefix=(sp.cls,), suffix=(sp.sep,))
    gpt = encode_snippets([TEXT[:24]], bpe.encode, 12, pad_id=NUL_PAD)
    names = lambda ids, pad: [("[PAD]" if i == pad else bpe.decode([i])) for i in ids]  # noqa: E731
    bert_at = int(tnp.pool_positions(bert, "first", sp.pad)[0])
    gpt_at = int(tnp.pool_positions(gpt, "last", NUL_PAD)[0])
    return names(bert[0], sp.pad), names(gpt[0], NUL_PAD), bert_at, gpt_at


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def test_the_figure_renders_with_the_library_names():
    b, g, bert_at, gpt_at = rows()
    fig = pooling_figure(b, g, bert_at=bert_at, gpt_at=gpt_at)
    found = texts(fig)
    head = HEAD_LABEL.replace(": ", ":\n")
    for label in ('BERT, pool="first"', 'GPT, pool="last"', "[CLS]", "[SEP]", "[PAD]", "logits (B, 6)", head,
                  "pad keys are masked", "h_t has read tokens 0 .. t only"):  # fmt: skip
        assert label in found, label
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_the_highlighted_state_is_the_one_the_classifier_reads():
    b, g, bert_at, gpt_at = rows()
    assert bert_at == 0 and g[gpt_at] != "[PAD]" and g[gpt_at + 1] == "[PAD]"  # padded: not the array's end
    fig = pooling_figure(b, g, bert_at=bert_at, gpt_at=gpt_at)
    gids = sorted(p.get_gid() for p in fig.axes[0].patches if p.get_gid())
    assert gids == sorted([f"pooled-bert-{bert_at}", f"pooled-gpt-{gpt_at}"])
    assert f"h{gpt_at}: (B, d_model)" in texts(fig)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(gpt_at=11), ValueError, r"gpt_at=11 must be a position of gpt_tokens .* not padding"),
        (dict(bert_at=12), ValueError, "bert_at=12 must be a position"),
        (dict(gpt_tokens="abc"), TypeError, "gpt_tokens expected a non-empty sequence of token strings"),
        (dict(n_classes=0), ValueError, "n_classes must be an int >= 1"),
    ],
)
def test_refusals(kw, error, match):
    b, g, bert_at, gpt_at = rows()
    args = dict(bert_tokens=b, gpt_tokens=g, bert_at=bert_at, gpt_at=gpt_at) | kw
    with pytest.raises(error, match=match):
        pooling_figure(args.pop("bert_tokens"), args.pop("gpt_tokens"), **args)


def test_every_public_name_is_tested():
    assert set(diagrams_finetune.__all__) == {"pooling_figure", "HEAD_LABEL"}
