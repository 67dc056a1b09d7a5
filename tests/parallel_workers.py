"""Targets of the worker processes started by test_parallel.py: importable, and light (no torch), so that a
spawned worker starts fast."""

from __future__ import annotations

import time


def ring(rank, world, ring, xs):
    comm = ring.member(rank)
    try:
        shard = comm.reduce_scatter(xs[rank])
        return shard, comm.all_gather(shard, xs[rank].size), comm.all_reduce(xs[rank]), comm.bytes_sent
    finally:
        comm.close()


def failing(rank, world):
    if rank == 1:
        raise ValueError("worker one fails")
    time.sleep(60)  # the other would run long: it must be stopped


def sleeping(rank, world):
    time.sleep(60)
