"""Building blocks, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .module import as_generator, check_dtype, check_input

__all__ = ["Linear"]


class Linear(nn.Module):
    """y = x W^T + b; initialization as torch's default, drawn from an explicit generator."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rng=None, dtype=None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear: features must be positive, got in={in_features}, out={out_features}")
        self.in_features, self.out_features = in_features, out_features
        dt, g = check_dtype(dtype), as_generator(rng)
        bound = 1.0 / math.sqrt(in_features)
        w = torch.empty(out_features, in_features, dtype=dt).uniform_(-bound, bound, generator=g)
        self.weight = nn.Parameter(w)
        b = torch.empty(out_features, dtype=dt).uniform_(-bound, bound, generator=g) if bias else None
        self.bias = nn.Parameter(b) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("Linear", x, last_dim=self.in_features, dtype=self.weight.dtype)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
