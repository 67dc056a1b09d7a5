"""Mixture of experts, NumPy track (chapter 20c): a router sends each token to top_k of n_experts feed-forwards and
sums their outputs weighted by its gates; the backward by hand, through the gates and the router's softmax.

Shapes: `(..., d_model)` in and out (any leading dims; the N tokens are routed one by one). The routing decisions
(which experts, which assignments fit under the capacity) are made once, in `tfm_common.moe.route`.
"""

from __future__ import annotations

import numpy as np

from tfm_common.moe import (
    balance_fractions,
    check_capacity_factor,
    check_moe_args,
    expert_capacity,
    moe_gpt_parts,
    renormalizes,
)
from tfm_common.moe import route as route_tokens

from .functional import softmax, softmax_backward
from .gpt import GPT, GPTBlock
from .layers import Linear
from .module import Module, ModuleList, as_rng, check_dtype, check_input
from .sublayers import PositionwiseFeedForward

__all__ = ["MoEFeedForward", "MoEGPTBlock", "MoEGPT"]


class MoEFeedForward(Module):
    """y_n = sum_j keep[n, j] g[n, j] FFN_{e(n, j)}(x_n): a mixture of n_experts feed-forwards, top_k per token.

        logits = x W_r^T (N, E)      p = softmax(logits)      e(n, 1..k) = the k largest p[n], best first
        g[n, j] = p[n, e(n, j)] / sum_l p[n, e(n, l)]   (top_k >= 2: renormalized, Shazeer 2017 / Mixtral)
        g[n, 0] = p[n, e(n, 0)]                          (top_k = 1: the probability itself, Switch Transformer)
        keep[n, j]: the assignment fits in its expert's capacity C = ceil(capacity_factor N k / E) (tfm_common.moe)

    Two auxiliary losses, computed in every forward and, times their coefficients, differentiated in `backward`
    (the layer adds their gradients itself: a training loop sees only its own loss):
        aux_loss = E sum_i f_i P_i    (Switch Transformer; f_i the share of assignments to expert i, P_i the mean
                                       router probability of expert i; 1 when both are uniform)
        z_loss   = mean_n (log sum_i exp logits[n, i])^2   (ST-MoE: keeps the router's logits small)
    After a forward: `routing` (tfm_common.moe.Routing), `tokens_per_expert` (E,), `dropped` (assignments dropped),
    `aux_loss`, `z_loss` (floats). state_dict keys: router.weight (E, d_model), experts.<e>.linear1.weight, ...
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int = 1,
        *,
        capacity_factor: float | None = None,
        activation: str = "gelu",
        dropout: float = 0.0,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        rng=None,
        dtype=np.float32,
    ):
        super().__init__()
        c = check_moe_args("MoEFeedForward", d_model, d_ff, n_experts, top_k, capacity_factor, activation,
                           aux_loss_coef, z_loss_coef)  # fmt: skip
        dt, rng = check_dtype(dtype), as_rng(rng)
        self.d_model, self.d_ff, self.n_experts, self.top_k = c["d_model"], c["d_ff"], c["n_experts"], c["top_k"]
        self.capacity_factor, self.activation_name = c["capacity_factor"], c["activation"]
        self.aux_loss_coef, self.z_loss_coef = c["aux_loss_coef"], c["z_loss_coef"]
        self.router = Linear(d_model, n_experts, bias=False, rng=rng, dtype=dt)  # (E, d_model)
        ffs = (PositionwiseFeedForward(d_model, d_ff, dropout, activation, rng=rng, dtype=dt) for _ in range(n_experts))
        self.experts = ModuleList(ffs)
        self.routing = self.aux_loss = self.z_loss = None

    def _check_forward(self, x) -> None:
        check_input("MoEFeedForward", x, last_dim=self.d_model, dtype=self.router.weight.dtype)

    def set_capacity_factor(self, capacity_factor: float | None) -> None:
        """Change the capacity factor (None: unlimited) of later forwards; no weight changes."""
        self.capacity_factor = check_capacity_factor("MoEFeedForward", capacity_factor)

    # -- the pieces (expert parallelism calls them one by one) -----------------------------------------------------
    def route(self, x2: np.ndarray):
        """(logits (N, E), probs (N, E), routing, gates (N, k)) of tokens x2 (N, d_model)."""
        logits = self.router(x2)  # (N, E)
        probs = softmax(logits)
        capacity = expert_capacity(len(x2), self.n_experts, self.top_k, self.capacity_factor)
        routing = route_tokens(probs, self.top_k, capacity)
        picked = np.take_along_axis(probs, routing.experts, axis=1)  # (N, k)
        gates = picked / picked.sum(axis=1, keepdims=True) if renormalizes(self.top_k) else picked
        return logits, probs, routing, gates

    def dispatch(self, x2: np.ndarray, routing) -> list[np.ndarray]:
        """[the rows of x2 that expert e serves, (n_e, d_model)] for each expert e."""
        return [x2[tokens] for tokens, _ in routing.groups]

    def combine(self, outs: list[np.ndarray], routing, gates: np.ndarray) -> np.ndarray:
        """y (N, d_model): each expert's outputs (n_e, d_model), times their gates, added into their tokens' rows."""
        y2 = np.zeros((len(gates), self.d_model), dtype=gates.dtype)
        for (tokens, slots), out in zip(routing.groups, outs, strict=True):
            y2[tokens] += gates[tokens, slots, None] * out  # a token appears once per expert: no repeated index
        return y2

    def losses(self, logits: np.ndarray, probs: np.ndarray, routing) -> tuple[float, float, np.ndarray]:
        """(aux_loss, z_loss, log sum exp of each token's logits (N,)) of one forward (see the class docstring)."""
        f = balance_fractions(routing, self.n_experts)  # (E,) float64
        aux = self.n_experts * float(f @ probs.mean(axis=0))
        m = logits.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]  # (N,) log sum exp
        return aux, float(np.mean(lse * lse)), lse

    # -- forward and backward ----------------------------------------------------------------------------------------
    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.d_model)  # (N, d): every token alone
        logits, probs, routing, gates = self.route(x2)
        outs = [expert(xe) for expert, xe in zip(self.experts, self.dispatch(x2, routing), strict=True)]
        y2 = self.combine(outs, routing, gates)  # (N, d)
        self.aux_loss, self.z_loss, lse = self.losses(logits, probs, routing)
        self.routing = routing
        self._cache = (x.shape, probs, routing, gates, outs, lse)
        return y2.reshape(x.shape)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        """dL/dx for L = (the caller's loss) + aux_loss_coef aux_loss + z_loss_coef z_loss."""
        x_shape, probs, routing, gates, outs, lse = self._saved()
        dy2 = grad_out.reshape(-1, self.d_model)  # (N, d)
        douts, dgates = self.combine_backward(dy2, routing, gates, outs)
        dx2 = np.zeros_like(dy2)
        for (tokens, _), expert, dout in zip(routing.groups, self.experts, douts, strict=True):
            dx2[tokens] += expert.backward(dout)  # the dispatch's backward: each expert's dx back to its rows
        dlogits = self.router_backward(dgates, probs, routing, gates, lse)
        return (dx2 + self.router.backward(dlogits)).reshape(x_shape)

    def combine_backward(self, dy2, routing, gates, outs):
        """(d outs: [(n_e, d)] per expert, d gates (N, k)) from dL/dy (N, d): y_n = sum g[n, j] out_{n, j}."""
        dgates = np.zeros_like(gates)
        douts = []
        for (tokens, slots), out in zip(routing.groups, outs, strict=True):
            douts.append(gates[tokens, slots, None] * dy2[tokens])  # dL/dout = g dL/dy
            dgates[tokens, slots] = (dy2[tokens] * out).sum(axis=1)  # dL/dg = <dL/dy, out>; 0 where dropped
        return douts, dgates

    def router_backward(self, dgates, probs, routing, gates, lse) -> np.ndarray:
        """dL/dlogits (N, E) from dL/dgates, plus the auxiliary losses' gradients (the choices held fixed)."""
        if renormalizes(self.top_k):  # g = r / sum(r): dL/dr_j = (dL/dg_j - sum_l g_l dL/dg_l) / sum(r)
            picked = np.take_along_axis(probs, routing.experts, axis=1)
            dpicked = (dgates - (gates * dgates).sum(axis=1, keepdims=True)) / picked.sum(axis=1, keepdims=True)
        else:
            dpicked = dgates
        dprobs = np.zeros_like(probs)
        np.put_along_axis(dprobs, routing.experts, dpicked, axis=1)  # the k chosen; the others get nothing here
        N, f = len(probs), balance_fractions(routing, self.n_experts)
        dprobs += (self.aux_loss_coef * self.n_experts / N * f).astype(probs.dtype)  # d(E f . mean_n p)/dp[n]
        dlogits = softmax_backward(probs, dprobs)
        dlogits += (self.z_loss_coef * 2 / N) * lse[:, None] * probs  # d mean(lse^2) / dlogits = 2 lse p / N
        return dlogits

    # -- bookkeeping -------------------------------------------------------------------------------------------------
    @property
    def tokens_per_expert(self) -> np.ndarray | None:
        """(E,) the assignments each expert served in the last forward (after the capacity)."""
        return None if self.routing is None else self.routing.kept

    @property
    def dropped(self) -> int | None:
        """Assignments dropped for want of capacity in the last forward."""
        return None if self.routing is None else self.routing.dropped

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, activation={self.activation_name!r}")  # fmt: skip


