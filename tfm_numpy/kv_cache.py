"""The key/value cache of incremental decoding, NumPy track: keys and values grown in place in buffers allocated
once (`cache_append`: MultiHeadAttention, GroupedQueryAttention, `Transformer.decode_step`), and the selection of
their rows that a beam search step makes (`reorder_cache`)."""

from __future__ import annotations

import numpy as np

__all__ = ["cache_append", "reorder_cache"]


def cache_append(cache: dict, name: str, new: np.ndarray, axis: int) -> np.ndarray:
    """Append `new` to cache[name] along `axis` without copying what is there: returns the grown cache[name].

    The positions live in a buffer, cache[name + "_buf"], allocated once with room for cache["capacity"] positions
    (the longest sequence the decoding will reach); each step writes its new positions in place, and cache[name]
    is a view of the part written so far. Growing by concatenation instead copies every earlier position at every
    step: quadratic in the length. (Past the capacity the buffer is reallocated at twice the size, so a cache
    without one still costs amortized O(1) copies per position.) cache["preallocate"] = False does exactly that
    concatenation instead, for comparison (chapter 15b, benchmarks/bench.py).
    """
    old, buf = cache.get(name), cache.get(name + "_buf")
    if not cache.get("preallocate", True):  # the quadratic way, kept to measure the difference: copy all, each step
        cache[name] = new if old is None else np.concatenate([old, new], axis=axis)
        return cache[name]
    t0 = 0 if old is None else old.shape[axis]
    t1 = t0 + new.shape[axis]
    if buf is None or buf.shape[axis] < t1:
        shape = list(new.shape)
        shape[axis] = max(t1, cache.get("capacity", 0), 2 * t0)
        buf = np.empty(shape, dtype=new.dtype)  # not touched until written: room costs no time
        if t0:
            buf[_span(axis, 0, t0)] = old
        cache[name + "_buf"] = buf
    buf[_span(axis, t0, t1)] = new
    cache[name] = buf[_span(axis, 0, t1)]  # a view: no copy
    return cache[name]


def append_position(cache: dict, name: str, new: np.ndarray, axis: int, t0: int) -> np.ndarray:
    """`cache_append` of the one position t0 (`new` of length 1 along `axis`) when the buffer has room for it (the
    usual case: a write and a view, nothing else); `cache_append` itself otherwise (the first step allocates)."""
    buf, old = cache.get(name + "_buf"), cache.get(name)
    if buf is None or buf.shape[axis] <= t0 or old is None or old.shape[axis] != t0:
        return cache_append(cache, name, new, axis)
    buf[_span(axis, t0, t0 + 1)] = new
    cache[name] = buf[_span(axis, 0, t0 + 1)]
    return cache[name]


def _span(axis: int, start: int, stop: int) -> tuple:
    """The index of positions start:stop along `axis` (every other axis whole)."""
    return (slice(None),) * axis + (slice(start, stop),)


def reorder_cache(cache: dict, rows: np.ndarray) -> dict:
    """The cache of `Transformer.decode_step` for the batch rows `rows` (repeats allowed), in that order: after a
    beam search step, new beam i continues the prefix of row rows[i], so it needs that row's keys and values.
    (The cross-attention's memory keys and values are gathered too; within a source they are the same rows.)
    A preallocated buffer (see `cache_append`) is gathered into a new one of the same capacity, copying only the
    positions written so far."""
    if isinstance(cache, list):
        return [reorder_cache(v, rows) for v in cache]
    if not isinstance(cache, dict):
        return cache[rows] if isinstance(cache, np.ndarray) else cache  # arrays are batch-first; the length stays
    out = {}
    for key, value in cache.items():
        buf = cache.get(key + "_buf")
        if key.endswith("_buf") and key[:-4] in cache:
            continue  # handled with its view
        if buf is None:
            out[key] = reorder_cache(value, rows)
            continue
        used = tuple(slice(0, n) for n in value.shape[1:])  # the written part of the buffer
        new_buf = np.empty((len(rows), *buf.shape[1:]), dtype=buf.dtype)
        new_buf[(slice(None), *used)] = value[rows]
        out[key + "_buf"], out[key] = new_buf, new_buf[(slice(None), *used)]
    return out
