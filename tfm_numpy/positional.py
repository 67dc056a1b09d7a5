"""Positional encodings, NumPy track: the fixed sinusoidal table and a learned table, added to the embeddings.

Inputs are `(B, T, d_model)` (any leading dims, positions along the second-to-last axis).
"""

from __future__ import annotations

import numpy as np

from tfm_common.validate import check_positions, check_sizes

from .layers import Dropout
from .module import Module, Parameter, as_rng, check_dtype, check_input

__all__ = ["sinusoidal_positional_encoding", "PositionalEncoding", "LearnedPositionalEmbedding"]


def sinusoidal_positional_encoding(max_len: int, d_model: int, dtype=np.float32) -> np.ndarray:
    """The table of "Attention Is All You Need", (max_len, d_model):

        PE[pos, 2i] = sin(pos / 10000^(2i / d_model)),   PE[pos, 2i+1] = cos(pos / 10000^(2i / d_model)).

    Computed in float64, then cast. Each (sin, cos) pair has norm 1, so every row has norm sqrt(d_model / 2).
    d_model must be even: the columns come in (sin, cos) pairs.
    """
    max_len, d_model = check_sizes("sinusoidal_positional_encoding", max_len=max_len, d_model=d_model).values()
    if d_model % 2:
        raise ValueError(
            f"sinusoidal_positional_encoding: need an even d_model (sin, cos pairs), got d_model={d_model}"
        )
    pos = np.arange(max_len, dtype=np.float64)[:, None]  # (max_len, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (d_model / 2,): 0, 2, 4, ...
    angle = pos / np.power(10000.0, two_i / d_model)  # (max_len, d_model / 2)
    pe = np.empty((max_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe.astype(check_dtype(dtype))


class PositionalEncoding(Module):
    """x + PE[offset : offset + T], then dropout. No parameters: the table is a fixed buffer (no state_dict key).

    `offset` shifts the positions (decoding one token at a time with a cache).
    """

    _kept_inputs = ()  # only x's shape is cached

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0, *, rng=None, dtype=np.float32):
        super().__init__()
        self.d_model, self.max_len, self.dtype = d_model, max_len, check_dtype(dtype)
        self.pe = sinusoidal_positional_encoding(max_len, d_model, dtype=self.dtype)  # (max_len, d_model)
        self.dropout = Dropout(dropout, rng=as_rng(rng))

    def _check_forward(self, x, offset: int = 0) -> None:
        check_input("PositionalEncoding", x, ndim_min=2, last_dim=self.d_model, dtype=self.dtype)
        check_positions("PositionalEncoding", x.shape[-2], offset, self.max_len)

    def forward(self, x: np.ndarray, offset: int = 0) -> np.ndarray:
        if self.pe.dtype != self.dtype:  # astype() changed the module's dtype: rebuild the table exactly
            self.pe = sinusoidal_positional_encoding(self.max_len, self.d_model, dtype=self.dtype)
        self._cache = x.shape  # the sum's gradient is the identity: nothing to keep but the fact of a forward
        return self.dropout(x + self.pe[offset : offset + x.shape[-2]])  # (..., T, d) + (T, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        self._saved()  # after a forward
        return self.dropout.backward(grad_out)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class LearnedPositionalEmbedding(Module):
    """x + W[offset : offset + T] with a trained table W (max_len, d_model).

    Initialized N(0, 1) like `torch.nn.Embedding` (our Embedding too); the caller may rescale.
    """

    _kept_inputs = ()  # only x's shape is cached

    def __init__(self, max_len: int, d_model: int, *, rng=None, dtype=np.float32):
        super().__init__()
        max_len, d_model = check_sizes("LearnedPositionalEmbedding", max_len=max_len, d_model=d_model).values()
        self.max_len, self.d_model = max_len, d_model
        dt, rng = check_dtype(dtype), as_rng(rng)
        self.weight = Parameter(rng.standard_normal((max_len, d_model)).astype(dt))

    def _check_forward(self, x, offset: int = 0) -> None:
        check_input("LearnedPositionalEmbedding", x, ndim_min=2, last_dim=self.d_model, dtype=self.weight.dtype)
        check_positions("LearnedPositionalEmbedding", x.shape[-2], offset, self.max_len)

    def forward(self, x: np.ndarray, offset: int = 0) -> np.ndarray:
        T = x.shape[-2]
        self._cache = (T, offset)
        return x + self.weight.data[offset : offset + T]  # (..., T, d) + (T, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        T, offset = self._saved()
        # every sequence in the batch used the same rows: sum over all leading dims
        self.weight.grad[offset : offset + T] += grad_out.reshape(-1, T, self.d_model).sum(axis=0)
        return grad_out

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"
