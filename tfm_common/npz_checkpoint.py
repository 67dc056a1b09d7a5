"""The `.npz` checkpoint format, shared by both tracks (NumPy only): one file that either track can read.

`tfm_numpy.save_checkpoint` writes it, `tfm_torch.export_npz` writes the same thing from a torch model, and
both `load_checkpoint`s read it. It is a plain `numpy.savez` archive, read with `allow_pickle=False`, so
loading it can never run code:

    model/<state_dict key>     one array per entry of the model's state_dict (a tied weight under each name)
    optim/exp_avg/<i>          Adam's first moment of parameter i (in the optimizer's parameter order)
    optim/exp_avg_sq/<i>       Adam's second moment of parameter i
    __meta__                   a 0-d unicode array holding JSON: format, version, the writing track, the
                               optimizer's scalars (step, lr, betas, eps, weight_decay) and the user's `extra`

Errors are clear at this boundary: a truncated or corrupted file, a file that is not a checkpoint, a missing
or unexpected key (KeyError, naming it) and a wrong shape (ValueError, naming the key and both shapes).
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = [
    "FORMAT",
    "VERSION",
    "META_KEY",
    "normalize_extra",
    "check_state",
    "atomic_write",
    "zip_kind",
    "write_npz",
    "read_npz",
]

FORMAT = "transformer-twice-checkpoint"
VERSION = 1
META_KEY = "__meta__"
OPTIM_SCALARS = ("step", "lr", "betas", "eps", "weight_decay")


def normalize_extra(extra, name: str) -> dict:
    """`extra` as it will come back from either track's file: a dict that survives a JSON round trip
    (tuples become lists). Checked before anything is written."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"{name}: extra expected a dict or None, got {type(extra).__name__}")
    try:
        return json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: extra must be JSON-serializable (str keys; numbers, str, lists, dicts): {e}") from e


def check_state(expected: dict, got: dict, name: str, what: str = "model") -> None:
    """Compare {key: shape} of what the model has (`expected`) with what the file holds (`got`).

    KeyError naming the missing and unexpected keys; ValueError naming the first key whose shape differs."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    if missing or unexpected:
        raise KeyError(f"{name}: the {what} state does not match: missing keys {missing}, unexpected keys {unexpected}")
    for k, shape in expected.items():
        if tuple(got[k]) != tuple(shape):
            raise ValueError(f"{name}: {what} key '{k}' expected shape {tuple(shape)}, got {tuple(got[k])}")


def atomic_write(path, write: Callable, name: str) -> Path:
    """Call write(file object) on a temporary file next to `path`, then rename it over `path`: an interrupted
    save never leaves a half-written checkpoint behind."""
    path = Path(os.fspath(path))
    if path.is_dir():
        raise IsADirectoryError(f"{name}: path {str(path)!r} is a directory")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{name}: directory {str(path.parent)!r} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def zip_kind(path) -> str:
    """ "npz" (our archive of .npy files), "torch" (a torch.save file), or "other" (not a readable zip)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, EOFError):
        return "other"
    if any(n.endswith(".npy") for n in names):
        return "npz"
    if any(n.endswith("data.pkl") for n in names):
        return "torch"
    return "other"


