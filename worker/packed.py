"""Reading the packed shard format (written by worker.pack).

``<shard>/packed/`` holds, per split (train, val), the images decoded at training size as
one uint8 array ``<split>_images.npy`` (N, S, S, 3) and the labels ``<split>_labels.npy``
(N,) int64, plus ``index.json``. The arrays are standard .npy files opened with a memory
map: a batch is one fancy-index copy out of the page cache, with no file open and no
decode per image.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from worker.data import PACKED_DIR
from worker.errors import WorkerError
from worker.ring import PinnedRing, RingBatch

FORMAT, VERSION = "orch-packed", 1
SPLITS = ("train", "val")


def read_index(packed: Path) -> dict[str, Any]:
    """The packed folder's index.json, checked; WorkerError if it is not a packed folder."""
    try:
        index = json.loads((packed / "index.json").read_text())
    except (OSError, ValueError) as e:
        raise WorkerError(f"{packed}: unreadable packed index: {e}",
                          hint=f"re-run python -m worker.pack --src {packed.parent}") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise WorkerError(f"{packed}: not an {FORMAT} v{VERSION} folder",
                          hint=f"re-run python -m worker.pack --src {packed.parent}")
    return index


def find_packed(shard: Path, image_size: int) -> tuple[Path | None, str]:
    """(packed folder, note): the folder when it exists and matches ``image_size``."""
    packed = shard / PACKED_DIR
    if not (packed / "index.json").is_file():
        return None, ""
    size = read_index(packed)["image_size"]
    if size != image_size:
        return None, (f"{packed} was packed at {size}px but --image-size is {image_size}: "
                      "reading the image files instead")
    return packed, ""


class PackedBatches(torch.utils.data.Dataset):
    """dataset[list of indices] -> (uint8 NHWC tensor, int64 labels), from the memory map;
    with a ring (``use_ring``), dataset[(slot, indices)] writes them into the ring's slot
    and returns only where (worker/ring.py)."""

    def __init__(self, packed: Path, split: str) -> None:
        entry = read_index(packed)["splits"][split]
        self.images_path = packed / entry["images"]
        self.labels = np.load(packed / entry["labels"])
        self.count = int(entry["count"])
        self._images: np.ndarray | None = None
        self.ring: PinnedRing | None = None

    def __len__(self) -> int:
        return self.count

    def __getstate__(self) -> dict[str, Any]:
        # A memmap pickles as a full copy of the array: DataLoader workers reopen it instead.
        return {**self.__dict__, "_images": None}

    @property
    def images(self) -> np.ndarray:
        if self._images is None:
            self._images = np.load(self.images_path, mmap_mode="r")
        return self._images

    @property
    def item_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def use_ring(self, ring: PinnedRing | None) -> None:
        self.ring = ring

    @overload
    def __getitem__(self, item: tuple[int, Sequence[int]]) -> RingBatch: ...  # type: ignore[overload-overlap]  # a (slot, indices) pair is no index list

    @overload
    def __getitem__(self, item: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, tuple):   # (slot, indices) from a SlotSampler
            assert self.ring is not None, "a slot without a ring"
            slot, indices = item
            return self.ring.fill(slot, self.images, self.labels, np.asarray(indices, np.int64))
        idx = np.asarray(item, dtype=np.int64)
        return torch.from_numpy(self.images[idx]), torch.from_numpy(self.labels[idx])
