"""Graded exercises of chapter 20c (mixture of experts): see foundations.py for the pattern.

`top_k_gates`: a router's top-k choice and its gates (renormalized for top_k >= 2, the probability itself for
top_k = 1). `load_balancing_loss`: Switch Transformer's balancing loss and its gradient with respect to the router's
logits. The expected values come from the library: tfm_common.moe.route and tfm_numpy.MoEFeedForward.
"""

from __future__ import annotations

import numpy as np

from tfm_common.moe import renormalizes, route

from ..functional import softmax
from ..moe import MoEFeedForward
from .grading import Exercise, Grader

__all__ = ["EXERCISES"]


# --- top-k routing with renormalization -----------------------------------------------------------------------------

GATES_HINT = ("gates: softmax over ALL experts, take the k chosen probabilities, and divide them by their sum when "
              "top_k >= 2 (top_k = 1 keeps the probability itself)")  # fmt: skip
GATES_HINTS = {
    "top_k = 1": "with top_k = 1 the gate is the probability p itself, NOT renormalized (that would make it the "
    "constant 1: the router would get no gradient from the task, which is why Switch keeps p)",
    "large logits": "subtract each row's max before exp: exp(1000) overflows to inf",
    "ties": "a tie goes to the LOWER expert index: a stable sort of -p (np.argsort(-p, kind='stable'))",
}


