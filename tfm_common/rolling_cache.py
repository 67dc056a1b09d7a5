"""Sliding-window attention and the rolling key/value cache (chapter 21c), the plumbing shared by both tracks: which
keys a query may see, which slot of the rolling cache a position is written to, and the checks of the GPT's `window`
and `sinks` options.

A model with window w and s sinks lets the query at position i see the keys j with

    j <= i   and   (i - j < w   or   j < s)

the last w positions (itself included: a causal band, Beltagy et al. 2020, Child et al. 2019) and the first s
positions of the text, the "attention sinks" of Xiao et al. (2023). s = 0 is the plain band; w >= T the causal mask.
During generation only those keys are ever read again, so a cache of s + w slots holds everything: slots 0 .. s - 1
keep positions 0 .. s - 1 for good, and position p >= s goes to slot s + (p - s) mod w, overwriting the position
p - w, which no later query sees. The memory stays s + w positions, however long the text.
"""

from __future__ import annotations

import numpy as np

from .validate import check_size

__all__ = ["window_allowed", "rolling_slots", "kept_positions", "check_window_options", "EMPTY_SLOT"]

EMPTY_SLOT = -1  # the position recorded for a slot not written yet: window_allowed never lets a query see it


def window_allowed(q_pos, k_pos, window: int, sinks: int = 0) -> np.ndarray:
    """Bool, broadcasting q_pos against k_pos (integer positions): True where the query at q_pos may see the key at
    k_pos: k_pos <= q_pos and (q_pos - k_pos < window or k_pos < sinks); a k_pos < 0 (an empty slot) never."""
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    return (k_pos >= 0) & (k_pos <= q_pos) & ((q_pos - k_pos < window) | (k_pos < sinks))


def rolling_slots(positions, window: int, sinks: int = 0) -> np.ndarray:
    """The slot of the rolling cache (of sinks + window slots) where each position is written: p itself for a sink
    (p < sinks), sinks + (p - sinks) mod window after."""
    p = np.asarray(positions)
    return np.where(p < sinks, p, sinks + (p - sinks) % window)


def kept_positions(positions, last: int, window: int, sinks: int = 0) -> np.ndarray:
    """Bool per position: still needed once the text reaches position `last` (a sink, or one of the last `window`)."""
    p = np.asarray(positions)
    return (p < sinks) | (p > last - window)


def check_window_options(owner: str, window, sinks) -> tuple[int | None, int]:
    """The GPT's window (None: full causal attention; else an int >= 1) and sinks (an int >= 0, fewer than window;
    0 without a window), checked: (window, sinks)."""
    sinks = check_size(owner, "sinks", sinks, minimum=0)
    if window is None:
        if sinks:
            raise ValueError(f"{owner}: sinks={sinks} needs a window (sinks are kept beside a sliding window), got "
                             "window=None")  # fmt: skip
        return None, 0
    window = check_size(owner, "window", window)
    if sinks >= window:
        raise ValueError(f"{owner}: sinks must be < window={window} (the sinks are kept beside the window's last "
                         f"positions), got sinks={sinks}")  # fmt: skip
    return window, sinks
