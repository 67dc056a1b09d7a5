"""Swin Transformer pieces, PyTorch track: the same functions, classes, arguments and state_dict keys as
tfm_numpy.swin; autograd does the backward. Masks are boolean, True = may attend."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch
from torch import nn

from tfm_common.config import check_window_grid, own_init
from tfm_common.model_doors import PatchMergingDoor, SwinBlockDoor, SwinDoor, WindowAttentionDoor
from tfm_common.validate import check_int, check_size, check_window_count

from .layers import Dropout, LayerNorm, Linear
from .module import Module, as_generator, at_the_door, check_dtype, check_input, normal_parameter
from .sublayers import PositionwiseFeedForward
from .vit import PatchEmbedding

__all__ = ["window_partition", "window_reverse", "cyclic_shift", "shifted_window_mask", "relative_position_index",
           "WindowAttention", "SwinBlock", "PatchMerging", "Swin"]  # fmt: skip


def window_partition(x: torch.Tensor, window_size: int) -> torch.Tensor:
    """(B, H, W, C) -> (B nW, M M, C)."""
    B, H, W, C = x.shape
    check_window_grid("window_partition", H, W, window_size)
    M = window_size
    return x.reshape(B, H // M, M, W // M, M, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, M * M, C)


def window_reverse(windows: torch.Tensor, window_size: int, H: int, W: int) -> torch.Tensor:
    """(B nW, M M, C) -> (B, H, W, C)."""
    check_window_grid("window_reverse", H, W, window_size)
    if at_the_door():  # inside SwinBlock, its own windows
        _check_windows("window_reverse", "windows", windows, 3)
        check_window_count("window_reverse", tuple(windows.shape), window_size, H, W)
    M, C = window_size, windows.shape[-1]
    return windows.reshape(-1, H // M, W // M, M, M, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, H, W, C)


def cyclic_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, H, W, C) rolled up and left by `shift`; -shift undoes it."""
    if at_the_door():  # inside SwinBlock, its own grid and shift
        _check_windows("cyclic_shift", "x", x, 4)
        check_int("cyclic_shift", "shift", shift)
    return torch.roll(x, (-shift, -shift), dims=(1, 2))


def _check_windows(owner: str, arg: str, x, ndim: int) -> None:
    """A torch.Tensor of `ndim` dimensions: (B nW, M M, C) windows or a (B, H, W, C) grid."""
    if not isinstance(x, torch.Tensor) or len(x.shape) != ndim:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: {arg} expected a torch.Tensor of {ndim} dimensions, got {got}")


def shifted_window_mask(H: int, W: int, window_size: int, shift: int) -> torch.Tensor:
    """(nW, M M, M M) torch.bool, True = may attend (see tfm_numpy.shifted_window_mask)."""
    check_window_grid("shifted_window_mask", H, W, window_size, shift)
    M = window_size
    label = torch.zeros(1, H, W, 1, dtype=torch.int64)
    if shift:
        edges = (slice(0, -M), slice(-M, -shift), slice(-shift, None))
        for i, rows in enumerate(edges):
            for j, cols in enumerate(edges):
                label[:, rows, cols] = 3 * i + j
    windows = window_partition(label, M)[..., 0]
    return windows[:, :, None] == windows[:, None, :]


def relative_position_index(window_size: int) -> torch.Tensor:
    """(M M, M M) int64: the bias table's row for each pair's offset (see tfm_numpy.relative_position_index)."""
    M = check_size("relative_position_index", "window_size", window_size)
    yy, xx = torch.arange(M * M) // M, torch.arange(M * M) % M
    dy, dx = yy[:, None] - yy[None, :], xx[:, None] - xx[None, :]
    return (dy + M - 1) * (2 * M - 1) + (dx + M - 1)


