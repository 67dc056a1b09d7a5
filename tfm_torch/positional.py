"""Positional encodings, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.positional."""

from __future__ import annotations

import torch
from torch import nn

from tfm_common.validate import check_positions, check_sizes

from .layers import Dropout
from .module import Module, as_generator, check_dtype, check_input

__all__ = ["sinusoidal_positional_encoding", "PositionalEncoding", "LearnedPositionalEmbedding"]


def sinusoidal_positional_encoding(max_len: int, d_model: int, dtype=None) -> torch.Tensor:
    """(max_len, d_model): PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...). Float64, then cast."""
    max_len, d_model = check_sizes("sinusoidal_positional_encoding", max_len=max_len, d_model=d_model).values()
    if d_model % 2:
        raise ValueError(
            f"sinusoidal_positional_encoding: need an even d_model (sin, cos pairs), got d_model={d_model}"
        )
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model / 2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (max_len, d_model / 2)
    pe = torch.empty(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.to(check_dtype(dtype))


class PositionalEncoding(Module):
    """x + PE[offset : offset + T], then dropout. The table is a non-persistent buffer: no state_dict key."""

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0, *, rng=None, dtype=None):
        super().__init__()
        self.d_model, self.max_len = d_model, max_len
        pe = sinusoidal_positional_encoding(max_len, d_model, dtype=check_dtype(dtype))
        self.register_buffer("pe", pe, persistent=False)  # moves with .to()/.double(), not saved
        self.dropout = Dropout(dropout, rng=as_generator(rng))

    def _check_forward(self, x, offset: int = 0) -> None:
        check_input("PositionalEncoding", x, ndim_min=2, last_dim=self.d_model, dtype=self.pe.dtype)
        check_positions("PositionalEncoding", x.shape[-2], offset, self.max_len)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return self.dropout(x + self.pe[offset : offset + x.shape[-2]])  # (..., T, d) + (T, d)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class LearnedPositionalEmbedding(Module):
    """x + W[offset : offset + T] with a trained table `weight` (max_len, d_model), initialized N(0, 1)."""

    def __init__(self, max_len: int, d_model: int, *, rng=None, dtype=None):
        super().__init__()
        max_len, d_model = check_sizes("LearnedPositionalEmbedding", max_len=max_len, d_model=d_model).values()
        self.max_len, self.d_model = max_len, d_model
        w = torch.empty(max_len, d_model, dtype=check_dtype(dtype)).normal_(generator=as_generator(rng))
        self.weight = nn.Parameter(w)

    def _check_forward(self, x, offset: int = 0) -> None:
        check_input("LearnedPositionalEmbedding", x, ndim_min=2, last_dim=self.d_model, dtype=self.weight.dtype)
        check_positions("LearnedPositionalEmbedding", x.shape[-2], offset, self.max_len)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x + self.weight[offset : offset + x.shape[-2]]  # (..., T, d) + (T, d)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"
