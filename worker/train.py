"""DDP training on each rank's own shard: ``torchrun ... -m worker.train [options]``.

Rank r reads ``$ORCH_DATA_DIR/worker_<r>_of_<W>/`` (packed arrays when the shard has
them, else the image files) and writes nothing but its log; rank 0 writes metrics.csv,
metrics.png, checkpoints (and with --tensorboard, tensorboard/) under ``$ORCH_OUTPUT_DIR``
(default ./output). With WORLD_SIZE unset or 1 it runs as one process without a process
group (a job-array task).
SIGTERM ends it quietly (one line, then the signal's own exit). ``--help`` lists the options.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from worker import checkpoint, distrib, folds, metrics
from worker.augment import augment, normalize
from worker.data import (
    DevicePrefetcher,
    EpochSampler,
    ImageFolderBatches,
    end_loaders,
    make_loader,
    scan_shard,
)
from worker.distrib import Ctx
from worker.errors import WorkerError
from worker.models import AUGMENTATION, build_model, load_pretrained, logits_param_names
from worker.optim import make_optimizer, make_scheduler, scaled_lr
from worker.options import parse_args
from worker.packed import PackedBatches, find_packed, read_index
from worker.stopping import (
    STOPPED,
    Stopped,
    exit_now,
    on_sigterm,
    quiet_sys_hook,
    quiet_thread_hook,
    stop_follows,
)


def say(ctx: Ctx, text: str) -> None:
    if ctx.is_main:
        print(text, flush=True)


# ---------------------------------------------------------------------------
# Data: every rank checks its shard, then all ranks agree before any training collective.

Batches = Union[ImageFolderBatches, PackedBatches]  # a runtime alias: no `|` before 3.10


@dataclass
class Data:
    train: Batches
    val: Batches
    classes: list[str]
    source: str
    train_total: int  # the largest training shard over all ranks: steps per epoch


Opened = tuple[Batches, Batches, list[str], str]  # train, val, classes, where they came from


def _open_local(args: argparse.Namespace, ctx: Ctx) -> Opened:
    if args.data_dir is None:
        raise WorkerError("no data folder: ORCH_DATA_DIR is not set",
                          hint="run under `orch up`, or pass --data-dir DIR")
    shard = args.data_dir / f"worker_{ctx.rank}_of_{ctx.world}"
    if not shard.is_dir():
        raise _missing_shard(args.data_dir, shard, ctx.world)
    packed, note = ((None, "") if args.data_format == "imagefolder"
                    else find_packed(shard, args.image_size))
    if note and ctx.is_main:
        print(f"note: {note}", flush=True)
    if packed is not None:
        return (PackedBatches(packed, "train"), PackedBatches(packed, "val"),
                read_index(packed)["classes"], f"{packed} (packed)")
    if args.data_format == "packed":
        raise WorkerError(f"{shard} has no packed data at {args.image_size}px",
                          hint=f"python -m worker.pack --src {shard} "
                               f"--image-size {args.image_size}")
    files = scan_shard(shard)
    return (ImageFolderBatches(files.train, args.image_size),
            ImageFolderBatches(files.val, args.image_size), files.classes,
            f"{shard} ({files.layout})")


def _missing_shard(data_dir: Path, shard: Path, world: int) -> WorkerError:
    others = sorted(p.name for p in data_dir.glob("worker_*_of_*")) if data_dir.is_dir() else []
    found = f"; {data_dir} has {', '.join(others[:4])}" if others else ""
    return WorkerError(f"shard folder {shard} does not exist{found}",
                       hint=f"split the data for {world} worker(s) (`orch split-data`), "
                            "then `orch up`")


def _check_classes(everyone: list[tuple[list[str], int, int]]) -> list[str]:
    union = sorted(set().union(*(set(c) for c, _, _ in everyone)))
    gaps = [(r, sorted(set(union) - set(c))) for r, (c, _, _) in enumerate(everyone)]
    missing = [f"rank {r} has no images of class {', '.join(m)}" for r, m in gaps if m]
    if missing:
        raise WorkerError("; ".join(missing),
                          hint="split the data so that every class is on every rank "
                          "(orch split-data splits every class across all workers)")
    if sum(nv for _, _, nv in everyone) == 0:
        raise WorkerError("no validation images on any rank",
                          hint="add ValidationData/<class>/ images to the shards")
    return union


def open_data(args: argparse.Namespace, ctx: Ctx) -> Data:
    error, opened = None, None
    try:
        opened = _open_local(args, ctx)
        if ctx.is_main:
            args.output_dir.mkdir(parents=True, exist_ok=True)
    except (WorkerError, OSError) as e:
        error = e if isinstance(e, WorkerError) else WorkerError(f"{args.output_dir}: {e}")
    distrib.agree(error)
    assert opened is not None  # agree() raised on every rank otherwise
    train, val, classes, source = opened
    if args.folds:  # the same deterministic folds on every rank's own shard
        train, val = folds.apply(train, args.folds, args.fold, f"rank {ctx.rank}")  # type: ignore[assignment]  # FoldView: same interface
        source += f", fold {args.fold} of {args.folds} validates"
    everyone = distrib.gather_all((classes, len(train), len(val)))
    classes = _check_classes(everyone)
    print(f"rank {ctx.rank}: {len(train)} train / {len(val)} validation images, "
          f"{len(classes)} classes, from {source}", flush=True)
    return Data(train, val, classes, source, max(n for _, n, _ in everyone))


# ---------------------------------------------------------------------------
# Model, optimiser, resume.


class Local(nn.Module):
    """One process, no process group: the model under the name DDP gives it (``.module``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)


