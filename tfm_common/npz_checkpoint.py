"""The `.npz` checkpoint format, shared by both tracks (NumPy only): one file that either track can read.

`tfm_numpy.save_checkpoint` writes it, `tfm_torch.export_npz` writes the same thing from a torch model, and
both `load_checkpoint`s read it. It is a plain `numpy.savez` archive, read with `allow_pickle=False`, so
loading it can never run code:

    model/<state_dict key>     one array per entry of the model's state_dict (a tied weight under each name)
    optim/exp_avg/<i>          Adam's (or AdamW's) first moment of parameter i (in the optimizer's parameter order)
    optim/exp_avg_sq/<i>       Adam's second moment of parameter i
    __meta__                   a 0-d unicode array holding JSON: format, version, the writing track, the library
                               version, the model's class, constructor configuration and dtype (`describe_model`),
                               the optimizer's type ("Adam" or "AdamW": weight_decay means a different update in
                               each, so one never loads into the other) and scalars (step, lr, betas, eps,
                               weight_decay), and the user's `extra`

Version 2 (this one) records the model's configuration, and loading refuses a model built differently
(`check_model_config`): a tied weight is stored under each of its names, so keys and shapes alone cannot tell a
`tie_output=False` file from a `tie_output=True` model. Version 1 files (no configuration) still load into a model
the caller builds; `check_ties` then still refuses a file whose aliases of one tied weight hold different values.
Every field of `__meta__` is checked (type, range, agreement with the arrays present) before anything is allocated.
What a file can ask for is bounded by what it holds: each .npy entry's header must not declare more bytes than the
entry holds (`read_npz`), and `load_model` builds a model only when the size its configuration declares
(`tfm_common.config.config_numbers`) is within the numbers the file stores plus UNSTORED_ALLOWANCE for the tables a
model computes (`check_config_size`); the exact shapes are compared once it is built. A crafted file that declares a
vocabulary of 10**9 is refused in milliseconds, whatever it claims.

Errors are clear at this boundary: a truncated or corrupted file, a file that is not a checkpoint, a missing
or unexpected key (KeyError, naming it) and a wrong shape (ValueError, naming the key and both shapes).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import numbers
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .config import config_numbers

__all__ = ["FORMAT", "VERSION", "READABLE_VERSIONS", "NpzContents", "library_version", "describe_model", "build_model",
           "tied_groups_of", "check_model_config", "check_ties", "same_values", "check_optim_meta", "check_optim_type",
           "META_KEY", "normalize_extra", "check_state", "atomic_write", "zip_kind", "write_npz",
           "read_npz", "check_config_size", "UNSTORED_ALLOWANCE"]  # fmt: skip

FORMAT = "transformer-twice-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
META_KEY = "__meta__"
OPTIM_SCALARS = ("step", "lr", "betas", "eps", "weight_decay")
OPTIM_TYPES = ("Adam", "AdamW")
DTYPES = ("float32", "float64")  # the dtype names a file records, and the names both tracks accept for `dtype`
# Beyond the numbers a file stores, what its configuration may ask a loader to allocate: the tables a model computes
# rather than stores (sinusoidal and rotary positions, Swin's window masks). 2**24 numbers: 64 MB in float32.
UNSTORED_ALLOWANCE = 2**24


class NpzContents(NamedTuple):
    """What `read_npz` returns: the model state, the optimizer state (or None), `extra`, and the model's
    description (`describe_model`'s dict, or None for a version-1 file or a model without a configuration)."""

    model: dict
    optim: dict | None
    extra: dict
    model_meta: dict | None


def library_version() -> str:
    """The installed version of this project's package, recorded in every checkpoint."""
    try:
        return importlib.metadata.version("transformer-twice")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def describe_model(model, dtype: str) -> dict | None:
    """{"class", "config", "dtype"} of a model that keeps its constructor's arguments in `model.config` (a dict of
    JSON values, as `Transformer` does); None for a model without one (a lone layer: keys and shapes say it all)."""
    config = getattr(model, "config", None)
    if not isinstance(config, dict):
        return None
    return {"class": type(model).__name__, "config": json.loads(json.dumps(config)), "dtype": dtype}


def check_config_size(meta: dict, stored: int, path, name: str) -> None:
    """Refuse a configuration that asks for more numbers than the file stores (`stored`: the numbers its model arrays
    hold, not the numbers their shapes claim: a torch view may repeat one value with stride 0) plus
    UNSTORED_ALLOWANCE, before anything is built: a few KB that declare vocab_size=10**9 and d_model=10**4 cost
    integer arithmetic, not 40 TB. Exact shapes are compared once the model is built."""
    asked = config_numbers(meta["class"], meta["config"])
    if asked is None:  # a layer's constructor would take any size from the file: none records a configuration
        raise ValueError(
            f"{name}: {os.fspath(path)!r} names a {meta['class']}, which records no configuration: only a Transformer, "
            "GPT, BERT, ViT or Swin is built from a file (build the module yourself and use load_checkpoint)"
        )
    if asked > stored + UNSTORED_ALLOWANCE:
        sizes = ", ".join(f"{k}={v!r}" for k, v in meta["config"].items() if type(v) in (int, list, tuple))
        raise ValueError(
            f"{name}: {os.fspath(path)!r} declares a {meta['class']} of at least {asked:.3g} numbers "
            f"({sizes:.300}), but stores {stored} (allowed: stored + {UNSTORED_ALLOWANCE} for computed tables): its "
            "configuration does not describe its arrays (a damaged or crafted file); nothing was built"
        )


def build_model(
    meta: dict | None, base: type, package: str, dtype, as_dtype: Callable[[str], object], path, name: str, stored: int
):
    """The bare model that `meta` (`describe_model`'s dict) describes, in `dtype` (None: the recorded dtype's name
    made a dtype by `as_dtype`), once `check_config_size` has compared its size with the numbers the file `stored`.

    The class is looked up among the public subclasses of `base` (the track's Module) defined in `package`
    ("tfm_numpy" or "tfm_torch"): a checkpoint names one of the library's classes, never arbitrary code. The
    subclasses are walked, so the package is not imported from inside itself."""
    where = repr(os.fspath(path))
    if meta is None:
        raise ValueError(
            f"{name}: {where} records no model configuration (a version-1 file, or a model without a `config`): "
            "build the model yourself and call load_checkpoint(path, model); saving it again writes a version-2 file"
        )
    classes, todo = {}, [base]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith(f"{package}.") and not cls.__name__.startswith("_"):
            classes[cls.__name__] = cls
    if meta["class"] not in classes:
        raise ValueError(f"{name}: {where} names a model class {meta['class']!r} that {package} does not have")
    check_config_size(meta, stored, path, name)
    try:
        return classes[meta["class"]](**meta["config"], dtype=as_dtype(meta["dtype"]) if dtype is None else dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: cannot build {meta['class']} from the configuration in {where}: {e}") from e


def tied_groups_of(named_parameters) -> list[list[str]]:
    """The names of each parameter that appears under more than one name (a tied weight), from (name, parameter)
    pairs that list a tied parameter under each of its names."""
    names: dict[int, list[str]] = {}
    for key, p in named_parameters:
        names.setdefault(id(p), []).append(key)
    return [keys for keys in names.values() if len(keys) > 1]


def check_model_config(stored: dict | None, own: dict | None, name: str, path) -> None:
    """Refuse a checkpoint written by a model of another class or configuration, naming the options that differ."""
    if stored is None or own is None:
        return  # a version-1 file, or a model without a config: the caller vouches for the configuration
    if stored["class"] != own["class"]:
        raise ValueError(f"{name}: {os.fspath(path)!r} holds a {stored['class']}, the model is a {own['class']}")
    a, b = stored["config"], own["config"]
    absent = "<absent>"
    diff = [f"{k}={a.get(k, absent)!r} in the file, {b.get(k, absent)!r} in the model"
            for k in sorted(set(a) | set(b)) if a.get(k, absent) != b.get(k, absent)]  # fmt: skip
    if diff:
        raise ValueError(
            f"{name}: {os.fspath(path)!r} was written by a {stored['class']} configured differently: "
            + "; ".join(diff)
            + ". Build the model with the file's configuration, or use load_model(path)"
        )


def check_ties(groups: list[list[str]], state: dict, equal: Callable, name: str, what: str = "checkpoint") -> None:
    """Each group lists the names of one tied parameter of the model; the file (`what`: or a state_dict) must hold
    one value under all of them. Different values mean the file comes from a model without that tie: refuse rather
    than let the last name win. `equal` counts NaN equal to NaN (`same_values`): a tied weight that went NaN is one
    value under two names, and saves and loads as any other."""
    why = {"checkpoint": "it was written by a model without this tie (tie_output / share_embeddings differ)"}
    for keys in groups:
        present = [k for k in keys if k in state]
        for k in present[1:]:
            if not equal(state[present[0]], state[k]):
                raise ValueError(
                    f"{name}: '{present[0]}' and '{k}' are one tied parameter in this model, but the {what} holds "
                    f"different values for them: "
                    + why.get(what, "give both names the same value (which one was meant cannot be told)")
                )


def same_values(a, b) -> bool:
    """NumPy arrays (or anything np.asarray takes) of one shape and equal values, NaN equal to NaN."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))


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


def write_npz(
    path, model_state: dict, optim_state: dict | None, extra, track: str, name: str, model_meta: dict | None = None
) -> Path:
    """Write the format above. model_state: {key: array}; optim_state: None or an Adam state in the NumPy
    track's form {"step", "lr", "betas", "eps", "weight_decay", "exp_avg": [arrays], "exp_avg_sq": [arrays]} and
    an optional "type" (OPTIM_TYPES, "Adam" if absent);
    model_meta: `describe_model(model, dtype)`."""
    extra = normalize_extra(extra, name)
    arrays = {f"model/{k}": np.asarray(v) for k, v in model_state.items()}
    meta = {"format": FORMAT, "version": VERSION, "track": track, "library_version": library_version(),
            "model": model_meta, "model_keys": list(model_state), "extra": extra}  # fmt: skip
    if optim_state is not None:
        m, v = optim_state["exp_avg"], optim_state["exp_avg_sq"]
        if len(m) != len(v):
            raise ValueError(f"{name}: optimizer state has {len(m)} exp_avg but {len(v)} exp_avg_sq arrays")
        kind = optim_state.get("type", "Adam")
        meta["optim"] = {k: optim_state[k] for k in OPTIM_SCALARS} | {"type": kind, "n_params": len(m)}
        meta["optim"]["betas"] = list(meta["optim"]["betas"])
        arrays |= {f"optim/exp_avg/{i}": np.asarray(a) for i, a in enumerate(m)}
        arrays |= {f"optim/exp_avg_sq/{i}": np.asarray(a) for i, a in enumerate(v)}
    for k, a in arrays.items():
        if a.dtype == object:
            raise TypeError(f"{name}: '{k}' is an object array; only numeric arrays can be saved")
    arrays[META_KEY] = np.array(json.dumps(meta))
    return atomic_write(path, lambda f: np.savez(f, allow_pickle=False, **arrays), name)


def read_npz(path, name: str) -> NpzContents:
    """Read the format above: `NpzContents(model, optim, extra, model_meta)`; optim in the NumPy track's form.

    Every array is read here, inside one try, so a damaged file fails with one clear ValueError; every field of
    `__meta__` is checked before anything is built from it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{name}: {path!r} is a directory, not a checkpoint file")
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
            _check_entry_sizes(z.zip)
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # BadZipFile, CRC errors, EOFError, format errors, pickled data refused, ...
        raise ValueError(
            f"{name}: cannot read {path!r} as an .npz checkpoint (truncated or corrupted?): {type(e).__name__}: {e}"
        ) from e
    if META_KEY not in arrays:
        raise ValueError(f"{name}: {path!r} is an .npz file but not a checkpoint: no '{META_KEY}' entry")
    meta = _read_meta(arrays.pop(META_KEY), path, name)
    model = {k[len("model/") :]: a for k, a in arrays.items() if k.startswith("model/")}
    optim = None
    if meta.get("optim") is not None:
        present = {part: sum(k.startswith(f"optim/{part}/") for k in arrays) for part in ("exp_avg", "exp_avg_sq")}
        n = check_optim_meta(meta["optim"], present, f"{name}: {path!r}")
        optim = (
            {k: meta["optim"][k] for k in OPTIM_SCALARS}
            | {"type": meta["optim"].get("type", "Adam")}
            | {part: [arrays[f"optim/{part}/{i}"] for i in range(n)] for part in ("exp_avg", "exp_avg_sq")}
        )
    known = {f"model/{k}" for k in model}
    if optim is not None:
        known |= {f"optim/{part}/{i}" for part in ("exp_avg", "exp_avg_sq") for i in range(len(optim["exp_avg"]))}
    stray = [k for k in arrays if k not in known]
    if stray:
        raise KeyError(f"{name}: {path!r}: unexpected entries in the file: {stray[:10]}")
    recorded = meta.get("model_keys", list(model))
    if set(model) != set(recorded):
        missing = [k for k in recorded if k not in model]
        unrecorded = [k for k in model if k not in recorded]
        raise KeyError(
            f"{name}: {path!r}: the model entries differ from the keys recorded in '{META_KEY}': "
            f"missing {missing}, not recorded {unrecorded}"
        )
    return NpzContents(model, optim, meta.get("extra") or {}, meta.get("model"))


def _check_entry_sizes(archive: zipfile.ZipFile) -> None:
    """Each .npy entry's header declares a shape and a dtype: refuse one that declares more bytes than the entry holds
    before NumPy reserves memory for it (a few bytes of header may claim terabytes)."""
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            continue
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                continue  # NumPy's own reader refuses or reads it
            shape, _, dtype = read_header[version](f, max_header_size=10_000)
            declared, held = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
        if declared > held:
            raise ValueError(
                f"entry {info.filename!r} declares shape {shape} of {dtype} ({declared} bytes) but holds {held} bytes"
            )


def _read_meta(raw: np.ndarray, path: str, name: str) -> dict:
    where = f"{name}: {path!r}: '{META_KEY}'"
    if raw.dtype.kind != "U" or raw.ndim != 0:
        raise ValueError(f"{where} must be a 0-d string array, got dtype {raw.dtype} and shape {raw.shape}")
    try:
        meta = json.loads(str(raw[()]))
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{name}: {path!r}: not a {FORMAT} file (format {got!r})")
    if meta.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{name}: {path!r}: format version {meta.get('version')!r}, this code reads {READABLE_VERSIONS}"
        )
    check_meta_fields(meta, where)
    return meta


def check_meta_fields(meta: dict, where: str) -> None:
    """Types of the fields both formats share: model_keys, extra, model (the description)."""
    keys = meta.get("model_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{where}: model_keys must be a list of strings, got {type(keys).__name__}")
    if not isinstance(meta.get("extra") or {}, dict):
        raise ValueError(f"{where}: extra must be a dict, got {type(meta.get('extra')).__name__}")
    m = meta.get("model")
    if m is None:
        return
    if not isinstance(m, dict) or set(m) != {"class", "config", "dtype"}:
        raise ValueError(f"{where}: model must be a dict with keys class, config, dtype, got {m!r:.200}")
    if not isinstance(m["class"], str) or not m["class"].isidentifier():
        raise ValueError(f"{where}: model class must be a class name, got {m['class']!r:.100}")
    if not isinstance(m["config"], dict) or not all(isinstance(k, str) for k in m["config"]):
        raise ValueError(f"{where}: model config must be a dict of options, got {m['config']!r:.200}")
    if m["dtype"] not in DTYPES:
        raise ValueError(f"{where}: model dtype must be one of {DTYPES}, got {m['dtype']!r:.50}")


def _real(x, low: float, high: float | None = None, high_open: bool = False) -> bool:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < low:
        return False
    return high is None or (x < high if high_open else x <= high)


def check_optim_type(stored: str, own: str, path, name: str) -> None:
    """Refuse to load one optimizer's state into the other: Adam's weight_decay is an L2 penalty, AdamW's a
    decoupled shrinking, so the same number would mean another update."""
    if stored != own:
        raise ValueError(f"{name}: {os.fspath(path)!r} holds {stored} state, the optimizer is {own}")


def check_optim_meta(o, present: dict[str, int], where: str) -> int:
    """Validate Adam's recorded scalars and parameter count against the arrays actually in the file, before any
    list or array is built from them (a crafted n_params = 10**10 must not allocate). Returns n_params."""
    if not isinstance(o, dict):
        raise ValueError(f"{where}: optimizer metadata must be a dict, got {type(o).__name__}")
    absent = [k for k in (*OPTIM_SCALARS, "n_params") if k not in o]
    if absent:
        raise KeyError(f"{where}: optimizer scalars missing from '{META_KEY}': {absent}")
    n = o["n_params"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{where}: optimizer n_params must be an int >= 0, got {n!r:.50}")
    if present["exp_avg"] != n or present["exp_avg_sq"] != n:
        raise KeyError(
            f"{where}: optimizer n_params={n}, but the file holds {present['exp_avg']} exp_avg and "
            f"{present['exp_avg_sq']} exp_avg_sq arrays"
        )
    step, betas = o["step"], o["betas"]
    checks = {
        "step (an int >= 0)": not isinstance(step, bool) and isinstance(step, int) and step >= 0,
        "lr (a finite float >= 0)": _real(o["lr"], 0.0),
        "betas (two floats in [0, 1))": isinstance(betas, list) and len(betas) == 2
        and all(_real(b, 0.0, 1.0, high_open=True) for b in betas),
        "eps (a finite float > 0)": _real(o["eps"], 0.0) and o["eps"] > 0,
        "weight_decay (a finite float >= 0)": _real(o["weight_decay"], 0.0),
        f"type (one of {OPTIM_TYPES})": o.get("type", "Adam") in OPTIM_TYPES,
    }  # fmt: skip
    bad = [what for what, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"{where}: invalid optimizer metadata: " + ", ".join(
            f"{w.split()[0]}={o[w.split()[0]]!r:.50} must be {w[w.index('(') + 1 : -1]}" for w in bad))  # fmt: skip
    return n
