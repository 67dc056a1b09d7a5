"""The decoder-only GPT as this book's code builds it (chapter 17b), drawn as code.

`gpt_figure(config)` draws the data flow from token ids to logits on the left (embedding, positions, the stack of
blocks under the causal mask, the final norm, the output projection) and one `GPTBlock` opened up on the right
(Pre-LN: norm1, self_attn, dropout1, the residual sum; norm2, ff, dropout2, the sum). The boxes carry the
`state_dict()` prefixes of `tfm_numpy.GPT` / `tfm_torch.GPT` (`PREFIXES` lists them; a test checks each against a
real model) and, given a model's `config`, its sizes. Built with matplotlib's object API, as
`tfm_common.diagrams`; it draws the code's structure and computes nothing.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from tfm_common.diagrams import COLORS

__all__ = ["gpt_figure", "PREFIXES"]

# every state_dict prefix the figure draws ({i}: each block), for the default options (GPT-2's)
PREFIXES = ("embed", "pos", "layers.{i}.norm1", "layers.{i}.self_attn", "layers.{i}.self_attn.q_proj",
            "layers.{i}.self_attn.k_proj", "layers.{i}.self_attn.v_proj", "layers.{i}.self_attn.out_proj",
            "layers.{i}.norm2", "layers.{i}.ff", "layers.{i}.ff.linear1", "layers.{i}.ff.linear2", "norm",
            "output_projection")  # fmt: skip
BLUE = "#1f5fa8"  # the residual stream


def _box(ax, x, y, w, h, text, kind, fontsize=8.0):
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08")
    patch.set(facecolor=COLORS[kind], edgecolor="#333333", linewidth=1.0)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)
    return y - h / 2, y + h / 2


def _arrow(ax, start, end, color="black", lw=1.1):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=lw, shrinkA=0, shrinkB=0))


def _note(ax, x, y, text, fontsize=7.2, color="#333333", ha="left"):
    ax.text(x, y, text, ha=ha, va="center", fontsize=fontsize, color=color)


def _sizes(config) -> dict:
    """Symbols, or the model's sizes after them ('d_model = 64')."""
    keys = ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_len")
    if config is None:
        return {k: k for k in keys} | {"norm": "layernorm", "positional": "learned", "activation": "gelu",
                                       "tie_output": True}  # fmt: skip
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"gpt_figure: config expected a GPT's config (model.config), missing {missing}")
    return {k: f"{k}={config[k]}" for k in keys} | {k: config.get(k) for k in ("norm", "positional", "activation",
                                                                                "tie_output")}  # fmt: skip


