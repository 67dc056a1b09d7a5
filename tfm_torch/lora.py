"""LoRA (Hu et al., 2021), PyTorch track: the same names, arguments, refusals and state_dict keys as tfm_numpy.lora;
autograd does the backward. Frozen here is torch's `requires_grad=False`: `add_lora` sets it on every parameter
that is not an adapter's, so `model.backward()` computes no gradient for them and `lora_parameters(model)` (what the
optimizer gets) is the list of the parameters that still require one.

    y = base(x) + s * (x A^T) B^T,   s = alpha / rank,   A: (rank, in) random,   B: (out, rank) zero
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tfm_common.lora import (
    ADAPTER_KEYS,
    adapter_meta,
    base_fingerprint,
    check_adapters,
    check_lora_args,
    lora_scaling,
    match_targets,
    read_adapters,
    write_adapters,
)

from .layers import Linear
from .module import Module, as_generator, check_input

__all__ = ["LoRALinear", "add_lora", "lora_parameters", "lora_state_dict", "merge_lora", "save_adapters",
           "load_adapters"]  # fmt: skip


def _checked(base, rank, alpha) -> tuple[int, float]:
    """LoRALinear's arguments: base a Linear of this track, then rank and alpha (`tfm_common.lora.check_lora_args`)."""
    if not isinstance(base, Linear):
        raise TypeError(f"LoRALinear: base expected a tfm_torch Linear, got {type(base).__name__}")
    return check_lora_args("LoRALinear", base.in_features, base.out_features, rank, alpha)


class LoRALinear(Module):
    """A frozen `Linear` (`base`, its parameters set to requires_grad=False) plus s * x A^T B^T, s = alpha / rank;
    A uniform in +-1/sqrt(in_features), B zero. state_dict keys `lora_A`, `lora_B`, `base.weight`, `base.bias`."""

    def __init__(self, base: Linear, rank: int, alpha: float, *, rng=None):
        super().__init__()
        rank, alpha = _checked(base, rank, alpha)
        self.rank, self.alpha, self.scaling = rank, alpha, lora_scaling(rank, alpha)
        self.in_features, self.out_features = base.in_features, base.out_features
        dt, gen, bound = base.weight.dtype, as_generator(rng), 1.0 / math.sqrt(base.in_features)
        a = torch.empty(rank, base.in_features, dtype=dt).uniform_(-bound, bound, generator=gen)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dt))
        self.base = base.requires_grad_(False)

    def _check_forward(self, x) -> None:
        check_input("LoRALinear", x, last_dim=self.in_features, dtype=self.lora_A.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)

    @torch.no_grad()
    def merge(self) -> Linear:
        """A plain Linear computing what this layer computes: W + s * B A, the same bias (copies)."""
        merged = Linear(self.in_features, self.out_features, self.base.bias is not None, dtype=self.lora_A.dtype)
        merged.weight.copy_(self.base.weight + self.scaling * (self.lora_B @ self.lora_A))
        if self.base.bias is not None:
            merged.bias.copy_(self.base.bias)
        return merged

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"
        )


def _check_model(owner: str, model) -> None:
    if not isinstance(model, Module):
        raise TypeError(f"{owner}: model expected a tfm_torch Module, got {type(model).__name__}")


def _candidates(model: nn.Module) -> list[tuple[str, str]]:
    """(name, class name) of every module outside a LoRALinear (a LoRALinear itself is listed, not its base)."""
    inside = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    return [(n, type(m).__name__) for n, m in model.named_modules()
            if not any(n.startswith(f"{i}.") for i in inside)]  # fmt: skip


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)  # an existing name: torch keeps its place


def _adapters(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def _targets_of(model, rank, alpha, targets) -> tuple[list[str], dict]:
    """add_lora's checks: the model, the layers `targets` picks, rank and alpha for each; (names, modules by name)."""
    _check_model("add_lora", model)
    names = match_targets("add_lora", _candidates(model), targets)
    layers = dict(model.named_modules())
    for n in names:
        check_lora_args(f"add_lora ({n})", layers[n].in_features, layers[n].out_features, rank, alpha)
    return names, layers


def add_lora(model: nn.Module, rank: int, alpha: float, targets, *, rng=None) -> list[str]:
    """Wrap every Linear that `targets` picks in a `LoRALinear(rank, alpha)`, in place, and freeze every other
    parameter (requires_grad=False); returns the adapted names. Everything is checked before anything changes."""
    names, layers = _targets_of(model, rank, alpha, targets)  # every check, before any change
    gen = as_generator(rng)
    for n in names:
        _replace(model, n, LoRALinear(layers[n], rank, alpha, rng=gen))
    adapters = {id(p) for p in lora_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters)
    return names


def lora_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The adapters' parameters (A, B of each LoRALinear, in model order): what an optimizer gets."""
    _check_model("lora_parameters", model)
    return [getattr(m, k) for _, m in _adapters(model) for k in ADAPTER_KEYS]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the adapters only, under their state_dict names (`<layer>.lora_A`, `<layer>.lora_B`)."""
    _check_model("lora_state_dict", model)
    return {f"{n}.{k}": getattr(m, k).detach().clone() for n, m in _adapters(model) for k in ADAPTER_KEYS}


def merge_lora(model: nn.Module) -> list[str]:
    """Replace every LoRALinear by its `merge()`, in place; returns the merged names. The merged layers are
    trainable again (requires_grad=True, a fresh Linear's); the rest stays as it was."""
    _check_model("merge_lora", model)
    adapters = _adapters(model)
    for n, m in adapters:
        _replace(model, n, m.merge())
    return [n for n, _ in adapters]


def _numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def save_adapters(model: nn.Module, path) -> None:
    """Write only the adapters (rank, alpha, the adapted names, the base model's fingerprint with them) to `path`
    (.npz; tfm_numpy reads it too)."""
    _check_model("save_adapters", model)
    adapters = _adapters(model)
    if not adapters:
        raise ValueError("save_adapters: the model has no LoRA adapters (add_lora first)")
    names, kinds = [n for n, _ in adapters], {(m.rank, m.alpha) for _, m in adapters}
    if len(kinds) != 1:
        raise ValueError(f"save_adapters: the adapters have different (rank, alpha) {sorted(kinds)}: one per file")
    (rank, alpha) = kinds.pop()
    meta = adapter_meta(rank, alpha, names, names, base_fingerprint(_numpy_state(model)))
    write_adapters(path, meta, {k: v.cpu().numpy() for k, v in lora_state_dict(model).items()})


def load_adapters(model: nn.Module, path, *, rng=None) -> list[str]:
    """Add the adapters saved in `path` to `model`, a base model without adapters (the one they were trained on:
    another base is refused by its fingerprint); returns the adapted names. A refused load changes nothing."""
    _check_model("load_adapters", model)
    meta, arrays = read_adapters("load_adapters", path)
    names = match_targets("load_adapters", _candidates(model), meta["targets"])
    layers = dict(model.named_modules())
    shapes = {n: (layers[n].in_features, layers[n].out_features) for n in names}
    check_adapters("load_adapters", meta, arrays, names, base_fingerprint(_numpy_state(model)), shapes)
    add_lora(model, meta["rank"], meta["alpha"], meta["targets"], rng=rng)
    with torch.no_grad():
        for n, m in _adapters(model):
            for k in ADAPTER_KEYS:
                getattr(m, k).copy_(torch.from_numpy(arrays[f"{n}.{k}"]))
    return names
