"""LoRA (Hu et al., 2021), NumPy track: a frozen Linear plus a trainable low-rank door, its backward by hand, the
merge back into one Linear, and the model-level calls (add the adapters, list them, save and load only them).

    y = base(x) + s * (x A^T) B^T,   s = alpha / rank,   A: (rank, in) random,   B: (out, rank) zero

The rules (checks, which layers a target picks, the adapter file) are `tfm_common.lora`, shared with tfm_torch.

Frozen, in this track: NumPy has no `requires_grad`. `LoRALinear.backward` never adds into its base's `.grad` (the
frozen weight gets no gradient at all), and `lora_parameters(model)` is the list an optimizer is given: the other
layers of the model still receive gradients from `model.backward` (they are on the path to the adapters below
them), but no optimizer holds them, so they never change and cost no optimizer memory.
"""

from __future__ import annotations

import numpy as np

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
from .module import Module, Parameter, as_rng, check_input

__all__ = ["LoRALinear", "add_lora", "lora_parameters", "lora_state_dict", "merge_lora", "save_adapters",
           "load_adapters"]  # fmt: skip


def _checked(base, rank, alpha) -> tuple[int, float]:
    """LoRALinear's arguments: base a Linear of this track, then rank and alpha (`tfm_common.lora.check_lora_args`)."""
    if not isinstance(base, Linear):
        raise TypeError(f"LoRALinear: base expected a tfm_numpy Linear, got {type(base).__name__}")
    return check_lora_args("LoRALinear", base.in_features, base.out_features, rank, alpha)


class LoRALinear(Module):
    """A frozen `Linear` (`base`) plus the low-rank update s * x A^T B^T, s = alpha / rank. A is drawn uniform in
    +-1/sqrt(in_features) (torch's Linear default, as peft draws it), B is zero: the adapted layer starts as the
    base. state_dict keys: `lora_A`, `lora_B`, `base.weight`, `base.bias` (the same in tfm_torch)."""

    def __init__(self, base: Linear, rank: int, alpha: float, *, rng=None):
        super().__init__()
        rank, alpha = _checked(base, rank, alpha)
        self.rank, self.alpha, self.scaling = rank, alpha, lora_scaling(rank, alpha)
        self.in_features, self.out_features = base.in_features, base.out_features
        dt, rng, bound = base.weight.dtype, as_rng(rng), 1.0 / np.sqrt(base.in_features)
        self.lora_A = Parameter(rng.uniform(-bound, bound, (rank, base.in_features)).astype(dt))
        self.lora_B = Parameter(np.zeros((base.out_features, rank), dtype=dt))
        self.base = base

    def _check_forward(self, x) -> None:
        check_input("LoRALinear", x, last_dim=self.in_features, dtype=self.lora_A.dtype)

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.in_features)  # (N, in)
        h = x2 @ self.lora_A.data.T  # (N, r): down through the door
        y2 = self.base.forward(x2) + self.scaling * (h @ self.lora_B.data.T)  # (N, out)
        self._cache = (x2, h, x.shape)
        return y2.reshape(*x.shape[:-1], self.out_features)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        x2, h, x_shape = self._saved()
        g = grad_out.reshape(-1, self.out_features)  # (N, out)
        self.lora_B.grad += self.scaling * (g.T @ h)  # (out, r)
        gh = self.scaling * (g @ self.lora_B.data)  # (N, r): the gradient at h
        self.lora_A.grad += gh.T @ x2  # (r, in)
        dx = g @ self.base.weight.data + gh @ self.lora_A.data  # (N, in); no gradient for the frozen base
        return dx.reshape(x_shape)

    def merge(self) -> Linear:
        """A plain Linear computing what this layer computes: W + s * B A, the same bias (copies)."""
        merged = Linear(self.in_features, self.out_features, self.base.bias is not None, dtype=self.lora_A.dtype)
        merged.weight.data[...] = self.base.weight.data + self.scaling * (self.lora_B.data @ self.lora_A.data)
        if self.base.bias is not None:
            merged.bias.data[...] = self.base.bias.data
        return merged

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"
        )


def _check_model(owner: str, model) -> None:
    if not isinstance(model, Module):
        raise TypeError(f"{owner}: model expected a tfm_numpy Module, got {type(model).__name__}")


def _candidates(model: Module) -> list[tuple[str, str]]:
    """(name, class name) of every module outside a LoRALinear (a LoRALinear itself is listed, not its base)."""
    inside = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    return [(n, type(m).__name__) for n, m in model.named_modules()
            if not any(n.startswith(f"{i}.") for i in inside)]  # fmt: skip


