"""Diagrams of the architecture, drawn as code: the book's visual spine for Part III.

Each function returns a `matplotlib.figure.Figure` built with the object API (no pyplot state, as
`tfm_common.plotting`), with the book's own names on it: the modules' attribute names and `state_dict` key
prefixes (`encoder.layers.{i}.self_attn`, `output_projection`, ...), the tensors' shapes (B, S, d_model),
and the names of what each forward keeps in `_cache`. No data goes in: they draw the code's structure.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

__all__ = ["architecture_figure", "encoder_layer_backward_figure", "norm_placement_figure"]

# One color per kind of module, the same in every diagram.
COLORS = {
    "attn": "#fdd9a6",  # attention
    "ff": "#c6dbef",  # feed-forward
    "norm": "#fff3b0",  # LayerNorm (and the residual sum before it)
    "embed": "#f2cfe6",  # embeddings, positions, the output projection
    "io": "#e5e5e5",  # tokens, logits: data, not modules
    "drop": "#dcedc8",  # dropout
}
GRAD = "#c0392b"  # gradient arrows and what a backward consumes


def _canvas(width: float, height: float) -> tuple[Figure, object]:
    """A figure whose data coordinates are inches: (0, 0) bottom left, (width, height) top right."""
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    return fig, ax


def _box(ax, x, y, w, h, text, kind, fontsize=8.5, **text_kw):
    """A rounded box centered at (x, y), colored by `kind`, with centered text; returns its edges."""
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08")
    patch.set(facecolor=COLORS[kind], edgecolor="#333333", linewidth=1.0)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, **text_kw)
    return {"left": x - w / 2, "right": x + w / 2, "bottom": y - h / 2, "top": y + h / 2}


def _arrow(ax, start, end, color="black", lw=1.2, rad=0.0, style="-|>"):
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops=dict(arrowstyle=style, color=color, lw=lw, shrinkA=0, shrinkB=0, connectionstyle=f"arc3,rad={rad}"),
    )


def _path(ax, points, color="black", lw=1.2):
    """A polyline whose last segment ends in an arrowhead (a residual bypass, drawn around a box)."""
    xs, ys = zip(*points, strict=True)
    ax.plot(xs[:-1], ys[:-1], color=color, lw=lw, solid_capstyle="butt")
    _arrow(ax, points[-2], points[-1], color=color, lw=lw)


def _label(ax, x, y, text, fontsize=7.5, color="#333333", **kw):
    kw = {"ha": "left", "va": "center", **kw}
    ax.text(x, y, text, fontsize=fontsize, color=color, **kw)


# -- the whole encoder-decoder --------------------------------------------------------------------------------


_CLASSES = {"self_attn": "MultiHeadAttention", "cross_attn": "MultiHeadAttention", "ff": "PositionwiseFeedForward"}


def _sublayer_pair(ax, x, y, name, prefix, kind, norm, detail="", w=2.5):
    """One Post-LN sublayer: the module, then 'add & norm', with the residual bypass on the left.

    (x, y) is the bottom center; returns the y of the pair's top edge."""
    box = _box(ax, x, y + 0.33, w, 0.56, f"{_CLASSES[name]}\n{prefix}.{name}", kind, fontsize=7.5)
    if detail:
        _label(ax, box["right"] + 0.08, y + 0.33, detail, fontsize=6.8)
    _arrow(ax, (x, box["top"]), (x, box["top"] + 0.2))
    add = _box(ax, x, box["top"] + 0.4, w, 0.4, f"add, then {norm}", "norm", fontsize=7.5)
    xl, ya = box["left"] - 0.18, add["bottom"] + 0.2  # the bypass: around the sublayer, into 'add'
    _path(ax, [(x, y - 0.08), (xl, y - 0.08), (xl, ya), (add["left"], ya)])
    return add["top"]


def _stack(ax, x, y, prefix, sublayers, side_label):
    """A frame holding one layer's sublayers, stacked upward from y; returns the frame's top edge."""
    top = y + 0.15
    for i, (name, kind, detail) in enumerate(sublayers):
        _arrow(ax, (x, top), (x, top + 0.2))
        top = _sublayer_pair(ax, x, top + 0.2, name, prefix, kind, f"norm{i + 1}", detail)
    frame = FancyBboxPatch((x - 1.65, y), 3.3, top + 0.15 - y, boxstyle="round,pad=0,rounding_size=0.12")
    frame.set(facecolor="none", edgecolor="#777777", linewidth=1.2, linestyle="--")
    ax.add_patch(frame)
    _label(ax, x - 1.62, top + 0.3, prefix, fontsize=7.5, color="#555555")
    left = side_label == "left"
    _label(ax, x - 1.72 if left else x + 1.72, y + 0.3, "× n_layers\ni = 0 .. n_layers − 1", fontsize=8,
           color="#555555", ha="right" if left else "left")  # fmt: skip
    return top + 0.15


