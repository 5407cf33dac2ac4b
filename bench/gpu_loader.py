"""The packed loader alone on a GPU: images/s through the prefetcher, no training step.

    python bench/gpu_loader.py [--workers 8] [--batches 300] [--images 1024]

Makes ``--images`` JPEGs (bench/gpu.py's set), packs them at 224 px, and times
an epoch of ``--batches`` batches of 128 through worker.data's DevicePrefetcher to the GPU
(after 20 untimed ones of an epoch before, left there), twice: through the page-locked ring the loader processes
write into (worker/ring.py) and through torch's own path (a shared-memory file per batch,
then its pin-memory thread). What the loader can deliver, with nothing else competing:
bench/gpu.py measures it under training. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

BATCH, WARMUP = 128, 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_loader.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8, help="loader processes")
    p.add_argument("--batches", type=int, default=300, help="timed batches of 128")
    p.add_argument("--images", type=int, default=1024, help="distinct images (repeated)")
    return p


def rate(packed: Path, workers: int, batches: int, ring: bool) -> float:
    """Images/s of `batches` batches after WARMUP, all on the GPU when timed."""
    import torch

    import gpu
    from worker.data import DevicePrefetcher, EpochSampler, make_loader
    from worker.packed import PackedBatches
    ds = PackedBatches(packed, "train")
    sampler = EpochSampler(len(ds), BATCH, 0, 0, total=batches * BATCH)
    source = DevicePrefetcher(make_loader(ds, sampler, workers, pin_memory=True, ring=ring),
                              torch.device("cuda"))
    try:
        for i, _ in enumerate(source):   # the processes started, then an epoch cut short
            if i == WARMUP:
                break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(len(y) for _, y in source)
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)
    finally:
        gpu.release(ds)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU: skipping bench/gpu_loader.py (the loader feeds a GPU)")
        return 0
    import gpu
    from worker.pack import pack_shard
    with tempfile.TemporaryDirectory(prefix="orch-gpu-loader-") as tmp:
        packed = pack_shard(gpu.write_images(Path(tmp) / "shard", args.images, 320), 224)
        for ring in (True, False):
            name = "ring" if ring else "torch's pin path"
            got = rate(packed, args.workers, args.batches, ring)
            print(f"loader alone, {args.workers} processes, {name}: {got:.0f} images/s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
