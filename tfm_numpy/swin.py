"""Swin Transformer pieces (Liu et al., 2021), NumPy track: attention inside windows, shifted windows with their
mask, a relative position bias, patch merging, and a small classifier; forward and hand-written backward.

Tokens live on an H x W grid, stored row-major as (B, H W, C) (the order `PatchEmbedding` gives). Inside a block
they are viewed as (B, H, W, C) and cut into M x M windows:

    window_partition   (B, H, W, C) -> (B nW, M M, C)      windows row-major, tokens row-major inside each
    window_reverse     (B nW, M M, C) -> (B, H, W, C)       its inverse
    cyclic_shift       (B, H, W, C) rolled by -s on both axes (cyclic_shift(x, -s) undoes it)

All three only move entries, so each one's backward is its inverse applied to the gradient.
`shifted_window_mask(H, W, M, s)` is boolean, (nW, M M, M M), True = may attend (the library's convention).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tfm_common.config import check_window_grid, own_init
from tfm_common.model_doors import PatchMergingDoor, SwinBlockDoor, SwinDoor, WindowAttentionDoor
from tfm_common.validate import check_int, check_size, check_window_count

from .layers import Dropout, LayerNorm, Linear
from .module import Module, ModuleList, as_rng, at_the_door, check_dtype, check_input, normal_parameter
from .sublayers import PositionwiseFeedForward
from .vit import PatchEmbedding

__all__ = ["window_partition", "window_reverse", "cyclic_shift", "shifted_window_mask", "relative_position_index",
           "WindowAttention", "SwinBlock", "PatchMerging", "Swin"]  # fmt: skip


def window_partition(x: np.ndarray, window_size: int) -> np.ndarray:
    """(B, H, W, C) -> (B nW, M M, C): non-overlapping M x M windows, each a short sequence of its own."""
    B, H, W, C = x.shape
    check_window_grid("window_partition", H, W, window_size)
    M = window_size
    x = x.reshape(B, H // M, M, W // M, M, C).transpose(0, 1, 3, 2, 4, 5)  # (B, H/M, W/M, M, M, C)
    return x.reshape(-1, M * M, C)


def window_reverse(windows: np.ndarray, window_size: int, H: int, W: int) -> np.ndarray:
    """(B nW, M M, C) -> (B, H, W, C): the inverse of `window_partition`. B is what is left, len(windows) / nW with
    nW = (H/M)(W/M): a count that is not a whole number of images is refused, but an H and W of another nW that
    divides the count cannot be told from another batch size (pass the H and W that window_partition was given)."""
    check_window_grid("window_reverse", H, W, window_size)
    if at_the_door():  # inside SwinBlock, its own windows
        _check_windows("window_reverse", "windows", windows, 3)
        check_window_count("window_reverse", tuple(windows.shape), window_size, H, W)
    M, C = window_size, windows.shape[-1]
    x = windows.reshape(-1, H // M, W // M, M, M, C).transpose(0, 1, 3, 2, 4, 5)  # (B, H/M, M, W/M, M, C)
    return x.reshape(-1, H, W, C)


def cyclic_shift(x: np.ndarray, shift: int) -> np.ndarray:
    """(B, H, W, C) rolled up and left by `shift` (row i+s moves to row i, with wrap-around); -shift undoes it."""
    if at_the_door():  # inside SwinBlock, its own grid and shift
        _check_windows("cyclic_shift", "x", x, 4)
        check_int("cyclic_shift", "shift", shift)
    return np.roll(x, (-shift, -shift), axis=(1, 2))


def _check_windows(owner: str, arg: str, x, ndim: int) -> None:
    """A numpy.ndarray of `ndim` dimensions: (B nW, M M, C) windows or a (B, H, W, C) grid."""
    if not isinstance(x, np.ndarray) or len(x.shape) != ndim:
        got = f"shape {tuple(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{owner}: {arg} expected a numpy.ndarray of {ndim} dimensions, got {got}")


def shifted_window_mask(H: int, W: int, window_size: int, shift: int) -> np.ndarray:
    """(nW, M M, M M) bool, True = may attend, for windows taken after `cyclic_shift(x, shift)`.

    After the roll, the last windows along each axis hold tokens from opposite edges of the image, side by side.
    Label the shifted grid's rows by region, [0, H-M), [H-M, H-s), [H-s, H) (the last one wrapped around from
    the top), the columns alike; two tokens may attend to each other iff their (row, column) labels are equal.
    With shift = 0 every entry is True.
    """
    check_window_grid("shifted_window_mask", H, W, window_size, shift)
    M = window_size
    label = np.zeros((1, H, W, 1), dtype=np.int64)
    if shift:
        edges = (slice(0, -M), slice(-M, -shift), slice(-shift, None))
        for i, rows in enumerate(edges):
            for j, cols in enumerate(edges):
                label[:, rows, cols] = 3 * i + j
    windows = window_partition(label, M)[..., 0]  # (nW, M M): each token's region
    return windows[:, :, None] == windows[:, None, :]  # (nW, M M, M M)


def relative_position_index(window_size: int) -> np.ndarray:
    """(M M, M M) ints: for tokens i, j of a window, the row of the bias table for their offset
    (dy, dx) = pos_i - pos_j, each in [-(M-1), M-1], numbered (dy + M - 1) (2M - 1) + (dx + M - 1)."""
    M = check_size("relative_position_index", "window_size", window_size)
    yy, xx = np.divmod(np.arange(M * M), M)  # each token's (row, column) in the window
    dy, dx = yy[:, None] - yy[None, :], xx[:, None] - xx[None, :]
    return (dy + M - 1) * (2 * M - 1) + (dx + M - 1)


class WindowAttention(WindowAttentionDoor, Module):
    """Multi-head self-attention inside each window, with a learned relative position bias:

        A = softmax(Q K^T / sqrt(dk) + B[index] + mask),   B = relative_position_bias_table ((2M-1)^2, heads)

    forward(x (B nW, M M, d), mask (nW, M M, M M) bool or None) -> (B nW, M M, d); backward(dy) -> dx.
    Projections named as in MultiHeadAttention (`q_proj`, `k_proj`, `v_proj`, `out_proj`). The bias table
    starts N(0, 0.02^2). A masked pair gets weight exactly 0 (score -inf), as the library's attention does.
    """

    _mask_kind = (np.ndarray, np.bool_, "array")  # see tfm_common.model_doors
    _check_float = staticmethod(check_input)

    def _split(self, x: np.ndarray) -> np.ndarray:
        Bw, N, _ = x.shape
        return x.reshape(Bw, N, self.n_heads, self.d_head).transpose(0, 2, 1, 3)  # (Bw, h, N, dk)

    def _merge(self, x: np.ndarray) -> np.ndarray:
        Bw, _, N, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(Bw, N, self.d_model)

    def bias(self) -> np.ndarray:
        """(heads, M M, M M): the table's rows gathered by the offset of each pair of tokens."""
        return self.relative_position_bias_table.data[self.index].transpose(2, 0, 1)

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        q, k, v = (self._split(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))  # (Bw, h, N, dk)
        scores = q @ k.transpose(0, 1, 3, 2) * (1.0 / math.sqrt(self.d_head)) + self.bias()  # (Bw, h, N, N)
        keep = _window_mask(mask, x.shape[0])  # (Bw, 1, N, N) or None
        p = _masked_softmax(scores, keep)
        p_drop = self.dropout(p)
        self.attn_weights = p
        self._cache = (q, k, v, p, p_drop)
        return self.out_proj(self._merge(p_drop @ v))  # (Bw, N, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        q, k, v, p, p_drop = self._saved()
        d_ctx = self._split(self.out_proj.backward(grad_out))  # (Bw, h, N, dk)
        dv = p_drop.transpose(0, 1, 3, 2) @ d_ctx
        dp = self.dropout.backward(d_ctx @ v.transpose(0, 1, 3, 2))  # (Bw, h, N, N)
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))  # softmax backward; 0 where masked (p = 0)
        # the bias entered every window's scores: sum over windows, then scatter into the table rows by offset
        d_bias = ds.sum(axis=0).transpose(1, 2, 0).reshape(-1, self.n_heads)  # (N N, h)
        np.add.at(self.relative_position_bias_table.grad, self.index.reshape(-1), d_bias)
        ds *= 1.0 / math.sqrt(self.d_head)
        dq, dk = ds @ k, ds.transpose(0, 1, 3, 2) @ q
        dx = self.q_proj.backward(self._merge(dq))
        dx += self.k_proj.backward(self._merge(dk))
        dx += self.v_proj.backward(self._merge(dv))  # x fed queries, keys and values: the gradients add
        return dx