@dataclass
class State:
    model: DDP | Local  # Local: one process, no process group
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    comm: Any  # worker.compression's stats, or None
    start_epoch: int = 1
    elapsed: float = 0.0  # training seconds before this run (resume)
    hits: int = 0  # epochs in a row at or above --target-accuracy


def _cuda_only_notes(args: argparse.Namespace, ctx: Ctx) -> None:
    """--amp, --channels-last and --sync-bn are GPU features (SyncBatchNorm refuses CPU)."""
    if ctx.device.type != "cuda":
        for flag in ("amp", "channels_last", "sync_bn"):
            if getattr(args, flag):
                say(ctx, f"note: --{flag.replace('_', '-')} has no effect on CPU; ignored")
        args.amp = args.channels_last = args.sync_bn = False


def _local_model(args: argparse.Namespace, ctx: Ctx, num_classes: int) -> nn.Module:
    torch.manual_seed(args.seed)
    model = build_model(args.model, num_classes)
    if args.pretrained and ctx.is_main:  # DDP copies rank 0's weights to every rank
        say(ctx, load_pretrained(model, args.pretrained))
    return model


def _install_comm_hook(ddp: DDP, args: argparse.Namespace, logits: set[str]) -> Any:
    try:
        from worker.compression import install_comm_hook
    except ImportError:
        if args.grad_compression != "none":
            raise WorkerError(f"--grad-compression {args.grad_compression} needs "
                              "worker/compression.py",
                              hint="sync the whole worker/ folder") from None
        return None
    return install_comm_hook(ddp, args.grad_compression, clip_factor=args.clip_factor,
                             size_to_binarize=args.size_to_binarize,
                             quantize_logits=args.quantize_logits,
                             logits_param_names=logits, seed=args.seed,
                             error_feedback=args.error_feedback,
                             adam_correction=_corrected(args))


def _corrected(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "terngrad_adam_correction", False))


def _restore(args: argparse.Namespace, ctx: Ctx, model: nn.Module,
             classes: list[str]) -> dict[str, Any] | None:
    """Load rank 0's newest checkpoint into ``model`` (rank 0) and return the rest."""
    model_state, ckpt = checkpoint.load_for_resume(args.output_dir, ctx.is_main)
    if ckpt is None:
        say(ctx, f"--resume: no checkpoint in {args.output_dir / checkpoint.SUBDIR}; "
                 "starting at epoch 1")
        return None
    if ckpt["model_name"] != args.model or ckpt["classes"] != classes:
        raise WorkerError(f"the checkpoint of epoch {ckpt['epoch']} is for --model "
                          f"{ckpt['model_name']} with {len(ckpt['classes'])} classes",
                          hint="use the same --model and data, or another --output-dir")
    if model_state is not None:
        model.load_state_dict(model_state)
    return ckpt


