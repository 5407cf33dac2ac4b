"""HOGWILD! (Niu, Recht, Re & Wright, 2011) on one host: ``python -m worker.hogwild --procs N``.

N processes train one model held in shared memory (``share_memory()``), each with its own
data order and loader, and each applies its SGD steps to the shared parameters with no lock.
An epoch is split between them (process p gets every N-th image of the epoch's
permutation), so N processes do an epoch's work in about 1/N of the time. After each epoch
the parent process evaluates the shared model and writes metrics.csv and metrics.png, the
same columns as worker.train.

Optimiser state: plain SGD without momentum (the paper's update, the default) has none.
With ``--momentum m`` one momentum buffer per parameter is allocated in shared memory by the
parent, once, before the processes start, and every process's SGD updates that same buffer
(lock-free, like the parameters): one momentum for the one model, instead of N private
momenta that each see only 1/N of the steps.

Reads ``--data-dir``/$ORCH_DATA_DIR like worker.train (shard ``worker_<r>_of_<W>``). Run
under torchrun, each rank runs its own independent HOGWILD on its own shard; ranks do not
communicate. Rank 0 writes to the output folder, rank r > 0 to ``<output>/rank-<r>/``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import queue as queue_mod
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from torch import nn

from worker import folds, metrics, train
from worker.augment import augment, normalize
from worker.data import make_loader
from worker.distrib import Ctx, cpu_threads
from worker.errors import WorkerError
from worker.models import ALIASES, AUGMENTATION, MODELS, build_model
from worker.optim import SCHEDULES, schedule_factor
from worker.options import _Help, _Parser, _positive
from worker.stopping import STOPPED, Stopped, on_sigterm
from worker.train import _open_local

POLL_S = 0.2  # how often the parent checks that its processes are alive while it waits


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m worker.hogwild", formatter_class=_Help,
                description="HOGWILD!: N processes on this host update one shared model "
                            "without locks (plain SGD; see the module's docstring).")
    a = p.add_argument
    a("--procs", type=_positive(int), default=2, help="training processes sharing the model")
    a("--model", choices=MODELS + tuple(ALIASES), default="lenet", help="network to train")
    a("--epochs", type=_positive(int), default=10, help="epochs (each split between the processes)")
    a("--batch-size", type=_positive(int), default=64, help="images per step and process")
    a("--lr", type=_positive(float), default=0.01, help="learning rate of every process's steps")
    a("--momentum", type=_positive(float, zero_ok=True), default=0.0,
      help="SGD momentum; >0: one shared buffer per parameter, updated lock-free by all")
    a("--weight-decay", type=_positive(float, zero_ok=True), default=0.0, help="L2 penalty")
    a("--lr-schedule", choices=SCHEDULES, default="none", help="as in worker.train, per process step")
    a("--restart-epochs", type=_positive(float), default=2.0, help="--lr-schedule warm: T_0 in epochs")
    a("--folds", type=_positive(int), metavar="K", help="K-fold: validate on fold --fold")
    a("--fold", type=_positive(int, zero_ok=True), metavar="k", help="which fold validates (0..K-1)")
    a("--seed", type=_positive(int, zero_ok=True), default=0, help="weights, data orders, augmentation")
    a("--image-size", type=_positive(int), metavar="PIXELS", help="image side (default: per model)")
    a("--workers", type=_positive(int, zero_ok=True), default=0, help="data-loader processes per process")
    a("--data-format", choices=("auto", "packed", "imagefolder"), default="auto",
      help="as in worker.train")
    a("--data-dir", type=Path, default=os.environ.get("ORCH_DATA_DIR"), metavar="DIR",
      help="folder of worker_<r>_of_<W> shards (default: $ORCH_DATA_DIR)")
    a("--output-dir", type=Path, default=Path(os.environ.get("ORCH_OUTPUT_DIR") or "output"),
      metavar="DIR", help="metrics (default: $ORCH_OUTPUT_DIR, else ./output)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return train.parse_args(argv, build_parser())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def host_ctx() -> Ctx:
    """This process's place under torchrun (rank 0 of 1 without it); no process group."""
    return Ctx(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0),
               _env_int("LOCAL_WORLD_SIZE", 1), torch.device("cpu"), "none")


# ---------------------------------------------------------------- one training process