def _window_mask(mask, n_windows_total: int):
    """(nW, N, N) bool -> (B nW, 1, N, N): window w of every image gets mask[w] (windows are image-major)."""
    if mask is None:
        return None
    reps = n_windows_total // mask.shape[0]
    return np.broadcast_to(mask[None], (reps, *mask.shape)).reshape(n_windows_total, 1, *mask.shape[1:])


def _masked_softmax(scores: np.ndarray, keep) -> np.ndarray:
    """Softmax over the last axis with masked entries at exactly 0 (every row here keeps its own token)."""
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class SwinBlock(SwinBlockDoor, Module):
    """One Swin Transformer block, Pre-LN, on a `resolution` = (H, W) grid of tokens x (B, H W, d):

        x = x + dropout(reverse(WindowAttention(partition(shift(norm1(x))), mask)))   (then unshift)
        x = x + dropout(ff(norm2(x)))

    shift = 0: regular windows (W-MSA); shift = M // 2 in every other block: shifted windows (SW-MSA), so that
    information crosses the window borders of the block before. The mask is built once, at construction.
    """

    _check_float = staticmethod(check_input)  # see tfm_common.model_doors

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._cache = x.shape  # a forward to differentiate
        x = x + self.dropout1(self._attend(self.norm1(x)))
        return x + self.dropout2(self.ff(self.norm2(x)))  # (B, H W, d)

    def _attend(self, x: np.ndarray) -> np.ndarray:
        B, (H, W), M = x.shape[0], self.resolution, self.window_size
        grid = cyclic_shift(x.reshape(B, H, W, -1), self.shift)  # (B, H, W, d)
        out = self.attn(window_partition(grid, M), self.mask)  # (B nW, M M, d)
        return cyclic_shift(window_reverse(out, M, H, W), -self.shift).reshape(B, H * W, -1)

    def _attend_backward(self, grad_out: np.ndarray) -> np.ndarray:
        B, (H, W), M = grad_out.shape[0], self.resolution, self.window_size
        d_windows = window_partition(cyclic_shift(grad_out.reshape(B, H, W, -1), self.shift), M)  # each step's inverse
        dgrid = window_reverse(self.attn.backward(d_windows), M, H, W)
        return cyclic_shift(dgrid, -self.shift).reshape(B, H * W, -1)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        self._saved()  # once per forward
        dx = grad_out + self.norm2.backward(self.ff.backward(self.dropout2.backward(grad_out)))
        return dx + self.norm1.backward(self._attend_backward(self.dropout1.backward(dx)))


