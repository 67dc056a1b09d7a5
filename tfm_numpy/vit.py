"""The Vision Transformer (Dosovitskiy et al., 2021), NumPy track: an image as a sequence of patches, read by a
Pre-LN encoder, classified from one token.

    images (B, C, H, W) -> patches (B, N, C p p) -> Linear -> (B, N, d)       N = (H / p) (W / p), row-major
    [cls; patches] + learned positions -> dropout -> Encoder (Pre-LN, final LayerNorm) -> pool -> Linear -> (B, K)

`pool="cls"` reads the class token's output (the paper); `pool="mean"` averages the patch tokens' outputs and has
no class token. The encoder is the library's `Encoder(norm_first=True)` with GELU, unchanged: an image is just
a sequence with no padding, so no mask.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tfm_common.config import own_init
from tfm_common.model_doors import PatchEmbeddingDoor, ViTDoor

from .encoder_decoder import Encoder
from .layers import Dropout, Linear
from .module import Module, as_rng, check_dtype, check_input, normal_parameter, scale_
from .positional import LearnedPositionalEmbedding

__all__ = ["PatchEmbedding", "ViT", "patchify", "unpatchify"]


def patchify(images: np.ndarray, patch_size: int) -> np.ndarray:
    """(B, C, H, W) -> (B, N, C p p): patches in row-major order, each flattened channel-first as (C, p, p), the
    order of a `Conv2d` weight (d, C, p, p), so that one Linear on patches IS a strided convolution."""
    B, C, H, W = images.shape
    gh, gw, p = H // patch_size, W // patch_size, patch_size
    x = images.reshape(B, C, gh, p, gw, p)  # split each spatial axis into (grid, within-patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * p * p)  # (B, gh, gw, C, p, p) -> (B, N, C p p)


def unpatchify(patches: np.ndarray, patch_size: int, channels: int, height: int, width: int) -> np.ndarray:
    """The inverse of `patchify` (B, N, C p p) -> (B, C, H, W); a permutation, so it is also patchify's backward."""
    B, p = patches.shape[0], patch_size
    gh, gw = height // p, width // p
    x = patches.reshape(B, gh, gw, channels, p, p).transpose(0, 3, 1, 4, 2, 5)  # (B, C, gh, p, gw, p)
    return x.reshape(B, channels, height, width)


class PatchEmbedding(PatchEmbeddingDoor, Module):
    """Cut (B, C, H, W) images into non-overlapping p x p patches and map each to d_model: (B, N, d_model).

    A reshape and one Linear `proj` (weight (d_model, C p p)); equal to `Conv2d(C, d_model, p, stride=p)` whose
    weight is `proj.weight.reshape(d_model, C, p, p)`. Backward: the Linear's, then the inverse reshape.
    """

    _check_float = staticmethod(check_input)  # see tfm_common.model_doors

    def forward(self, images: np.ndarray) -> np.ndarray:
        self._cache = images.shape
        return self.proj(patchify(images, self.patch_size))  # (B, N, d)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        B, C, H, W = self._saved()
        return unpatchify(self.proj.backward(grad_out), self.patch_size, C, H, W)  # (B, C, H, W)


class ViT(ViTDoor, Module):
    """A Vision Transformer classifier. `model(images (B, C, H, W))` -> logits (B, n_classes);
    `model.backward(dlogits)` fills every parameter's `.grad` and returns dL/dimages.

    Parameters: `patch_embed.proj`, `cls_token` (1, 1, d) (pool="cls" only), `pos_embed.weight` (T, d) with
    T = N + 1 (or N), the encoder's layers and final `norm`, and `head` (n_classes, d). The class token and the
    positions start N(0, 0.02^2), as in the reference implementation; the Linears keep their default init.
    """

    def forward(self, images: np.ndarray) -> np.ndarray:
        x = self.patch_embed(images)  # (B, N, d)
        if self.cls_token is not None:
            cls = np.broadcast_to(self.cls_token.data, (x.shape[0], 1, self.d_model))
            x = np.concatenate([cls, x], axis=1)  # (B, 1 + N, d): the class token first
        h = self.encoder(self.dropout(self.pos_embed(x)))  # (B, T, d), final LayerNorm included
        pooled = h[:, 0] if self.pool == "cls" else h.mean(axis=1)  # (B, d)
        self._cache = h.shape
        return self.head(pooled)  # (B, K)

    def backward(self, grad_logits: np.ndarray) -> np.ndarray:
        h_shape = self._saved()
        d_pooled = self.head.backward(grad_logits)  # (B, d)
        if self.pool == "cls":
            dh = np.zeros(h_shape, dtype=d_pooled.dtype)
            dh[:, 0] = d_pooled  # only the class token's output was read
        else:
            dh = np.repeat(d_pooled[:, None] / h_shape[1], h_shape[1], axis=1)  # a mean: 1/T to every token
        dx = self.pos_embed.backward(self.dropout.backward(self.encoder.backward(dh)))  # (B, T, d)
        if self.cls_token is not None:
            self.cls_token.grad += dx[:, :1].sum(axis=0, keepdims=True)  # one token shared by every image
            dx = dx[:, 1:]
        return self.patch_embed.backward(np.ascontiguousarray(dx))  # (B, C, H, W)


# the building blocks of the constructors written in tfm_common.model_doors (PatchEmbeddingDoor, ViTDoor)
PatchEmbedding._parts = ViT._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_rng, Linear=Linear, Dropout=Dropout, PatchEmbedding=PatchEmbedding,
    normal_parameter=normal_parameter, scale_=scale_, LearnedPositionalEmbedding=LearnedPositionalEmbedding,
    Encoder=Encoder,
)  # fmt: skip
for _cls in (PatchEmbedding, ViT):
    own_init(_cls, dtype=np.float32)  # tfm_numpy's default dtype
