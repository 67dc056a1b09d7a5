"""Where a classifier's head reads a pretrained model (chapter 22b), drawn as code.

`pooling_figure(bert_tokens, gpt_tokens, bert_at=..., gpt_at=...)` draws two rows of real token strings (a snippet
as each model reads it, right-padded) with the hidden state above each position, and the one state that
`SequenceClassifier` hands to its head: for the BERT (pool="first") position 0, its [CLS] token, which attends to
every token that is not padding; for the GPT (pool="last") the last token that is not padding, the only position
whose causal attention has read the whole text, and none of the padding after it. The positions are the caller's
(`tfm_numpy.pool_positions`), so the figure shows what the library reads; the pooled box of each row carries the
gid "pooled-bert-<t>" / "pooled-gpt-<t>" (a test compares t with the library). Built with matplotlib's object API,
as `tfm_common.diagrams`; it computes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from .diagrams import COLORS
from .validate import check_size

__all__ = ["pooling_figure", "HEAD_LABEL"]

HEAD_LABEL = "head: Linear(d_model, n_classes)"
POOLED = "#c0392b"  # the state the head reads
PAD_FACE = "#f4f4f4"


def _box(ax, x, y, w, h, text, face, *, edge="#333333", lw=1.0, fontsize=7.0, gid=None, color="black"):
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.05")
    patch.set(facecolor=face, edgecolor=edge, linewidth=lw, gid=gid)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color=color, family="monospace")


def _arrow(ax, start, end, color="black", lw=1.0, rad=0.0):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=lw, shrinkA=0, shrinkB=0,
                                                          connectionstyle=f"arc3,rad={rad}"))  # fmt: skip


def _shown(token: str) -> str:
    """A token as the figure prints it: whitespace made visible, long ones cut."""
    text = token.replace("\n", "\\n").replace(" ", "·")
    return text if len(text) <= 7 else text[:6] + "…"


def _row(ax, y, tokens, at, pad, name, title, note, width):
    n = len(tokens)
    step = (width - 4.4) / n
    x0 = 1.9 + step / 2
    ax.text(0.15, y + 1.85, title, ha="left", va="center", fontsize=10, weight="bold")
    ax.text(0.15, y + 1.52, note, ha="left", va="center", fontsize=7.6, color="#333333")
    ax.text(1.75, y, "tokens", ha="right", va="center", fontsize=7.6)
    ax.text(1.75, y + 0.75, "encode →\nhidden states", ha="right", va="center", fontsize=7.2)
    for t, token in enumerate(tokens):
        x = x0 + t * step
        is_pad, pooled = token == pad, t == at
        _box(ax, x, y, step * 0.92, 0.36, _shown(token), PAD_FACE if is_pad else COLORS["io"],
             edge="#aaaaaa" if is_pad else "#333333", color="#999999" if is_pad else "black", fontsize=6.4)  # fmt: skip
        _box(
            ax,
            x,
            y + 0.75,
            step * 0.7,
            0.36,
            f"h{t}",
            COLORS["attn"] if not is_pad else PAD_FACE,
            edge=POOLED if pooled else ("#aaaaaa" if is_pad else "#333333"),
            lw=2.4 if pooled else 0.8,
            gid=f"pooled-{name}-{t}" if pooled else None,
            fontsize=6.4,
            color="#999999" if is_pad else "black",
        )
        _arrow(ax, (x, y + 0.18), (x, y + 0.57), color="#aaaaaa" if is_pad else "black", lw=0.7)  # fmt: skip
    return x0 + at * step, y + 0.93


def pooling_figure(bert_tokens: Sequence[str], gpt_tokens: Sequence[str], *, bert_at: int, gpt_at: int,
                   pad: str = "[PAD]", n_classes: int = 6) -> Figure:  # fmt: skip
    """The two pools of `SequenceClassifier` on real rows of tokens (strings, as `ByteBPE.decode` gives them;
    padding written as `pad`): the BERT's row read at `bert_at` (0, [CLS]), the GPT's at `gpt_at` (its last
    non-pad token), each into the head and the n_classes logits."""
    for arg, tokens, at in (("bert", bert_tokens, bert_at), ("gpt", gpt_tokens, gpt_at)):
        if isinstance(tokens, str) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TypeError(f"pooling_figure: {arg}_tokens expected a non-empty sequence of token strings")
        check_size("pooling_figure", f"{arg}_at", at, minimum=0)
        if at >= len(tokens) or tokens[at] == pad:
            raise ValueError(f"pooling_figure: {arg}_at={at} must be a position of {arg}_tokens (0 .. "
                             f"{len(tokens) - 1}) that is not padding")  # fmt: skip
    check_size("pooling_figure", "n_classes", n_classes)
    width, height = 12.0, 4.9
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    rows = (
        (2.7, bert_tokens, bert_at, "bert", 'BERT, pool="first": the [CLS] token\'s state',
         "no causal mask: every position attends to every token that is not padding (pad keys are masked), so "
         "position 0 has read the whole text"),
        (0.3, gpt_tokens, gpt_at, "gpt", 'GPT, pool="last": the last token that is not padding',
         "causal mask: h_t has read tokens 0 .. t only; the padding comes after the text, so the last real token has "
         "read all of it and no padding (h_{T-1} would be a pad's state)"),
    )  # fmt: skip
    for y, tokens, at, name, title, note in rows:
        x, top = _row(ax, y, list(tokens), at, pad, name, title, note, width)
        hx, hy, lane = width - 1.2, y + 0.75, y + 1.2  # the head, and the lane above the states
        _box(ax, hx, hy, 1.9, 0.5, HEAD_LABEL.replace(": ", ":\n"), COLORS["embed"], fontsize=6.6)
        ax.plot([x, x, hx], [top, lane, lane], color=POOLED, lw=1.4)
        _arrow(ax, (hx, lane), (hx, hy + 0.25), color=POOLED, lw=1.4)
        ax.text(hx, y + 0.22, f"logits (B, {n_classes})", ha="center", va="center", fontsize=7.2)
        _arrow(ax, (hx, hy - 0.25), (hx, y + 0.36), lw=1.0)
        ax.text(x + 0.08, lane + 0.1, f"h{at}: (B, d_model)", ha="left", va="bottom", fontsize=6.8, color=POOLED)
    return fig
