"""Helpers shared by the torch track: explicit generators and input checks.

The torch twin of `tfm_numpy.module`: modules here are plain `torch.nn.Module`s, so the
contract (named_parameters, state_dict, train/eval, zero_grad) is torch's own.
"""

from __future__ import annotations

import torch


def as_generator(rng: torch.Generator | int | None) -> torch.Generator:
    """A `torch.Generator` from a generator, a seed, or None (seed 0: never hidden global state)."""
    if isinstance(rng, torch.Generator):
        return rng
    if rng is None or isinstance(rng, int):
        return torch.Generator().manual_seed(0 if rng is None else rng)
    raise TypeError(f"rng: expected a torch.Generator, an int seed or None, got {type(rng).__name__}")


def check_dtype(dtype) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    return dtype


def check_input(name: str, x, ndim_min: int = 1, last_dim: int | None = None, dtype=None) -> torch.Tensor:
    """Validate a floating input at a public boundary; the message names the layer and what was expected."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: expected a float32 or float64 tensor, got dtype {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the parameters' dtype), got {x.dtype}")
    if x.dim() < ndim_min:
        raise ValueError(f"{name}: expected at least {ndim_min} dimension(s), got shape {tuple(x.shape)}")
    if last_dim is not None and x.shape[-1] != last_dim:
        raise ValueError(f"{name}: expected last dimension {last_dim}, got shape {tuple(x.shape)}")
    return x
