"""Pack a shard's images into memory-mappable arrays: ``python -m worker.pack --src SHARD``.

The images are decoded once, here, at the training size, so training reads raw pixels
(as TensorFlow's RAW_PIXEL records or an LMDB of decoded images do) instead of opening
and decoding a file per image per epoch. The result is ``<shard>/packed/`` (see
worker.packed); worker.train uses it automatically when its image size matches.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from worker.data import PACKED_DIR, load_image, scan_shard
from worker.errors import WorkerError
from worker.packed import FORMAT, VERSION

CHUNK = 256  # images per decode task: big enough to amortise the thread hand-off


def _write_split(folder: Path, split: str, items: list[tuple[str, int]], size: int,
                 jobs: int) -> dict:
    images = np.lib.format.open_memmap(folder / f"{split}_images.npy", mode="w+",
                                       dtype=np.uint8, shape=(len(items), size, size, 3))
    _decode_into(images, items, size, jobs)
    images.flush()
    del images
    np.save(folder / f"{split}_labels.npy", np.array([lab for _, lab in items], dtype=np.int64))
    return {"count": len(items), "images": f"{split}_images.npy", "labels": f"{split}_labels.npy"}


def _decode_into(images: np.ndarray, items: list[tuple[str, int]], size: int,
                 jobs: int) -> None:
    def fill(start: int) -> None:
        for i in range(start, min(start + CHUNK, len(items))):
            images[i] = load_image(items[i][0], size)

    # PIL releases the GIL while decoding, so threads overlap decodes without pickling.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(fill, range(0, len(items), CHUNK)))


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put ``tmp`` in place of ``final``: a reader never sees a half-written packed folder."""
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def pack_shard(src: Path, image_size: int, jobs: int | None = None) -> Path:
    """Pack one shard folder; returns ``<src>/packed``. Raises WorkerError on a bad shard."""
    src = Path(src)
    files = scan_shard(src)
    tmp = src / f".{PACKED_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        jobs = jobs or min(8, os.cpu_count() or 1)
        splits = {name: _write_split(tmp, name, items, image_size, jobs)
                  for name, items in (("train", files.train), ("val", files.val))}
        index = {"format": FORMAT, "version": VERSION, "image_size": image_size,
                 "layout": "NHWC uint8 RGB", "classes": files.classes, "splits": splits,
                 "source_layout": files.layout}
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        _replace_dir(tmp, src / PACKED_DIR)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return src / PACKED_DIR


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.pack", description=__doc__.split("\n")[0])
    p.add_argument("--src", type=Path, nargs="+", required=True, metavar="SHARD_DIR",
                   help="shard folder(s): TrainData/ValidationData or a plain ImageFolder")
    p.add_argument("--image-size", type=int, required=True, help="the training --image-size")
    p.add_argument("--jobs", type=int, default=None, help="decode threads (default: cores, max 8)")
    a = p.parse_args(argv)
    if a.image_size < 1:
        p.error("--image-size must be at least 1")
    for src in a.src:
        t0 = time.perf_counter()
        try:
            out = pack_shard(src, a.image_size, a.jobs)
        except WorkerError as e:
            print(f"error: {e.one_line()}", file=sys.stderr)
            return 2
        n = sum(s["count"] for s in json.loads((out / "index.json").read_text())["splits"].values())
        print(f"packed {n} images of {src} into {out} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