class WindowAttention(WindowAttentionDoor, Module):
    """Multi-head self-attention inside each window with a relative position bias (twin of tfm_numpy's)."""

    _mask_kind = (torch.Tensor, torch.bool, "tensor")  # see tfm_common.model_doors
    _check_float = staticmethod(check_input)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        Bw, N, _ = x.shape
        return x.reshape(Bw, N, self.n_heads, self.d_head).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        Bw, _, N, _ = x.shape
        return x.transpose(1, 2).reshape(Bw, N, self.d_model)

    def bias(self) -> torch.Tensor:
        """(heads, M M, M M)."""
        return self.relative_position_bias_table[self.index].permute(2, 0, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (self._split(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))  # (Bw, h, N, dk)
        scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(self.d_head)) + self.bias()  # (Bw, h, N, N)
        keep = _window_mask(mask, x.shape[0])  # (Bw, 1, N, N) or None
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        self.attn_weights = p.detach()
        return self.out_proj(self._merge(self.dropout(p) @ v))


def _window_mask(mask, n_windows_total: int):
    """(nW, N, N) bool -> (B nW, 1, N, N): window w of every image gets mask[w] (windows are image-major)."""
    if mask is None:
        return None
    return mask.repeat(n_windows_total // mask.shape[0], 1, 1)[:, None]


class SwinBlock(SwinBlockDoor, Module):
    """One Pre-LN Swin block on an (H, W) grid of tokens (B, H W, d), regular (shift 0) or shifted windows."""

    _check_float = staticmethod(check_input)  # see tfm_common.model_doors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout1(self._attend(self.norm1(x)))
        return x + self.dropout2(self.ff(self.norm2(x)))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        B, (H, W), M = x.shape[0], self.resolution, self.window_size
        grid = cyclic_shift(x.reshape(B, H, W, -1), self.shift)
        out = self.attn(window_partition(grid, M), self.mask)
        return cyclic_shift(window_reverse(out, M, H, W), -self.shift).reshape(B, H * W, -1)


class PatchMerging(PatchMergingDoor, Module):
    """(B, H W, d) -> (B, H/2 W/2, 2d): 2x2 groups concatenated, LayerNorm(4d), Linear(4d, 2d, bias=False)."""

    _check_float = staticmethod(check_input)  # see tfm_common.model_doors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (H, W), d, B = self.resolution, self.d_model, x.shape[0]
        groups = x.reshape(B, H // 2, 2, W // 2, 2, d).permute(0, 1, 3, 4, 2, 5).reshape(B, H * W // 4, 4 * d)
        return self.reduction(self.norm(groups))


class Swin(SwinDoor, Module):
    """A small Swin classifier, the twin of tfm_numpy.Swin (same arguments, same keys)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.patch_embed(images))
        for i, stage in enumerate(self.stages):
            for block in stage:
                x = block(x)
            if i < len(self.merges):
                x = self.merges[i](x)
        return self.head(self.norm(x).mean(dim=1))


# the building blocks of the constructors written in tfm_common.model_doors (SwinDoor, WindowAttentionDoor,
# SwinBlockDoor, PatchMergingDoor); a constant (a mask, an index) is kept as a buffer, not saved
Swin._parts = WindowAttention._parts = SwinBlock._parts = PatchMerging._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_generator, ModuleList=nn.ModuleList, LayerNorm=LayerNorm, Linear=Linear,
    Dropout=Dropout, PatchEmbedding=PatchEmbedding, SwinBlock=SwinBlock, PatchMerging=PatchMerging,
    WindowAttention=WindowAttention, PositionwiseFeedForward=PositionwiseFeedForward,
    shifted_window_mask=shifted_window_mask, relative_position_index=relative_position_index,
    normal_parameter=normal_parameter, keep_constant=functools.partial(nn.Module.register_buffer, persistent=False),
)  # fmt: skip
for _cls in (Swin, WindowAttention, SwinBlock, PatchMerging):
    own_init(_cls)  # a wrong argument is refused in the name of the class built, not of its door
