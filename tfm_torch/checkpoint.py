"""Checkpoints, PyTorch track: the functions of tfm_numpy.checkpoint, plus the bridge between the tracks.

`save_checkpoint` writes a `torch.save` file (format, version, model meta, state dicts, `extra`), read back with
`torch.load(..., weights_only=True)` (tensors and plain containers, never code). `export_npz` writes the NumPy
track's `.npz` (`tfm_common.npz_checkpoint`) from a torch model, and `load_checkpoint` reads either format (the
file's content decides, not its suffix): every conversion lives here, so the NumPy track never imports torch.
Adam's or AdamW's state crosses too (one param group, amsgrad off; one never loads into the other), the moments
matched by position in the optimizer's parameter list (the model's `parameters()` order with make_adam(w)).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tfm_common.npz_checkpoint import (
    FORMAT,
    READABLE_VERSIONS,
    VERSION,
    atomic_write,
    build_model,
    check_meta_fields,
    check_model_config,
    check_optim_type,
    check_state,
    check_ties,
    describe_model,
    library_version,
    normalize_extra,
    read_npz,
    tied_groups_of,
    write_npz,
    zip_kind,
)

from .module import Module, same_tensor_values

__all__ = ["save_checkpoint", "load_checkpoint", "load_model", "export_npz", "tied_groups"]


def _check_args(name: str, model, optimizer) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name}: model expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{name}: optimizer expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra=None) -> Path:
    """As tfm_numpy.save_checkpoint, with `torch.save`. Returns the path."""
    name = "save_checkpoint"
    _check_args(name, model, optimizer)
    ckpt = {
        "format": FORMAT,
        "version": VERSION,
        "track": "torch",
        "library_version": library_version(),
        "model_meta": describe_model(model, _dtype_name(model)),
        "model": model.state_dict(),
        "optim": optimizer.state_dict() if optimizer is not None else None,
        "extra": normalize_extra(extra, name),
    }
    return atomic_write(path, lambda f: torch.save(ckpt, f), name)


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint of either track into `model` (and `optimizer`); return its `extra` dict. Checked as
    tfm_numpy.load_checkpoint's, before anything changes; a torch file is read with `weights_only=True`."""
    name = "load_checkpoint"
    _check_args(name, model, optimizer)
    return _load_into(_read_any(path, name), model, optimizer, path, name)


def load_model(path, dtype: torch.dtype | None = None) -> nn.Module:
    """As tfm_numpy.load_model, from either track's file; `dtype` torch.float32 or torch.float64."""
    name = "load_model"
    contents = _read_any(path, name)
    stored = sum(_numbers_held(v) for v in contents[0].values())
    model = build_model(contents[3], Module, "tfm_torch", dtype, functools.partial(getattr, torch), path, name, stored)
    _load_into(contents, model, None, path, name)
    return model


