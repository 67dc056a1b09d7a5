"""Building blocks, NumPy track: each layer's forward and backward side by side.

Shapes: `N` is any number of leading dimensions, e.g. `(B, T)`.
"""

from __future__ import annotations

import numpy as np

from .module import Module, Parameter, as_rng, check_dtype, check_input

__all__ = ["Linear"]


class Linear(Module):
    """y = x W^T + b, with W of shape (out_features, in_features) as in torch.

    Initialization matches torch's default: W and b uniform in +-1/sqrt(in_features).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rng=None, dtype=np.float32):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear: features must be positive, got in={in_features}, out={out_features}")
        self.in_features, self.out_features = in_features, out_features
        dt, g = check_dtype(dtype), as_rng(rng)
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Parameter(g.uniform(-bound, bound, (out_features, in_features)).astype(dt))
        self.bias = Parameter(g.uniform(-bound, bound, out_features).astype(dt)) if bias else None

    def forward(self, x: np.ndarray) -> np.ndarray:
        check_input("Linear", x, last_dim=self.in_features, dtype=self.weight.dtype)
        x2 = x.reshape(-1, self.in_features)  # (N, in): one 2-D matmul, whatever the leading dims
        y2 = x2 @ self.weight.data.T  # (N, out)
        if self.bias is not None:
            y2 += self.bias.data
        self._cache = (x2, x.shape)
        return y2.reshape(*x.shape[:-1], self.out_features)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        x2, x_shape = self._saved()
        g2 = grad_out.reshape(-1, self.out_features)  # (N, out)
        self.weight.grad += g2.T @ x2  # (out, in)
        if self.bias is not None:
            self.bias.grad += g2.sum(axis=0)  # (out,)
        return (g2 @ self.weight.data).reshape(x_shape)  # (N, in) -> x's shape

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
