"""Process-group set-up from torchrun's environment, and agreeing on errors across ranks."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from worker.errors import WorkerError


@dataclass
class Ctx:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def cpu_threads(local_world: int) -> int:
    """OMP_NUM_THREADS when set (by the user, the job's env, or torchrun), else the cores
    per process on this host, so N processes on N cores do not oversubscribe."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world))


def grouped() -> bool:
    """Whether there is a process group (none when running as one process)."""
    return dist.is_available() and dist.is_initialized()


def setup(choice: str = "auto") -> Ctx:
    """init_process_group from torchrun's variables; ``choice`` is --dist-backend.

    ``auto``: nccl when CUDA is available, else gloo (the same program runs on laptops,
    CPU clusters and GPU boxes), and no group at all for one process (WORLD_SIZE unset or
    1, e.g. one task of a job array): it needs no rendezvous, no store and no gloo threads,
    and the collectives below then act on this process alone. ``nccl`` or ``gloo``: that
    backend, with a group even for one process (what a torchrun script does), so one GPU
    runs the same NCCL path as many; without torchrun's MASTER_ADDR one process's group
    lives in an in-process store.
    """
    cuda = torch.cuda.is_available()
    if choice == "nccl" and not cuda:
        raise WorkerError("--dist-backend nccl needs a CUDA GPU and this process sees none "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})",
                          hint="use --dist-backend gloo, or auto to pick by the device")
    backend = ("nccl" if cuda else "gloo") if choice == "auto" else choice
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed image size: pick the fastest kernels once
    torch.set_num_threads(cpu_threads(local_world))
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1 and choice == "auto":
        return Ctx(0, 1, local_rank, local_world, device, "none")
    device_id = device if backend == "nccl" else None
    if world <= 1 and not os.environ.get("MASTER_ADDR"):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device_id)
    else:
        dist.init_process_group(backend, device_id=device_id)
    return Ctx(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device, backend)


def teardown() -> None:
    if grouped():
        dist.destroy_process_group()


def agree(error: WorkerError | None) -> None:
    """Collective: raise on every rank if any rank had an error, naming the ranks.

    Each rank checks locally first and then calls this, so a mistake on one rank stops
    all of them with the same message instead of leaving the others blocked in a
    collective that the failed rank never reaches.
    """
    mine = None if error is None else error.one_line()
    if not grouped():
        if mine is not None:
            raise WorkerError(f"rank 0: {mine}")
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [f"rank {r}: {msg}" for r, msg in enumerate(everyone) if msg is not None]
    if failed:
        raise WorkerError("; ".join(failed))


def gather_all(obj: Any) -> list[Any]:
    if not grouped():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """all_reduce(SUM) of a few numbers in one call (float64, exact for counts)."""
    if not grouped():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
