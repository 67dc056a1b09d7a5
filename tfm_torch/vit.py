"""The Vision Transformer, PyTorch track: the same names, arguments and state_dict keys as tfm_numpy.vit;
autograd does the backward."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tfm_common.config import own_init
from tfm_common.model_doors import PatchEmbeddingDoor, ViTDoor

from .encoder_decoder import Encoder
from .layers import Dropout, Linear
from .module import Module, as_generator, check_dtype, check_input, normal_parameter, scale_
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

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(patchify(images, self.patch_size))  # (B, N, d)


class ViT(ViTDoor, Module):
    """A Vision Transformer classifier, the twin of tfm_numpy.ViT: `model(images)` -> logits (B, n_classes)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)  # (B, N, d)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], 1, self.d_model), x], dim=1)  # (B, 1 + N, d)
        h = self.encoder(self.dropout(self.pos_embed(x)))  # (B, T, d)
        pooled = h[:, 0] if self.pool == "cls" else h.mean(dim=1)  # (B, d)
        return self.head(pooled)  # (B, K)


# the building blocks of the constructors written in tfm_common.model_doors (PatchEmbeddingDoor, ViTDoor)
PatchEmbedding._parts = ViT._parts = SimpleNamespace(
    check_dtype=check_dtype, as_rng=as_generator, Linear=Linear, Dropout=Dropout, PatchEmbedding=PatchEmbedding,
    normal_parameter=normal_parameter, scale_=scale_, LearnedPositionalEmbedding=LearnedPositionalEmbedding,
    Encoder=Encoder,
)  # fmt: skip
for _cls in (PatchEmbedding, ViT):
    own_init(_cls)  # a wrong argument is refused in the name of the class built, not of its door