def _embedding_column(ax, x, side, tokens, length):
    """tokens (B, L) -> embed * sqrt(d_model) + positions -> dropout; returns the y of the last box's top."""
    _box(ax, x, 0.45, 2.6, 0.42, f"{side} (B, {length}) token ids", "io", fontsize=8)
    _arrow(ax, (x, 0.66), (x, 0.9))
    text = f"{side}_embed(·) × √d_model  +  {side}_pos\n({tokens}, then {side}_dropout)"
    emb = _box(ax, x, 1.2, 3.0, 0.6, text, "embed", fontsize=7.5)
    return emb["top"]


def architecture_figure() -> Figure:
    """The encoder-decoder Transformer as this book's code builds it (Post-LN, the paper's arrangement).

    Boxes carry the `state_dict` prefixes of `tfm_numpy.Transformer` / `tfm_torch.Transformer`; arrows carry the
    shapes of the tensors between them. Pre-LN (`norm_first=True`) moves each norm before its sublayer and adds
    `encoder.norm` and `decoder.norm` at the top of the stacks (see `norm_placement_figure`).
    """
    fig, ax = _canvas(11.5, 10.2)
    xe, xd = 3.0, 7.9
    enc_top = _embedding_column(ax, xe, "src", "embedding, sinusoidal or learned positions", "S")
    dec_top = _embedding_column(ax, xd, "tgt", "shifted right: tgt_in", "T")
    _label(ax, xe + 0.08, enc_top + 0.25, "x (B, S, d_model)")
    _label(ax, xd + 0.08, dec_top + 0.25, "y (B, T, d_model)")
    enc = [("self_attn", "attn", "src_mask (B, 1, 1, S)")]
    enc.append(("ff", "ff", ""))
    e_top = _stack(ax, xe, enc_top + 0.45, "encoder.layers.{i}", enc, "left")
    dec = [("self_attn", "attn", "tgt_mask (B, 1, T, T)\ncausal and padding")]
    dec += [("cross_attn", "attn", "q: from below\nk, v: memory\nsrc_mask (B, 1, 1, S)"), ("ff", "ff", "")]
    d_top = _stack(ax, xd, dec_top + 0.45, "decoder.layers.{i}", dec, "right")
    _arrow(ax, (xe, enc_top), (xe, enc_top + 0.45))
    _arrow(ax, (xd, dec_top), (xd, dec_top + 0.45))
    # the memory: the encoder's last output, read by the cross-attention of EVERY decoder layer
    mem = _box(ax, xe, e_top + 0.55, 2.8, 0.5, "memory (B, S, d_model)\nencoder output", "io", fontsize=8)
    _arrow(ax, (xe, e_top), (xe, mem["bottom"]))
    cross_y = dec_top + 0.45 + 0.15 + 0.2 + 1.36 + 0.2 + 0.33  # the cross_attn box's center
    _path(ax, [(mem["right"], mem["top"] - 0.1), (5.0, mem["top"] - 0.1), (5.0, cross_y), (xd - 1.25, cross_y)])
    _label(ax, 5.07, (mem["top"] + cross_y) / 2, "the same memory\nin every\ndecoder layer", fontsize=7)
    # the output side: projection to the vocabulary, then the loss
    text = "output_projection\nLinear(d_model, V_tgt), no bias"
    out = _box(ax, xd, d_top + 0.55, 3.0, 0.56, text, "embed", fontsize=8)
    _arrow(ax, (xd, d_top), (xd, out["bottom"]))
    _label(ax, xd + 0.08, d_top + 0.13, "(B, T, d_model)")
    _label(ax, out["right"] + 0.1, out["top"] - 0.28, "weight tied to\ntgt_embed.weight\n(tie_output=True)", fontsize=7)
    logits = _box(ax, xd, out["top"] + 0.55, 3.0, 0.42, "logits (B, T, V_tgt)", "io", fontsize=8)
    _arrow(ax, (xd, out["top"]), (xd, logits["bottom"]))
    loss = _box(ax, xd, logits["top"] + 0.45, 3.0, 0.42, "softmax cross-entropy vs tgt_out", "io", fontsize=8)
    _arrow(ax, (xd, logits["top"]), (xd, loss["bottom"]))
    ax.text(xe, 9.85, "Encoder", ha="center", fontsize=12, weight="bold")
    ax.text(xd, 9.85, "Decoder", ha="center", fontsize=12, weight="bold")
    _label(ax, 0.15, 9.3, "Transformer(src_vocab_size, tgt_vocab_size, d_model, n_heads, d_ff, n_layers, ...)\n"
           "Post-LN: every sublayer is LN(x + sublayer(x))", fontsize=7.5)  # fmt: skip
    return fig


