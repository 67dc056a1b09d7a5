"""Mixture of experts (chapter 20c): what both tracks share, once. The arguments' checks; the routing decisions
made on a NumPy array of router probabilities (which experts each token goes to, which assignments fit under the
capacity, which are dropped); the bookkeeping (tokens per expert, the balancing loss's fractions f_i); the
formulas that take no gradient. The arithmetic that is differentiated (softmax, gates, the weighted sum, the
losses) lives in each track.

The routing, for N tokens, E experts and top_k = k:
    experts[n]  the k experts of the highest router probability for token n, best first (a tie goes to the lower
                index: a stable sort, the same in both tracks because both decide here, on NumPy numbers)
    capacity    C = ceil(capacity_factor * N * k / E) assignments per expert (None: no limit, nothing dropped)
    keep[n, j]  whether assignment (n, j) fits: the assignments to one expert are served first choices first
                (j = 0 of every token, in token order, then j = 1, ...), as GShard does; past C they are dropped
                (the token's output then lacks that expert's term: in a block, the residual carries the token on)
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from .validate import check_choice, check_real, check_size, check_sizes

__all__ = ["Routing", "check_moe_args", "check_router_args", "check_capacity_factor", "moe_gpt_parts",
           "expert_capacity", "route", "renormalizes", "balance_fractions", "MOE_ACTIVATIONS", "MOE_KEYS"]  # fmt: skip

MOE_ACTIVATIONS = ("relu", "gelu")  # the experts are the library's PositionwiseFeedForward


def check_capacity_factor(owner: str, capacity_factor) -> float | None:
    """None (no capacity: nothing dropped) or a finite float > 0."""
    if capacity_factor is None:
        return None
    cf = check_real(owner, "capacity_factor", capacity_factor, 0)
    if cf <= 0:
        raise ValueError(f"{owner}: capacity_factor must be > 0 (or None: no limit), got {capacity_factor}")
    return cf


def check_moe_args(owner: str, d_model, d_ff, n_experts, top_k, capacity_factor, activation, aux_loss_coef,
                   z_loss_coef) -> dict:  # fmt: skip
    """The layer's constructor arguments, validated (the same refusals in both tracks), as a dict of Python numbers."""
    c = check_sizes(owner, d_model=d_model, d_ff=d_ff)
    return c | check_router_args(owner, n_experts, top_k, capacity_factor, activation, aux_loss_coef, z_loss_coef)


def check_router_args(owner: str, n_experts, top_k, capacity_factor, activation, aux_loss_coef, z_loss_coef) -> dict:
    """The mixture's own arguments (all but the sizes d_model, d_ff), validated."""
    c = {"n_experts": check_size(owner, "n_experts", n_experts), "top_k": check_size(owner, "top_k", top_k)}
    if c["top_k"] > c["n_experts"]:
        raise ValueError(f"{owner}: top_k must be <= n_experts={c['n_experts']} (a token picks top_k distinct "
                         f"experts), got top_k={top_k}")  # fmt: skip
    c["capacity_factor"] = check_capacity_factor(owner, capacity_factor)
    c["activation"] = check_choice(owner, "activation", activation, MOE_ACTIVATIONS)
    c["aux_loss_coef"] = check_real(owner, "aux_loss_coef", aux_loss_coef, 0)
    c["z_loss_coef"] = check_real(owner, "z_loss_coef", z_loss_coef, 0)
    return c


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """C = ceil(capacity_factor * n_tokens * top_k / n_experts): each expert's slots (Switch Transformer's "expert
    capacity", counted in assignments so that top_k > 1 is covered); None without a capacity factor. Computed in
    exact rational arithmetic where it can be, so 1.25 * 16 * 2 / 4 is 10, not 10.000000000000002 -> 11."""
    if capacity_factor is None:
        return None
    num = n_tokens * top_k * capacity_factor
    c = num / n_experts
    r = round(c)
    return int(r) if abs(c - r) < 1e-9 * max(1.0, c) else math.ceil(c)


