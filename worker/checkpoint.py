"""Atomic checkpoints held by rank 0, and resuming every rank from them without shared storage."""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from worker import distrib
from worker.errors import WorkerError
from worker.stopping import stop_deferred

SUBDIR = "checkpoints"
KEEP = 2  # newest checkpoints kept; older ones are deleted after each save
_NAME = re.compile(r"^epoch-(\d+)\.pt$")


def path_for(out_dir: Path, epoch: int) -> Path:
    return out_dir / SUBDIR / f"epoch-{epoch:05d}.pt"


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    folder = out_dir / SUBDIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def atomic_save(obj: Any, path: Path) -> None:
    """Write beside, fsync, rename: a kill at any moment leaves the old file or the new one.
    A stop (SIGTERM) that comes meanwhile is taken once the file is in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with stop_deferred():
        try:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)


def prune(out_dir: Path, keep: int = KEEP) -> None:
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink(missing_ok=True)


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types that torch.load(weights_only=True) accepts."""
    # numpy's global RandomState is always MT19937: its legacy state is the 5-tuple
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(out_dir: Path, epoch: int, state: dict[str, Any], is_main: bool) -> None:
    """Collective: gathers every rank's RNG state; rank 0 writes ``state`` plus those."""
    if not distrib.grouped():
        rngs: list[Any] | None = [rng_state()]
    else:
        rngs = [None] * dist.get_world_size() if is_main else None
        dist.gather_object(rng_state(), rngs, dst=0)
    if is_main:
        atomic_save({**state, "epoch": epoch, "rng": rngs}, path_for(out_dir, epoch))
        prune(out_dir)


def _load_newest(out_dir: Path) -> tuple[dict | None, str | None]:
    found = list_checkpoints(out_dir)
    if not found:
        return None, None
    path = found[-1][1]
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as e:  # any unreadable file: report it on every rank, not a traceback
        return None, f"cannot read checkpoint {path}: {e}"


def load_for_resume(out_dir: Path,
                    is_main: bool) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Collective: (model state or None, everything else or None) from rank 0's newest file.

    Only rank 0 needs the file. The model state stays on rank 0 (DDP's constructor
    broadcasts rank 0's parameters and buffers); the rest (optimizer, scheduler, epoch,
    RNG states) reaches the other ranks with broadcast_object_list.
    """
    model_state = None
    payload: list[Any] = [None]  # what rank 0 sends, unpickled
    if is_main:
        ckpt, error = _load_newest(out_dir)
        if ckpt is not None:
            model_state = ckpt.pop("model")
        payload = [{"ckpt": ckpt, "error": error}]
    if distrib.grouped():
        dist.broadcast_object_list(payload, src=0)
    if payload[0]["error"]:
        raise WorkerError(f"rank 0: {payload[0]['error']}",
                          hint="delete that file to resume from the one before it")
    return model_state, payload[0]["ckpt"]
