"""LoRA (Hu et al., 2021), what is the same in both tracks: the checks of `LoRALinear` and `add_lora`, which layers
a target pattern picks, the fingerprint of a base model and the adapter file.

A LoRA layer keeps a Linear's weight W (out, in) frozen and learns a low-rank change of it,

    y = x W^T + b + (alpha / rank) * x A^T B^T        A: (rank, in), random;  B: (out, rank), zero

so at the start the adapted layer is the base layer, and only rank * (in + out) numbers per layer are trained.
The tracks (`tfm_numpy.lora`, `tfm_torch.lora`) hold the arithmetic; this module holds the rules, on NumPy arrays
and names only (it imports neither track).

The adapter file (`save_adapters` / `load_adapters` in either track) is one `.npz`: for each adapted layer its
`<name>.lora_A` and `<name>.lora_B`, and `__lora__`, a JSON string with the rank, alpha, the target patterns, the
adapted names and the fingerprint of the base model it was trained on; one file loads into either track.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable

import numpy as np

from .validate import check_real, check_size

__all__ = [
    "ADAPTER_KEYS",
    "check_lora_args",
    "lora_scaling",
    "check_targets",
    "match_targets",
    "base_name",
    "base_fingerprint",
    "adapter_meta",
    "write_adapters",
    "read_adapters",
    "check_adapters",
]

ADAPTER_KEYS = ("lora_A", "lora_B")  # the adapter's own parameters, in this order (state_dict keys <layer>.lora_A)
_META = "__lora__"
_FORMAT = "tfm-lora-1"


def check_lora_args(owner: str, in_features: int, out_features: int, rank, alpha) -> tuple[int, float]:
    """rank an int in [1, min(in, out)] (a larger rank is no longer low: the full matrix has rank min(in, out)),
    alpha a finite float > 0 (the update is scaled by alpha / rank). Returns (rank, alpha)."""
    rank = check_size(owner, "rank", rank)
    if rank > min(in_features, out_features):
        low = min(in_features, out_features)
        raise ValueError(f"{owner}: rank must be <= min(in_features, out_features) = {low} (in {in_features}, "
                         f"out {out_features}), got {rank}")  # fmt: skip
    alpha = check_real(owner, "alpha", alpha)
    if not alpha > 0:
        raise ValueError(f"{owner}: alpha must be > 0, got {alpha}")
    return rank, alpha


def lora_scaling(rank: int, alpha: float) -> float:
    """The factor of the low-rank update: alpha / rank (alpha fixed: a larger rank does not mean a larger step)."""
    return alpha / rank


def check_targets(owner: str, targets) -> tuple[str, ...]:
    """One pattern (str) or a non-empty list/tuple of them, returned as a tuple."""
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise TypeError(f"{owner}: targets expected a pattern (str) or a non-empty list of them, got {targets!r}")
    return tuple(targets)


def _matches(name: str, pattern: str) -> bool:
    """A pattern (shell-style: * and ?) matches a layer's full dotted name, or its last part ("q_proj", as peft)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], pattern)


def match_targets(owner: str, modules: Iterable[tuple[str, str]], targets, linear: str = "Linear") -> list[str]:
    """The names of the layers that `targets` picks, in the model's order. `modules`: (name, class name) of every
    module a LoRA layer may replace. Every pattern must pick at least one `linear`; a pattern that picks another
    kind of layer (a LayerNorm, an Embedding, a LoRALinear already there) is refused, naming it."""
    targets = check_targets(owner, targets)
    modules = [(n, kind) for n, kind in modules if n]
    chosen: list[str] = []
    for pattern in targets:
        hits = [(n, kind) for n, kind in modules if _matches(n, pattern)]
        wrong = [(n, kind) for n, kind in hits if kind != linear]
        if wrong:
            n, kind = wrong[0]
            raise TypeError(f"{owner}: targets pattern {pattern!r} picks {n!r}, a {kind}, not a {linear} "
                            "(LoRA adapts Linear layers only)")  # fmt: skip
        if not hits:
            names = [n for n, kind in modules if kind == linear]
            raise ValueError(f"{owner}: targets pattern {pattern!r} matches no Linear layer of the model; its Linear "
                             f"layers are {names[:8]}{' ...' if len(names) > 8 else ''}")  # fmt: skip
        chosen += [n for n, _ in hits if n not in chosen]
    order = [n for n, _ in modules]
    return sorted(chosen, key=order.index)


