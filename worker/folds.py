"""K-fold cross-validation over a shard's training set (``--folds K --fold k``).

Fold assignment is stratified and deterministic: the images of each class are put in a
fixed pseudo-random order (seeded by the class and K only, never by ``--seed``, so every
task of a job array sees the same folds whatever its model or seed) and dealt round-robin
into K folds. Fold k is the validation set; the other K - 1 folds are the training set.
The shard's own ValidationData is not used in this mode.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from worker.errors import WorkerError

FOLD_SEED = 20_110  # fixed: folds must not depend on --seed


def fold_of(labels: np.ndarray, folds: int) -> np.ndarray:
    """For each index, the fold (0..folds-1) it belongs to."""
    out = np.empty(len(labels), dtype=np.int64)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        order = np.random.default_rng([FOLD_SEED, folds, int(cls)]).permutation(len(members))
        out[members[order]] = np.arange(len(members)) % folds
    return out


def split_indices(labels: np.ndarray, folds: int, fold: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices) for fold ``fold`` of ``folds``, both sorted."""
    which = fold_of(labels, folds)
    return np.flatnonzero(which != fold), np.flatnonzero(which == fold)


class FoldView(torch.utils.data.Dataset):
    """A batch dataset (``dataset[list of indices]``) restricted to some of its indices."""

    def __init__(self, base: Any, indices: np.ndarray) -> None:
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)
        self.labels = np.asarray(base.labels)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, indices: Sequence[int]) -> Any:
        return self.base[self.indices[np.asarray(indices, dtype=np.int64)].tolist()]


def apply(train: Any, folds: int, fold: int, where: str) -> tuple[FoldView, FoldView]:
    """(training part, validation part) of the training set ``train`` for fold k of K."""
    if len(train) < folds:
        raise WorkerError(f"{where}: {len(train)} training images cannot make {folds} folds",
                          hint=f"use --folds {max(2, len(train))} or fewer, or more images")
    tr, va = split_indices(np.asarray(train.labels), folds, fold)
    return FoldView(train, tr), FoldView(train, va)