def gpt_figure(config: dict | None = None) -> Figure:
    """The GPT's data flow (left) and one GPTBlock opened up (right), with the library's names.

    config: a GPT's `config` (e.g. `model.config`) to print its sizes and options; None draws the symbols and the
    default options (LayerNorm, learned positions, GELU, tied output: GPT-2's).
    """
    s = _sizes(config)
    fig = Figure(figsize=(11.5, 9.4))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 11.5)
    ax.set_ylim(0, 9.4)
    ax.set_axis_off()
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(s["norm"], str(s["norm"]))

    # -- left: token ids to logits ----------------------------------------------------------------------------------
    x = 3.0
    ax.text(x, 9.05, "GPT: the decoder-only data flow", ha="center", fontsize=11.5, weight="bold")
    steps = [
        ("tokens (B, T) int64 ids", "io", 0.42),
        (f"embed(tokens) × √d_model\nembed.weight ({s['vocab_size']}, {s['d_model']})", "embed", 0.62),
        (f"+ pos: {s['positional']} positions\npos.weight ({s['max_len']}, {s['d_model']}), rows 0 .. T − 1", "embed",
         0.62),
        ("dropout", "drop", 0.38),
        (f"layers.{{i}}: GPTBlock,  i = 0 .. n_layers − 1  ({s['n_layers']})\n"
         "under mask = causal_mask(T), (1, 1, T, T):"
         "\nquery t may attend to keys 0 .. t", "attn", 0.95),
        (f"norm: the final {norm}\n(a Pre-LN stack needs one)", "norm", 0.62),
        (f"output_projection: Linear(d_model, vocab_size), no bias\n"
         f"{'weight IS embed.weight (tie_output=True)' if s['tie_output'] else 'its own weight (tie_output=False)'}",
         "embed", 0.62),
        (f"logits (B, T, {s['vocab_size']})\nlogits[:, t] predict tokens[:, t + 1]", "io", 0.62),
    ]  # fmt: skip
    y, edges = 0.45, []
    for k, (text, kind, h) in enumerate(steps):
        bottom, top = _box(ax, x, y + h / 2, 4.4, h, text, kind, fontsize=7.8)
        if k:
            _arrow(ax, (x, edges[-1][1]), (x, bottom))
        edges.append((bottom, top))
        y = top + 0.42
    _note(ax, x + 0.08, (edges[3][1] + edges[4][0]) / 2, "x (B, T, d_model)")
    # the zoom: from the stack box to the block on the right
    for dy in (edges[4][1], edges[4][0]):
        ax.plot([x + 2.2, 6.2], [dy, 0.55 if dy == edges[4][0] else 8.3], color="#999999", lw=0.8, ls=":")

    # -- right: one GPTBlock, Pre-LN -----------------------------------------------------------------------------------
    xb = 8.5
    frame = FancyBboxPatch((6.2, 0.55), 5.1, 7.75, boxstyle="round,pad=0,rounding_size=0.12")
    frame.set(facecolor="none", edgecolor="#777777", linewidth=1.2, linestyle="--")
    ax.add_patch(frame)
    ax.text(xb, 8.55, "layers.{i}: GPTBlock (Pre-LN)", ha="center", fontsize=10.5, weight="bold")
    ax.text(xb, 8.05, "x ← x + dropout1(self_attn(norm1(x), mask));  x ← x + dropout2(ff(norm2(x)))", ha="center",
            fontsize=7.2)  # fmt: skip
    ff = "PositionwiseFeedForward" if s["activation"] != "swiglu" else "SwiGLUFeedForward"
    inner = "linear1 → GELU → linear2" if s["activation"] == "gelu" else f"linear1 → {s['activation']} → linear2"
    block = [
        ("x (B, T, d_model)", "io", 0.38),
        (f"norm1 ({norm})", "norm", 0.38),
        ("self_attn: GroupedQueryAttention\nq_proj, k_proj, v_proj → causal softmax → out_proj", "attn", 0.62),
        ("dropout1", "drop", 0.32),
        ("+  (residual sum)", "norm", 0.32),
        (f"norm2 ({norm})", "norm", 0.38),
        (f"ff: {ff}\n{inner}" if s["activation"] != "swiglu" else f"ff: {ff}", "ff", 0.62),
        ("dropout2", "drop", 0.32),
        ("+  (residual sum)", "norm", 0.32),
        ("x (B, T, d_model)", "io", 0.38),
    ]
    y, ys = 0.8, []
    for k, (text, kind, h) in enumerate(block):
        bottom, top = _box(ax, xb, y + h / 2, 3.5, h, text, kind, fontsize=7.6)
        if k:
            _arrow(ax, (xb, ys[-1][1]), (xb, bottom))
        ys.append((bottom, top))
        y = top + 0.3
    for start, plus in ((0, 4), (4, 8)):  # the residual stream: from x around the sublayer into the sum
        y0, y1 = ys[start][1] + 0.12, (ys[plus][0] + ys[plus][1]) / 2
        xl = xb - 2.0
        ax.plot([xb, xl, xl], [y0, y0, y1], color=BLUE, lw=1.3)
        _arrow(ax, (xl, y1), (xb - 1.75, y1), color=BLUE, lw=1.3)
    _note(ax, xb - 2.05, (ys[0][1] + ys[4][0]) / 2, "residual\nstream", color=BLUE, ha="right")
    _note(ax, xb + 1.8, (ys[2][0] + ys[2][1]) / 2, f"{s['n_heads']},\ncausal\nmask", fontsize=6.8)
    _note(ax, xb + 1.8, (ys[6][0] + ys[6][1]) / 2, f"{s['d_ff']}", fontsize=6.8)
    return fig
