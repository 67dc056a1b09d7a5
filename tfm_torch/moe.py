"""Mixture of experts, PyTorch track (chapter 20c): the same names, arguments and state_dict keys as tfm_numpy.moe;
the routing decisions are tfm_common.moe's (made on the router's probabilities as NumPy numbers, so both tracks
choose the same experts), autograd does the backward."""

from __future__ import annotations

import numpy as np
import torch

from tfm_common.moe import (
    balance_fractions,
    check_capacity_factor,
    check_moe_args,
    expert_capacity,
    moe_gpt_parts,
    renormalizes,
)
from tfm_common.moe import route as route_tokens

from .gpt import GPT, GPTBlock
from .layers import Linear
from .module import Module, as_generator, check_dtype, check_input
from .sublayers import PositionwiseFeedForward

__all__ = ["MoEFeedForward", "MoEGPTBlock", "MoEGPT", "add_aux_loss"]


class _AddAuxLoss(torch.autograd.Function):
    """y unchanged in the forward; in the backward, y's gradient passes and `loss` receives dL/dloss = 1: the
    objective becomes L + loss without the caller adding it (DeepSeek-MoE's AddAuxiliaryLoss)."""

    @staticmethod
    def forward(ctx, y, loss):
        ctx.loss_needs_grad = loss.requires_grad
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, (torch.ones((), dtype=grad_y.dtype, device=grad_y.device) if ctx.loss_needs_grad else None)