def renormalizes(top_k: int) -> bool:
    """Whether the k selected probabilities are rescaled to sum to 1 (the gates of Shazeer et al. 2017's softmax
    over the kept logits, of GShard's top-2 and Mixtral's): yes for top_k >= 2. For top_k = 1 the rescaled gate
    would be the constant 1 and the router would learn from the balancing loss alone; Switch Transformer multiplies
    by the probability itself there, and so do we."""
    return top_k > 1


class Routing(NamedTuple):
    """The routing of one forward: N tokens, E experts, top_k = k (all NumPy)."""

    experts: np.ndarray  # (N, k) int64: token n's choices, best first
    keep: np.ndarray  # (N, k) bool: the assignment fits under the capacity
    capacity: int | None  # slots per expert (None: unlimited)
    chosen: np.ndarray  # (E,) int64: assignments each expert was chosen for (before the capacity)
    kept: np.ndarray  # (E,) int64: assignments each expert serves (after the capacity)
    groups: tuple  # E pairs (tokens (n_e,), slots (n_e,)): the kept assignments of expert e, in service order

    @property
    def dropped(self) -> int:
        """Assignments dropped for want of capacity."""
        return int(self.keep.size - self.keep.sum())

    @property
    def dropped_share(self) -> float:
        """The dropped share of the N k assignments."""
        return self.dropped / self.keep.size if self.keep.size else 0.0


def route(probs: np.ndarray, top_k: int, capacity: int | None) -> Routing:
    """The routing decisions from the router's probabilities `probs` (N, E) (any float dtype, NumPy): top_k
    experts per token, and which assignments fit under `capacity` slots per expert (None: all)."""
    N, E = probs.shape
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(np.int64)  # (N, k), best first
    order = experts.T.reshape(-1)  # (k N,): first choices of every token, then second choices, ...
    onehot = order[:, None] == np.arange(E)  # (k N, E)
    position = (np.cumsum(onehot, axis=0) - 1)[np.arange(order.size), order]  # the slot each assignment asks for
    fits = position < (capacity if capacity is not None else order.size)
    keep = fits.reshape(top_k, N).T  # (N, k)
    groups = []
    for e in range(E):
        served = np.flatnonzero((order == e) & fits)  # in service order: j-major, then token order
        groups.append((served % N, served // N))  # (tokens, slots)
    chosen = np.bincount(order, minlength=E).astype(np.int64)
    kept = np.bincount(order[fits], minlength=E).astype(np.int64)
    return Routing(experts, keep, capacity, chosen, kept, tuple(groups))


def balance_fractions(routing: Routing, n_experts: int) -> np.ndarray:
    """f_i (E,) float64: the share of the N k assignments whose router chose expert i (before the capacity), the f
    of Switch Transformer's balancing loss E sum_i f_i P_i, which is 1 when both f and P are uniform. f is a count:
    piecewise constant in the router's weights, so the loss's gradient flows through P alone."""
    total = routing.experts.size
    return routing.chosen.astype(np.float64) / total if total else np.zeros(n_experts)


MOE_KEYS = ("n_experts", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef")  # in a MoEGPT's config


def moe_gpt_parts(model, parts: SimpleNamespace, block, n_experts, top_k, capacity_factor, aux_loss_coef,
                  z_loss_coef, options: dict) -> None:  # fmt: skip
    """What a track's MoEGPT does before the GPT's constructor runs: its MoE arguments checked (kept as model._moe,
    for its config) and model._parts, a copy of the GPT's building blocks whose GPTBlock is `block` (the track's
    MoEGPTBlock) given those arguments. The GPT's constructor (tfm_common.model_doors.GPTDoor) then builds it."""
    owner = type(model).__name__
    if "window" in options:
        raise TypeError(f"{owner}: window is not an option of a mixture-of-experts GPT (sliding windows: GPT)")
    c = check_router_args(owner, n_experts, top_k, capacity_factor, options.get("activation", "gelu"), aux_loss_coef,
                          z_loss_coef)  # fmt: skip
    moe = {k: c[k] for k in MOE_KEYS}

    def make_block(*args, **kwargs):
        return block(*args, **moe, **kwargs)

    object.__setattr__(model, "_moe", moe)
    object.__setattr__(model, "_parts", SimpleNamespace(**{**vars(parts), "GPTBlock": make_block}))