# -- Post-LN next to Pre-LN ---------------------------------------------------------------------------------------


def _block_column(ax, x, title, steps, residuals, formula):
    """A vertical chain of boxes (bottom to top) with residual bypasses from step i to step j on the left."""
    centers, y = [], 0.7
    _box(ax, x, y, 1.6, 0.4, "x (B, S, d_model)", "io", fontsize=8)
    for text, kind in steps:
        _arrow(ax, (x, y + 0.2 if y == 0.7 else y + 0.22), (x, y + 0.58))
        y += 0.8
        _box(ax, x, y, 2.2, 0.5, text, kind, fontsize=7.5)
        centers.append(y)
    _arrow(ax, (x, y + 0.22), (x, y + 0.58))
    _box(ax, x, y + 0.8, 1.6, 0.4, "out (B, S, d_model)", "io", fontsize=8)
    for k, (start, end, color) in enumerate(residuals):
        y0 = 0.7 + 0.36 if start < 0 else centers[start] + 0.36
        xl = x - 1.3 - 0.2 * (k % 2)
        _path(ax, [(x, y0), (xl, y0), (xl, centers[end]), (x - 1.1, centers[end])], color=color)
    ax.text(x, y + 1.45, title, ha="center", fontsize=11, weight="bold")
    ax.text(x, y + 1.15, formula, ha="center", fontsize=9)
    return y


def norm_placement_figure() -> Figure:
    """One encoder layer twice: Post-LN (`norm_first=False`, the paper) and Pre-LN (`norm_first=True`).

    The residual (identity) path is drawn in blue: in Post-LN it runs through norm1 and norm2, in Pre-LN it meets
    no norm at all, and the stack needs a final LayerNorm (`encoder.norm`, `final_norm`) instead.
    """
    fig, ax = _canvas(10.8, 7.6)
    blue = "#1f5fa8"
    attn, ff = ("self_attn\nMultiHeadAttention", "attn"), ("ff\nPositionwiseFeedForward", "ff")
    post = [attn, ("+  (residual sum)", "norm"), ("norm1", "norm")]
    post += [ff, ("+  (residual sum)", "norm"), ("norm2", "norm")]
    _block_column(ax, 2.8, "Post-LN  (norm_first=False)", post, [(-1, 1, blue), (2, 4, blue)],
                  "x ← norm(x + F(x))")  # fmt: skip
    pre = [("norm1", "norm"), attn, ("+  (residual sum)", "norm")]
    pre += [("norm2", "norm"), ff, ("+  (residual sum)", "norm")]
    top = _block_column(ax, 7.6, "Pre-LN  (norm_first=True)", pre, [(-1, 2, blue), (2, 5, blue)],
                        "x ← x + F(norm(x))")  # fmt: skip
    _label(ax, 8.9, top - 1.0, "after the last layer:\nencoder.norm\n(final_norm, Pre-LN only)", fontsize=7.5)
    _label(ax, 3.95, 2.0, "identity path (blue)\npasses norm1 and norm2:\nevery gradient meets\nevery norm above it",
           fontsize=7.5, color=blue)  # fmt: skip
    _label(ax, 8.75, 2.4, "identity path (blue)\nmeets no norm: the\nstream is never\nnormalized", fontsize=7.5,
           color=blue)  # fmt: skip
    return fig


# -- the backward of one encoder layer ----------------------------------------------------------------------------