def add_aux_loss(y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """y, whose backward also differentiates the scalar `loss` (as if it were added to the caller's loss)."""
    return _AddAuxLoss.apply(y, loss)


class MoEFeedForward(Module):
    """y_n = sum_j keep[n, j] g[n, j] FFN_{e(n, j)}(x_n) (twin of tfm_numpy's: see its docstring). After a forward:
    `routing`, `tokens_per_expert`, `dropped`, and `aux_loss`, `z_loss` as tensors of the graph; their gradients,
    times aux_loss_coef and z_loss_coef, are added in the backward (`add_aux_loss`), as tfm_numpy's backward adds
    them by hand."""

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
        dtype=None,
    ):
        super().__init__()
        c = check_moe_args("MoEFeedForward", d_model, d_ff, n_experts, top_k, capacity_factor, activation,
                           aux_loss_coef, z_loss_coef)  # fmt: skip
        dt, gen = check_dtype(dtype), as_generator(rng)
        self.d_model, self.d_ff, self.n_experts, self.top_k = c["d_model"], c["d_ff"], c["n_experts"], c["top_k"]
        self.capacity_factor, self.activation_name = c["capacity_factor"], c["activation"]
        self.aux_loss_coef, self.z_loss_coef = c["aux_loss_coef"], c["z_loss_coef"]
        self.router = Linear(d_model, n_experts, bias=False, rng=gen, dtype=dt)  # (E, d_model)
        ffs = (PositionwiseFeedForward(d_model, d_ff, dropout, activation, rng=gen, dtype=dt) for _ in range(n_experts))
        self.experts = torch.nn.ModuleList(ffs)
        self.routing = self.aux_loss = self.z_loss = None

    def _check_forward(self, x) -> None:
        check_input("MoEFeedForward", x, last_dim=self.d_model, dtype=self.router.weight.dtype)

    def set_capacity_factor(self, capacity_factor: float | None) -> None:
        """Change the capacity factor (None: unlimited) of later forwards; no weight changes."""
        self.capacity_factor = check_capacity_factor("MoEFeedForward", capacity_factor)

    # -- the pieces (expert parallelism calls them one by one) -----------------------------------------------------
    def route(self, x2: torch.Tensor):
        """(logits (N, E), probs (N, E), routing, gates (N, k)) of tokens x2 (N, d_model)."""
        logits = self.router(x2)  # (N, E)
        probs = torch.softmax(logits, dim=-1)
        capacity = expert_capacity(len(x2), self.n_experts, self.top_k, self.capacity_factor)
        routing = route_tokens(probs.detach().cpu().numpy(), self.top_k, capacity)  # the decisions: NumPy, shared
        picked = probs.gather(1, torch.as_tensor(routing.experts, device=probs.device))  # (N, k)
        gates = picked / picked.sum(dim=1, keepdim=True) if renormalizes(self.top_k) else picked
        return logits, probs, routing, gates

    def dispatch(self, x2: torch.Tensor, routing) -> list[torch.Tensor]:
        """[the rows of x2 that expert e serves, (n_e, d_model)] for each expert e."""
        return [x2[torch.as_tensor(tokens, device=x2.device)] for tokens, _ in routing.groups]

    def combine(self, outs: list[torch.Tensor], routing, gates: torch.Tensor) -> torch.Tensor:
        """y (N, d_model): each expert's outputs (n_e, d_model), times their gates, added into their tokens' rows."""
        y2 = gates.new_zeros((len(gates), self.d_model))
        for (tokens, slots), out in zip(routing.groups, outs, strict=True):
            t, s = (torch.as_tensor(a, device=gates.device) for a in (tokens, slots))
            y2 = y2.index_add(0, t, gates[t, s, None] * out)
        return y2

    def losses(self, logits: torch.Tensor, probs: torch.Tensor, routing) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_loss, z_loss) of one forward, tensors of the graph."""
        f = torch.as_tensor(balance_fractions(routing, self.n_experts), dtype=probs.dtype, device=probs.device)
        aux = self.n_experts * (f * probs.mean(dim=0)).sum()
        lse = torch.logsumexp(logits, dim=1)  # (N,)
        return aux, (lse * lse).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.d_model)  # (N, d): every token alone
        logits, probs, routing, gates = self.route(x2)
        outs = [expert(xe) for expert, xe in zip(self.experts, self.dispatch(x2, routing), strict=True)]
        y2 = self.combine(outs, routing, gates)  # (N, d)
        self.aux_loss, self.z_loss = self.losses(logits, probs, routing)
        self.routing = routing
        if torch.is_grad_enabled():  # the backward adds aux_loss_coef aux_loss + z_loss_coef z_loss to the objective
            y2 = add_aux_loss(y2, self.aux_loss_coef * self.aux_loss + self.z_loss_coef * self.z_loss)
        return y2.reshape(x.shape)

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
    """A GPTBlock whose `ff` is a MoEFeedForward (twin of tfm_numpy's)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, *, n_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001,
                 activation: str = "gelu", rng=None, dtype=None, **block):  # fmt: skip
        check_moe_args("MoEGPTBlock", d_model, d_ff, n_experts, top_k, capacity_factor, activation, aux_loss_coef,
                       z_loss_coef)  # fmt: skip
        dt, gen = check_dtype(dtype), as_generator(rng)
        super().__init__(d_model, n_heads, d_ff, dropout, activation=activation, rng=gen, dtype=dt, **block)
        del self.ff  # registered again, last: the submodules' order of tfm_numpy's twin
        self.ff = MoEFeedForward(d_model, d_ff, n_experts, top_k, capacity_factor=capacity_factor,
                                 activation=activation, dropout=dropout, aux_loss_coef=aux_loss_coef,
                                 z_loss_coef=z_loss_coef, rng=gen, dtype=dt)  # fmt: skip


class MoEGPT(GPT):
    """The GPT with a MoEFeedForward in every block (twin of tfm_numpy's: see its docstring). The training loss is the
    dense GPT's plus each layer's aux_loss_coef aux_loss + z_loss_coef z_loss, added in the backward."""

    def __new__(cls, *args, **kwargs):
        return torch.nn.Module.__new__(cls)  # not GPT's __new__: no windowed variant

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
        return float(sum(m.aux_loss_coef * float(m.aux_loss.detach()) + m.z_loss_coef * float(m.z_loss.detach())
                         for m in self.moe_layers()))  # fmt: skip
