"""FlashAttention by hand, PyTorch track: the same tiled forward and backward as tfm_numpy.flash (see its docstring),
as a `torch.autograd.Function`: its forward records no graph (no (Tq, Tk) array kept for autograd either) and saves
q, k, v, the output and lse, from which its backward recomputes each tile's probabilities."""

from __future__ import annotations

import math

import torch

from tfm_common.attention import mask_tile, tiles
from tfm_common.validate import check_size

from .masks import check_qkv
from .module import at_the_door

__all__ = ["flash_attention", "flash_attention_backward"]


def _prepare(name: str, q, k, v, mask, tile_size):
    if at_the_door():  # inside a module, its door has checked them
        check_qkv(q, k, v, mask=mask, name=name)
    tile = check_size(name, "tile_size", tile_size)
    if mask is not None:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    return tile, mask


def _scores(q_i, k_j, scale: float, m_ij):
    s = (q_i @ k_j.transpose(-1, -2)) * scale  # (..., Br, Bc)
    return s if m_ij is None else s.masked_fill(~m_ij, float("-inf"))


def _forward(q, k, v, mask, tile: int):
    """The tiled forward with the online softmax: (out (..., Tq, dv), lse (..., Tq))."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1])
    for rows in tiles(q.shape[-2], tile):
        q_i = q[..., rows, :]  # (..., Br, dk)
        m = q_i.new_full((*q_i.shape[:-1], 1), float("-inf"))  # running row max
        l = q_i.new_zeros(m.shape)  # running sum of exp(s - m)  # noqa: E741
        acc = q_i.new_zeros((*q_i.shape[:-1], v.shape[-1]))  # running sum of exp(s - m) v
        for cols in tiles(k.shape[-2], tile):
            m_ij = mask_tile(mask, rows, cols)
            if m_ij is not None and not bool(m_ij.any()):  # a tile with nothing allowed: skipped
                continue
            s = _scores(q_i, k[..., cols, :], scale, m_ij)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            shift = torch.where(torch.isfinite(m_new), m_new, 0.0)  # nothing allowed yet: any finite shift
            p = torch.exp(s - shift)
            alpha = torch.exp(m - shift)
            l = alpha * l + p.sum(dim=-1, keepdim=True)  # noqa: E741
            acc = alpha * acc + p @ v[..., cols, :]
            m = m_new
        empty = l == 0
        out[..., rows, :] = acc / torch.where(empty, 1.0, l)
        lse[..., rows] = torch.where(empty, float("-inf"), m + torch.log(l))[..., 0]
    return out, lse


def _check_saved(grad_out, q, out, lse) -> None:
    """The backward's own inputs, as the forward gave them (messages as tfm_numpy's): out (..., Tq, dv), grad_out of
    out's shape, lse (..., Tq), all of q's dtype."""
    name, lead = "flash_attention_backward", tuple(q.shape[:-1])  # (..., Tq)
    for arg, x in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {arg} expected a torch.Tensor (what flash_attention returned), got "
                            f"{type(x).__name__}")  # fmt: skip
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} expected dtype {q.dtype} (q's), got {x.dtype}")
    if tuple(out.shape[:-1]) != lead:
        raise ValueError(f"{name}: out expected shape {lead} + (dv,) (the forward's), got {tuple(out.shape)}")
    if grad_out.shape != out.shape:
        raise ValueError(f"{name}: grad_out and out must have one shape (flash_attention's output), got grad_out "
                         f"{tuple(grad_out.shape)} and out {tuple(out.shape)}")  # fmt: skip
    if tuple(lse.shape) != lead:
        raise ValueError(f"{name}: lse expected shape {lead} (q's without dk), got {tuple(lse.shape)}")


def flash_attention_backward(grad_out, q, k, v, out, lse, mask=None, *, tile_size: int = 64):
    """(dq, dk, dv) from dL/dout, the forward's inputs, out and lse: the tiles' P recomputed from lse."""
    tile, mask = _prepare("flash_attention_backward", q, k, v, mask, tile_size)
    _check_saved(grad_out, q, out, lse)
    scale = 1.0 / math.sqrt(q.shape[-1])
    big_d = (grad_out * out).sum(dim=-1, keepdim=True)  # (..., Tq, 1): rowsum(dO * O)
    lse_safe = torch.where(torch.isfinite(lse), lse, 0.0)[..., None]  # (..., Tq, 1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for cols in tiles(k.shape[-2], tile):
        k_j, v_j = k[..., cols, :], v[..., cols, :]
        for rows in tiles(q.shape[-2], tile):
            m_ij = mask_tile(mask, rows, cols)
            if m_ij is not None and not bool(m_ij.any()):
                continue
            q_i, do_i = q[..., rows, :], grad_out[..., rows, :]
            p = torch.exp(_scores(q_i, k_j, scale, m_ij) - lse_safe[..., rows, :])  # (..., Br, Bc)
            dv[..., cols, :] += p.transpose(-1, -2) @ do_i
            ds = p * (do_i @ v_j.transpose(-1, -2) - big_d[..., rows, :]) * scale  # dS = P * (dP - D)
            dq[..., rows, :] += ds @ k_j
            dk[..., cols, :] += ds.transpose(-1, -2) @ q_i
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, tile):
        out, lse = _forward(q, k, v, mask, tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.tile = mask, tile
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(grad_out, q, k, v, out, lse, ctx.mask, tile_size=ctx.tile)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, mask=None, *, tile_size: int = 64):
    """softmax(q k^T / sqrt(dk)) v in tiles, as tfm_numpy.flash_attention: returns (out (..., Tq, dv), lse (..., Tq)).

    Differentiable in q, k, v through the hand-written tiled backward (`flash_attention_backward`), not through
    autograd of the loop; lse carries no gradient.
    """
    tile, mask = _prepare("flash_attention", q, k, v, mask, tile_size)
    return _FlashAttention.apply(q, k, v, mask, tile)
