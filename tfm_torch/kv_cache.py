"""The key/value cache of incremental decoding, PyTorch track: the twins of tfm_numpy.kv_cache's functions."""

from __future__ import annotations

import torch

__all__ = ["cache_append", "reorder_cache"]


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
