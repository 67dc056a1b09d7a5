"""The key/value cache of incremental decoding, PyTorch track: the twins of tfm_numpy.kv_cache's functions (chapter
21c's int8 and rolling caches included)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "cache_append",
    "reorder_cache",
    "quantize_rows",
    "dequantize_rows",
    "store_kv",
    "ring_store",
    "cache_nbytes",
]


def cache_append(cache: dict, name: str, new: torch.Tensor, axis: int) -> torch.Tensor:
    """Append `new` to cache[name] along `axis` in place, in a buffer cache[name + "_buf"] of cache["capacity"]
    positions allocated once; cache[name] is a view of the written part (as tfm_numpy.cache_append)."""
    old, buf = cache.get(name), cache.get(name + "_buf")
    if not cache.get("preallocate", True):  # the quadratic way, kept to measure the difference: copy all, each step
        cache[name] = new if old is None else torch.cat([old, new], dim=axis)
        return cache[name]
    t0 = 0 if old is None else old.shape[axis]
    t1 = t0 + new.shape[axis]
    if buf is None or buf.shape[axis] < t1:
        shape = list(new.shape)
        shape[axis] = max(t1, cache.get("capacity", 0), 2 * t0)
        buf = new.new_empty(shape)
        if t0:
            buf[_span(axis, 0, t0)] = old
        cache[name + "_buf"] = buf
    buf[_span(axis, t0, t1)] = new
    cache[name] = buf[_span(axis, 0, t1)]  # a view: no copy
    return cache[name]


def _span(axis: int, start: int, stop: int) -> tuple:
    return (slice(None),) * axis + (slice(start, stop),)


def reorder_cache(cache: dict, rows: torch.Tensor) -> dict:
    """The cache for the batch rows `rows` (repeats allowed), in that order, as tfm_numpy.reorder_cache."""
    if isinstance(cache, list):
        return [reorder_cache(v, rows) for v in cache]
    if not isinstance(cache, dict):
        return cache[rows] if isinstance(cache, torch.Tensor) else cache  # tensors are batch-first
    out = {}
    for key, value in cache.items():
        buf = cache.get(key + "_buf")
        if key.endswith("_buf") and key[:-4] in cache:
            continue  # handled with its view
        if buf is None:
            out[key] = reorder_cache(value, rows)
            continue
        used = tuple(slice(0, n) for n in value.shape[1:])
        new_buf = buf.new_empty((len(rows), *buf.shape[1:]))
        new_buf[(slice(None), *used)] = value[rows]
        out[key + "_buf"], out[key] = new_buf, new_buf[(slice(None), *used)]
    return out


# -- chapter 21c: an int8 cache and a rolling cache ------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes, one scale max|x| / 127 per row (last axis), as tfm_numpy.quantize_rows."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127  # (..., 1)
    codes = torch.round(x / torch.where(scale == 0, 1.0, scale))  # half to even, as np.rint
    return codes.clamp(-127, 127).to(torch.int8), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(scale.dtype) * scale


def store_kv(cache: dict, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the new keys and values to a layer's cache, return all so far as floats (int8 codes and scales in an
    int8 cache), as tfm_numpy.store_kv."""
    if cache.get("kv_dtype") != "int8":
        return cache_append(cache, "k", k, axis=2), cache_append(cache, "v", v, axis=2)
    out = []
    for name, x in (("k", k), ("v", v)):
        codes, scale = quantize_rows(x)
        out.append(dequantize_rows(cache_append(cache, name, codes, 2), cache_append(cache, name + "_scale", scale, 2)))
    return out[0], out[1]


def ring_store(cache: dict, name: str, new: torch.Tensor, keep: np.ndarray, slots: np.ndarray, size: int):
    """The rolling cache's store, as tfm_numpy.ring_store: the slots so far followed by the new positions, as floats;
    then the new positions still needed (`keep`) written into their `slots` (NumPy index arrays)."""
    int8 = cache.get("kv_dtype") == "int8"
    keep, slots = torch.from_numpy(keep).to(new.device), torch.from_numpy(slots).to(new.device)
    if name not in cache:
        B, H, _, dh = new.shape
        cache[name] = new.new_zeros((B, H, size, dh), dtype=torch.int8 if int8 else new.dtype)
        if int8:
            cache[name + "_scale"] = new.new_zeros((B, H, size, 1))
    if int8:
        codes, scale = quantize_rows(new)
        old = dequantize_rows(cache[name], cache[name + "_scale"])
        every = torch.cat([old, dequantize_rows(codes, scale)], dim=2)
        cache[name][:, :, slots], cache[name + "_scale"][:, :, slots] = codes[:, :, keep], scale[:, :, keep]
        return every
    every = torch.cat([cache[name], new], dim=2)  # (B, Hkv, size + Tn, dh)
    cache[name][:, :, slots] = new[:, :, keep]
    return every


def cache_nbytes(cache: dict) -> int:
    """The bytes of keys, values and scales a GPT cache holds, as tfm_numpy.cache_nbytes."""
    names = ("k", "v", "k_scale", "v_scale")
    return sum(layer[n].nelement() * layer[n].element_size() for layer in cache.get("layers", []) for n in names
               if n in layer)  # fmt: skip