def build_state(args: argparse.Namespace, ctx: Ctx, data: Data) -> State:
    _cuda_only_notes(args, ctx)
    error, model = None, None
    try:
        model = _local_model(args, ctx, len(data.classes))
    except WorkerError as e:
        error = e
    distrib.agree(error)
    assert model is not None  # agree() raised on every rank otherwise
    logits = logits_param_names(model)
    ckpt = _restore(args, ctx, model, data.classes) if args.resume else None
    if args.sync_bn and ctx.world > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(ctx.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    lr = scaled_lr(args.lr, ctx.world, args.lr_scaling)
    optimizer = make_optimizer(args.optimizer, model.parameters(), lr, args.momentum,
                               args.weight_decay, corrected=_corrected(args))
    steps = -(-data.train_total // args.batch_size)
    scheduler = make_scheduler(optimizer, steps, args.warmup_epochs, ctx.world,
                               args.lr_schedule, args.epochs, args.restart_epochs)
    wrapped, comm = _wrap(model, args, ctx, logits)
    if comm is not None and getattr(comm.hook_state, "squares", None) is not None:
        optimizer.squares = comm.hook_state.squares  # type: ignore[attr-defined]
    st = State(wrapped, optimizer, scheduler,  # type: ignore[arg-type]  # _wrap gives DDP or Local
               torch.amp.GradScaler(ctx.device.type, enabled=args.amp), comm)
    # Ranks draw different augmentations and dropout masks; a resume restores the draws.
    torch.manual_seed(args.seed + 1000 * ctx.rank)
    if ckpt is not None:
        _apply(st, ckpt, ctx, args.seed)
    return st


def _wrap(model: nn.Module, args: argparse.Namespace, ctx: Ctx,
          logits: set[str]) -> tuple[nn.Module, Any]:
    """DDP (with the gradient hook) across processes; the bare model on one process."""
    if ctx.world == 1:
        if args.grad_compression != "none":
            say(ctx, f"note: --grad-compression {args.grad_compression} has no effect on one "
                     "process (no gradient is sent); ignored")
        return Local(model), None
    ddp = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    return ddp, _install_comm_hook(ddp, args, logits)


def _apply(st: State, ckpt: dict[str, Any], ctx: Ctx, seed: int) -> None:
    st.optimizer.load_state_dict(ckpt["optimizer"])
    st.scheduler.load_state_dict(ckpt["scheduler"])
    st.scaler.load_state_dict(ckpt["scaler"])
    st.start_epoch, st.elapsed, st.hits = ckpt["epoch"] + 1, ckpt["elapsed"], ckpt["hits"]
    if len(ckpt["rng"]) == ctx.world:
        checkpoint.set_rng_state(ckpt["rng"][ctx.rank])
    else:  # another world size: fresh draws rather than a replay of epoch 1's
        torch.manual_seed(seed + 1000 * ctx.rank + st.start_epoch)
    print(f"rank {ctx.rank}: resumed from the checkpoint of epoch {ckpt['epoch']}", flush=True)


def checkpoint_state(args: argparse.Namespace, st: State, classes: list[str],
                     elapsed: float) -> dict[str, Any]:
    return {"model": st.model.module.state_dict(), "optimizer": st.optimizer.state_dict(),
            "scheduler": st.scheduler.state_dict(), "scaler": st.scaler.state_dict(),
            "model_name": args.model, "classes": classes, "elapsed": elapsed, "hits": st.hits}


# ---------------------------------------------------------------------------
# Epochs.


def prepare(x: torch.Tensor, args: argparse.Namespace, ctx: Ctx, train: bool) -> torch.Tensor:
    """NHWC uint8 from the loader -> augmented, normalised NCHW float on the device."""
    x = x.to(ctx.device, non_blocking=True).permute(0, 3, 1, 2)
    if train:
        x = augment(x, AUGMENTATION[args.model])
    return normalize(x, torch.channels_last if args.channels_last else torch.contiguous_format)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class Heartbeat:
    """orch's hang watch counts a touch of $ORCH_HEARTBEAT as progress, so a quiet epoch
    is not a hang; touched at most every EVERY seconds (one clock read per step)."""

    EVERY = 2.0

    def __init__(self) -> None:
        self.path, self.last = os.environ.get("ORCH_HEARTBEAT"), 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self.path and now - self.last >= self.EVERY:
            self.last = now
            try:
                os.utime(self.path)
            except OSError:   # its folder was removed: the watch is not worth a failure
                self.path = None


beat = Heartbeat()


def train_epoch(args: argparse.Namespace, ctx: Ctx, st: State, loader: Any) -> dict[str, float]:
    st.model.train()
    loss_fn = nn.CrossEntropyLoss()
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
    correct = torch.zeros((), device=ctx.device, dtype=torch.int64)
    seen, steps, lr, t0 = 0, 0, 0.0, time.perf_counter()
    for x, y in loader:
        x, y = prepare(x, args, ctx, train=True), y.to(ctx.device, non_blocking=True)
        with torch.autocast(ctx.device.type, dtype=torch.float16, enabled=args.amp):
            out = st.model(x)
            loss = loss_fn(out, y)
        st.optimizer.zero_grad(set_to_none=True)
        st.scaler.scale(loss).backward()
        st.scaler.step(st.optimizer)
        st.scaler.update()
        lr = st.optimizer.param_groups[0]["lr"]  # the rate this step used
        st.scheduler.step()
        loss_sum += loss.detach().double() * len(y)
        correct += (out.argmax(1) == y).sum()
        seen, steps = seen + len(y), steps + 1
        beat()
    seconds = time.perf_counter() - t0
    return {"loss_sum": loss_sum.item(), "correct": correct.item(), "seen": seen,
            "images_per_s": seen / max(seconds, 1e-9), "steps": steps, "lr": lr}


@torch.no_grad()
def validate(args: argparse.Namespace, ctx: Ctx, st: State,
             loader: Any) -> tuple[float, float, float]:
    # The plain module, not DDP: no buffer broadcast, and ranks may have unequal slices.
    model = st.model.module
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in loader:
        x, y = prepare(x, args, ctx, train=False), y.to(ctx.device, non_blocking=True)
        with torch.autocast(ctx.device.type, dtype=torch.float16, enabled=args.amp):
            out = model(x)
        loss_sum += nn.functional.cross_entropy(out.float(), y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        seen += len(y)
        beat()
    return loss_sum, correct, seen


def progress(loader: Any, epoch: int, every: int, ctx: Ctx) -> Any:
    """The loader, and on rank 0 with --log-every N a line `epoch E step S/T` once step S
    (every Nth, and the first) is done: printed when the next batch is asked for."""
    if not every or not ctx.is_main:
        return loader
    return _progress_lines(loader, epoch, every)


def _progress_lines(loader: Any, epoch: int, every: int) -> Iterator[Any]:
    total = len(loader) if hasattr(loader, "__len__") else "?"
    step = 0
    for batch in loader:
        if step and (step == 1 or step % every == 0):
            print(f"epoch {epoch} step {step}/{total}", flush=True)
        yield batch
        step += 1
    if step and (step == 1 or step % every == 0):
        print(f"epoch {epoch} step {step}/{total}", flush=True)


def run_epoch(args: argparse.Namespace, ctx: Ctx, st: State, epoch: int, loaders: tuple,
              started: float) -> dict[str, float]:
    """One epoch on every rank; returns the row rank 0 logs (averaged/summed over ranks)."""
    t0 = time.perf_counter()
    loaders[0].sampler.set_epoch(epoch)
    sent_before = st.comm.bytes_sent if st.comm is not None else 0
    tr = train_epoch(args, ctx, st, progress(loaders[0], epoch, args.log_every, ctx))
    v_loss, v_correct, v_seen = validate(args, ctx, st, loaders[1])
    loss, corr, seen, ips, vl, vc, vs = distrib.sum_over_ranks(
        [tr["loss_sum"], tr["correct"], tr["seen"], tr["images_per_s"], v_loss, v_correct, v_seen],
        ctx.device)
    if ctx.world == 1:
        sent: float = 0  # one process sends no gradients
    elif st.comm is not None:
        sent = st.comm.bytes_sent - sent_before
    else:
        sent = _param_bytes(st.model) * tr["steps"]
    now = time.perf_counter()
    return {"epoch": epoch, "time_s": st.elapsed + now - started, "epoch_time_s": now - t0,
            "train_loss": loss / seen, "train_acc": corr / seen, "val_loss": vl / vs,
            "val_acc": vc / vs, "images_per_s": ips,
            "lr": tr["lr"], "grad_bytes": int(sent)}


def _loaders(args: argparse.Namespace, ctx: Ctx, data: Data) -> tuple:
    pin = ctx.device.type == "cuda"
    train = EpochSampler(len(data.train), args.batch_size, args.seed, ctx.rank, data.train_total)
    val = EpochSampler(len(data.val), 2 * args.batch_size, args.seed, ctx.rank, shuffle=False)
    loaders = (make_loader(data.train, train, args.workers, pin, ring=True),
               make_loader(data.val, val, min(args.workers, 1), pin))
    if pin:  # CUDA: batches are copied to the GPU one step ahead, on a side stream
        return tuple(DevicePrefetcher(loader, ctx.device) for loader in loaders)
    return loaders


def fit(args: argparse.Namespace, ctx: Ctx, data: Data, st: State) -> None:
    csv_path = args.output_dir / "metrics.csv"
    resumed = st.start_epoch - 1 if args.resume else None
    if args.tensorboard:
        metrics.require_tensorboard()   # every rank: each says it, none waits on rank 0
    if ctx.is_main:
        metrics.start(csv_path, resumed)
    scalars = metrics.Scalars(args.output_dir, resumed) if args.tensorboard and ctx.is_main else None
    loaders, started = _loaders(args, ctx, data), time.perf_counter()
    for epoch in range(st.start_epoch, args.epochs + 1):
        row = run_epoch(args, ctx, st, epoch, loaders, started)
        at_target = args.target_accuracy and row["val_acc"] >= args.target_accuracy
        st.hits = st.hits + 1 if at_target else 0
        stop = bool(args.target_accuracy) and st.hits >= args.patience
        if ctx.is_main:
            print(metrics.line(row, args.epochs), flush=True)
            metrics.append(csv_path, row)
            if scalars is not None:
                scalars.add(row)
        last = stop or epoch == args.epochs
        if args.checkpoint_every > 0 and (epoch % args.checkpoint_every == 0 or last):
            state = checkpoint_state(args, st, data.classes, row["time_s"])
            checkpoint.save(args.output_dir, epoch, state, ctx.is_main)
        if stop:
            say(ctx, f"reached validation accuracy {row['val_acc']:.4f} >= {args.target_accuracy} "
                     f"for {args.patience} epoch(s): stopping after epoch {epoch}")
            break
    if scalars is not None:
        scalars.close()
    if ctx.is_main and metrics.read_rows(csv_path):
        fold = f"fold {args.fold} of {args.folds}" if args.folds else ""
        metrics.plot(csv_path, args.output_dir / "metrics.png",
                     metrics.title(args.model, ctx.world, fold))
        say(ctx, f"wrote {csv_path} and {args.output_dir / 'metrics.png'}")


def run(args: argparse.Namespace, ctx: Ctx) -> None:
    say(ctx, f"worker.train: {ctx.world} process(es), backend {ctx.backend}, model {args.model}, "
             f"{torch.get_num_threads()} thread(s) per process, "
             f"lr {scaled_lr(args.lr, ctx.world, args.lr_scaling):g} ({args.lr_scaling} scaling)")
    data = open_data(args, ctx)
    st = build_state(args, ctx, data)
    fit(args, ctx, data, st)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.excepthook, threading.excepthook = quiet_sys_hook, quiet_thread_hook
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    ctx, stopped = None, False
    try:
        ctx = distrib.setup(args.dist_backend)
        run(args, ctx)
        return 0
    except WorkerError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")  # one write: lines of ranks do not mix
        sys.stderr.flush()
        return e.exit_code
    except Stopped:
        stopped = True
    except Exception:
        if not (ctx is not None and ctx.world > 1 and stop_follows()):
            raise
        stopped = True
    finally:
        end_loaders()
        signal.signal(signal.SIGTERM, previous)  # the CLI's previous: the default, ending us
        if not stopped:
            distrib.teardown()
    sys.stderr.write(f"worker.train: rank {os.environ.get('RANK', '0')} stopped by SIGTERM\n")
    sys.stderr.flush()
    return STOPPED


if __name__ == "__main__":
    exit_now(main())
