"""The masked language model of chapter 22a, drawn from a real corrupted sequence.

`mlm_figure(ids, batch, token_text, special)` draws, left, one sequence three times: the clean tokens, what the BERT
reads after `mask_tokens` (each position coloured by its fate: not chosen, [MASK], a random token, kept), and what
the loss asks for (the original token at the chosen positions, nothing elsewhere: IGNORE_INDEX). Right, which keys
each query may attend to: the GPT's causal mask against the BERT's, where every query sees every key but padding.
It draws the values it is given (a test checks them against `mask_tokens`, `padding_mask` and `causal_mask`) and
computes nothing but the two masks' pictures, with matplotlib's object API as `tfm_common.diagrams`. Each token box
and text carries a gid ("text:t", "inputs:t", "targets:t") and each mask cell one ("gpt:q,k", "bert:q,k").
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from .diagrams import COLORS
from .mlm import FATES, MaskedBatch, SpecialIds, mask_fates

__all__ = ["FATE_COLORS", "mlm_figure", "attention_allowed"]

FATE_COLORS = ("#e5e5e5", "#fdae61", "#d7191c", "#1a9641")  # not chosen, [MASK], random, kept (FATES' order)


def attention_allowed(ids: np.ndarray, pad_id: int | None, causal: bool) -> np.ndarray:
    """(T, T) bool, query in rows: the keys a query may attend to, for one sequence: every key that is not padding
    (the BERT), or also only keys at or before the query (the GPT, causal=True)."""
    ids = np.asarray(ids)
    T = len(ids)
    allowed = np.ones((T, T), dtype=bool) if pad_id is None else np.broadcast_to(ids != pad_id, (T, T)).copy()
    return allowed & np.tri(T, dtype=bool) if causal else allowed


def _token_box(ax, x, y, w, h, text, color, gid, fontsize=7.0, bold=False):
    patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.04")
    patch.set(facecolor=color, edgecolor="#333333", linewidth=0.8, gid=gid)
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, weight="bold" if bold else "normal",
            color="white" if color in FATE_COLORS[2:] else "black", gid=gid)  # fmt: skip


def _matrix(ax, x0, y0, size, allowed, title, name):
    T = len(allowed)
    cell = size / T
    for q in range(T):
        for k in range(T):
            color = "#1f5fa8" if allowed[q, k] else "#f4f4f4"
            ax.add_patch(Rectangle((x0 + k * cell, y0 + size - (q + 1) * cell), cell, cell, facecolor=color,
                                   edgecolor="white", linewidth=0.4, gid=f"{name}:{q},{k}"))  # fmt: skip
    ax.text(x0 + size / 2, y0 + size + 0.22, title, ha="center", fontsize=8.5, weight="bold")
    ax.text(x0 + size / 2, y0 - 0.2, "keys →", ha="center", fontsize=7)
    ax.text(x0 - 0.12, y0 + size / 2, "queries ↓", ha="right", va="center", fontsize=7, rotation=90)


def mlm_figure(ids, batch: MaskedBatch, token_text, special: SpecialIds) -> Figure:
    """One sequence `ids` (T,) and its corruption `batch` (inputs, targets, chosen, each (T,)) as the BERT sees
    them; `token_text(i)` -> a short label for token i (e.g. from the tokenizer's bytes); `special`: the ids of
    [PAD], [CLS], [SEP], [MASK]. Right: the attention masks of a GPT and of this BERT on `batch.inputs`."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or any(np.shape(a) != ids.shape for a in batch):
        raise ValueError(f"mlm_figure: ids expected one sequence (T,) and a batch of its shape, got {ids.shape}, "
                         f"{[np.shape(a) for a in batch]}")  # fmt: skip
    fate = mask_fates(ids, batch, special.mask)
    T, w, gap = len(ids), 0.72, 0.06
    width = 1.55 + T * (w + gap) + 5.0
    fig = Figure(figsize=(width, 5.2))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, 5.2)
    ax.set_axis_off()
    ax.text(0.2, 4.95, "Masked language modelling: what BERT reads, what it must predict", fontsize=11.5,
            weight="bold", va="center")  # fmt: skip
    xs = 1.55 + np.arange(T) * (w + gap) + w / 2
    rows = (("text", 4.3), ("inputs", 3.45), ("targets", 0.95))
    for name, y in rows:
        ax.text(0.2, y, name, fontsize=8.5, va="center", weight="bold")
    for t in range(T):
        _token_box(ax, xs[t], 4.3, w, 0.42, token_text(int(ids[t])), COLORS["io"], f"text:{t}")
        _token_box(ax, xs[t], 3.45, w, 0.42, token_text(int(batch.inputs[t])), FATE_COLORS[fate[t]], f"inputs:{t}")
        if batch.chosen[t]:
            _token_box(ax, xs[t], 0.95, w, 0.42, token_text(int(batch.targets[t])), "#ffffff", f"targets:{t}",
                       bold=True)  # fmt: skip
            ax.annotate("", xy=(xs[t], 1.18), xytext=(xs[t], 1.65),
                        arrowprops=dict(arrowstyle="-|>", lw=0.9, color="#333333"))  # fmt: skip
        else:
            ax.text(xs[t], 0.95, "–", ha="center", va="center", fontsize=9, color="#999999", gid=f"targets:{t}")
    x_left, x_right = xs[0] - w / 2, xs[-1] + w / 2
    body = FancyBboxPatch((x_left, 1.7), x_right - x_left, 1.25, boxstyle="round,pad=0,rounding_size=0.08")
    body.set(facecolor=COLORS["attn"], edgecolor="#333333", linewidth=1.0)
    ax.add_patch(body)
    body_text = ("BERT: embed + positions, n_layers GPTBlocks WITHOUT the causal mask (every query sees every key but "
                 "[PAD]),\nnorm, then the MLM head: head_dense → GELU → head_norm → output_projection (tied, + bias): "
                 "logits (T, vocab_size)")  # fmt: skip
    ax.text((x_left + x_right) / 2, 2.32, body_text, ha="center", va="center", fontsize=7.6)
    for t in range(T):
        ax.annotate("", xy=(xs[t], 2.95), xytext=(xs[t], 3.22), arrowprops=dict(arrowstyle="-|>", lw=0.7))
    ax.text((x_left + x_right) / 2, 0.45, "the loss counts only the chosen positions (targets elsewhere: "
            "IGNORE_INDEX = -100)", ha="center", fontsize=7.6)  # fmt: skip
    counts = [int((fate == k).sum()) for k in range(4)]
    for k, (name, color) in enumerate(zip(FATES, FATE_COLORS, strict=True)):
        x = 1.55 + k * 2.1
        ax.add_patch(Rectangle((x, 3.83), 0.22, 0.17, facecolor=color, edgecolor="#333333", linewidth=0.6))
        ax.text(x + 0.3, 3.915, f"{name}: {counts[k]}", fontsize=7.4, va="center")
    # -- right: who attends to whom ---------------------------------------------------------------------------------
    size, x0 = 1.75, x_right + 0.75
    _matrix(ax, x0, 2.4, size, attention_allowed(batch.inputs, special.pad, causal=True), "GPT: causal", "gpt")
    _matrix(ax, x0 + size + 0.55, 2.4, size, attention_allowed(batch.inputs, special.pad, causal=False),
            "BERT: all but [PAD]", "bert")  # fmt: skip
    ax.text(x0 + size + 0.27, 1.6, "blue: the query (row) may attend to the key (column);\nthe GPT predicts the "
            "NEXT token from the left only,\nthe BERT fills in a token from both sides", ha="center", va="center",
            fontsize=7.2)  # fmt: skip
    return fig
