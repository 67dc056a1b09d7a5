"""Checkpoints, NumPy track: the model's weights, Adam's state and a small `extra` dict in one `.npz` file (the
format is in `tfm_common.npz_checkpoint`), read with `allow_pickle=False`: opening a checkpoint never runs code.

The NumPy track never imports torch, so it cannot read a `torch.save` file (a pickle): `tfm_torch.export_npz` writes
this format from a torch model and `tfm_torch.load_checkpoint` reads it, so weights move both ways bit for bit.
"""

from __future__ import annotations

from pathlib import Path

from tfm_common.npz_checkpoint import (
    NpzContents,
    build_model,
    check_model_config,
    check_optim_type,
    check_state,
    check_ties,
    describe_model,
    read_npz,
    same_values,
    tied_groups_of,
    write_npz,
)

from .module import Module, check_dtype
from .optim import Adam

__all__ = ["save_checkpoint", "load_checkpoint", "load_model", "tied_groups"]


def save_checkpoint(path, model: Module, optimizer: Adam | None = None, extra: dict | None = None) -> Path:
    """Write `model`'s state dict (and `optimizer`'s state, and `extra`: a JSON-able dict such as the epoch
    or the loss history) to `path`, atomically (a temporary file renamed over `path`). Returns the path."""
    _check_args("save_checkpoint", model, optimizer)
    optim = optimizer.state_dict() | {"type": _optim_type(optimizer)} if optimizer is not None else None
    meta = describe_model(model, str(model.param_dtype))
    return write_npz(path, model.state_dict(), optim, extra, track="numpy", name="save_checkpoint", model_meta=meta)


def load_checkpoint(path, model: Module, optimizer: Adam | None = None) -> dict:
    """Load an `.npz` checkpoint (written by either track) into `model` (and `optimizer`); return its `extra`.

    Everything is checked before anything changes: a model of another class or configuration (the file records
    it) raises ValueError naming the options that differ; a missing or unexpected key KeyError naming it; a shape
    mismatch ValueError naming the key and both shapes; two names of one tied weight holding different values
    ValueError; a damaged file ValueError. Arrays are cast to the model's dtype (a float64 file loads into a
    float32 model); the same dtype round-trips bit for bit. A version-1 file (no configuration recorded) loads
    into the model you built: its configuration is yours to get right.
    """
    _check_args("load_checkpoint", model, optimizer)
    return _load_into(read_npz(path, "load_checkpoint"), model, optimizer, path, "load_checkpoint")


def _check_args(name: str, model, optimizer) -> None:
    if not isinstance(model, Module):
        raise TypeError(f"{name}: model expected a tfm_numpy Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, Adam):
        raise TypeError(f"{name}: optimizer expected a tfm_numpy Adam, AdamW or None, got {type(optimizer).__name__}")


def load_model(path, dtype=None) -> Module:
    """A new model built from the configuration recorded in the checkpoint, with its weights: no need to know
    how it was built. `dtype` (float32 or float64) overrides the recorded one. For the optimizer state and
    `extra`, call `load_checkpoint(path, model, optimizer)` on the result."""
    name = "load_model"
    contents = read_npz(path, name)
    stored = sum(v.size for v in contents.model.values())  # read_npz checked that each entry holds its bytes
    model = build_model(contents.model_meta, Module, "tfm_numpy", dtype, check_dtype, path, name, stored)
    _load_into(contents, model, None, path, name)
    return model


def _optim_type(optimizer: Adam) -> str:
    return "AdamW" if optimizer.decoupled else "Adam"


def tied_groups(model: Module) -> list[list[str]]:
    """The state_dict names of each parameter that appears under more than one name (a tied weight)."""
    return tied_groups_of(model._named_parameters_all())


def _load_into(contents: NpzContents, model: Module, optimizer: Adam | None, path, name: str) -> dict:
    state, optim, extra, stored = contents
    check_model_config(stored, describe_model(model, str(model.param_dtype)), name, path)
    own = model.state_dict()
    check_state({k: v.shape for k, v in own.items()}, {k: v.shape for k, v in state.items()}, name)
    for k, v in state.items():
        if v.dtype.kind != "f":
            raise TypeError(f"{name}: model key '{k}' holds {v.dtype} values, expected floats")
    check_ties(tied_groups(model), state, same_values, name)
    if optimizer is not None:
        if optim is None:
            raise KeyError(f"{name}: {str(path)!r} holds no optimizer state (saved without an optimizer)")
        optim = dict(optim)
        check_optim_type(optim.pop("type"), _optim_type(optimizer), path, name)
        optimizer.load_state_dict(optim)  # checks its own shapes and count before changing anything
    model.load_state_dict(state)  # keys and shapes were checked above: this cannot fail half-way
    return extra