def base_name(name: str) -> str | None:
    """The name a parameter of an adapted model has in the base model: `x.base.weight` -> `x.weight`; None for an
    adapter's own parameter (`x.lora_A`)."""
    if name.rpartition(".")[2] in ADAPTER_KEYS:
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] == "base":
        return ".".join(parts[:-2] + parts[-1:])
    return name


def base_fingerprint(state: dict[str, np.ndarray]) -> str:
    """A SHA-256 of the base model's parameters (names and values as float32, in name order): the same for a model
    and for that model with adapters added (their `.base.` names map back), in either track and either dtype
    (float64 converted from float32 weights hashes as them)."""
    h = hashlib.sha256()
    items = {}
    for name, value in state.items():
        plain = base_name(name)
        if plain is not None:
            items[plain] = value
    for name in sorted(items):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(items[name], dtype=np.float32)).tobytes())
    return h.hexdigest()


def adapter_meta(rank: int, alpha: float, targets, names: list[str], fingerprint: str) -> dict:
    return {"format": _FORMAT, "rank": int(rank), "alpha": float(alpha), "targets": list(targets),
            "names": list(names), "base": fingerprint}  # fmt: skip


def write_adapters(path, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """One .npz: the adapters' arrays under their state_dict names and the metadata as a JSON string."""
    payload = {name: np.asarray(a) for name, a in arrays.items()}
    payload[_META] = np.array(json.dumps(meta))
    with open(os.fspath(path), "wb") as f:
        np.savez(f, **payload)


def read_adapters(owner: str, path) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of an adapter file; a file that is not one is refused."""
    try:
        with np.load(os.fspath(path), allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{owner}: {os.fspath(path)!r} is not an adapter file ({e})") from None
    raw = arrays.pop(_META, None)
    meta = json.loads(str(raw)) if raw is not None else None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"{owner}: {os.fspath(path)!r} is not an adapter file (no {_META} of format {_FORMAT})")
    return meta, arrays


def check_adapters(owner: str, meta: dict, arrays: dict[str, np.ndarray], names: list[str], fingerprint: str,
                   shapes: dict[str, tuple[int, int]]) -> None:  # fmt: skip
    """Before anything changes: the file was trained on this base (same fingerprint), picks the same layers here,
    and holds A (rank, in) and B (out, rank) for each. `names`: what its targets pick in this model; `shapes`:
    (in, out) of each."""
    if meta["base"] != fingerprint:
        raise ValueError(f"{owner}: these adapters were trained on another base model (fingerprint "
                         f"{meta['base'][:12]}..., this model's {fingerprint[:12]}...): load them onto the model "
                         "they were trained from")  # fmt: skip
    if list(names) != list(meta["names"]):
        raise ValueError(f"{owner}: the file adapts {meta['names']}, its targets pick {list(names)} in this model")
    rank = meta["rank"]
    expected = {
        f"{n}.{k}": s
        for n in names
        for k, s in zip(ADAPTER_KEYS, ((rank, shapes[n][0]), (shapes[n][1], rank)), strict=True)
    }
    if set(arrays) != set(expected):
        raise KeyError(f"{owner}: the file's arrays {sorted(arrays)[:4]} are not the adapters {sorted(expected)[:4]}")
    for key, shape in expected.items():
        if arrays[key].shape != shape:
            raise ValueError(f"{owner}: '{key}' expected shape {shape}, got {arrays[key].shape}")
