"""Building blocks, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tfm_common.validate import check_padding_idx, check_probability, check_sizes
from tfm_common.validate import normalized_shape as normalized_shape_of

from .module import Module, as_generator, check_dtype, check_indices, check_input

__all__ = ["Linear", "Embedding", "ReLU", "GELU", "Dropout", "LayerNorm"]


class Linear(Module):
    """y = x W^T + b; initialization as torch's default, drawn from an explicit generator."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rng=None, dtype=None):
        super().__init__()
        in_features, out_features = check_sizes("Linear", in_features=in_features, out_features=out_features).values()
        self.in_features, self.out_features = in_features, out_features
        dt, gen = check_dtype(dtype), as_generator(rng)
        bound = 1.0 / math.sqrt(in_features)
        w = torch.empty(out_features, in_features, dtype=dt).uniform_(-bound, bound, generator=gen)
        self.weight = nn.Parameter(w)
        b = torch.empty(out_features, dtype=dt).uniform_(-bound, bound, generator=gen) if bias else None
        self.bias = nn.Parameter(b) if bias else None

    def _check_forward(self, x) -> None:
        check_input("Linear", x, last_dim=self.in_features, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table (num_embeddings, embedding_dim); row `padding_idx` starts at zero and gets no gradient.

    Initialization as torch.nn.Embedding: N(0, 1). F.embedding does the lookup and, given
    padding_idx, zeroes that row's gradient (plain `weight[ids]` indexing would not).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *, rng=None, dtype=None
    ):
        super().__init__()
        sizes = check_sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        num_embeddings, embedding_dim = sizes.values()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx("Embedding", padding_idx, num_embeddings)
        dt, gen = check_dtype(dtype), as_generator(rng)
        w = torch.empty(num_embeddings, embedding_dim, dtype=dt).normal_(generator=gen)
        if self.padding_idx is not None:
            w[self.padding_idx] = 0
        self.weight = nn.Parameter(w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = check_indices("Embedding: ids", ids, self.num_embeddings)  # int32 or int64, as F.embedding wants
        return F.embedding(ids, self.weight, self.padding_idx)  # (*ids.shape, D)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


class ReLU(Module):
    """y = max(x, 0)."""

    def _check_forward(self, x) -> None:
        check_input("ReLU", x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class GELU(Module):
    """y = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2; approximate="tanh" uses
    Phi(x) ~ (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2. Written out (not F.gelu) to mirror tfm_numpy."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def _check_forward(self, x) -> None:
        check_input("GELU", x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "none":
            return x * 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2))))
        return x * 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Dropout(Module):
    """Inverted dropout, as tfm_numpy.Dropout (`mask`, `forward(x, mask=...)`); `rng` a torch.Generator or seed,
    never the global generator. A NumPy mask is given as `torch.from_numpy(np_dropout.mask)`."""

    def __init__(self, p: float = 0.5, *, rng=None):
        super().__init__()
        self.p = check_probability("Dropout", "p", p, allow_one=False)
        self.rng = as_generator(rng)
        self.mask: torch.Tensor | None = None

    def _check_forward(self, x, mask=None) -> None:
        check_input("Dropout", x)
        ok = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == x.shape
        if mask is not None and self.training and not ok:  # in eval mode the mask is not used
            got = f"{mask.dtype} tensor of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask)
            raise ValueError(f"Dropout: mask expected a bool tensor of shape {tuple(x.shape)}, got {got}")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or (self.p == 0 and mask is None):
            return x
        if mask is None and torch.compiler.is_compiling():
            # torch.compile cannot trace a draw from a torch.Generator argument: the graph would break at every
            # dropout. Compiled, the mask comes from torch's global generator (torch.manual_seed), as
            # attn_impl="sdpa" draws its dropout: the same distribution, not the masks `rng` would give.
            mask = torch.rand(x.shape, dtype=torch.float64, device=x.device) >= self.p
        elif mask is None:
            u = torch.rand(x.shape, generator=self.rng, dtype=torch.float64, device=self.rng.device)
            mask = (u >= self.p).to(x.device)  # keep with probability 1 - p
        self.mask = mask
        return x * mask / (1 - self.p)  # autograd's backward multiplies by the same mask / (1 - p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def norm_scaled(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(x / c, c), what LayerNorm and RMSNorm square, as tfm_numpy's: c is max|x| in a group whose squares could
    overflow (above finfo.max^(1/4)), 1 elsewhere (a division by 1: ordinary groups give the plain formula's
    numbers, bit for bit). In eager mode on the CPU an input with no such group (one test of its extremes) comes
    back as it is, with c = 1.0; on a GPU or under torch.compile, where that test would wait for the device or break
    the graph, every group is divided by its c. c is detached: the result does not depend on it (up to rounding)."""
    big = torch.finfo(x.dtype).max ** 0.25
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        if x.numel() == 0 or max(float(x.detach().amax()), -float(x.detach().amin())) <= big:
            return x, 1.0
    s = x.detach().abs().amax(dim=dims, keepdim=True)
    c = torch.where(s > big, s, torch.ones_like(s))
    return x / c, c


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last len(normalized_shape) dims, biased variance.

    Written out (not F.layer_norm) to mirror tfm_numpy; the tests compare it with torch.nn.LayerNorm.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, *, dtype=None):
        super().__init__()
        shape = normalized_shape_of("LayerNorm", normalized_shape)
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be > 0, got {eps}")
        self.normalized_shape, self.eps = tuple(int(n) for n in shape), float(eps)
        dt = check_dtype(dtype)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, dtype=dt))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, dtype=dt))

    def _check_forward(self, x) -> None:
        k = len(self.normalized_shape)
        check_input("LayerNorm", x, ndim_min=k, dtype=self.weight.dtype)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise ValueError(f"LayerNorm: expected trailing shape {self.normalized_shape}, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        u, c = norm_scaled(x, dims)  # x / c: c = max|x| where x's squares would overflow, else 1
        mu = u.mean(dim=dims, keepdim=True)
        var = ((u - mu) ** 2).mean(dim=dims, keepdim=True)  # biased, like torch.nn.LayerNorm (of x / c)
        return (u - mu) * torch.rsqrt(var + self.eps / c / c) * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
