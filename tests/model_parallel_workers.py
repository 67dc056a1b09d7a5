"""Targets of the worker processes started by test_model_parallel.py: importable, and light (no torch)."""

from __future__ import annotations

import numpy as np


def ping_pong(rank, world, there, back, n):
    """Rank 0 sends n arrays to rank 1, which returns each doubled; rank 0 returns what came back."""
    if rank == 0:
        out = []
        for i in range(n):
            there.send(np.full(3, float(i)))
            out.append(back.recv((3,)))
        result = (out, there.bytes_sent)
    else:
        for _ in range(n):
            back.send(2 * there.recv((3,)))
        result = None
    there.close()
    back.close()
    return result


def silent(rank, world, chan):
    """Rank 0 waits for a message nobody sends: the channel's timeout must end it."""
    try:
        if rank == 0:
            chan.recv((3,))
    finally:
        chan.close()
