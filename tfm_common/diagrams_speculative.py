"""The diagram of speculative decoding (chapter 21b), drawn from a real round: the draft proposes k tokens one
cached step at a time, the target scores all of them in one forward, the acceptance rule keeps a prefix of them and
adds one token of the target's own (from the residual after a rejection, a bonus from p when all are accepted).

It takes what a run did (tokens as strings, the number accepted, the acceptance probabilities) and only draws it.
Figures use matplotlib's object API, as `tfm_common.plotting`.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

__all__ = ["plot_speculative_round", "ROUND_COLORS"]

_BOX = dict(boxstyle="round,pad=0.3", linewidth=1.0)
ROUND_COLORS = {  # face, edge
    "context": ("#eeeeee", "gray"),
    "proposed": ("#cfe0f5", "tab:blue"),
    "accepted": ("#cdeccd", "tab:green"),
    "rejected": ("#f6c6c6", "firebrick"),
    "discarded": ("white", "lightgray"),
    "target": ("#fde3c8", "tab:orange"),
}
_Y = {"draft": 0.0, "target": 1.15, "rule": 2.2, "out": 3.2}


_DX = 1.4  # the distance between two positions' columns


def _token(ax, x, y, text, kind, size=10):
    face, edge = ROUND_COLORS[kind]
    ax.text(x * _DX, y, text, ha="center", va="center", fontsize=size, gid=kind,
            bbox={**_BOX, "facecolor": face, "edgecolor": edge})  # fmt: skip


def _arrow(ax, a, b, color="black", rad=0.0, ls="-"):
    a, b = (a[0] * _DX, a[1]), (b[0] * _DX, b[1])
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=9, color=color, ls=ls,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=10, shrinkB=10))  # fmt: skip


def plot_speculative_round(context, drafted, accepted: int, next_token: str, accept_probs=None) -> Figure:
    """One round, one column per position: the last context token(s), then the k drafted tokens.

    context: the last tokens before the round (strings; the last one is what the draft and the target read first);
    drafted: the draft's k proposals; accepted: how many of them the rule kept (0..k); next_token: the target's
    own token that ends the round (drawn from the residual norm(max(0, p - q)) after a rejection, from p when all
    k were accepted); accept_probs: min(1, p(x)/q(x)) of each proposal, printed under it if given.
    """
    k = len(drafted)
    if not context or k == 0:
        raise ValueError(f"plot_speculative_round: context and drafted expected tokens, got {len(context)} and {k}")
    if not 0 <= accepted <= k:
        raise ValueError(f"plot_speculative_round: accepted must be in [0, {k}] (the proposals), got {accepted}")
    if accept_probs is not None and len(accept_probs) != k:
        raise ValueError(f"plot_speculative_round: accept_probs expected {k} numbers, got {len(accept_probs)}")
    c = len(context)
    fig = Figure(figsize=(1.0 * (c + k) + 4.0, 4.6), layout="constrained")
    ax = fig.subplots()
    for i, tok in enumerate(context):  # columns -c .. -1
        _token(ax, i - c, _Y["draft"], tok, "context")
    for i, tok in enumerate(drafted):  # the draft: one cached step per proposal, each reading the previous one
        _token(ax, i, _Y["draft"], tok, "proposed")
        _arrow(ax, (i - 1, _Y["draft"]), (i, _Y["draft"]), color="tab:blue", rad=-0.5)
    ax.add_patch(FancyBboxPatch((-1.4 * _DX, _Y["target"] - 0.22), (k + 0.8) * _DX, 0.44, boxstyle="round,pad=0.05",
                                facecolor=ROUND_COLORS["target"][0], edgecolor=ROUND_COLORS["target"][1]))  # fmt: skip
    ax.text(((k - 1) / 2 - 0.5) * _DX, _Y["target"], f"target: ONE forward\nover {k + 1} positions: p_1 .. p_{k + 1}",
            ha="center", va="center", fontsize=9)  # fmt: skip
    for i in range(-1, k):
        _arrow(ax, (i, _Y["draft"]), (i, _Y["target"] - 0.22), color="gray")
    for i, tok in enumerate(drafted):  # the rule, in order, until the first rejection
        kind = "accepted" if i < accepted else "rejected" if i == accepted else "discarded"
        word = {"accepted": "accept", "rejected": "reject", "discarded": "not looked at"}[kind]
        prob = f"\n{accept_probs[i]:.2f}" if accept_probs is not None and i <= accepted else ""
        ax.text(i * _DX, _Y["rule"], word + prob, ha="center", va="center", fontsize=8, color=ROUND_COLORS[kind][1])
        if i < accepted:
            _token(ax, i, _Y["out"], tok, "accepted")
    source = "from the residual\nnorm(max(0, p - q))" if accepted < k else "bonus token\nfrom p_{k+1}"
    _token(ax, accepted, _Y["out"], next_token, "target")
    ax.text(accepted * _DX, _Y["out"] + 0.55, source, ha="center", va="center", fontsize=8, color="tab:orange")
    labels = {
        "draft": "draft proposes\n(k cached steps)",
        "target": "target verifies",
        "rule": "acceptance rule\nP(accept) = min(1, p/q)",
        "out": f"output: {accepted + 1} token{'s' if accepted else ''}",
    }
    for row, text in labels.items():
        ax.text((-c - 0.6) * _DX, _Y[row], text, ha="right", va="center", fontsize=10)
    ax.set_xlim((-c - 2.6) * _DX, (k + 0.6) * _DX)
    ax.set_ylim(_Y["out"] + 0.95, _Y["draft"] - 0.7)
    ax.axis("off")
    return fig
