"""Batch augmentation on uint8 image tensors, shared by the ImageFolder and packed loaders.

Working on a whole batch at once (one gather or one grid_sample per batch) instead of one
PIL transform per image keeps augmentation off the per-image hot path, and the same code
runs on the GPU when the batch is moved there first.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
POLICIES = ("none", "crop_flip", "resized_crop_flip")


def crop_flip(x: torch.Tensor, pad: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Random crop of the zero-padded image plus a horizontal flip with p=0.5 (uint8 in, out).

    torchvision's RandomCrop(size, padding=pad) + RandomHorizontalFlip as one torch.gather
    over flattened pixels (several times faster than 4-D advanced indexing).
    """
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    hp, wp = h + 2 * pad, w + 2 * pad
    oy = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen).to(x.device)
    flip = (torch.rand(n, 1, 1, generator=gen) < 0.5).to(x.device)
    cols = torch.arange(w, device=x.device).view(1, 1, w)
    cols = torch.where(flip, w - 1 - cols, cols) + ox
    rows = torch.arange(h, device=x.device).view(1, h, 1) + oy
    index = (rows * wp + cols).view(n, 1, h * w).expand(n, c, h * w)
    return torch.gather(padded.reshape(n, c, hp * wp), 2, index).view(n, c, h, w)


def resized_crop_flip(x: torch.Tensor, gen: torch.Generator | None = None,
                      scale: tuple[float, float] = (0.08, 1.0),
                      ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """RandomResizedCrop(scale, ratio) + flip as one bilinear grid_sample (returns float 0..255).

    torchvision retries a crop that does not fit 10 times; here the sides are clipped to
    the image instead, which keeps the draw to one vectorised step.
    """
    n = x.shape[0]
    area = torch.empty(n).uniform_(*scale, generator=gen)
    log_r = torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=gen)
    w = torch.sqrt(area * torch.exp(log_r)).clamp(max=1.0)
    h = torch.sqrt(area / torch.exp(log_r)).clamp(max=1.0)
    cx = (torch.rand(n, generator=gen) * 2 - 1) * (1 - w)
    cy = (torch.rand(n, generator=gen) * 2 - 1) * (1 - h)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w * sign, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta.to(x.device), list(x.shape), align_corners=False)
    return F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border",
                         align_corners=False)


def augment(x: torch.Tensor, policy: str, gen: torch.Generator | None = None) -> torch.Tensor:
    """Apply ``policy`` to an NCHW uint8 batch; the result is uint8 or float in 0..255."""
    if policy == "crop_flip":
        return crop_flip(x, max(1, x.shape[-1] // 8), gen)
    if policy == "resized_crop_flip":
        return resized_crop_flip(x, gen)
    return x


def normalize(x: torch.Tensor, mean: tuple[float, ...] = IMAGENET_MEAN,
              std: tuple[float, ...] = IMAGENET_STD) -> torch.Tensor:
    """0..255 pixels to ImageNet-normalised float, in one multiply-add."""
    scale = torch.tensor([1 / (255 * s) for s in std], device=x.device).view(1, -1, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], device=x.device).view(1, -1, 1, 1)
    return torch.addcmul(shift, x.float(), scale)
