"""Gradient bytes per step and step time for none / fp16 / terngrad (gloo, CPU);
with --accuracy, validation accuracy per epoch of fp32, TernGrad, TernGrad with error
feedback and TernGrad with the Adam correction in real 2-process trainings.

    .venv/bin/python bench/terngrad.py                 # W = 2 and 4, the demo model
    .venv/bin/python bench/terngrad.py --workers 2 --steps 10 --json out.json
    .venv/bin/python bench/terngrad.py --accuracy      # ~15-25 min on 2 cores
    .venv/bin/python bench/terngrad.py --accuracy --settings demo --seeds 0
    .venv/bin/python bench/terngrad.py --accuracy --settings demo \
        --variants "terngrad --terngrad-adam-correction"   # fp32 and this one only

Bytes mode: for every world size W it starts W processes on 127.0.0.1 (gloo, one thread each) that
train the demo model on random 32x32 images with each hook in turn, and prints per
kind: the gradient bytes one rank handed to collectives per step (CommStats.bytes_sent),
the ratio to ``none``, an estimate of what a ring algorithm puts on the wire per rank
(allreduce: 2 (W-1)/W x payload; TernGrad's all_gather: (W-1) x payload), and the
median step time (forward, backward with communication, SGD step). ``terngrad+logits``
is TernGrad with --quantize-logits. Loopback is far faster than a real network, and
with fewer cores than W the step times include CPU contention: they show the cost of
encoding, not the saving on a slow link.

Accuracy mode (bench/terngrad_accuracy.py): ``torchrun --nproc-per-node 2 -m
worker.train`` (gloo, one thread per process) per setting x seed x variant, on the demo
data made by worker.demo_data; prints per setting a table of validation accuracy per epoch
(mean +- std over the seeds) and the gradient bytes per epoch from metrics.csv, and writes
them to bench/out/terngrad-accuracy.md. Accuracy does not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker import compression  # noqa: E402

# Bench variant -> (hook kind, quantize_logits). "terngrad+logits" is --quantize-logits.
VARIANTS = {"none": ("none", False), "fp16": ("fp16", False),
            "terngrad": ("terngrad", False), "terngrad+logits": ("terngrad", True)}
IMAGE_SIZE = 32
JOIN_TIMEOUT_S = 600


def build_model(name: str, num_classes: int) -> nn.Module:
    from worker import models  # the training program's models, so the numbers match it

    return models.build_model(name, num_classes=num_classes)


def _time_steps(ddp: nn.Module, opt: torch.optim.Optimizer, stats: compression.CommStats,
                batch: tuple[torch.Tensor, torch.Tensor], warmup: int, steps: int
                ) -> tuple[float, float]:
    """(bytes per step, median seconds per step) after ``warmup`` untimed steps."""
    times, start_bytes = [], 0
    for i in range(warmup + steps):
        if i == warmup:
            start_bytes = stats.bytes_sent
        dist.barrier()  # every step starts together: times are not skewed by stragglers
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(batch[0]), batch[1]).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return (stats.bytes_sent - start_bytes) / steps, statistics.median(times)


def _run_variant(args: argparse.Namespace, variant: str, rank: int) -> dict:
    torch.manual_seed(0)  # same initial weights on every rank, as DDP would broadcast
    model = build_model(args.model, args.classes)
    ddp = nn.parallel.DistributedDataParallel(model)
    kind, quantize_logits = VARIANTS[variant]
    stats = compression.install_comm_hook(
        ddp, kind, clip_factor=args.clip_factor, quantize_logits=quantize_logits)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(args.batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen),
             torch.randint(0, args.classes, (args.batch_size,), generator=gen))
    per_step, seconds = _time_steps(ddp, opt, stats, batch, args.warmup, args.steps)
    numel = sum(p.numel() for p in model.parameters())
    return {"kind": variant, "bytes_per_step": per_step, "step_s": seconds, "params": numel}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        rows = [_run_variant(args, variant, rank) for variant in args.kinds]
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(args: argparse.Namespace, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        ctx = mp.start_processes(_worker, args=(world, _free_port(), args, out),
                                 nprocs=world, join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"W={world} did not finish in {JOIN_TIMEOUT_S} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        rows = json.loads(Path(out).read_text())
    for row in rows:
        row["workers"] = world
    return rows


def ring_traffic(kind: str, world: int, sent: float) -> float:
    """Bytes one rank puts on the wire with ring algorithms (estimate).

    A ring allreduce sends 2 (W-1)/W of the payload per rank; a ring all_gather relays
    everyone's payload, W-1 of them (TernGrad's scalers, a tiny allreduce, are
    counted as gathered too).
    """
    if kind.startswith("terngrad"):
        return (world - 1) * sent
    return 2 * (world - 1) / world * sent


def format_table(rows: list[dict]) -> str:
    lines = ["| kind | W | grad bytes/step (per rank) | vs none | ring traffic/step "
             "(per rank, est.) | vs none | step time (ms) |",
             "|---|---|---|---|---|---|---|"]
    base = {r["workers"]: r["bytes_per_step"] for r in rows if r["kind"] == "none"}
    for r in rows:
        world, sent = r["workers"], r["bytes_per_step"]
        ratio = base.get(world, float("nan")) / sent
        wire = ring_traffic(r["kind"], world, sent)
        wire_ratio = ring_traffic("none", world, base.get(world, float("nan"))) / wire
        lines.append(f"| {r['kind']} | {world} | {sent:,.0f} | {ratio:.1f}x fewer | "
                     f"{wire:,.0f} | {wire_ratio:.1f}x fewer | {1000 * r['step_s']:.1f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from terngrad_accuracy import SETTINGS
    from terngrad_accuracy import VARIANTS as ACC_VARIANTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accuracy", action="store_true",
                   help="train for real and report accuracy per epoch (not bytes per step)")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                   help="--accuracy: demo (6 classes), hard (20 classes), demo-sgd (SGD)")
    p.add_argument("--variants", nargs="+", choices=list(ACC_VARIANTS), default=None,
                   help="--accuracy: which variants to run (fp32 always runs; default all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--accuracy")
    p.add_argument("--epochs", type=int, default=8, help="--accuracy (the demo reaches 0.95 by 8)")
    p.add_argument("--model", default="lenet", help="a model of worker.models (default lenet)")
    p.add_argument("--classes", type=int, default=6, help="logits (the demo task has 6)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kinds", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="terngrad+logits: terngrad with --quantize-logits")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=20, help="timed steps per kind")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (DDP rebuilds buckets)")
    p.add_argument("--clip-factor", type=float, default=None, help="TernGrad: scaler c x std(g)")
    p.add_argument("--json", help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.accuracy:
        from terngrad_accuracy import run_accuracy

        return run_accuracy(args.settings, args.seeds, args.epochs, args.variants)
    rows = [row for world in args.workers for row in run_world(args, world)]
    print(f"model={args.model} batch={args.batch_size}/rank steps={args.steps} "
          f"params={rows[0]['params']:,} clip_factor={args.clip_factor}")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
