"""The Vision Transformer, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.vit;
autograd does the backward."""

from __future__ import annotations

import torch
from torch import nn

from tfm_common.config import VIT_ARGS, check_patch_embedding, check_vit_config
from tfm_common.model_doors import PatchEmbeddingDoor, ViTDoor

from .encoder_decoder import Encoder
from .layers import Dropout, Linear
from .module import Module, as_generator, check_dtype, check_input
from .positional import LearnedPositionalEmbedding

__all__ = ["PatchEmbedding", "ViT", "patchify", "unpatchify"]


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C p p), patches row-major, each flattened as (C, p, p) (a Conv2d weight's order)."""
    B, C, H, W = images.shape
    gh, gw, p = H // patch_size, W // patch_size, patch_size
    x = images.reshape(B, C, gh, p, gw, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * p * p)


def unpatchify(patches: torch.Tensor, patch_size: int, channels: int, height: int, width: int) -> torch.Tensor:
    """The inverse of `patchify`: (B, N, C p p) -> (B, C, H, W)."""
    B, p = patches.shape[0], patch_size
    gh, gw = height // p, width // p
    x = patches.reshape(B, gh, gw, channels, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, channels, height, width)


class PatchEmbedding(PatchEmbeddingDoor, Module):
    """Non-overlapping p x p patches, each mapped to d_model by one Linear `proj`: (B, C, H, W) -> (B, N, d)."""

    _check_float = staticmethod(check_input)  # see tfm_common.model_doors

    def __init__(self, image_size: int, patch_size: int, in_channels: int, d_model: int, *, rng=None, dtype=None):
        super().__init__()
        check_patch_embedding("PatchEmbedding", image_size, patch_size, in_channels, d_model)
        self.image_size, self.patch_size, self.in_channels, self.d_model = image_size, patch_size, in_channels, d_model
        self.grid = image_size // patch_size
        self.n_patches = self.grid * self.grid
        n_in = in_channels * patch_size * patch_size
        self.proj = Linear(n_in, d_model, rng=as_generator(rng), dtype=check_dtype(dtype))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(patchify(images, self.patch_size))  # (B, N, d)


class ViT(ViTDoor, Module):
    """A Vision Transformer classifier, the twin of tfm_numpy.ViT: `model(images)` -> logits (B, n_classes)."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        n_classes: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        dropout: float = 0.0,
        *,
        pool: str = "cls",
        rng=None,
        dtype=None,
    ):
        super().__init__()
        self.config = check_vit_config("ViT", {k: v for k, v in locals().items() if k in VIT_ARGS})
        dt, rng = check_dtype(dtype), as_generator(rng)
        self.pool, self.d_model = pool, d_model
        self.patch_embed = PatchEmbedding(image_size, patch_size, in_channels, d_model, rng=rng, dtype=dt)
        n_tokens = self.patch_embed.n_patches + (pool == "cls")
        cls = nn.Parameter(0.02 * torch.randn(1, 1, d_model, generator=rng, dtype=dt)) if pool == "cls" else None
        self.cls_token = cls
        self.pos_embed = LearnedPositionalEmbedding(n_tokens, d_model, rng=rng, dtype=dt)
        with torch.no_grad():
            self.pos_embed.weight.mul_(0.02)
        self.dropout = Dropout(dropout, rng=rng)
        self.encoder = Encoder(n_layers, d_model, n_heads, d_ff, dropout, "gelu", norm_first=True, rng=rng, dtype=dt)
        self.head = Linear(d_model, n_classes, rng=rng, dtype=dt)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)  # (B, N, d)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], 1, self.d_model), x], dim=1)  # (B, 1 + N, d)
        h = self.encoder(self.dropout(self.pos_embed(x)))  # (B, T, d)
        pooled = h[:, 0] if self.pool == "cls" else h.mean(dim=1)  # (B, d)
        return self.head(pooled)  # (B, K)