def _numbers_held(v) -> int:
    """How many numbers a file's tensor holds: its storage's, when a view claims more (stride 0 repeats one value
    over any shape); 0 for what is not a tensor (refused later)."""
    if not torch.is_tensor(v):
        return 0
    return min(v.numel(), v.untyped_storage().nbytes() // max(v.element_size(), 1))


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The state_dict names of each parameter that appears under more than one name (a tied weight)."""
    return tied_groups_of(model.named_parameters(remove_duplicate=False))


def _read_any(path, name: str) -> tuple:
    """(state {key: tensor}, optimizer state dict in torch's form or a NumPy-form dict or None, extra, model meta,
    "npz" | "torch")."""
    if os.path.isdir(os.fspath(path)):
        raise IsADirectoryError(f"{name}: {os.fspath(path)!r} is a directory, not a checkpoint file")
    if not os.path.isfile(os.fspath(path)):
        raise FileNotFoundError(f"{name}: no such checkpoint file {os.fspath(path)!r}")
    if zip_kind(path) == "npz":
        state_np, optim_np, extra, meta = read_npz(path, name)
        return {k: torch.from_numpy(v) for k, v in state_np.items()}, optim_np, extra, meta, "npz"
    return (*_read_torch(path, name), "torch")


def _load_into(contents: tuple, model: nn.Module, optimizer, path, name: str) -> dict:
    state, optim, extra, stored, kind = contents
    check_model_config(stored, describe_model(model, _dtype_name(model)), name, path)
    own = model.state_dict()
    check_state({k: tuple(v.shape) for k, v in own.items()}, {k: tuple(v.shape) for k, v in state.items()}, name)
    for k, v in state.items():
        if not torch.is_tensor(v) or not v.is_floating_point():
            raise TypeError(f"{name}: model key '{k}' holds {getattr(v, 'dtype', type(v).__name__)}, expected floats")
    check_ties(tied_groups(model), state, same_tensor_values, name)
    optim_sd = None
    if optimizer is not None:
        if optim is None:
            raise KeyError(f"{name}: {os.fspath(path)!r} holds no optimizer state (saved without an optimizer)")
        optim_sd = _adam_from_numpy(optimizer, optim, path, name) if kind == "npz" else optim
        _check_optim_state(optimizer, optim_sd, name)
    if optim_sd is not None:
        optimizer.load_state_dict(optim_sd)
    model.load_state_dict(state)  # keys, shapes and ties were checked above: this cannot fail half-way
    return extra


def _dtype_name(model: nn.Module) -> str:
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return str(floats[0]).removeprefix("torch.") if floats else "float32"


def export_npz(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra=None) -> Path:
    """Write the torch model (and Adam's state) in the NumPy track's `.npz` format, for `tfm_numpy.load_checkpoint`
    (or this track's `load_checkpoint`). The arrays are the tensors' exact values."""
    name = "export_npz"
    _check_args(name, model, optimizer)
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    optim = _adam_to_numpy(optimizer, name) if optimizer is not None else None
    meta = describe_model(model, _dtype_name(model))
    return write_npz(path, state, optim, extra, track="torch", name=name, model_meta=meta)


# -- torch files -----------------------------------------------------------------------------------------------


def _read_torch(path, name: str):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, corrupted records, or a pickle that weights_only refuses
        raise ValueError(
            f"{name}: cannot read {os.fspath(path)!r} as a checkpoint (a torch file or an .npz; truncated, corrupted, "
            f"or not saved by save_checkpoint?): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{name}: {os.fspath(path)!r} is not a {FORMAT} file (written by save_checkpoint)")
    if ckpt.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{name}: {os.fspath(path)!r}: format version {ckpt.get('version')!r}, this code reads {READABLE_VERSIONS}"
        )
    missing = [k for k in ("model", "optim", "extra") if k not in ckpt]
    if missing:
        raise KeyError(f"{name}: {os.fspath(path)!r}: entries missing from the checkpoint: {missing}")
    if not isinstance(ckpt["model"], dict):
        raise ValueError(f"{name}: {os.fspath(path)!r}: 'model' is a {type(ckpt['model']).__name__}, not a state dict")
    check_meta_fields({"extra": ckpt["extra"], "model": ckpt.get("model_meta")}, f"{name}: {os.fspath(path)!r}")
    return ckpt["model"], ckpt["optim"], ckpt["extra"] or {}, ckpt.get("model_meta")


def _check_optim_state(optimizer: torch.optim.Optimizer, sd, name: str) -> None:
    """torch's own `load_state_dict` checks the group sizes but not the moments' shapes: check them here."""
    if not isinstance(sd, dict) or set(sd) != {"state", "param_groups"}:
        raise KeyError(f"{name}: the optimizer state must have keys ['param_groups', 'state'], got {sorted(sd)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sizes, own = ([len(group["params"]) for group in groups] for groups in (sd["param_groups"], optimizer.param_groups))
    if sizes != own:
        raise ValueError(f"{name}: the optimizer has param groups of sizes {own}, the checkpoint {sizes}")
    for i, st in sd["state"].items():
        if not 0 <= int(i) < len(params):
            raise KeyError(f"{name}: optimizer state for parameter {i}, but the optimizer has {len(params)}")
        for key, value in st.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tuple(params[int(i)].shape):
                raise ValueError(
                    f"{name}: optimizer state '{key}' of parameter {i} expected shape {tuple(params[int(i)].shape)}, "
                    f"got {tuple(value.shape)}"
                )


# -- Adam state between the tracks -------------------------------------------------------------------------------


def _check_adam(optimizer, name: str) -> list:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or len(optimizer.param_groups) != 1:
        raise TypeError(f"{name}: only Adam with one param group (or AdamW) converts to the NumPy track's optimizer")
    group = optimizer.param_groups[0]
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError(f"{name}: Adam with amsgrad or maximize has no NumPy twin")
    return group["params"]


def _optim_type(optimizer) -> str:
    """ "AdamW" for decoupled weight decay (torch.optim.AdamW, or Adam(decoupled_weight_decay=True)), else "Adam"."""
    decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.param_groups[0].get("decoupled_weight_decay")
    return "AdamW" if decoupled else "Adam"


def _adam_to_numpy(optimizer, name: str) -> dict:
    """A torch Adam's state in the NumPy track's form (`tfm_numpy.Adam.state_dict()`)."""
    params = _check_adam(optimizer, name)
    group = optimizer.param_groups[0]
    steps = {int(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state[p]}
    if len(steps) > 1:
        raise ValueError(f"{name}: the parameters have different step counts {sorted(steps)}; cannot export")
    if steps and any("step" not in optimizer.state[p] for p in params):
        raise ValueError(f"{name}: some parameters have no optimizer state (no gradient yet); cannot export")

    def moment(p, key):
        st, dt = optimizer.state[p], (np.float64 if p.dtype == torch.float64 else np.float32)
        return st[key].detach().cpu().numpy().copy() if key in st else np.zeros(tuple(p.shape), dt)

    return {
        "step": steps.pop() if steps else 0,
        "lr": float(group["lr"]),
        "betas": [float(b) for b in group["betas"]],
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "exp_avg": [moment(p, "exp_avg") for p in params],
        "exp_avg_sq": [moment(p, "exp_avg_sq") for p in params],
        "type": _optim_type(optimizer),
    }


def _adam_from_numpy(optimizer, optim: dict, path, name: str) -> dict:
    """The NumPy track's Adam state as a torch `Adam.state_dict()` for `optimizer` (shapes checked later)."""
    params = _check_adam(optimizer, name)
    check_optim_type(optim["type"], _optim_type(optimizer), path, name)
    n = len(optim["exp_avg"])
    if n != len(params):
        raise ValueError(f"{name}: the checkpoint's optimizer has {n} parameters, this optimizer {len(params)}")
    sd = optimizer.state_dict()
    sd["param_groups"][0].update(
        lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"], weight_decay=optim["weight_decay"]
    )
    sd["state"] = {}
    if optim["step"] > 0:
        for i in range(n):
            sd["state"][i] = {
                "step": torch.tensor(float(optim["step"]), dtype=torch.float32),
                "exp_avg": torch.from_numpy(np.array(optim["exp_avg"][i])),
                "exp_avg_sq": torch.from_numpy(np.array(optim["exp_avg_sq"][i])),
            }
    return sd
