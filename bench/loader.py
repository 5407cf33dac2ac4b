"""Training-input throughput: image files decoded with PIL against the packed memmap format.

    .venv/bin/python bench/loader.py [--images 2000] [--image-size 64] [--repeats 3]

Generates its own images (worker.demo_data, PNG) in a temp dir, packs them
(worker.pack), then times full passes over the same images in the same run, each
loader producing what the training step consumes (augmented, normalised float batches):

- torchvision ImageFolder + per-image PIL transforms: the source tutorials' pipeline;
- ImageFolder + PIL decode, then worker's batch augmentation on uint8 tensors;
- packed memmap, then the same batch augmentation (worker.train's fast path).

The ratio is packed / (ImageFolder + PIL), same augmentation. Files are read from the
page cache in both cases (they were just written), so the gap is decode and per-image
overhead, not disk. Median of --repeats passes, interleaved.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from worker import demo_data
from worker.augment import augment, normalize
from worker.data import EpochSampler, ImageFolderBatches, make_loader, scan_shard
from worker.pack import pack_shard
from worker.packed import PackedBatches


def batch_pass(dataset: ImageFolderBatches | PackedBatches, args: argparse.Namespace) -> int:
    """One epoch through worker's loader: batches of uint8 -> augmented float."""
    sampler = EpochSampler(len(dataset), args.batch_size, seed=0, rank=0)
    n = 0
    for x, _ in make_loader(dataset, sampler, args.workers):
        n += len(normalize(augment(x.permute(0, 3, 1, 2), args.augment)))
    return n


def torchvision_pass(root: Path, args: argparse.Namespace) -> int:
    """The tutorials' loader: ImageFolder, one PIL transform chain per image, default collate."""
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    s = args.image_size
    aug = (T.RandomResizedCrop(s) if args.augment == "resized_crop_flip"
           else T.RandomCrop(s, padding=max(1, s // 8)))
    tf = T.Compose([aug, T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    loader = torch.utils.data.DataLoader(ImageFolder(str(root), tf), batch_size=args.batch_size,
                                         shuffle=True, num_workers=args.workers)
    return sum(len(x) for x, _ in loader)


def measure(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, int] = {}
    for _ in range(repeats):  # interleaved, so a busy moment hits every loader alike
        for name, run in runs.items():
            t0 = time.perf_counter()
            counts[name] = run()
            times[name].append(time.perf_counter() - t0)
    return {name: {"images": counts[name], "seconds": statistics.median(ts),
                   "images_per_s": counts[name] / statistics.median(ts)}
            for name, ts in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2000, help="training images (8 classes)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=0, help="data-loader processes (all loaders)")
    p.add_argument("--augment", choices=("crop_flip", "resized_crop_flip"), default="crop_flip")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)  # one training process per core, as worker.train runs on 2 cores
    with tempfile.TemporaryDirectory(prefix="orch-bench-loader-") as tmp:
        shard = demo_data.generate(Path(tmp) / "shard", classes=8, train_per_class=args.images // 8,
                                   val_per_class=1, image_size=args.image_size, seed=0)
        t0 = time.perf_counter()
        packed = pack_shard(shard, args.image_size)
        pack_s = time.perf_counter() - t0
        files = scan_shard(shard)
        folder_ds = ImageFolderBatches(files.train, args.image_size)
        packed_ds = PackedBatches(packed, "train")
        results = measure({
            "torchvision ImageFolder + PIL transforms":
                lambda: torchvision_pass(shard / "TrainData", args),
            "ImageFolder + PIL, batch uint8 augment": lambda: batch_pass(folder_ds, args),
            "packed memmap, batch uint8 augment": lambda: batch_pass(packed_ds, args),
        }, args.repeats)
    base = results["ImageFolder + PIL, batch uint8 augment"]["images_per_s"]
    fast = results["packed memmap, batch uint8 augment"]["images_per_s"]
    tv = results["torchvision ImageFolder + PIL transforms"]["images_per_s"]
    print(f"{len(files.train)} PNG images {args.image_size}x{args.image_size}, "
          f"batch {args.batch_size}, {args.workers} loader workers, augment {args.augment}, "
          f"median of {args.repeats}")
    print(f"{'loader':<42} {'images':>7} {'seconds':>8} {'images/s':>10}")
    for name, r in results.items():
        print(f"{name:<42} {r['images']:>7} {r['seconds']:>8.3f} {r['images_per_s']:>10.0f}")
    print(f"packing (one-off, at split time): {pack_s:.2f}s")
    print(f"ratio packed / ImageFolder+PIL (same augmentation): {fast / base:.1f}x")
    print(f"ratio packed / torchvision ImageFolder pipeline:     {fast / tv:.1f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "pack_s": pack_s,
                                         "ratio": fast / base, "ratio_torchvision": fast / tv},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