class ShareSampler:
    """Process p's part of each epoch: every N-th index of the epoch's permutation, batched.

    The permutation is seeded by (seed, epoch), the part by p: the processes see disjoint
    parts whose union is the epoch, each in its own order.
    """

    def __init__(self, n: int, batch_size: int, seed: int, proc: int, procs: int) -> None:
        self.n, self.batch_size, self.seed, self.proc, self.procs = n, batch_size, seed, proc, procs
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)[self.proc::self.procs]

    def __len__(self) -> int:
        return -(-len(range(self.proc, self.n, self.procs)) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.indices()
        for start in range(0, len(mine), self.batch_size):
            yield sorted(mine[start:start + self.batch_size].tolist())


def shared_momentum(model: nn.Module, momentum: float) -> list[torch.Tensor]:
    """One zero buffer per parameter in shared memory, made once by the parent (none at 0)."""
    if momentum == 0:
        return []
    return [torch.zeros_like(p).share_memory_() for p in model.parameters()]


def make_sgd(model: nn.Module, args: argparse.Namespace, buffers: list[torch.Tensor]) -> torch.optim.SGD:
    """SGD over the shared parameters whose momentum buffers (if any) are the shared ones.

    torch's SGD updates an existing ``momentum_buffer`` in place (buf = m * buf + g; at the
    first step too, which from zeros equals its own first step, buf = g), so every
    process's steps go through the same buffers.
    """
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    for param, buf in zip(model.parameters(), buffers):
        opt.state[param]["momentum_buffer"] = buf
    return opt


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies, so no orphan keeps training."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def train_part(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, loader: Any,
               policy: str) -> dict[str, float]:
    """One epoch of this process's part: lock-free steps on the shared model."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    loss_sum, correct, seen, lr, t0 = 0.0, 0, 0, 0.0, time.perf_counter()
    for x, y in loader:
        out = model(normalize(augment(x.permute(0, 3, 1, 2), policy)))
        loss = loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()  # in place on the shared tensors, no lock: the HOGWILD! update
        sched.step()
        loss_sum += loss.item() * len(y)
        correct += int((out.argmax(1) == y).sum())
        seen += len(y)
    return {"loss_sum": loss_sum, "correct": correct, "seen": seen, "lr": lr,
            "seconds": time.perf_counter() - t0}


def proc_main(proc: int, args: argparse.Namespace, model: nn.Module, buffers: list[torch.Tensor],
              train_set: Any, threads: int, results: Any, go: Any) -> None:
    """A training process: waits for the parent's go, trains its part, reports; per epoch."""
    _die_with_parent()
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed + 1000 * (proc + 1))  # its own augmentation draws
    sampler = ShareSampler(len(train_set), args.batch_size, args.seed, proc, args.procs)
    loader = make_loader(train_set, sampler, args.workers)  # type: ignore[arg-type]  # same methods as EpochSampler
    opt = make_sgd(model, args, buffers)
    steps = len(sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(
        s, steps, 0, 1, args.lr_schedule, args.epochs, args.restart_epochs))
    results.put(("ready", proc, None))
    for epoch in range(1, args.epochs + 1):
        go.acquire()
        sampler.set_epoch(epoch)
        try:
            results.put(("epoch", proc, train_part(model, opt, sched, loader, AUGMENTATION[args.model])))
        except WorkerError as e:
            results.put(("error", proc, e.one_line()))
            return


# ---------------------------------------------------------------- the parent


