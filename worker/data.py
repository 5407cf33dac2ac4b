"""A rank's shard: finding its images, reading them as uint8 batches, and sampling epochs.

A shard is ``TrainData/<class>/*`` + ``ValidationData/<class>/*`` (what ``orch split-data``
writes), or a plain ImageFolder (``<class>/*``), from which every 10th image per class is
held out for validation. Datasets here return whole batches (NHWC uint8 + labels), so a
DataLoader with ``batch_size=None`` moves one tensor per batch between processes.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from PIL import Image, ImageOps

from worker.errors import WorkerError

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp"}
TRAIN_DIR, VAL_DIR, PACKED_DIR = "TrainData", "ValidationData", "packed"
HOLD_OUT_EVERY = 10  # plain ImageFolder shards: file i of a class is validation when i % 10 == 9


@dataclass
class ShardFiles:
    """The image files of one shard, with labels indexing ``classes``."""

    classes: list[str]
    train: list[tuple[str, int]] = field(default_factory=list)
    val: list[tuple[str, int]] = field(default_factory=list)
    layout: str = "TrainData/ValidationData"


def _class_dirs(root: Path) -> dict[str, list[str]]:
    out = {}
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and d.name != PACKED_DIR:
            out[d.name] = sorted(str(f) for f in d.iterdir() if f.suffix.lower() in IMAGE_EXTS)
    return out


def _hold_out(per_class: dict[str, list[str]]) -> tuple[dict, dict]:
    train = {c: [f for i, f in enumerate(fs) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
             for c, fs in per_class.items()}
    val = {c: [f for i, f in enumerate(fs) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
           for c, fs in per_class.items()}
    return train, val


def _labelled(per_class: dict[str, list[str]], index: dict[str, int]) -> list[tuple[str, int]]:
    return [(f, index[c]) for c, fs in per_class.items() for f in fs]


def scan_shard(shard: Path) -> ShardFiles:
    """List a shard's images. Classes are the class folders with at least one training image."""
    if not shard.is_dir():
        raise WorkerError(f"shard folder {shard} does not exist",
                          hint="run `orch split-data` for this world size, then `orch up`")
    if (shard / TRAIN_DIR).is_dir():
        train = _class_dirs(shard / TRAIN_DIR)
        val = _class_dirs(shard / VAL_DIR) if (shard / VAL_DIR).is_dir() else None
        layout = "TrainData/ValidationData" if val is not None else "TrainData (10% held out)"
    else:
        train, val, layout = _class_dirs(shard), None, "ImageFolder (10% held out)"
    if val is None:
        train, val = _hold_out(train)
    classes = [c for c, fs in train.items() if fs]
    if not classes:
        raise WorkerError(f"shard folder {shard} holds no training images",
                          hint=f"put images in {shard}/{TRAIN_DIR}/<class>/ (png or jpg)")
    strays = sorted(c for c, fs in val.items() if fs and c not in classes)
    if strays:
        raise WorkerError(f"{shard}: validation classes {strays} have no training images",
                          hint="every validation class needs training images on every rank")
    index = {c: i for i, c in enumerate(classes)}
    return ShardFiles(classes, _labelled({c: train[c] for c in classes}, index),
                      _labelled(val, index), layout)


def load_image(path: str, size: int) -> np.ndarray:
    """Decode to RGB uint8 HWC at size x size (shorter side scaled, centre crop)."""
    try:
        with Image.open(path) as src:
            src.draft("RGB", (size, size))  # JPEG: decode at reduced scale when it can
            img = src.convert("RGB")
            if img.size != (size, size):
                img = ImageOps.fit(img, (size, size), Image.Resampling.BILINEAR)
            return np.asarray(img, dtype=np.uint8)
    except OSError as e:  # unreadable or not an image: name the file, not a traceback
        raise WorkerError(f"cannot read image {path}: {e}") from None


class ImageFolderBatches(torch.utils.data.Dataset):
    """dataset[list of indices] -> (uint8 NHWC tensor, int64 labels), decoding with PIL."""

    def __init__(self, items: Sequence[tuple[str, int]], image_size: int) -> None:
        self.files = [f for f, _ in items]
        self.labels = np.array([label for _, label in items], dtype=np.int64)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        images = np.stack([load_image(self.files[i], self.image_size) for i in indices])
        return torch.from_numpy(images), torch.from_numpy(self.labels[list(indices)])