class MoEGPTBlock(GPTBlock):
    """A GPTBlock whose feed-forward `ff` is a MoEFeedForward (of n_experts feed-forwards of width d_ff): the block's
    forward and backward are GPTBlock's, unchanged (they call self.ff and self.ff.backward)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, *, n_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001,
                 activation: str = "gelu", rng=None, dtype=np.float32, **block):  # fmt: skip
        check_moe_args("MoEGPTBlock", d_model, d_ff, n_experts, top_k, capacity_factor, activation, aux_loss_coef,
                       z_loss_coef)  # fmt: skip
        dt, rng = check_dtype(dtype), as_rng(rng)
        super().__init__(d_model, n_heads, d_ff, dropout, activation=activation, rng=rng, dtype=dt, **block)
        self.ff = MoEFeedForward(d_model, d_ff, n_experts, top_k, capacity_factor=capacity_factor,
                                 activation=activation, dropout=dropout, aux_loss_coef=aux_loss_coef,
                                 z_loss_coef=z_loss_coef, rng=rng, dtype=dt)  # fmt: skip


class MoEGPT(GPT):
    """The GPT of chapter 17b with a MoEFeedForward in place of every block's dense feed-forward (chapter 20c):
    MoEGPT(vocab_size, d_model, n_heads, d_ff, n_layers, max_len, dropout, n_experts=E, top_k=k, capacity_factor=,
    aux_loss_coef=, z_loss_coef=, **the GPT's options) (no window; activation "gelu" or "relu"). Its forward and
    backward are the GPT's: each MoE layer adds its auxiliary losses' gradients in its own backward, so the training
    loss is (cross-entropy) + sum over layers of (aux_loss_coef aux_loss + z_loss_coef z_loss) while the training
    loop (lm_train_step, train_lm) is the dense GPT's. `aux_losses()` gives that added term of the last forward."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)  # not GPT's __new__: no windowed variant

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, d_ff: int, n_layers: int, max_len: int,
                 dropout: float = 0.0, *, n_experts: int, top_k: int = 1, capacity_factor: float | None = None,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001, **gpt_options):  # fmt: skip
        moe_gpt_parts(self, GPT._parts, MoEGPTBlock, n_experts, top_k, capacity_factor, aux_loss_coef, z_loss_coef,
                      gpt_options)  # fmt: skip
        super().__init__(vocab_size, d_model, n_heads, d_ff, n_layers, max_len, dropout, **gpt_options)
        self.config.update(self._moe)

    def moe_layers(self) -> list[MoEFeedForward]:
        return [layer.ff for layer in self.layers]

    def aux_losses(self) -> float:
        """sum over layers of aux_loss_coef aux_loss + z_loss_coef z_loss, of the last forward."""
        return float(sum(m.aux_loss_coef * m.aux_loss + m.z_loss_coef * m.z_loss for m in self.moe_layers()))