@torch.no_grad()
def evaluate(model: nn.Module, val_set: Any, batch_size: int) -> tuple[float, float]:
    """(mean loss, accuracy) of the shared model on the validation set."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(val_set), batch_size):
        x, y = val_set[list(range(start, min(start + batch_size, len(val_set))))]
        out = model(normalize(x.permute(0, 3, 1, 2)))
        loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
        correct += int((out.argmax(1) == y).sum())
    return loss_sum / len(val_set), correct / len(val_set)


class Group:
    """The N training processes, their result queue and per-process go semaphores."""

    def __init__(self, args: argparse.Namespace, model: nn.Module, train_set: Any,
                 threads: int) -> None:
        ctx = mp.get_context("spawn")  # no fork after torch's thread pools exist
        self.results = ctx.Queue()
        self.go = [ctx.Semaphore(0) for _ in range(args.procs)]
        buffers = shared_momentum(model, args.momentum)
        self.procs = [ctx.Process(target=proc_main, name=f"hogwild-{p}", args=(
            p, args, model, buffers, train_set, threads, self.results, self.go[p]))
            for p in range(args.procs)]
        for proc in self.procs:
            proc.start()

    def collect(self, kind: str) -> list[Any]:
        """One message of ``kind`` from every process; WorkerError if one failed or died."""
        got: dict[int, Any] = {}
        while len(got) < len(self.procs):
            try:
                what, proc, payload = self.results.get(timeout=POLL_S)
            except queue_mod.Empty:
                self._check_alive()
                continue
            if what == "error":
                raise WorkerError(f"hogwild process {proc}: {payload}")
            got[proc] = payload
        return [got[p] for p in range(len(self.procs))]

    def _check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.exitcode is not None and proc.exitcode != 0:
                if proc.exitcode == -signal.SIGTERM:
                    time.sleep(1)  # a stop signals the whole group: ours raises Stopped here
                error = WorkerError(f"hogwild process {i} died (exit code {proc.exitcode})",
                                    hint="see its output above")
                error.exit_code = 1  # a crash, not a usage error
                raise error

    def epoch(self) -> list[dict[str, float]]:
        for sem in self.go:
            sem.release()
        return self.collect("epoch")

    def finish(self, timeout: float = 30) -> None:
        for proc in self.procs:
            proc.join(timeout)
        self.stop()

    def stop(self) -> None:
        """End every process still running (SIGTERM, then SIGKILL) and reap it."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def epoch_row(epoch: int, parts: list[dict[str, float]], wall: float, val: tuple[float, float],
              elapsed: float) -> dict[str, float]:
    seen = sum(p["seen"] for p in parts)
    return {"epoch": epoch, "time_s": elapsed, "epoch_time_s": wall,
            "train_loss": sum(p["loss_sum"] for p in parts) / max(1, seen),
            "train_acc": sum(p["correct"] for p in parts) / max(1, seen),
            "val_loss": val[0], "val_acc": val[1], "images_per_s": seen / max(wall, 1e-9),
            "lr": parts[0]["lr"], "grad_bytes": 0}  # shared memory: no gradient is sent


def open_sets(args: argparse.Namespace, ctx: Ctx) -> tuple[Any, Any, list[str]]:
    train_set, val_set, classes, source = _open_local(args, ctx)
    if args.folds:
        train_set, val_set = folds.apply(train_set, args.folds, args.fold, f"rank {ctx.rank}")  # type: ignore[assignment]  # FoldView: same interface
        source += f", fold {args.fold} of {args.folds} validates"
    if len(val_set) == 0:
        raise WorkerError(f"{source}: no validation images",
                          hint="add ValidationData/<class>/ images, or use --folds K --fold k")
    print(f"rank {ctx.rank}: {len(train_set)} train / {len(val_set)} validation images, "
          f"{len(classes)} classes, from {source}", flush=True)
    return train_set, val_set, classes


def output_dir(args: argparse.Namespace, ctx: Ctx) -> Path:
    return args.output_dir if ctx.rank == 0 else args.output_dir / f"rank-{ctx.rank}"


def run(args: argparse.Namespace, ctx: Ctx) -> None:
    threads = cpu_threads(ctx.local_world * args.procs)
    print(f"worker.hogwild: {args.procs} process(es) x {threads} thread(s) sharing one "
          f"{args.model}, lr {args.lr:g}, momentum {args.momentum:g}", flush=True)
    train_set, val_set, classes = open_sets(args, ctx)
    out = output_dir(args, ctx)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = build_model(args.model, len(classes))
    model.share_memory()  # parameters and buffers (BN statistics) in shared memory
    group = Group(args, model, train_set, threads)
    try:
        fit(args, ctx, group, model, val_set, out)
        group.finish()
    finally:
        group.stop()


def fit(args: argparse.Namespace, ctx: Ctx, group: Group, model: nn.Module, val_set: Any,
        out: Path) -> None:
    csv_path = out / "metrics.csv"
    metrics.start(csv_path, None)
    group.collect("ready")  # start-up (spawn, imports) is not training time
    torch.set_num_threads(cpu_threads(ctx.local_world))  # the parent evaluates between epochs
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        parts = group.epoch()
        wall = time.perf_counter() - t0
        val = evaluate(model, val_set, 2 * args.batch_size)
        row = epoch_row(epoch, parts, wall, val, time.perf_counter() - started)
        print(metrics.line(row, args.epochs), flush=True)
        metrics.append(csv_path, row)
    metrics.plot(csv_path, out / "metrics.png",
                 metrics.title(args.model, 1, f"HOGWILD! {args.procs} processes"))
    print(f"wrote {csv_path} and {out / 'metrics.png'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        run(args, host_ctx())
        return 0
    except WorkerError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        return e.exit_code
    except Stopped:
        sys.stderr.write("worker.hogwild: stopped by SIGTERM\n")
        return STOPPED
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == STOPPED:  # end by the signal itself, so the parent sees why
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(code)