def _replace(model: Module, name: str, new: Module) -> None:
    """Put `new` where module `name` was, keeping its place in its parent's order (the parameters' order, as
    torch's assignment to an existing name keeps it)."""
    parent_name, _, child = name.rpartition(".")
    parent = dict(model.named_modules())[parent_name]
    parent._modules[child] = new  # an existing key: its position stays
    object.__setattr__(parent, child, new)


def _targets_of(model, rank, alpha, targets) -> tuple[list[str], dict]:
    """add_lora's checks: the model, the layers `targets` picks, rank and alpha for each; (names, modules by name)."""
    _check_model("add_lora", model)
    names = match_targets("add_lora", _candidates(model), targets)
    layers = dict(model.named_modules())
    for n in names:
        check_lora_args(f"add_lora ({n})", layers[n].in_features, layers[n].out_features, rank, alpha)
    return names, layers


def add_lora(model: Module, rank: int, alpha: float, targets, *, rng=None) -> list[str]:
    """Wrap every Linear that `targets` picks (patterns on the dotted names, or their last part: "q_proj",
    "layers.*.ff.linear1") in a `LoRALinear(rank, alpha)`, in place; returns the adapted names. Everything is
    checked before anything changes. Train with `Adam(lora_parameters(model))`: the rest stays frozen."""
    names, layers = _targets_of(model, rank, alpha, targets)  # every check, before any change
    rng = as_rng(rng)
    for n in names:
        _replace(model, n, LoRALinear(layers[n], rank, alpha, rng=rng))
    return names


def _adapters(model: Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def lora_parameters(model: Module) -> list[Parameter]:
    """The adapters' parameters (A, B of each LoRALinear, in model order): what an optimizer gets."""
    _check_model("lora_parameters", model)
    return [getattr(m, k) for _, m in _adapters(model) for k in ADAPTER_KEYS]


def lora_state_dict(model: Module) -> dict[str, np.ndarray]:
    """Copies of the adapters only, under their state_dict names (`<layer>.lora_A`, `<layer>.lora_B`)."""
    _check_model("lora_state_dict", model)
    return {f"{n}.{k}": getattr(m, k).data.copy() for n, m in _adapters(model) for k in ADAPTER_KEYS}


def merge_lora(model: Module) -> list[str]:
    """Replace every LoRALinear by its `merge()`, in place (a plain model again, no slower than the base);
    returns the merged names."""
    _check_model("merge_lora", model)
    adapters = _adapters(model)
    for n, m in adapters:
        _replace(model, n, m.merge())
    return [n for n, _ in adapters]


def save_adapters(model: Module, path) -> None:
    """Write only the adapters (and what loading them needs: rank, alpha, the adapted names, the base model's
    fingerprint) to `path` (.npz; tfm_torch reads it too)."""
    _check_model("save_adapters", model)
    adapters = _adapters(model)
    if not adapters:
        raise ValueError("save_adapters: the model has no LoRA adapters (add_lora first)")
    names, kinds = [n for n, _ in adapters], {(m.rank, m.alpha) for _, m in adapters}
    if len(kinds) != 1:
        raise ValueError(f"save_adapters: the adapters have different (rank, alpha) {sorted(kinds)}: one per file")
    (rank, alpha) = kinds.pop()
    meta = adapter_meta(rank, alpha, names, names, base_fingerprint(model.state_dict()))
    write_adapters(path, meta, lora_state_dict(model))


def load_adapters(model: Module, path, *, rng=None) -> list[str]:
    """Add the adapters saved in `path` to `model`, a base model without adapters (the one they were trained on:
    another base is refused by its fingerprint); returns the adapted names. A refused load changes nothing."""
    _check_model("load_adapters", model)
    meta, arrays = read_adapters("load_adapters", path)
    names = match_targets("load_adapters", _candidates(model), meta["targets"])
    layers = dict(model.named_modules())
    shapes = {n: (layers[n].in_features, layers[n].out_features) for n in names}
    check_adapters("load_adapters", meta, arrays, names, base_fingerprint(model.state_dict()), shapes)
    add_lora(model, meta["rank"], meta["alpha"], meta["targets"], rng=rng)
    for n, m in _adapters(model):
        for k in ADAPTER_KEYS:
            getattr(m, k).data[...] = arrays[f"{n}.{k}"].astype(getattr(m, k).dtype, copy=False)
    return names
