"""Building blocks, NumPy track: each layer's forward and backward side by side.

Shapes: `N` is any number of leading dimensions, e.g. `(B, T)`.
"""

from __future__ import annotations

import math

import numpy as np

from tfm_common.validate import check_padding_idx, check_probability, check_sizes
from tfm_common.validate import normalized_shape as normalized_shape_of

from .functional import erf, gelu_float32
from .module import Module, Parameter, as_rng, check_dtype, check_indices, check_input

__all__ = ["Linear", "Embedding", "ReLU", "GELU", "Dropout", "LayerNorm"]


class Linear(Module):
    """y = x W^T + b, with W of shape (out_features, in_features) as in torch.

    Initialization matches torch's default: W and b uniform in +-1/sqrt(in_features).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rng=None, dtype=np.float32):
        super().__init__()
        in_features, out_features = check_sizes("Linear", in_features=in_features, out_features=out_features).values()
        self.in_features, self.out_features = in_features, out_features
        dt, rng = check_dtype(dtype), as_rng(rng)
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)).astype(dt))
        self.bias = Parameter(rng.uniform(-bound, bound, out_features).astype(dt)) if bias else None

    def _check_forward(self, x) -> None:
        check_input("Linear", x, last_dim=self.in_features, dtype=self.weight.dtype)

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.in_features)  # (N, in): one 2-D matmul, whatever the leading dims
        y2 = x2 @ self.weight.data.T  # (N, out)
        if self.bias is not None:
            y2 += self.bias.data
        self._cache = (x2, x.shape)
        return y2.reshape(*x.shape[:-1], self.out_features)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        x2, x_shape = self._saved()
        grad2 = grad_out.reshape(-1, self.out_features)  # (N, out)
        self.weight.grad += grad2.T @ x2  # (out, in)
        if self.bias is not None:
            self.bias.grad += grad2.sum(axis=0)  # (out,)
        return (grad2 @ self.weight.data).reshape(x_shape)  # (N, in) -> x's shape

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table: row `i` of `weight` (num_embeddings, embedding_dim) is the vector of token `i`.

    Mathematically `onehot(ids) @ weight`, but building the (N, num_embeddings) one-hot matrix
    would waste memory and FLOPs: the forward is plain indexing and the backward scatters rows.
    Initialization as torch: N(0, 1). Row `padding_idx` (if given) starts at zero and never
    receives a gradient, so it stays zero during training.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *, rng=None, dtype=np.float32
    ):
        super().__init__()
        sizes = check_sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        num_embeddings, embedding_dim = sizes.values()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx("Embedding", padding_idx, num_embeddings)
        dt, rng = check_dtype(dtype), as_rng(rng)
        w = rng.standard_normal((num_embeddings, embedding_dim)).astype(dt)
        if self.padding_idx is not None:
            w[self.padding_idx] = 0
        self.weight = Parameter(w)

    def _check_forward(self, ids) -> None:
        check_indices("Embedding: ids", ids, self.num_embeddings)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        self._cache = ids
        return self.weight.data[ids]  # (*ids.shape, D): one row gathered per id

    def backward(self, grad_out: np.ndarray) -> None:
        flat_ids = self._saved().reshape(-1)  # (N,)
        grad2 = grad_out.reshape(-1, self.embedding_dim)  # (N, D)
        if self.padding_idx is not None:
            keep = flat_ids != self.padding_idx
            flat_ids, grad2 = flat_ids[keep], grad2[keep]
        # dW[i] = sum of grad rows whose id is i. `W.grad[ids] += grad2` would be wrong: with a
        # repeated id, fancy-index assignment keeps only one of the rows. np.add.at accumulates all.
        np.add.at(self.weight.grad, flat_ids, grad2)
        return None  # integer ids have no gradient

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


class ReLU(Module):
    """y = max(x, 0); dy/dx = 1 where x > 0, else 0 (0 at x = 0 exactly, as torch)."""

    _kept_inputs = ()  # backward needs only the mask it computes: no copy of x

    def _check_forward(self, x) -> None:
        check_input("ReLU", x)

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._cache = x > 0  # (N...) bool: where the gradient flows
        return np.maximum(x, 0)  # the Python 0 does not change x's dtype

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        # grad * mask (bool -> 0 or 1, grad's dtype), not np.where(mask, grad, 0): a branch on each element of a
        # random-looking mask is mispredicted about half the time
        return grad_out * self._saved()


class GELU(Module):
    """y = x Phi(x), Phi the standard normal CDF: Phi(x) = (1 + erf(x / sqrt 2)) / 2.

    approximate="tanh" uses Phi(x) ~ (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2 (the GPT-2 / BERT form).
      exact:  dy/dx = Phi(x) + x phi(x),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
      tanh:   with u = sqrt(2/pi) (x + 0.044715 x^3), t = tanh u:
              dy/dx = (1 + t) / 2 + x (1 - t^2) / 2 * sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    """

    _kept_inputs = ()  # backward needs only dy/dx, computed in forward: no copy of x

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def _check_forward(self, x) -> None:
        check_input("GELU", x)

    def forward(self, x: np.ndarray) -> np.ndarray:
        if self.approximate == "none" and x.dtype == np.float32:
            # the same two lines as below, a block of numbers at a time, with a fast float32 Phi (functional.py)
            y, dydx = gelu_float32(x)
        else:
            if self.approximate == "none":  # Phi(x) and phi(x) = Phi'(x), to float64 accuracy
                cdf = 0.5 * (1 + erf(x * (1 / math.sqrt(2))))
                dcdf = np.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
            else:
                c = math.sqrt(2 / math.pi)
                t = np.tanh(c * (x + 0.044715 * x**3))
                cdf = 0.5 * (1 + t)
                dcdf = 0.5 * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
            y, dydx = x * cdf, cdf + x * dcdf  # dy/dx by the product rule on x * cdf(x), ready for the backward
        self._cache = (dydx,)  # one array kept, not three (x, cdf, dcdf)
        return y

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        (dydx,) = self._saved()
        return grad_out * dydx

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Dropout(Module):
    """Inverted dropout: in training, zero each entry with probability p and scale the rest by 1/(1-p),
    so E[y] = x and nothing needs rescaling at evaluation, where dropout is the identity.

    `rng` (a numpy Generator or seed) draws the masks. After a training forward, `mask` holds the
    boolean keep-mask that was used; `forward(x, mask=...)` applies a given keep-mask instead of
    drawing one (to run two tracks, or a gradient check, with the same mask).
    """

    _kept_inputs = ("mask",)  # x is not kept (scale is computed), and eval mode returns x itself

    def __init__(self, p: float = 0.5, *, rng=None):
        super().__init__()
        self.p = check_probability("Dropout", "p", p, allow_one=False)
        self.rng = as_rng(rng)
        self.mask: np.ndarray | None = None

    def _check_forward(self, x, mask=None) -> None:
        check_input("Dropout", x)
        ok = isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == x.shape
        if mask is not None and self.training and not ok:  # in eval mode the mask is not used
            got = f"{mask.dtype} array of shape {mask.shape}" if isinstance(mask, np.ndarray) else type(mask).__name__
            raise ValueError(f"Dropout: mask expected a bool array of shape {x.shape}, got {got}")

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        if not self.training or (self.p == 0 and mask is None):
            self._cache = (None,)  # the identity
            return x
        if mask is None:
            mask = self.rng.random(x.shape) >= self.p  # keep with probability 1 - p (float64 draw: dtype-free)
        self.mask = mask
        scale = mask * x.dtype.type(1 / (1 - self.p))  # (N...) in x's dtype: 0 or 1/(1-p)
        self._cache = (scale,)
        return x * scale

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        (scale,) = self._saved()
        return grad_out if scale is None else grad_out * scale  # the same mask and scale as forward

    def extra_repr(self) -> str:
        return f"p={self.p}"


def norm_scaled(x: np.ndarray, axes) -> tuple[np.ndarray, np.ndarray | np.floating]:
    """(x / c, c), what LayerNorm and RMSNorm square: c (N..., 1...) is max|x| in a normalized group so large that its
    squares could overflow (max|x| above finfo.max^(1/4): 2^32 in float32, 2^256 in float64; a float32 x of 1e30
    squares to inf), 1 in the others. When no group is that large (any ordinary input: one test of x's extremes),
    returns x itself and c = 1: the norms then compute the plain formula's numbers, bit for bit."""
    big = np.finfo(x.dtype).max ** 0.25
    if x.size == 0 or max(x.max(), -x.min()) <= big:  # (a NaN fails the test: the groups' scales sort it out)
        return x, x.dtype.type(1)
    c = np.maximum(x.max(axis=axes, keepdims=True), -x.min(axis=axes, keepdims=True))  # max|x| per group
    c = np.where(c > big, c, 1).astype(x.dtype)
    return x / c, c


class LayerNorm(Module):
    """Normalize over the last len(normalized_shape) dims, then scale and shift (exactly torch.nn.LayerNorm):
        mu = mean(x), var = mean((x - mu)^2)  (biased: divide by n, not n - 1)
        xhat = (x - mu) / sqrt(var + eps)     (eps inside the square root)
        y = xhat * weight + bias              weight = 1, bias = 0 at initialization

    Backward, per normalized group of n values, with g = dL/dy and rstd = 1/sqrt(var + eps):
        dL/dweight = sum over groups of g * xhat,   dL/dbias = sum over groups of g
        dxhat = g * weight
        dL/dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    The last line comes from d xhat_i / d x_j = rstd (delta_ij - 1/n - xhat_i xhat_j / n): the mean
    term removes the component along (1, ..., 1), the xhat term the component along xhat (both
    directions that the normalization cannot change).

    A group so large that its squares would overflow (float32 |x| above 2^32) is divided by c = max|x| first and
    its statistics taken of x / c (`norm_scaled`): rstd = 1 / (c sqrt(var(x/c) + eps / c^2)). Every other group is
    computed as written above, bit for bit.
    """

    _kept_inputs = ()  # backward needs xhat and rstd, computed here: no copy of x

    def __init__(self, normalized_shape, eps: float = 1e-5, *, dtype=np.float32):
        super().__init__()
        shape = normalized_shape_of("LayerNorm", normalized_shape)
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be > 0, got {eps}")
        self.normalized_shape, self.eps = tuple(int(n) for n in shape), float(eps)
        dt = check_dtype(dtype)
        self.weight = Parameter(np.ones(self.normalized_shape, dtype=dt))
        self.bias = Parameter(np.zeros(self.normalized_shape, dtype=dt))

    def _check_forward(self, x) -> None:
        k = len(self.normalized_shape)
        check_input("LayerNorm", x, ndim_min=k, dtype=self.weight.dtype)
        if x.shape[-k:] != self.normalized_shape:
            raise ValueError(f"LayerNorm: expected trailing shape {self.normalized_shape}, got shape {x.shape}")

    def forward(self, x: np.ndarray) -> np.ndarray:
        axes = tuple(range(-len(self.normalized_shape), 0))
        u, c = norm_scaled(x, axes)  # x / c: c = max|x| where x's squares would overflow, else 1 (u is x)
        mu = u.mean(axis=axes, keepdims=True)  # (N..., 1...)
        xc = u - mu
        var = np.square(xc).mean(axis=axes, keepdims=True)  # biased variance (of x / c)
        rstd = 1 / np.sqrt(var + self.eps / c / c)  # (N..., 1...): 1 / sqrt(var(x) + eps), times c
        xhat = xc
        xhat *= rstd  # (N..., *normalized_shape), in place of xc (no longer needed)
        self._cache = (xhat, rstd / c, axes)  # the backward's rstd: 1 / sqrt(var(x) + eps)
        y = xhat * self.weight.data
        y += self.bias.data
        return y

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        xhat, rstd, axes = self._saved()
        lead = tuple(range(xhat.ndim - len(axes)))  # the batch dims, summed for the parameters
        self.weight.grad += (grad_out * xhat).sum(axis=lead)
        self.bias.grad += grad_out.sum(axis=lead)
        dxhat = grad_out * self.weight.data
        proj = xhat * (dxhat * xhat).mean(axis=axes, keepdims=True)
        proj += dxhat.mean(axis=axes, keepdims=True)  # mean(dxhat) + xhat * mean(dxhat * xhat)
        dx = np.subtract(dxhat, proj, out=proj)  # in place: no new array of x's size from here on
        dx *= rstd
        return dx

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
