"""Graded exercises of chapter 20b (splitting the model): Megatron's feed-forward split, and the 1F1B schedule.

The expected values come from the library: the partial outputs are what `TensorParallelFeedForward` hands to its
all-reduce (recorded by a stand-in communicator that sums nothing), the layer's output is the unsplit
`PositionwiseFeedForward`'s, and the schedule is `tfm_common.model_parallel.pipeline_schedule(..., "1f1b")`.
"""

from __future__ import annotations

import numpy as np

from tfm_common.model_parallel import peak_in_flight, pipeline_schedule, simulate_schedule

from ..model_parallel import TensorParallelFeedForward
from ..sublayers import PositionwiseFeedForward
from .grading import MISSING, Exercise, Grader

__all__ = ["EXERCISES"]


class _Recorder:
    """A communicator for one rank alone: all_reduce returns its input and keeps it (the rank's partial sum)."""

    def __init__(self):
        self.sent: list[np.ndarray] = []

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        self.sent.append(x.copy())
        return x


def _library_ffn(x, w1, b1, w2, b2, world):
    """The library's partials (one per rank) and the unsplit layer's output."""
    d, d_ff = w1.shape[1], w1.shape[0]
    ff = PositionwiseFeedForward(d, d_ff, 0.0, "relu", dtype=x.dtype)
    ff.load_state_dict({"linear1.weight": w1, "linear1.bias": b1, "linear2.weight": w2, "linear2.bias": b2})
    partials = []
    for r in range(world):
        rec = _Recorder()
        TensorParallelFeedForward(ff, r, world, rec)(x)
        partials.append(rec.sent[0].reshape(x.shape))
    return partials, ff(x)


def grade_tensor_parallel_ffn(g: Grader) -> None:
    rng = np.random.default_rng(2035)
    f64 = np.float64
    cases = [((2, 3), 8, 16, 2, f64), ((1, 1), 8, 16, 2, f64), ((5,), 4, 12, 3, f64),
             ((2, 4), 8, 16, 4, f64), ((2, 3), 8, 16, 1, f64), ((3, 2), 8, 16, 2, np.float32)]  # fmt: skip
    for lead, d, d_ff, world, dt in cases:
        x = rng.standard_normal((*lead, d)).astype(dt)
        w1, b1 = rng.standard_normal((d_ff, d)).astype(dt), rng.standard_normal(d_ff).astype(dt)
        w2, b2 = rng.standard_normal((d, d_ff)).astype(dt), rng.standard_normal(d).astype(dt)
        label = f"x {x.shape} {np.dtype(dt).name}, world={world}"
        tol = 1e-5 if dt == np.float32 else 1e-12
        out = g.run(label, x, w1, b1, w2, b2, world, hint="tensor_parallel_ffn(x, w1, b1, w2, b2, world)")
        if out is MISSING:
            continue
        if not (isinstance(out, tuple) and len(out) == 2 and len(out[0]) == world):
            g.record(label, False, f"expected (partials, y) with {world} partials, got {type(out).__name__}")
            continue
        partials, y = out
        want_p, want_y = _library_ffn(x, w1, b1, w2, b2, world)
        hint = ("rank r's partial is relu(x W1_r^T + b1_r) W2_r^T: W1's rows and W2's columns of the same hidden "
                "units, no b2 (added once, after the sum), the activation before the sum")  # fmt: skip
        for r in range(world):
            g.compare(f"{label}: partial of rank {r}", partials[r], want_p[r], tol=tol, dtype=dt, hint=hint)
        g.compare(f"{label}: y = sum of partials + b2", y, want_y, tol=tol, dtype=dt,
                  hint="y is the all-reduce of the partials plus b2 once (not once per rank)")  # fmt: skip
    x = rng.standard_normal((2, 8))
    w1, b1, w2, b2 = rng.standard_normal((12, 8)), rng.standard_normal(12), rng.standard_normal((8, 12)), np.zeros(8)
    g.refuses("world=5 does not divide d_ff=12", x, w1, b1, w2, b2, 5, expected="names world and d_ff")


def grade_one_f_one_b(g: Grader) -> None:
    for p, m in ((2, 4), (3, 5), (4, 8), (4, 2), (2, 1), (1, 3)):
        label = f"n_stages={p}, micro_batches={m}"
        got = g.run(label, p, m)
        if got is MISSING:
            continue
        want = pipeline_schedule(p, m, "1f1b")
        try:
            got = [[(str(op), int(i)) for op, i in ops] for ops in got]
        except (TypeError, ValueError):
            g.record(label, False, "expected one list of (op, micro) pairs per stage, e.g. [('F', 0), ('B', 0)]")
            continue
        peaks = [peak_in_flight(ops) for ops in got]
        g.require(f"{label}: activations held", peaks == [peak_in_flight(ops) for ops in want],
                  f"stage s holds at most min(m, p - s) micro-batches: {peaks}",
                  f"held at most {peaks} micro-batches per stage, 1F1B holds "
                  f"{[peak_in_flight(ops) for ops in want]}: warm up with p - 1 - s forwards (at most m)")  # fmt: skip
        try:
            simulate_schedule(got)
            runs = True
        except (ValueError, KeyError, IndexError):
            runs = False
        g.require(f"{label}: runs", runs, "runs without deadlock", "deadlocks: some operation waits forever")
        g.require(f"{label}: the 1F1B order", got == want, "each stage's order is 1F1B's",
                  f"stage orders differ from 1F1B's: stage 0 {got[0][:6]}... expected {want[0][:6]}...")  # fmt: skip
    g.refuses("micro_batches=0", 2, 0, expected="names micro_batches")


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "tensor_parallel_ffn",
        "20b_model_parallel",
        "tensor_parallel_ffn(x, w1, b1, w2, b2, world) -> (partials, y): x (..., d), w1 (d_ff, d), b1 (d_ff,), "
        "w2 (d, d_ff), b2 (d,); partials: a list of world arrays (..., d), y (..., d); ReLU",
        grade_tensor_parallel_ffn,
    ),
    Exercise(
        "one_f_one_b",
        "20b_model_parallel",
        "one_f_one_b(n_stages, micro_batches) -> schedule: per stage a list of ('F', i) / ('B', i) in order",
        grade_one_f_one_b,
    ),
)
