"""The position-wise feed-forward sublayer, NumPy track: two matmuls with an activation between them.

Shapes: `(B, T, d_model)` in and out (any leading dims: every position is transformed alone, by the same
weights, which is what "position-wise" means).
"""

from __future__ import annotations

import numpy as np

from tfm_common.config import FF_ACTIVATIONS as ACTIVATIONS
from tfm_common.validate import check_choice, check_sizes

from .layers import GELU, Dropout, Linear, ReLU
from .module import Module, as_rng, check_dtype

__all__ = ["ACTIVATIONS", "PositionwiseFeedForward"]


class PositionwiseFeedForward(Module):
    """FFN(x) = linear2(dropout(activation(linear1(x)))), "Attention Is All You Need" eq. (2):

        FFN(x) = max(0, x W1 + b1) W2 + b2,   W1: d_model -> d_ff,  W2: d_ff -> d_model  (d_ff = 4 d_model there)

    The dropout sits on the hidden activations, as in torch.nn.TransformerEncoderLayer (the layers' ff_dropout=False
    gives it p = 0, as some popular code does: see chapter 16a); the dropout on the
    sublayer's output belongs to the residual connection, so it lives in the encoder/decoder layer.
    Submodule names as torch's layers: `linear1`, `linear2` (state_dict keys `linear1.weight`, ...).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: str = "relu",
        *,
        rng=None,
        dtype=np.float32,
    ):
        super().__init__()
        d_model, d_ff = check_sizes("PositionwiseFeedForward", d_model=d_model, d_ff=d_ff).values()
        dt, rng = check_dtype(dtype), as_rng(rng)
        self.d_model, self.d_ff, self.activation_name = d_model, d_ff, activation
        self.linear1 = Linear(d_model, d_ff, rng=rng, dtype=dt)  # (d_ff, d_model)
        act = check_choice("PositionwiseFeedForward", "activation", activation, ACTIVATIONS)
        self.activation = ReLU() if act == "relu" else GELU()
        self.dropout = Dropout(dropout, rng=rng)  # on the d_ff hidden units
        self.linear2 = Linear(d_ff, d_model, rng=rng, dtype=dt)  # (d_model, d_ff)

    def _check_forward(self, x) -> None:
        self.linear1._check_forward(x)  # what linear1 checks of a caller's x

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = self.activation(self.linear1(x))  # (B, T, d_ff)
        return self.linear2(self.dropout(h))  # (B, T, d_model)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        dh = self.dropout.backward(self.linear2.backward(grad_out))  # (B, T, d_ff)
        return self.linear1.backward(self.activation.backward(dh))  # (B, T, d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation_name!r}"
