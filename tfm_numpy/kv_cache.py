"""The key/value cache of incremental decoding, NumPy track: keys and values grown in place in buffers allocated
once (`cache_append`: MultiHeadAttention, GroupedQueryAttention, `Transformer.decode_step`), and the selection of
their rows that a beam search step makes (`reorder_cache`); chapter 21c's variants: keys and values kept as int8 codes
(`store_kv`, `quantize_rows`) and the rolling cache of a sliding window (`ring_store`)."""

from __future__ import annotations

import numpy as np

__all__ = [
    "cache_append",
    "reorder_cache",
    "quantize_rows",
    "dequantize_rows",
    "store_kv",
    "ring_store",
    "cache_nbytes",
]


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


# -- chapter 21c: an int8 cache and a rolling cache ------------------------------------------------------------------


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes of x (..., d), one scale per row (the last axis): scale = max|x| / 127,
    codes = round(x / scale) in [-127, 127], so that codes * scale is within scale / 2 of x. Returns (codes int8
    (..., d), scales (..., 1) of x's dtype); a row of zeros gets scale 0 and codes 0. (A per-row quantizer of its
    own: the cache needs nothing more.)"""
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127  # (..., 1)
    codes = np.rint(x / np.where(scale == 0, 1, scale))  # round half to even, as torch.round
    return np.clip(codes, -127, 127).astype(np.int8), scale


def dequantize_rows(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes (..., d) int8 times their row's scale (..., 1): floats of the scale's dtype."""
    return codes.astype(scale.dtype) * scale


def store_kv(cache: dict, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Append the new keys and values (B, Hkv, Tn, dh) to one attention layer's cache (`cache_append`) and return all
    of them so far, as floats. A layer cache made with "kv_dtype": "int8" (`GPT.new_cache("int8")`) keeps int8 codes
    under "k", "v" and one scale per (position, head) under "k_scale", "v_scale" (B, Hkv, T, 1), dequantized here:
    what attention reads is codes * scale, within half a step of the float keys."""
    if cache.get("kv_dtype") != "int8":
        return cache_append(cache, "k", k, axis=2), cache_append(cache, "v", v, axis=2)
    out = []
    for name, x in (("k", k), ("v", v)):
        codes, scale = quantize_rows(x)
        out.append(dequantize_rows(cache_append(cache, name, codes, 2), cache_append(cache, name + "_scale", scale, 2)))
    return out[0], out[1]


def ring_store(cache: dict, name: str, new: np.ndarray, keep: np.ndarray, slots: np.ndarray, size: int) -> np.ndarray:
    """The rolling cache of a sliding window (tfm_common.rolling_cache): cache[name] (B, Hkv, size, dh) is allocated
    once (zeros: an empty slot is masked, never read); returns its keys (or values) so far followed by the new ones
    (B, Hkv, size + Tn, dh), as floats, then writes the new positions that stay needed (`keep`, bool (Tn,)) into
    their `slots`. int8 codes and scales when cache["kv_dtype"] is "int8", as `store_kv`."""
    int8 = cache.get("kv_dtype") == "int8"
    if name not in cache:
        B, H, _, dh = new.shape
        cache[name] = np.zeros((B, H, size, dh), dtype=np.int8 if int8 else new.dtype)
        if int8:
            cache[name + "_scale"] = np.zeros((B, H, size, 1), dtype=new.dtype)
    if int8:
        codes, scale = quantize_rows(new)
        every = np.concatenate([dequantize_rows(cache[name], cache[name + "_scale"]), dequantize_rows(codes, scale)], 2)
        cache[name][:, :, slots], cache[name + "_scale"][:, :, slots] = codes[:, :, keep], scale[:, :, keep]
        return every
    every = np.concatenate([cache[name], new], axis=2)  # (B, Hkv, size + Tn, dh)
    cache[name][:, :, slots] = new[:, :, keep]
    return every


def cache_nbytes(cache: dict) -> int:
    """The bytes a GPT cache (`GPT.forward_step`'s dict) holds in keys, values and scales: the written positions of a
    growing cache (its views), every slot of a rolling one."""
    names = ("k", "v", "k_scale", "v_scale")
    return sum(layer[n].nbytes for layer in cache.get("layers", []) for n in names if n in layer)
