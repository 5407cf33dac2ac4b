"""A deterministic synthetic image-classification set, written as image files.

Each class is a drawn shape (circle, square, triangle, ...) in its own range of hues.
Every image gets a random background, a jittered fill colour, a random size, position
and rotation, and pixel noise. Image i of class k in a split depends only on (seed,
number of classes, split, k, i): more images per class extend a smaller set.

    python -m worker.demo_data --out data/demo --seed 0

writes ``DIR/TrainData/<class>/*.png`` and ``DIR/ValidationData/<class>/*.png``.
No torch import: generating the demo data costs about a second.
"""
from __future__ import annotations

import argparse
import colorsys
import math
import sys
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw

DEFAULT_CLASSES = 6
DEFAULT_TRAIN_PER_CLASS = 300
DEFAULT_VAL_PER_CLASS = 50
DEFAULT_IMAGE_SIZE = 32
SUPERSAMPLE = 4  # draw large, then shrink: smooth edges at small sizes
SPLITS = {"TrainData": 0, "ValidationData": 1}

Box = tuple[float, float, float, float]  # centre x, centre y, radius, rotation (radians)


def _polygon(corners: int, star: bool = False) -> Callable[[ImageDraw.ImageDraw, Box, tuple], None]:
    def draw(d: ImageDraw.ImageDraw, box: Box, fill: tuple) -> None:
        cx, cy, r, rot = box
        n = corners * 2 if star else corners
        pts = []
        for j in range(n):
            rr = r * (0.45 if star and j % 2 else 1.0)
            a = rot + 2 * math.pi * j / n
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        d.polygon(pts, fill=fill)
    return draw


def _circle(d: ImageDraw.ImageDraw, box: Box, fill: tuple) -> None:
    cx, cy, r, _ = box
    d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)


def _ring(d: ImageDraw.ImageDraw, box: Box, fill: tuple) -> None:
    cx, cy, r, _ = box
    d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(1, int(r * 0.35)))


def _bars(angle: float, count: int) -> Callable[[ImageDraw.ImageDraw, Box, tuple], None]:
    def draw(d: ImageDraw.ImageDraw, box: Box, fill: tuple) -> None:
        cx, cy, r, rot = box
        width = max(1, int(r * 0.45))
        for j in range(count):
            a = rot * 0.2 + angle + math.pi * j / count
            dx, dy = r * math.cos(a), r * math.sin(a)
            d.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=fill, width=width)
    return draw


SHAPES: dict[str, Callable[[ImageDraw.ImageDraw, Box, tuple], None]] = {
    "circle": _circle,
    "square": _polygon(4),
    "triangle": _polygon(3),
    "cross": _bars(0.0, 2),
    "ring": _ring,
    "star": _polygon(5, star=True),
    "hbar": _bars(0.0, 1),
    "vbar": _bars(math.pi / 2, 1),
    "hexagon": _polygon(6),
    "x": _bars(math.pi / 4, 2),
}


def class_names(classes: int) -> list[str]:
    """Shape names; past the last shape, names repeat with a colour family suffix."""
    shapes = list(SHAPES)
    return [shapes[k % len(shapes)] + (f"-{k // len(shapes)}" if k >= len(shapes) else "")
            for k in range(classes)]


def _colour(rng: np.random.Generator, k: int, classes: int) -> tuple[int, int, int]:
    """Class k's hue (evenly spaced round the wheel) with jitter; random saturation, value."""
    hue = (k / classes + rng.uniform(-0.25, 0.25) / classes) % 1.0
    rgb = colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 1.0), rng.uniform(0.55, 1.0))
    r, g, b = (int(255 * v) for v in rgb)
    return r, g, b


def draw_image(seed: int, classes: int, split: int, k: int, i: int, size: int) -> Image.Image:
    """Image i of class k: depends on nothing else, so any subset is reproducible."""
    rng = np.random.default_rng([seed, classes, split, k, i])
    big = size * SUPERSAMPLE
    fill = _colour(rng, k, classes)
    background = tuple(int(v) for v in rng.integers(0, 256, 3))
    while sum(abs(a - b) for a, b in zip(fill, background)) < 150:  # keep the shape visible
        background = tuple(int(v) for v in rng.integers(0, 256, 3))
    img = Image.new("RGB", (big, big), background)
    r = big * rng.uniform(0.22, 0.4)
    cx, cy = rng.uniform(r, big - r, 2)
    shape = list(SHAPES.values())[k % len(SHAPES)]
    shape(ImageDraw.Draw(img), (cx, cy, r, rng.uniform(0, 2 * math.pi)), fill)
    pixels = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR), dtype=np.int16)
    noisy = pixels + rng.normal(0, 12, pixels.shape).astype(np.int16)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def generate(out: Path, classes: int = DEFAULT_CLASSES,
             train_per_class: int = DEFAULT_TRAIN_PER_CLASS,
             val_per_class: int = DEFAULT_VAL_PER_CLASS,
             image_size: int = DEFAULT_IMAGE_SIZE, seed: int = 0) -> Path:
    """Write the data set under ``out`` (TrainData/, ValidationData/); return ``out``."""
    out = Path(out)
    counts = {"TrainData": train_per_class, "ValidationData": val_per_class}
    for split, split_id in SPLITS.items():
        for k, name in enumerate(class_names(classes)):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(counts[split]):
                image = draw_image(seed, classes, split_id, k, i, image_size)
                image.save(folder / f"{name}_{i:05d}.png")
    return out


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.demo_data",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    p.add_argument("--classes", type=_positive, default=DEFAULT_CLASSES)
    p.add_argument("--train-per-class", type=_positive, default=DEFAULT_TRAIN_PER_CLASS)
    p.add_argument("--val-per-class", type=_positive, default=DEFAULT_VAL_PER_CLASS)
    p.add_argument("--image-size", type=_positive, default=DEFAULT_IMAGE_SIZE)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        generate(a.out, a.classes, a.train_per_class, a.val_per_class, a.image_size, a.seed)
    except OSError as e:
        print(f"error: cannot write {a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    total = a.classes * (a.train_per_class + a.val_per_class)
    print(f"wrote {total} images ({a.classes} classes, {a.image_size}x{a.image_size}) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
