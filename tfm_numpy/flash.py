"""FlashAttention by hand, NumPy track: attention in tiles with the online softmax, forward and backward.

The explicit attention (`scaled_dot_product_attention`) forms the scores S = Q K^T / sqrt(dk) and the weights
P = softmax(S), two (..., Tq, Tk) arrays: memory quadratic in the length. Here the keys and values are read in
tiles of `tile_size`; for each block of queries a running row max m, a running sum l and an unnormalized
output acc are kept (the online softmax), and only one (..., Br, Bc) tile of scores exists at a time:

    m' = max(m, rowmax(S_ij))        l' = exp(m - m') l + rowsum(exp(S_ij - m'))
    acc' = exp(m - m') acc + exp(S_ij - m') V_j         and at the end   O = acc / l,  lse = m + log(l)

The backward (as FlashAttention-2, Dao 2023) saves only O and the per-row log-sum-exp `lse`, and recomputes
each tile's probabilities P_ij = exp(S_ij - lse) from them; with D = rowsum(dO * O) (equal to rowsum(dP * P)):

    dV_j += P_ij^T dO_i     dP_ij = dO_i V_j^T     dS_ij = P_ij * (dP_ij - D_i)
    dQ_i += dS_ij K_j / sqrt(dk)     dK_j += dS_ij^T Q_i / sqrt(dk)

Masks are boolean, True = may attend, and broadcast against the scores (..., Tq, Tk) as in `attention`
((B, 1, 1, Tk) padding, (1, 1, T, T) causal); they are sliced tile by tile, and a tile with no allowed entry
(above the diagonal of a causal mask) is skipped without computing its scores. A query row with nothing to
attend to gives a zero output row and zero gradients, as the explicit attention does; its lse is -inf.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from tfm_common.attention import mask_tile, tiles
from tfm_common.validate import check_size

from .masks import check_qkv
from .module import at_the_door

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_counts"]


def _prepare(name: str, q, k, v, mask, tile_size):
    """Checks shared by forward and backward (a module's door has made them); the mask made at least 2-D so that its
    tiles can be sliced."""
    if at_the_door():
        check_qkv(q, k, v, mask=mask, name=name)
    tile = check_size(name, "tile_size", tile_size)
    if mask is not None:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    return tile, mask


def _scores(q_i, k_j, scale: float, m_ij):
    """One tile of scores (..., Br, Bc), masked entries -inf (exp(-inf) = 0: they get no weight)."""
    s = q_i @ np.swapaxes(k_j, -1, -2)  # (..., Br, dk) @ (..., dk, Bc) -> (..., Br, Bc), a new array
    s *= scale
    if m_ij is not None:
        np.copyto(s, -np.inf, where=~m_ij)
    return s


def flash_attention(q, k, v, mask=None, *, tile_size: int = 64):
    """softmax(q k^T / sqrt(dk)) v in tiles of `tile_size` queries x `tile_size` keys, never forming (Tq, Tk).

    q (..., Tq, dk), k (..., Tk, dk), v (..., Tk, dv); mask boolean, True = may attend, broadcasting to
    (..., Tq, Tk). Returns (out (..., Tq, dv), lse (..., Tq)): lse is the log-sum-exp of each row's allowed scores,
    what the backward needs instead of the weights (-inf, and out = 0, for a row with nothing to attend to).
    """
    tile, mask = _prepare("flash_attention", q, k, v, mask, tile_size)
    scale = 1.0 / math.sqrt(q.shape[-1])  # a python float: float32 stays float32
    out = np.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)  # (..., Tq, dv)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)  # (..., Tq)
    for rows in tiles(q.shape[-2], tile):
        q_i = q[..., rows, :]  # (..., Br, dk): read once
        out[..., rows, :], lse[..., rows] = _forward_rows(q_i, k, v, mask, rows, tile, scale)
    return out, lse


def _forward_rows(q_i, k, v, mask, rows: slice, tile: int, scale: float):
    """One block of queries against every block of keys: the online softmax. Returns (out_i, lse_i)."""
    m = np.full((*q_i.shape[:-1], 1), -np.inf, dtype=q_i.dtype)  # (..., Br, 1): the row max so far
    l = np.zeros_like(m)  # (..., Br, 1): sum of exp(s - m) so far  # noqa: E741
    acc = np.zeros((*q_i.shape[:-1], v.shape[-1]), dtype=q_i.dtype)  # (..., Br, dv): sum of exp(s - m) v so far
    for cols in tiles(k.shape[-2], tile):
        m_ij = mask_tile(mask, rows, cols)
        if m_ij is not None and not m_ij.any():  # nothing allowed in this tile (causal: above the diagonal)
            continue
        k_j, v_j = k[..., cols, :], v[..., cols, :]  # (..., Bc, dk), (..., Bc, dv)
        s = _scores(q_i, k_j, scale, m_ij)  # (..., Br, Bc)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        shift = np.where(np.isfinite(m_new), m_new, 0)  # a row with nothing allowed yet: any finite shift
        s -= shift
        p = np.exp(s, out=s)  # (..., Br, Bc): exp(s - m'), in place
        alpha = np.exp(m - shift)  # (..., Br, 1): rescales what was summed under the old max (0 at the start)
        l = alpha * l + p.sum(axis=-1, keepdims=True)  # noqa: E741
        acc *= alpha
        acc += p @ v_j
        m = m_new
    empty = l == 0  # (..., Br, 1): rows with nothing to attend to
    out_i = acc / np.where(empty, 1, l)  # acc is 0 there: a zero row, as the explicit attention gives
    with np.errstate(divide="ignore"):  # log(0) = -inf for those rows, on purpose
        lse_i = np.where(empty, -np.inf, m + np.log(l))
    return out_i, lse_i[..., 0]


def _check_saved(grad_out, q, out, lse) -> None:
    """The backward's own inputs, as the forward gave them (messages as tfm_torch's): out (..., Tq, dv), grad_out of
    out's shape, lse (..., Tq), all of q's dtype."""
    name, lead = "flash_attention_backward", q.shape[:-1]  # (..., Tq)
    for arg, x in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: {arg} expected a numpy.ndarray (what flash_attention returned), got "
                            f"{type(x).__name__}")  # fmt: skip
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} expected dtype {q.dtype} (q's), got {x.dtype}")
    if out.shape[:-1] != lead:
        raise ValueError(f"{name}: out expected shape {lead} + (dv,) (the forward's), got {out.shape}")
    if grad_out.shape != out.shape:
        raise ValueError(f"{name}: grad_out and out must have one shape (flash_attention's output), got grad_out "
                         f"{grad_out.shape} and out {out.shape}")  # fmt: skip
    if lse.shape != lead:
        raise ValueError(f"{name}: lse expected shape {lead} (q's without dk), got {lse.shape}")


def flash_attention_backward(grad_out, q, k, v, out, lse, mask=None, *, tile_size: int = 64):
    """Backward of `flash_attention`: (dq, dk, dv) from dL/dout (..., Tq, dv), the forward's inputs, its out and lse.

    The weights are not stored: each tile's P = exp(S - lse) is recomputed (FlashAttention-2). `mask` and
    `tile_size` as in the forward (any tile size gives the same gradients, to rounding).
    """
    tile, mask = _prepare("flash_attention_backward", q, k, v, mask, tile_size)
    _check_saved(grad_out, q, out, lse)
    scale = 1.0 / math.sqrt(q.shape[-1])
    big_d = (grad_out * out).sum(axis=-1, keepdims=True)  # (..., Tq, 1): D_i = rowsum(dO * O) = rowsum(dP * P)
    lse_safe = np.where(np.isfinite(lse), lse, 0)[..., None]  # (..., Tq, 1); rows with lse = -inf have P = 0
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for cols in tiles(k.shape[-2], tile):  # outer loop over keys: dK_j, dV_j accumulate in one place
        k_j, v_j = k[..., cols, :], v[..., cols, :]
        for rows in tiles(q.shape[-2], tile):
            m_ij = mask_tile(mask, rows, cols)
            if m_ij is not None and not m_ij.any():
                continue
            q_i, do_i = q[..., rows, :], grad_out[..., rows, :]
            s = _scores(q_i, k_j, scale, m_ij)  # (..., Br, Bc)
            s -= lse_safe[..., rows, :]
            p = np.exp(s, out=s)  # the forward's weights of this tile, recomputed
            dv[..., cols, :] += np.swapaxes(p, -1, -2) @ do_i  # (..., Bc, Br) @ (..., Br, dv)
            ds = do_i @ np.swapaxes(v_j, -1, -2)  # dP_ij (..., Br, Bc)
            ds -= big_d[..., rows, :]
            ds *= p  # dS = P * (dP - D)
            ds *= scale  # through S = q k^T / sqrt(dk)
            dq[..., rows, :] += ds @ k_j  # (..., Br, Bc) @ (..., Bc, dk)
            dk[..., cols, :] += np.swapaxes(ds, -1, -2) @ q_i  # (..., Bc, Br) @ (..., Br, dk)
    return dq, dk, dv


class _CountedReads(np.ndarray):
    """A view of q, k or v that counts every slice taken from it: `counts[name]` elements in `counts[name, "slices"]`
    slices. The tiled loops read their inputs only by slicing, so this measures what they read."""

    def __getitem__(self, index):
        part = super().__getitem__(index).view(np.ndarray)
        self.counts[self.name] += part.size
        self.counts[self.name, "slices"] += 1
        return part


def flash_attention_counts(q, k, v, mask=None, *, tile_size: int = 64) -> dict[str, int]:
    """Runs `flash_attention` and counts what it reads and writes: the elements of q, k, v read and of the output
    written (each once), and the tiles computed (each reads one block of keys) and skipped."""
    counts = collections.Counter()
    views = [np.asarray(x).view(_CountedReads) for x in (q, k, v)]
    for view, name in zip(views, "qkv", strict=True):
        view.counts, view.name = counts, name
    out, _ = flash_attention(*views, mask, tile_size=tile_size)
    computed = counts["k", "slices"]
    every = math.ceil(q.shape[-2] / tile_size) * math.ceil(k.shape[-2] / tile_size)
    return {"q": counts["q"], "k": counts["k"], "v": counts["v"], "o": out.size, "tiles": computed,
            "tiles_skipped": every - computed}  # fmt: skip
