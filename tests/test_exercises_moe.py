"""Wrong attempts at chapter 20c's exercises (mixture of experts): each fails with a message that points at the
mistake; the chapter's worked solutions pass."""

from __future__ import annotations

import numpy as np
from helpers_exercises import fails, solution

from tfm_numpy.exercises import check

# --- top_k_gates ------------------------------------------------------------------------------------------------------


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _refuse(logits, top_k):
    if top_k > logits.shape[1]:
        raise ValueError(f"top_k must be <= n_experts={logits.shape[1]}, got {top_k}")


def test_top_k_gates_renormalized_for_top_1():
    def attempt(logits, top_k):
        _refuse(logits, top_k)
        p = _softmax(logits)
        e = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        picked = np.take_along_axis(p, e, axis=1)
        return e, picked / picked.sum(axis=1, keepdims=True)  # also for top_k = 1: the constant 1

    result = fails("top_k_gates", attempt, "top_k = 1, (N, E) = (6, 4): gates", "NOT renormalized")
    assert not result.failed("top_k = 2, (N, E) = (6, 4)")


def test_top_k_gates_not_renormalized():
    def attempt(logits, top_k):
        _refuse(logits, top_k)
        p = _softmax(logits)
        e = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        return e, np.take_along_axis(p, e, axis=1)

    result = fails("top_k_gates", attempt, "top_k = 2, (N, E) = (6, 4): gates", "divide them by their sum")
    assert not result.failed("top_k = 1, (N, E)")


def test_top_k_gates_softmax_without_the_max_shift():
    def attempt(logits, top_k):
        _refuse(logits, top_k)
        e_ = np.exp(logits)
        p = e_ / e_.sum(axis=1, keepdims=True)
        e = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        picked = np.take_along_axis(p, e, axis=1)
        return e, picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked

    result = fails("top_k_gates", attempt, "large logits", "subtract each row's max")
    assert not result.failed("top_k = 2, (N, E) = (6, 4)")


def test_top_k_gates_ties_to_the_higher_index():
    def attempt(logits, top_k):
        _refuse(logits, top_k)
        p = _softmax(logits)
        e = np.argsort(p, axis=1, kind="stable")[:, ::-1][:, :top_k]  # descending, but a tie to the higher index
        picked = np.take_along_axis(p, e, axis=1)
        return e, picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked

    fails("top_k_gates", attempt, "ties (experts 1 and 3 equal), top_k = 2: experts", "LOWER expert index")


def test_top_k_gates_accepts_too_large_top_k():
    def attempt(logits, top_k):
        p = _softmax(logits)
        e = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
        picked = np.take_along_axis(p, e, axis=1)
        return e, picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked

    fails("top_k_gates", attempt, "top_k > E")


def test_top_k_gates_solution_passes():
    assert check("top_k_gates", solution("top_k_gates"), quiet=True).passed


# --- load_balancing_loss ----------------------------------------------------------------------------------------------


def _f(experts, E):
    return np.bincount(experts.reshape(-1), minlength=E) / experts.size


def _through_softmax(p, dp):
    return p * (dp - (p * dp).sum(axis=1, keepdims=True))


def test_load_balancing_loss_counts_tokens_not_assignments():
    def attempt(logits, experts):
        N, E = logits.shape
        p = _softmax(logits)
        f = np.bincount(experts.reshape(-1), minlength=E) / N  # sums to k, not 1
        return E * float(f @ p.mean(axis=0)), _through_softmax(p, np.broadcast_to(E * f / N, p.shape))

    result = fails("load_balancing_loss", attempt, "top_k = 2, (N, E) = (8, 4): loss", "the N*k assignments")
    assert not result.failed("top_k = 1, (N, E)")


def test_load_balancing_loss_gradient_stops_at_the_probabilities():
    def attempt(logits, experts):
        N, E = logits.shape
        p, f = _softmax(logits), _f(experts, logits.shape[1])
        return E * float(f @ p.mean(axis=0)), np.broadcast_to(E * f / N, p.shape).copy()  # dloss/dp, not dlogits

    fails("load_balancing_loss", attempt, "dlogits", "then through the softmax")


def test_load_balancing_loss_gradient_without_the_mean():
    def attempt(logits, experts):
        N, E = logits.shape
        p, f = _softmax(logits), _f(experts, E)
        return E * float(f @ p.mean(axis=0)), _through_softmax(p, np.broadcast_to(E * f, p.shape))  # no 1/N

    result = fails("load_balancing_loss", attempt, "top_k = 1, (N, E) = (8, 4): gradient", "E f_i / N")
    assert not result.failed("one token")  # N = 1: the missing 1/N does not show


def test_load_balancing_loss_fraction_from_the_first_choice_only():
    def attempt(logits, experts):
        N, E = logits.shape
        p, f = _softmax(logits), _f(experts[:, :1], E)
        return E * float(f @ p.mean(axis=0)), _through_softmax(p, np.broadcast_to(E * f / N, p.shape))

    result = fails("load_balancing_loss", attempt, "top_k = 2, (N, E) = (8, 4): loss")
    assert not result.failed("top_k = 1, (N, E)")


def test_load_balancing_loss_solution_passes():
    assert check("load_balancing_loss", solution("load_balancing_loss"), quiet=True).passed
