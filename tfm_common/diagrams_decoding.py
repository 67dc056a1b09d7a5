"""Diagrams of decoding (chapter 13), drawn from real runs: teacher forcing against autoregressive decoding, and
the tree of a beam search.

Both take what a model actually did (tokens as strings, log-probabilities) and only draw it; they compute nothing
about the model. Figures use matplotlib's object API, as `tfm_common.plotting`.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

__all__ = ["plot_forcing_vs_decoding", "plot_beam_tree"]

_BOX = dict(boxstyle="round,pad=0.25", linewidth=1.0)


def _token(ax, x, y, text, color="white", edge="black", size=11):
    ax.text(x, y, text, ha="center", va="center", fontsize=size, bbox={**_BOX, "facecolor": color, "edgecolor": edge})


def _arrow(ax, a, b, color="black", style="-|>", rad=0.0, lw=1.0, ls="-"):
    ax.add_patch(
        FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, color=color, lw=lw, ls=ls,
                        connectionstyle=f"arc3,rad={rad}", shrinkA=9, shrinkB=9)
    )  # fmt: skip


def _decoder_panel(ax, reads, writes, right, title, feedback):
    n = len(reads)
    ax.add_patch(FancyBboxPatch((-0.45, 0.75), n - 0.1, 0.5, boxstyle="round,pad=0.05", facecolor="#e8eef7",
                                edgecolor="gray"))  # fmt: skip
    ax.text((n - 1) / 2, 1.0, "decoder (causal)", ha="center", va="center", fontsize=10, color="dimgray")
    for i, (r, w, ok) in enumerate(zip(reads, writes, right, strict=True)):
        _token(ax, i, 0.0, r)
        _token(ax, i, 2.0, w, color="white" if ok else "#f6c6c6", edge="black" if ok else "firebrick")
        _arrow(ax, (i, 0.0), (i, 0.75), style="-")
        _arrow(ax, (i, 1.25), (i, 2.0))
        if feedback and i + 1 < n:  # the token written at step i is what step i + 1 reads
            _arrow(ax, (i, 2.0), (i + 1, 0.0), color="tab:orange", rad=-0.25, lw=1.2)
    ax.text(-0.9, 0.0, "reads", ha="right", va="center", fontsize=10)
    ax.text(-0.9, 2.0, "writes", ha="right", va="center", fontsize=10)
    ax.set_title(title, fontsize=11)
    ax.set_xlim(-2.2, n - 0.4)
    ax.set_ylim(-0.5, 2.5)
    ax.axis("off")


def plot_forcing_vs_decoding(reference, forced, generated) -> Figure:
    """Two panels, one decoder input per column: training (teacher forcing) above, decoding below.

    reference: the reference tokens (strings), `<eos>` last; forced: the model's argmax at each position when it
    reads <bos> + reference[:-1] (one call for all positions); generated: greedy decoding's tokens, each read back
    at the next step (one call per token). Written tokens that differ from the reference are shaded red.
    """
    n = len(reference)
    if len(forced) != n:
        raise ValueError(f"plot_forcing_vs_decoding: forced expected {n} tokens (as reference), got {len(forced)}")
    if not generated:
        raise ValueError("plot_forcing_vs_decoding: generated expected at least one token, got none")
    fig = Figure(figsize=(0.62 * max(n, len(generated)) + 1.8, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    ok = [f == r for f, r in zip(forced, reference, strict=True)]
    title = "training, teacher forcing: the decoder reads the reference, all positions in one call"
    _decoder_panel(top, ["<bos>", *reference[:-1]], list(forced), ok, title, feedback=False)
    ok = [i < n and g == reference[i] for i, g in enumerate(generated)]
    title = "decoding, autoregressive: the decoder reads its own output, one call per token"
    _decoder_panel(bottom, ["<bos>", *generated[:-1]], list(generated), ok, title, feedback=True)
    return fig


_STATUS = {  # face color, edge color, line style of the edge from the parent
    "kept": ("#cfe0f5", "tab:blue", "-"),
    "complete": ("#cdeccd", "tab:green", "-"),
    "pruned": ("#eeeeee", "gray", ":"),
}


def plot_beam_tree(steps, best=None, title: str | None = None) -> Figure:
    """The tree of one beam search, time running down: one row per step, one column per candidate looked at.

    steps: for each step, the candidates looked at, best first, as dicts with keys `token` (str), `logp` (the
    prefix's log-probability), `parent` (the index of the beam it extends among the previous step's kept
    beams, in their order; 0 at step 1, where the one beam is <bos>, drawn as row 0) and `status`: "kept" (a
    beam of the next step), "complete" (ended with <eos> and set aside) or "pruned". best: the (step, column)
    nodes of the returned hypothesis, drawn with a thick outline.
    """
    if not steps:
        raise ValueError("plot_beam_tree: steps expected at least one step, got none")
    width = max(len(s) for s in steps)
    fig = Figure(figsize=(1.25 * width + 1.2, 0.55 * len(steps) + 1.5), layout="constrained")
    ax = fig.subplots()
    best = set(best or ())
    kept_cols = [[0]]  # the columns of the kept beams of each step so far; step 0 is <bos>
    _token(ax, 0, 0, "<bos>", size=9)
    for t, cands in enumerate(steps, start=1):
        for c, cand in enumerate(cands):
            if cand["status"] not in _STATUS:
                raise ValueError(f"plot_beam_tree: status must be one of {list(_STATUS)}, got {cand['status']!r}")
            face, edge, ls = _STATUS[cand["status"]]
            _arrow(ax, (kept_cols[-1][cand["parent"]], t - 1), (c, t), color=edge, style="-", ls=ls)
            lw = 2.5 if (t, c) in best else 1.0
            ax.text(c, t, f"{cand['token']}  {cand['logp']:.2f}", ha="center", va="center", fontsize=9,
                    bbox={**_BOX, "facecolor": face, "edgecolor": edge, "linewidth": lw})  # fmt: skip
        kept_cols.append([c for c, cand in enumerate(cands) if cand["status"] == "kept"])
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(len(steps) + 0.6, -0.6)
    ax.set_yticks(range(len(steps) + 1))
    ax.set_ylabel("step (output length)")
    ax.set_xticks(range(width))
    ax.set_xlabel("candidates looked at, best log p first")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [ax.plot([], [], "s", color=_STATUS[s][0], mec=_STATUS[s][1], ms=10, label=s)[0] for s in _STATUS]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    if title:
        ax.set_title(title)
    return fig