class PatchMerging(PatchMergingDoor, Module):
    """Halve the grid, double the width: each 2x2 group of tokens concatenated (4d), normalized, mapped to 2d.

    x (B, H W, d) -> (B, H/2 W/2, 2d). The concatenation order is Swin's: (even row, even col), (odd, even),
    (even, odd), (odd, odd). Submodules `norm` (LayerNorm(4d)) and `reduction` (Linear(4d, 2d), no bias).
    """

    _check_float = staticmethod(check_input)  # see tfm_common.model_doors

    def forward(self, x: np.ndarray) -> np.ndarray:
        (H, W), d, B = self.resolution, self.d_model, x.shape[0]
        self._cache = x.shape
        # (B, H/2, 2 [row parity], W/2, 2 [col parity], d) -> (B, H/2, W/2, col parity, row parity, d): Swin's order
        groups = x.reshape(B, H // 2, 2, W // 2, 2, d).transpose(0, 1, 3, 4, 2, 5).reshape(B, H * W // 4, 4 * d)
        return self.reduction(self.norm(groups))  # (B, H W / 4, 2d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        shape = self._saved()
        (H, W), d, B = self.resolution, self.d_model, shape[0]
        d_groups = self.norm.backward(self.reduction.backward(grad_out))  # (B, H W / 4, 4d)
        return d_groups.reshape(B, H // 2, W // 2, 2, 2, d).transpose(0, 1, 4, 2, 3, 5).reshape(shape)


class Swin(SwinDoor, Module):
    """A small Swin classifier: patches -> stages of SwinBlocks (shift 0, M/2, 0, M/2, ...) with PatchMerging
    between stages -> LayerNorm -> mean over tokens -> Linear. No absolute positions: the relative position
    bias of every window attention carries where tokens are.

    Stage i works on a (G / 2^i)^2 grid at width d_model 2^i with n_heads[i] heads and d_ff = mlp_ratio * width.
    `model(images)` -> logits (B, n_classes); `backward(dlogits)` fills the gradients and returns dL/dimages.
    """

    def _blocks(self):
        """Every module of the body in forward order."""
        for i, stage in enumerate(self.stages):
            yield from stage
            if i < len(self.merges):
                yield self.merges[i]

    def forward(self, images: np.ndarray) -> np.ndarray:
        x = self.dropout(self.patch_embed(images))  # (B, N, d)
        for block in self._blocks():
            x = block(x)
        h = self.norm(x)  # (B, N', d')
        self._cache = h.shape
        return self.head(h.mean(axis=1))  # (B, K)

    def backward(self, grad_logits: np.ndarray) -> np.ndarray:
        h_shape = self._saved()
        d_pooled = self.head.backward(grad_logits)  # (B, d')
        dx = self.norm.backward(np.repeat(d_pooled[:, None] / h_shape[1], h_shape[1], axis=1))
        for block in reversed(list(self._blocks())):
            dx = block.backward(dx)
        return self.patch_embed.backward(self.dropout.backward(dx))  # (B, C, H, W)


# the building blocks of the constructors written in tfm_common.model_doors (SwinDoor, WindowAttentionDoor,
# SwinBlockDoor, PatchMergingDoor); a constant (a mask, an index) is kept as an attribute
Swin._parts = WindowAttention._parts = SwinBlock._parts = PatchMerging._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_rng, ModuleList=ModuleList, LayerNorm=LayerNorm, Linear=Linear, Dropout=Dropout,
    PatchEmbedding=PatchEmbedding, SwinBlock=SwinBlock, PatchMerging=PatchMerging, WindowAttention=WindowAttention,
    PositionwiseFeedForward=PositionwiseFeedForward, shifted_window_mask=shifted_window_mask,
    relative_position_index=relative_position_index, normal_parameter=normal_parameter,
    keep_constant=setattr,
)  # fmt: skip
for _cls in (Swin, WindowAttention, SwinBlock, PatchMerging):
    own_init(_cls, dtype=np.float32)  # tfm_numpy's default dtype
