"""The position-wise feed-forward sublayer, PyTorch track: the same names, arguments and state_dict keys as
tfm_numpy.sublayers."""

from __future__ import annotations

import torch

from tfm_common.config import FF_ACTIVATIONS as ACTIVATIONS
from tfm_common.validate import check_choice, check_sizes

from .layers import GELU, Dropout, Linear, ReLU
from .module import Module, as_generator, check_dtype

__all__ = ["ACTIVATIONS", "PositionwiseFeedForward"]


class PositionwiseFeedForward(Module):
    """FFN(x) = linear2(dropout(activation(linear1(x)))): d_model -> d_ff -> d_model at every position alone."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        *,
        rng=None,
        dtype=None,
    ):
        super().__init__()
        d_model, d_ff = check_sizes("PositionwiseFeedForward", d_model=d_model, d_ff=d_ff).values()
        dt, gen = check_dtype(dtype), as_generator(rng)
        self.d_model, self.d_ff, self.activation_name = d_model, d_ff, activation
        self.linear1 = Linear(d_model, d_ff, rng=gen, dtype=dt)  # (d_ff, d_model)
        act = check_choice("PositionwiseFeedForward", "activation", activation, ACTIVATIONS)
        self.activation = ReLU() if act == "relu" else GELU()
        self.dropout = Dropout(dropout, rng=gen)  # on the d_ff hidden units
        self.linear2 = Linear(d_ff, d_model, rng=gen, dtype=dt)  # (d_model, d_ff)

    def _check_forward(self, x) -> None:
        self.linear1._check_forward(x)  # what linear1 checks of a caller's x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.linear1(x))  # (B, T, d_ff)
        return self.linear2(self.dropout(h))  # (B, T, d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation_name!r}"