def _library_gates(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    probs = softmax(logits)
    experts = route(probs, top_k, None).experts
    picked = np.take_along_axis(probs, experts, axis=1)
    return experts, picked / picked.sum(axis=1, keepdims=True) if renormalizes(top_k) else picked


def _gates_cases(rng):
    ties = rng.standard_normal((4, 5))
    ties[:, 3] = ties[:, 1] = ties.max(axis=1) + 1.0  # experts 1 and 3 tie for first place
    return (
        ("top_k = 2, (N, E) = (6, 4)", rng.standard_normal((6, 4)), 2),
        ("top_k = 1, (N, E) = (6, 4)", rng.standard_normal((6, 4)), 1),
        ("top_k = 3, (N, E) = (5, 8)", rng.standard_normal((5, 8)), 3),
        ("one token, top_k = E = 3", rng.standard_normal((1, 3)), 3),
        ("large logits (about 1000), top_k = 2", 1000 + 30 * rng.standard_normal((4, 4)), 2),
        ("ties (experts 1 and 3 equal), top_k = 2", ties, 2),
    )


def _gates_hint(label: str) -> str:
    return next((h for key, h in GATES_HINTS.items() if label.startswith(key)), GATES_HINT)


def grade_top_k_gates(g: Grader) -> None:
    rng = np.random.default_rng(2031)
    for label, logits, k in _gates_cases(rng):
        hint = _gates_hint(label)
        got = g.run(label, logits, k, hint=hint)
        experts, gates = _library_gates(logits, k)
        if not isinstance(got, tuple) or len(got) != 2:
            g.record(label, False, "expected a tuple (experts, gates)")
            continue
        g.compare(f"{label}: experts", got[0], experts, tol=0, hint=hint)
        g.compare(f"{label}: gates", got[1], gates, tol=1e-12, hint=hint)
    logits = rng.standard_normal((3, 4)).astype(np.float32)
    got = g.run("float32", logits, 2)
    if isinstance(got, tuple) and len(got) == 2:
        g.compare("float32: gates", got[1], _library_gates(logits, 2)[1], tol=1e-6, dtype=np.float32)
    g.refuses("top_k > E", rng.standard_normal((3, 4)), 5, expected="says top_k must be <= the number of experts")


# --- the load-balancing loss ------------------------------------------------------------------------------------------

BALANCE_HINTS = {
    "loss": "loss = E * sum_i f_i P_i with f_i the share of the N*k assignments (all k choices of every token) sent "
    "to expert i, and P_i the mean over tokens of softmax(logits)[:, i]",
    "dlogits": "f is a count (no gradient): dloss/dp[n, i] = E f_i / N, then through the softmax: "
    "dlogits = p * (dp - sum_j p_j dp_j)",
}


def _balance_layer(n_experts: int, top_k: int, dtype) -> MoEFeedForward:
    return MoEFeedForward(2, 1, n_experts, top_k, aux_loss_coef=1.0, z_loss_coef=0.0, dtype=dtype)


def _library_balance(logits: np.ndarray, top_k: int):
    """(experts, loss, dlogits) from the library's layer: its routing, its aux_loss, its router backward."""
    layer = _balance_layer(logits.shape[1], top_k, logits.dtype)
    probs = softmax(logits)
    routing = route(probs, top_k, None)
    aux, _, lse = layer.losses(logits, probs, routing)
    dlogits = layer.router_backward(np.zeros(routing.experts.shape, logits.dtype), probs, routing,
                                    np.ones(routing.experts.shape, logits.dtype), lse)  # fmt: skip
    return routing, aux, dlogits


def _balance_numeric(logits: np.ndarray, routing, top_k: int) -> np.ndarray:
    """Central differences of the layer's aux_loss in the logits, the experts held fixed (they are an input)."""
    layer, x, grad, h = _balance_layer(logits.shape[1], top_k, np.float64), logits.copy(), np.zeros_like(logits), 1e-6
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        up = layer.losses(x, softmax(x), routing)[0]
        x[idx] = old - h
        down = layer.losses(x, softmax(x), routing)[0]
        x[idx] = old
        grad[idx] = (up - down) / (2 * h)
    return grad


def grade_load_balancing_loss(g: Grader) -> None:
    rng = np.random.default_rng(2032)
    balanced = np.full((4, 4), -3.0)
    balanced[np.arange(4), np.arange(4)] = 3.0  # token i prefers expert i: f and P uniform
    cases = (
        ("top_k = 1, (N, E) = (8, 4)", rng.standard_normal((8, 4)), 1),
        ("top_k = 2, (N, E) = (8, 4)", rng.standard_normal((8, 4)), 2),
        ("top_k = 2, (N, E) = (5, 6)", 2 * rng.standard_normal((5, 6)), 2),
        ("one token, top_k = 1", rng.standard_normal((1, 4)), 1),
        ("large logits (about 1000), top_k = 1", 1000 + 20 * rng.standard_normal((6, 4)), 1),
        ("balanced: each expert chosen once, top_k = 1", balanced, 1),
    )
    for label, logits, k in cases:
        routing, loss, dlogits = _library_balance(logits, k)
        got = g.run(label, logits, routing.experts, hint=BALANCE_HINTS["loss"])
        if not isinstance(got, tuple) or len(got) != 2:
            g.record(label, False, "expected a tuple (loss, dlogits)")
            continue
        g.compare(f"{label}: loss", got[0], loss, tol=1e-12, hint=BALANCE_HINTS["loss"])
        numeric = {"dlogits": _balance_numeric(logits, routing, k)} if "large" not in label else None
        g.backward(f"{label}: gradient", (got[1],), {"dlogits": dlogits}, numeric,
                   hints={"dlogits": BALANCE_HINTS["dlogits"]})  # fmt: skip
    logits = rng.standard_normal((6, 4)).astype(np.float32)
    routing, loss, dlogits = _library_balance(logits, 2)
    got = g.run("float32", logits, routing.experts)
    if isinstance(got, tuple) and len(got) == 2:
        g.gradients("float32", (got[1],), {"dlogits": dlogits}, tol=1e-6, dtype=np.float32)


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "top_k_gates",
        "20c_mixture_of_experts",
        "top_k_gates(logits, top_k) -> (experts, gates): logits (N, E); experts (N, top_k) integer indices, best "
        "first, a tie to the lower index; gates (N, top_k): the chosen softmax probabilities, divided by their sum "
        "when top_k >= 2",
        grade_top_k_gates,
    ),
    Exercise(
        "load_balancing_loss",
        "20c_mixture_of_experts",
        "load_balancing_loss(logits, experts) -> (loss, dlogits): logits (N, E), experts (N, k) the chosen experts; "
        "loss = E sum_i f_i P_i (a float), dlogits (N, E) its gradient",
        grade_load_balancing_loss,
    ),
)