def write_npz(path, model_state: dict, optim_state: dict | None, extra, track: str, name: str) -> Path:
    """Write the format above. model_state: {key: array}; optim_state: None or an Adam state in the NumPy
    track's form {"step", "lr", "betas", "eps", "weight_decay", "exp_avg": [arrays], "exp_avg_sq": [arrays]}."""
    extra = normalize_extra(extra, name)
    arrays = {f"model/{k}": np.asarray(v) for k, v in model_state.items()}
    meta = {"format": FORMAT, "version": VERSION, "track": track, "model_keys": list(model_state), "extra": extra}
    if optim_state is not None:
        m, v = optim_state["exp_avg"], optim_state["exp_avg_sq"]
        if len(m) != len(v):
            raise ValueError(f"{name}: optimizer state has {len(m)} exp_avg but {len(v)} exp_avg_sq arrays")
        meta["optim"] = {k: optim_state[k] for k in OPTIM_SCALARS} | {"type": "Adam", "n_params": len(m)}
        meta["optim"]["betas"] = list(meta["optim"]["betas"])
        arrays |= {f"optim/exp_avg/{i}": np.asarray(a) for i, a in enumerate(m)}
        arrays |= {f"optim/exp_avg_sq/{i}": np.asarray(a) for i, a in enumerate(v)}
    for k, a in arrays.items():
        if a.dtype == object:
            raise TypeError(f"{name}: '{k}' is an object array; only numeric arrays can be saved")
    arrays[META_KEY] = np.array(json.dumps(meta))
    return atomic_write(path, lambda f: np.savez(f, allow_pickle=False, **arrays), name)


def read_npz(path, name: str) -> tuple[dict, dict | None, dict]:
    """Read the format above: (model state {key: array}, optim state in the NumPy track's form or None, extra).

    Every array is read here, inside one try, so a damaged file fails with one clear ValueError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: no such checkpoint file {path!r}")
    kind = zip_kind(path)
    if kind == "torch":
        raise ValueError(
            f"{name}: {path!r} is a torch checkpoint (torch.save). The NumPy track never unpickles; "
            "write an .npz from torch with tfm_torch.export_npz(path, model), or load it with tfm_torch.load_checkpoint"
        )
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # BadZipFile, CRC errors, EOFError, format errors, pickled data refused, ...
        raise ValueError(
            f"{name}: cannot read {path!r} as an .npz checkpoint (truncated or corrupted?): {type(e).__name__}: {e}"
        ) from e
    if META_KEY not in arrays:
        raise ValueError(f"{name}: {path!r} is an .npz file but not a checkpoint: no '{META_KEY}' entry")
    try:
        meta = json.loads(str(arrays.pop(META_KEY)[()]))
    except (ValueError, IndexError) as e:
        raise ValueError(f"{name}: {path!r}: '{META_KEY}' is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{name}: {path!r}: not a {FORMAT} file (format {got!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"{name}: {path!r}: format version {meta.get('version')!r}, this code reads {VERSION}")
    model = {k[len("model/") :]: a for k, a in arrays.items() if k.startswith("model/")}
    optim = None
    if meta.get("optim") is not None:
        absent = [k for k in (*OPTIM_SCALARS, "n_params") if k not in meta["optim"]]
        if absent:
            raise KeyError(f"{name}: {path!r}: optimizer scalars missing from '{META_KEY}': {absent}")
        n = meta["optim"]["n_params"]
        optim = {k: meta["optim"][k] for k in OPTIM_SCALARS}
        for part in ("exp_avg", "exp_avg_sq"):
            keys = [f"optim/{part}/{i}" for i in range(n)]
            absent = [k for k in keys if k not in arrays]
            if absent:
                raise KeyError(f"{name}: {path!r}: optimizer entries missing from the file: {absent}")
            optim[part] = [arrays[k] for k in keys]
    known = {f"model/{k}" for k in model}
    if optim is not None:
        known |= {f"optim/{part}/{i}" for part in ("exp_avg", "exp_avg_sq") for i in range(len(optim["exp_avg"]))}
    stray = [k for k in arrays if k not in known]
    if stray:
        raise KeyError(f"{name}: {path!r}: unexpected entries in the file: {stray}")
    recorded = meta.get("model_keys", list(model))
    if set(model) != set(recorded):
        missing = [k for k in recorded if k not in model]
        unrecorded = [k for k in model if k not in recorded]
        raise KeyError(
            f"{name}: {path!r}: the model entries differ from the keys recorded in '{META_KEY}': "
            f"missing {missing}, not recorded {unrecorded}"
        )
    return model, optim, meta.get("extra") or {}