# (label, kind, what its forward caches, what its backward computes from it), in forward order (Post-LN).
_ENCODER_STEPS = [
    ("self_attn", "attn", "_cache: q, k, v (B,H,S,d_k)\np, p_drop (B,H,S,S)\n+ each Linear: x2, its input",
     "dv = p_dropᵀ d_ctx\nds = p ⊙ (dp − Σ p ⊙ dp)\ndq = ds k/√d_k, dk = dsᵀ q/√d_k\ndW = gᵀ x2"),
    ("dropout1", "drop", "_cache: scale (B,S,d)\n0 or 1/(1 − p)", "dx = g ⊙ scale"),
    ("+", "norm", "nothing", "g to both\nbranch and\nidentity"),
    ("norm1", "norm", "_cache: xhat (B,S,d)\nrstd (B,S,1)", "dxhat = g ⊙ weight\ndx = rstd (dxhat\n − mean(dxhat)\n"
     " − xhat mean(dxhat xhat))"),
    ("ff", "ff", "linear1: x2 = h\nReLU: mask = a > 0\nlinear2: x2 = hidden",
     "dW2 = gᵀ hidden\nda = dhidden ⊙ mask\ndW1 = daᵀ h"),
    ("dropout2", "drop", "_cache: scale (B,S,d)", "dx = g ⊙ scale"),
    ("+", "norm", "nothing", "g to both\nbranch and\nidentity"),
    ("norm2", "norm", "_cache: xhat (B,S,d)\nrstd (B,S,1)", "the same as\nnorm1"),
]  # fmt: skip


def encoder_layer_backward_figure() -> Figure:
    """The backward of one Post-LN `EncoderLayer`: forward arrows left to right (black), gradient arrows right
    to left (red); under each module, what its forward keeps in `_cache` and what its backward computes from it.

    The residual bypasses are drawn above the boxes, the forward's (black) and the gradient's (red): at the fork
    where x feeds both the branch and the bypass, the two gradients are added (`dx = dx + self._sa_block_backward(dx)`).
    """
    fig, ax = _canvas(15.0, 5.6)
    y, step, x0 = 3.4, 1.5, 0.7
    names = ["x\n(B, S, d)"] + [name for name, *_ in _ENCODER_STEPS] + ["y\n(B, S, d)"]
    xs = [x0 + step * i for i in range(len(names))]
    half = [0.25 if n == "+" else 0.55 for n in names]
    for i in range(len(names) - 1):
        a, b = xs[i] + half[i] + 0.04, xs[i + 1] - half[i + 1] - 0.04
        _arrow(ax, (a, y + 0.12), (b, y + 0.12))
        _arrow(ax, (b, y - 0.12), (a, y - 0.12), color=GRAD)
    _box(ax, xs[0], y, 1.1, 0.6, names[0], "io")
    _box(ax, xs[-1], y, 1.1, 0.6, names[-1], "io")
    for x, hw, (name, kind, cache, grad) in zip(xs[1:-1], half[1:-1], _ENCODER_STEPS, strict=True):
        _box(ax, x, y, 2 * hw, 0.6, name, kind, fontsize=9)
        ax.text(x, y - 0.5, cache, ha="center", va="top", fontsize=6.6, family="monospace")
        ax.text(x, y - 1.3, grad, ha="center", va="top", fontsize=6.6, family="monospace", color=GRAD)
    for fork, plus, text in ((xs[0] + 0.45, xs[3], "residual: x + dropout1(self_attn(x, x, x))"),
                             (xs[4] + 0.45, xs[7], "residual: h + dropout2(ff(h)),  h = norm1(...)")):  # fmt: skip
        _path(ax, [(fork, y + 0.3), (fork, y + 0.7), (plus, y + 0.7), (plus, y + 0.3)])
        _path(ax, [(plus + 0.1, y + 0.3), (plus + 0.1, y + 0.95), (fork + 0.1, y + 0.95), (fork + 0.1, y + 0.3)],
              color=GRAD)  # fmt: skip
        ax.text((fork + plus) / 2, y + 1.05, text, ha="center", fontsize=7.5)
    _label(ax, 0.1, y - 0.75, "forward\ncaches", fontsize=7.5, weight="bold")
    _label(ax, 0.1, y - 1.6, "backward\nuses", fontsize=7.5, weight="bold", color=GRAD)
    ax.text(7.5, 5.25, "One Post-LN encoder layer: forward (black) and backward (red)", ha="center", fontsize=11,
            weight="bold")  # fmt: skip
    notes = (
        "self_attn takes x three times (query, key, value): its backward returns d_query + d_key + d_value.\n"
        "At each fork the gradients of the bypass and of the branch are added: "
        "dx = dx + self._sa_block_backward(dx).\n"
        "EncoderLayer's own _cache is (x.shape, x.dtype), to check grad_out; the tensors live in the submodules."
    )
    _label(ax, 0.2, 0.45, notes, fontsize=7.5)
    return fig
