"""Chapter 20b's graded exercises: wrong attempts fail with findings that point at the mistake; the solutions pass
(tests/test_exercises.py checks the chapter's own solution cells)."""

from __future__ import annotations

import numpy as np

from tfm_numpy.exercises import check


def solution_ffn(x, w1, b1, w2, b2, world, *, b2_each=False, act_after=False, interleaved=False, unsplit=False):
    d_ff = w1.shape[0]
    if d_ff % world:
        raise ValueError(f"world={world} must divide d_ff={d_ff}")
    k, partials = d_ff // world, []
    for r in range(world):
        u = slice(r * k, (r + 1) * k)
        u1 = slice(None) if unsplit else slice(r, None, world) if interleaved else u  # W1's hidden units
        u2 = slice(None) if unsplit else u  # W2's
        pre = x @ w1[u1].T + b1[u1]
        h = pre if act_after else np.maximum(pre, 0)
        partials.append(h @ w2[:, u2].T + (b2 if b2_each else 0))
    y = sum(partials)
    y = np.maximum(y, 0) if act_after else y
    return partials, (y if b2_each else y + b2)


def one_f_one_b(p, m, *, warm_of=lambda p, s, m: min(p - 1 - s, m), drain_reversed=False, gpipe=False):
    if m < 1:
        raise ValueError(f"micro_batches expected at least 1, got {m}")
    out = []
    for s in range(p):
        if gpipe:
            out.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = warm_of(p, s, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        drain = [("B", i) for i in range(m - warm, m)]
        out.append(ops + (drain[::-1] if drain_reversed else drain))
    return out


def test_the_right_attempts_pass():
    assert check("tensor_parallel_ffn", solution_ffn, quiet=True).passed
    assert check("one_f_one_b", one_f_one_b, quiet=True).passed


def test_ffn_bias_added_by_every_rank_fails_the_sum():
    r = check("tensor_parallel_ffn", lambda *a: solution_ffn(*a, b2_each=True), quiet=True)
    assert not r.passed and r.failed("partial of rank 0") and r.failed("no b2 (added once")
    assert not r.failed("world=1: y")  # with one rank, b2 once is b2 per rank


def test_ffn_activation_after_the_sum_fails_the_partials():
    r = check("tensor_parallel_ffn", lambda *a: solution_ffn(*a, act_after=True), quiet=True)
    assert not r.passed and r.failed("partial of rank 1") and r.failed("the activation before the sum")


def test_ffn_w1_and_w2_cut_into_different_units_fails():
    """W1's rows taken every world-th (r, r + W, ...), W2's columns in a block: each rank mixes units."""
    r = check("tensor_parallel_ffn", lambda *a: solution_ffn(*a, interleaved=True), quiet=True)
    assert not r.passed and r.failed("partial of rank 1") and r.failed("W1's rows and W2's columns of the same")


def test_ffn_every_rank_computing_the_whole_layer_fails():
    r = check("tensor_parallel_ffn", lambda *a: solution_ffn(*a, unsplit=True), quiet=True)
    assert not r.passed and r.failed("world=2: y = sum of partials + b2") and not r.failed("world=1")


def test_ffn_accepting_an_uneven_split_fails():
    def no_check(x, w1, b1, w2, b2, world):
        k = -(-w1.shape[0] // world)
        parts = [np.maximum(x @ w1[r * k : (r + 1) * k].T + b1[r * k : (r + 1) * k], 0) @ w2[:, r * k : (r + 1) * k].T
                 for r in range(world)]  # fmt: skip
        return parts, sum(parts) + b2

    r = check("tensor_parallel_ffn", no_check, quiet=True)
    assert not r.passed and r.failed("world=5 does not divide d_ff=12")


def test_1f1b_warm_up_of_p_minus_s_holds_one_more():
    r = check("one_f_one_b", lambda p, m: one_f_one_b(p, m, warm_of=lambda p, s, m: min(p - s, m)), quiet=True)
    assert not r.passed and r.failed("activations held") and r.failed("warm up with p - 1 - s")


def test_1f1b_gpipe_order_holds_m():
    r = check("one_f_one_b", lambda p, m: one_f_one_b(p, m, gpipe=True), quiet=True)
    assert not r.passed and r.failed("n_stages=4, micro_batches=8: activations held")


def test_1f1b_without_the_min_breaks_when_m_is_small():
    r = check("one_f_one_b", lambda p, m: one_f_one_b(p, m, warm_of=lambda p, s, m: p - 1 - s), quiet=True)
    assert not r.passed and r.failed("n_stages=4, micro_batches=2")
    assert not r.failed("n_stages=4, micro_batches=8")


def test_1f1b_drain_in_reverse_order_fails_the_order():
    r = check("one_f_one_b", lambda p, m: one_f_one_b(p, m, drain_reversed=True), quiet=True)
    assert not r.passed and r.failed("the 1F1B order")
