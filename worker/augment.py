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
    # Drawn on the CPU (same draws on every device); non_blocking: no wait for the GPU.
    oy = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen).to(x.device, non_blocking=True)
    ox = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen).to(x.device, non_blocking=True)
    flip = (torch.rand(n, 1, 1, generator=gen) < 0.5).to(x.device, non_blocking=True)
    cols = torch.arange(w, device=x.device).view(1, 1, w)
    cols = torch.where(flip, w - 1 - cols, cols) + ox
    rows = torch.arange(h, device=x.device).view(1, h, 1) + oy
    index = (rows * wp + cols).view(n, 1, h * w).expand(n, c, h * w)
    return torch.gather(padded.reshape(n, c, hp * wp), 2, index).view(n, c, h, w)


Boxes = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def draw_boxes(n: int, h: int, w: int, gen: torch.Generator | None = None,
               scale: tuple[float, float] = (0.08, 1.0),
               ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Boxes:
    """RandomResizedCrop's boxes for a batch, on the CPU: (top, left, height, width, flip).

    Drawn for the whole batch at once (torchvision retries a box that does not fit 10
    times; here its sides are clipped to the image), so a crop is never larger than the
    image: resizing it to the image size only ever enlarges.
    """
    area = torch.empty(n).uniform_(*scale, generator=gen) * (h * w)
    aspect = torch.exp(torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1]),
                                               generator=gen))
    cw = torch.sqrt(area * aspect).round().clamp(1, w).long()
    ch = torch.sqrt(area / aspect).round().clamp(1, h).long()
    top = (torch.rand(n, generator=gen) * (h - ch + 1)).long()
    left = (torch.rand(n, generator=gen) * (w - cw + 1)).long()
    flip = torch.rand(n, generator=gen) < 0.5
    return top, left, ch, cw, flip


def crops_by_interpolate(x: torch.Tensor, boxes: Boxes) -> torch.Tensor:
    """Each crop resized by torch's bilinear kernel, one call per image.

    On the CPU, uint8 in and out: torch's uint8 bilinear kernel is fastest on the
    channels-last view the loaders hand over (3x faster than one float grid_sample).
    """
    n, _, h, w = x.shape
    top, left, ch, cw, flip = (b.tolist() for b in boxes)
    out = torch.empty_like(x)
    for i in range(n):
        crop = x[i:i + 1, :, top[i]:top[i] + ch[i], left[i]:left[i] + cw[i]]
        crop = crop.flip(-1) if flip[i] else crop
        out[i:i + 1] = F.interpolate(crop, size=(h, w), mode="bilinear", align_corners=False,
                                     antialias=True)
    return out


def _source_coords(start: torch.Tensor, length: torch.Tensor, size: int) -> torch.Tensor:
    """(n, size) source pixel centres that bilinear resizing of [start, start+length) to
    ``size`` samples (align_corners=False), clamped to the crop as F.interpolate clamps."""
    j = torch.arange(size, device=start.device, dtype=torch.float32)
    length = length.float().unsqueeze(1)
    src = (j + 0.5) * (length / size) - 0.5
    return start.float().unsqueeze(1) + torch.minimum(src.clamp(min=0), length - 1)


def crops_by_grid(x: torch.Tensor, boxes: Boxes) -> torch.Tensor:
    """Every crop resized in one grid_sample over the batch (float 0..255 out).

    On a GPU one kernel for the batch instead of one interpolate per image. Equal to
    :func:`crops_by_interpolate` on float input: crops only ever get enlarged, where
    antialiasing changes nothing, and the sample points are clamped to the crop.
    """
    n, _, h, w = x.shape
    top, left, ch, cw, flip = (b.to(x.device, non_blocking=True) for b in boxes)
    xs = _source_coords(left, cw, w)
    xs = torch.where(flip.unsqueeze(1), xs.flip(1), xs)
    ys = _source_coords(top, ch, h)
    # grid_sample (align_corners=False) reads pixel p at normalised (2p + 1) / size - 1.
    gx = ((2 * xs + 1) / w - 1).unsqueeze(1).expand(n, h, w)
    gy = ((2 * ys + 1) / h - 1).unsqueeze(2).expand(n, h, w)
    grid = torch.stack([gx, gy], dim=-1)
    return F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border",
                         align_corners=False)


def resized_crop_flip(x: torch.Tensor, gen: torch.Generator | None = None,
                      scale: tuple[float, float] = (0.08, 1.0),
                      ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """RandomResizedCrop(size, scale, ratio) + RandomHorizontalFlip, bilinear.

    uint8 out on the CPU (one resize per image); off the CPU one grid_sample for the
    whole batch, float 0..255 out.
    """
    n, _, h, w = x.shape
    boxes = draw_boxes(n, h, w, gen, scale, ratio)
    if x.device.type == "cpu":
        return crops_by_interpolate(x, boxes)
    return crops_by_grid(x, boxes)


def augment(x: torch.Tensor, policy: str, gen: torch.Generator | None = None) -> torch.Tensor:
    """Apply ``policy`` to an NCHW uint8 batch (uint8 out; float 0..255 off the CPU)."""
    if policy == "crop_flip":
        return crop_flip(x, max(1, x.shape[-1] // 8), gen)
    if policy == "resized_crop_flip":
        return resized_crop_flip(x, gen)
    return x


def normalize(x: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format,
              mean: tuple[float, ...] = IMAGENET_MEAN,
              std: tuple[float, ...] = IMAGENET_STD) -> torch.Tensor:
    """0..255 pixels to ImageNet-normalised float32 in ``memory_format``.

    Layout and dtype change in one copy, then x * a + b in place: broadcasting the
    per-channel constants over a strided view is several times slower.
    """
    scale, shift = _constants(mean, std, x.device)
    out = x.to(dtype=torch.float32, memory_format=memory_format, copy=True)
    return out.mul_(scale).add_(shift)


_CONSTANTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(mean: tuple[float, ...], std: tuple[float, ...],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel (scale, shift), made once per device: a tensor built from a list
    on a GPU is a blocking copy from the host, which would stall every step."""
    key = (mean, std, str(device))
    if key not in _CONSTANTS:
        scale = torch.tensor([1 / (255 * s) for s in std]).view(1, -1, 1, 1)
        shift = torch.tensor([-m / s for m, s in zip(mean, std)]).view(1, -1, 1, 1)
        # non_blocking: a pageable source is staged at once; the GPU is not waited for
        _CONSTANTS[key] = (scale.to(device, non_blocking=True), shift.to(device, non_blocking=True))
    return _CONSTANTS[key]
