"""Checkpoints, NumPy track: the model's weights, Adam's state and a small `extra` dict in one `.npz` file.

The file is a plain NumPy archive (the format is in `tfm_common.npz_checkpoint`): an array "model/<key>" per
entry of `model.state_dict()`, the optimizer's moments under "optim/...", and the scalars (step, lr, ...)
with `extra` as a JSON string. It is read with `np.load(..., allow_pickle=False)`: opening a checkpoint can
never run code.

Across tracks: the NumPy track never imports torch, so it cannot read a `torch.save` file (a pickle). The
torch track does the conversion both ways: `tfm_torch.export_npz(path, model, optimizer)` writes this very
format from a torch model, and `tfm_torch.load_checkpoint` reads it into a torch model. One set of weights
therefore moves NumPy -> torch and torch -> NumPy, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

from tfm_common.npz_checkpoint import check_state, read_npz, write_npz

from .module import Module
from .optim import Adam

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(path, model: Module, optimizer: Adam | None = None, extra: dict | None = None) -> Path:
    """Write `model`'s state dict (and `optimizer`'s state, and `extra`: a JSON-able dict such as the epoch
    or the loss history) to `path`, atomically (a temporary file renamed over `path`). Returns the path."""
    if not isinstance(model, Module):
        raise TypeError(f"save_checkpoint: model expected a tfm_numpy Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, Adam):
        raise TypeError(f"save_checkpoint: optimizer expected a tfm_numpy Adam or None, got {type(optimizer).__name__}")
    optim = optimizer.state_dict() if optimizer is not None else None
    return write_npz(path, model.state_dict(), optim, extra, track="numpy", name="save_checkpoint")


def load_checkpoint(path, model: Module, optimizer: Adam | None = None) -> dict:
    """Load an `.npz` checkpoint (written by either track) into `model` (and `optimizer`); return its `extra`.

    Everything is checked before anything changes: a missing or unexpected key raises KeyError naming it, a
    shape mismatch ValueError naming the key and both shapes, a damaged file ValueError. Arrays are cast to
    the model's dtype (a float64 file loads into a float32 model); the same dtype round-trips bit for bit.
    """
    name = "load_checkpoint"
    if not isinstance(model, Module):
        raise TypeError(f"{name}: model expected a tfm_numpy Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, Adam):
        raise TypeError(f"{name}: optimizer expected a tfm_numpy Adam or None, got {type(optimizer).__name__}")
    state, optim, extra = read_npz(path, name)
    own = model.state_dict()
    check_state({k: v.shape for k, v in own.items()}, {k: v.shape for k, v in state.items()}, name)
    for k, v in state.items():
        if v.dtype.kind != "f":
            raise TypeError(f"{name}: model key '{k}' holds {v.dtype} values, expected floats")
    if optimizer is not None:
        if optim is None:
            raise KeyError(f"{name}: {str(path)!r} holds no optimizer state (saved without an optimizer)")
        optimizer.load_state_dict(optim)  # checks its own shapes and count before changing anything
    model.load_state_dict(state)  # keys and shapes were checked above: this cannot fail half-way
    return extra