class EpochSampler:
    """Yields sorted index batches of a fresh permutation per epoch (``set_epoch``).

    Every rank must run the same number of steps, or DDP's allreduce waits forever on the
    rank with fewer; ``total`` (the largest shard over all ranks) pads a smaller shard by
    going round its permutation again, as DistributedSampler pads.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int, total: int | None = None,
                 shuffle: bool = True) -> None:
        self.n, self.batch_size, self.seed, self.rank = n, batch_size, seed, rank
        self.total = total if total is not None else n
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.total // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.rank, self.epoch]).permutation(self.n)
        else:
            order = np.arange(self.n)
        order = np.resize(order, self.total)  # wraps around: the padding
        for start in range(0, self.total, self.batch_size):
            # Sorted: sequential reads from disk or memory map; order inside a batch is moot.
            yield sorted(order[start:start + self.batch_size].tolist())


RING_PREFETCH = 2  # batches ahead per loader process with a ring: the ring is the prefetch
# The loaders with worker processes, for end_loaders.
_LOADERS: weakref.WeakSet[torch.utils.data.DataLoader] = weakref.WeakSet()


def make_loader(dataset: torch.utils.data.Dataset, sampler: EpochSampler, workers: int,
                pin_memory: bool = False, ring: bool = False) -> torch.utils.data.DataLoader:
    """``ring`` (with ``pin_memory`` and workers, for a dataset with ``use_ring``: the
    packed format): batches land in a page-locked ring shared with the loader processes
    (worker/ring.py) instead of torch's copy, descriptor and pin thread per batch."""
    prefetch = 4
    batches: Any = sampler
    if ring and pin_memory and workers > 0 and hasattr(dataset, "use_ring"):
        from worker.ring import SLACK, PinnedRing, SlotSampler
        prefetch = RING_PREFETCH
        slots = prefetch * workers + SLACK
        packed: Any = dataset   # PackedBatches (data.py cannot import it: it imports us)
        packed.use_ring(PinnedRing(slots, sampler.batch_size, packed.item_shape))
        batches, pin_memory = SlotSampler(sampler, slots), False
    loader = torch.utils.data.DataLoader(
        dataset, sampler=batches, batch_size=None, num_workers=workers,
        persistent_workers=workers > 0, pin_memory=pin_memory,
        prefetch_factor=prefetch if workers > 0 else None)
    if workers > 0:
        _LOADERS.add(loader)
    return loader


def end_loaders() -> None:
    """End every loader's worker processes now. Left to the garbage collector (a loader
    that raised is held by its traceback's reference cycle), torch's shutdown runs inside
    the collection, where its stop message to a worker is no longer delivered, and it
    waits 5 s per worker before killing it: a rank with a broken image left 5 s late."""
    for loader in list(_LOADERS):
        shutdown = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)
        if shutdown is not None:   # torch's own, used by its __del__; idempotent
            shutdown()


class DevicePrefetcher:
    """A loader whose batches arrive already on a CUDA device, copied one batch ahead.

    The copy of batch k+1 (from pinned memory, non_blocking) runs on a side stream while
    the model computes on batch k, so the transfer never sits between two steps.
    ``sampler`` and ``len`` are the wrapped loader's.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    @property
    def sampler(self) -> EpochSampler:
        # make_loader gave it an EpochSampler, or a SlotSampler around one
        return cast(EpochSampler, getattr(self.loader.sampler, "inner", self.loader.sampler))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        stream = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        ring = getattr(self.loader.dataset, "ring", None)
        if ring is not None:
            ring.drain()
        batches = iter(self.loader)
        ahead = self._send(self._next(batches, ring), stream, ring)
        while ahead is not None:
            compute.wait_stream(stream)
            for t in ahead:  # allocated on the side stream, used on the compute stream
                t.record_stream(compute)
            batch, ahead = ahead, self._send(self._next(batches, ring), stream, ring)
            yield batch

    @staticmethod
    def _next(batches: Iterator[Any], ring: Any) -> Any:
        if ring is None:
            return next(batches, None)
        ring.before_next()
        got = next(batches, None)
        return None if got is None else ring.view(got)

    def _send(self, batch: tuple[torch.Tensor, ...] | None, stream: torch.cuda.Stream,
              ring: Any = None) -> tuple[torch.Tensor, ...] | None:
        if batch is None:
            return None
        with torch.cuda.stream(stream):
            sent = tuple(t.to(self.device, non_blocking=True) for t in batch)
            if ring is not None:   # the slot may be rewritten once this copy is done
                event = torch.cuda.Event()
                event.record(stream)
                ring.copied(event)
        return sent
