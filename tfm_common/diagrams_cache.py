"""The diagram of chapter 21c: sliding-window attention with attention sinks, and the rolling key/value cache that
serves it.

`plot_rolling_cache` returns a `matplotlib.figure.Figure` built with the object API (no pyplot state, as
`tfm_common.plotting`), with the library's names on it: `band_mask(T, window, sinks)`, `GPT(..., window, sinks)`,
`cache["slots"]`, `rolling_slots`. What it draws is computed with the library's own rules (`window_allowed`,
`rolling_slots`, `kept_positions` of `tfm_common.rolling_cache`); the tests compare the slot table with the
`cache["slots"]` of a real `WindowedGPT` stepping through a text.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .rolling_cache import EMPTY_SLOT, kept_positions, rolling_slots, window_allowed

__all__ = ["plot_rolling_cache", "slot_table"]

_SINK, _WINDOW, _OUT, _NEW = "#fdd9a6", "#c6dbef", "#f0f0f0", "tab:red"  # the cache's slots
_SINK_DARK, _WINDOW_DARK = "#d9730d", "#2b6ca3"  # the mask: True (may attend) dark, as the book's plot_mask


def _check(owner: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{owner}: {name} expected an integer >= {minimum}, got {value!r}")
    return int(value)


def slot_table(steps: int, window: int, sinks: int = 0) -> np.ndarray:
    """(steps, sinks + window) ints: row t is the position each slot of the rolling cache holds once position t is
    written (EMPTY_SLOT = -1 where nothing is yet), one token per step: `rolling_slots` applied step by step."""
    slots, rows = np.full(sinks + window, EMPTY_SLOT), []
    for t in range(steps):
        if kept_positions(t, t, window, sinks):
            slots = slots.copy()
            slots[rolling_slots(t, window, sinks)] = t
        rows.append(slots)
    return np.array(rows)


def plot_rolling_cache(window: int = 5, sinks: int = 2, steps: int = 14) -> Figure:
    """Two panels. Left: the mask of a GPT(..., window, sinks) over `steps` positions (`band_mask`): query i sees
    the last `window` keys and the first `sinks`. Right: the rolling cache of sinks + window slots, one row per
    generated position: which position each slot holds, the slot just written (red edge: the new key goes over the
    oldest one of the window, slot sinks + (p - sinks) mod window), the sinks kept for good."""
    owner = "plot_rolling_cache"
    window = _check(owner, "window", window, 1)
    sinks = _check(owner, "sinks", sinks, 0)
    steps = _check(owner, "steps", steps, 1)
    if sinks >= window:
        raise ValueError(f"{owner}: sinks must be < window={window}, got sinks={sinks}")
    i = np.arange(steps)
    allowed = window_allowed(i[:, None], i[None, :], window, sinks)  # (steps, steps)
    table = slot_table(steps, window, sinks)  # (steps, sinks + window)

    fig = Figure(figsize=(13, 5.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(steps, sinks + window + 3))
    for q in range(steps):
        for k in range(steps):
            color = (_SINK_DARK if k < sinks else _WINDOW_DARK) if allowed[q, k] else _OUT
            left.add_patch(Rectangle((k, q), 1, 1, facecolor=color, edgecolor="white", lw=1))
    left.set_xlim(0, steps)
    left.set_ylim(steps, 0)
    left.set_xticks(i + 0.5, [str(k) for k in i], fontsize=7)
    left.set_yticks(i + 0.5, [str(q) for q in i], fontsize=7)
    left.set_xlabel("key position j")
    left.set_ylabel("query position i")
    left.set_aspect("equal")
    left.set_title(f"band_mask(T={steps}, window={window}, sinks={sinks})\ni sees j <= i with i - j < {window} "
                   f"or j < {sinks}", fontsize=10)  # fmt: skip
    for spine in left.spines.values():
        spine.set_visible(False)

    size = sinks + window
    for t in range(steps):
        written = rolling_slots(t, window, sinks)
        for s in range(size):
            p = table[t, s]
            color = _OUT if p == EMPTY_SLOT else (_SINK if s < sinks else _WINDOW)
            edge, lw = (_NEW, 2.2) if s == written else ("white", 1)
            right.add_patch(Rectangle((s, t), 1, 1, facecolor=color, edgecolor=edge, lw=lw))
            right.text(s + 0.5, t + 0.5, "" if p == EMPTY_SLOT else str(p), ha="center", va="center", fontsize=8)
        right.text(size + 0.2, t + 0.5, f"step {t}: key of position {t} -> slot {written}", va="center", fontsize=7.5,
                   color=_NEW)  # fmt: skip
    right.set_xlim(0, size + 3.2)
    right.set_ylim(steps, -1.2)
    right.set_xticks(np.arange(size) + 0.5, [f"{s}" for s in range(size)], fontsize=7)
    right.set_yticks([])
    right.set_xlabel('slot of cache["layers"][i]["k"] (and "v")')
    if sinks:
        right.text(sinks / 2, -0.5, "sinks", ha="center", fontsize=9)
    right.text(sinks + window / 2, -0.5, f"window: slot {sinks} + (p - {sinks}) mod {window}", ha="center",
               fontsize=9)  # fmt: skip
    right.set_title(f'cache["slots"] after each step: {size} slots, constant memory\n'
                    "red edge: where the new key is written (over the oldest of the window)", fontsize=10)  # fmt: skip
    for spine in right.spines.values():
        spine.set_visible(False)
    fig.suptitle(f"GPT(..., window={window}, sinks={sinks}): sliding-window attention and its rolling cache",
                 fontsize=11)  # fmt: skip
    return fig
