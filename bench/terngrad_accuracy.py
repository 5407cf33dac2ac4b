"""Accuracy per epoch of fp32 and the TernGrad variants (plain, error feedback, the Adam
correction; bench/terngrad.py --accuracy): real 2-process trainings of worker.train on
the demo data.

Every run is ``torchrun --nproc-per-node 2 -m worker.train`` (gloo, OMP_NUM_THREADS=1)
with the shipped demo's training options (LeNet, Adam, lr 0.001, batch 32 per rank; no
early stop; setting demo-sgd: SGD instead), the same data for every run of a setting, and ``--seed`` varying the
weights, shuffling and augmentation. Runs are interleaved seed by seed, so a change in
the machine's load does not weigh on one variant only (accuracy does not depend on it;
the wall time does).
"""
from __future__ import annotations

import csv
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "terngrad-accuracy.md"
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Setting:
    classes: int
    train_per_class: int
    val_per_class: int
    note: str
    optimizer: tuple[str, ...] = ("--optimizer", "adam", "--lr", "0.001")  # the demo's


SETTINGS = {
    "demo": Setting(6, 300, 50, "the shipped demo's data: 6 classes, 1,800 training and "
                                "300 validation images"),
    "hard": Setting(20, 400, 100, "20 classes (shapes repeat past 10, told apart by hue "
                                  "alone), 8,000 training and 2,000 validation images"),
    "demo-sgd": Setting(6, 300, 50, "the demo's data, trained with SGD (lr 0.01, momentum "
                                    "0.9) instead of Adam: the optimizer of the TernGrad paper",
                        ("--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9")),
}

# Variant -> worker.train options. TernGrad as measured before (stochastic, 2.5 std);
# with error feedback the codes are deterministic and the scaler its default; the Adam
# correction keeps the stochastic codes (it only changes Adam's second moment).
VARIANTS = {
    "fp32": ["--grad-compression", "none"],
    "terngrad": ["--grad-compression", "terngrad", "--clip-factor", "2.5", "--quantize-logits",
                 "--no-terngrad-adam-correction"],   # the paper's, for the comparison
    "terngrad --error-feedback": ["--grad-compression", "terngrad", "--quantize-logits",
                                  "--error-feedback"],
    "terngrad --terngrad-adam-correction": ["--grad-compression", "terngrad", "--clip-factor",
                                            "2.5", "--quantize-logits",
                                            "--terngrad-adam-correction"],
}
TRAIN_ARGS = ["--model", "lenet", "--image-size", "32", "--batch-size", "32", "--workers", "0",
              "--checkpoint-every", "0"]


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ORCH_DATA_DIR",
            "ORCH_OUTPUT_DIR", "ORCH_JOB", "ORCH_HEARTBEAT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")
    return env


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        sys.exit(f"bench/terngrad.py: {' '.join(cmd[:6])} ... exited {done.returncode}:\n"
                 + "\n".join(tail))


def make_shards(root: Path, setting: Setting) -> Path:
    src, shards = root / "images", root / "shards"
    _run([sys.executable, "-m", "worker.demo_data", "--out", str(src), "--seed", "0",
          "--classes", str(setting.classes), "--train-per-class", str(setting.train_per_class),
          "--val-per-class", str(setting.val_per_class)])
    _run([sys.executable, "-m", "orchestrator", "split-data", "--workers", "2", "--source",
          str(src), "--out", str(shards)])
    return shards


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train(shards: Path, out: Path, variant: str, seed: int, epochs: int,
          optimizer: tuple[str, ...]) -> list[dict]:
    """One 2-process training; its metrics.csv rows (val_acc, grad_bytes per epoch)."""
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
          "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
          "-m", "worker.train", *TRAIN_ARGS, *optimizer, "--epochs", str(epochs), "--seed", str(seed),
          "--data-dir", str(shards), "--output-dir", str(out), *VARIANTS[variant]])
    with open(out / "metrics.csv", newline="") as f:
        return [{"val_acc": float(r["val_acc"]), "grad_bytes": int(r["grad_bytes"])}
                for r in csv.DictReader(f)]


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.2f} ± {100 * std:.2f}"


def table(runs: dict[str, list[list[dict]]], epochs: int) -> list[str]:
    """Validation accuracy (%) per epoch, mean ± std over seeds; bytes per epoch per rank."""
    head = " | ".join(f"ep {e}" for e in range(1, epochs + 1))
    lines = [f"| variant | {head} | gap to fp32 at ep {epochs} | grad bytes / epoch / rank "
             "| vs fp32 |", "|---|" + "---|" * (epochs + 3)]
    final = {v: [r[-1]["val_acc"] for r in rs] for v, rs in runs.items()}
    base_bytes = statistics.fmean(r[-1]["grad_bytes"] for r in runs["fp32"])
    for variant, seeds in runs.items():
        cells = [_mean_std([r[e]["val_acc"] for r in seeds]) for e in range(epochs)]
        gap = 100 * (statistics.fmean(final[variant]) - statistics.fmean(final["fp32"]))
        sent = statistics.fmean(r[-1]["grad_bytes"] for r in seeds)
        lines.append(f"| {variant} | {' | '.join(cells)} | {gap:+.2f} | {sent:,.0f} | "
                     f"{base_bytes / sent:.1f}x fewer |")
    return lines


def run_setting(name: str, seeds: list[int], epochs: int, root: Path,
                variants: list[str]) -> list[str]:
    setting = SETTINGS[name]
    shards = make_shards(root / name, setting)
    runs: dict[str, list[list[dict]]] = {v: [] for v in ["fp32", *variants] if v}
    t0 = time.monotonic()
    for seed in seeds:
        for variant in runs:
            start = time.monotonic()
            rows = train(shards, root / name / f"{variant.replace(' ', '')}-{seed}", variant,
                         seed, epochs, setting.optimizer)
            runs[variant].append(rows)
            print(f"{name} seed {seed} {variant}: val_acc {rows[-1]['val_acc']:.4f}, "
                  f"{time.monotonic() - start:.0f} s, load {_load()}", flush=True)
    wall = time.monotonic() - t0
    return [f"### {name}: {setting.note}", "",
            f"LeNet, `{' '.join(setting.optimizer)}` (lr x2 for 2 ranks), batch 32 per rank, "
            f"{epochs} epochs, "
            f"2 ranks (gloo), seeds {', '.join(map(str, seeds))}; validation accuracy in % "
            f"(mean ± std over the seeds). {len(seeds) * len(runs)} runs in "
            f"{wall / 60:.1f} min of wall time, load average {_load()} at the end.", "",
            *table(runs, epochs), ""]


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_accuracy(settings: list[str], seeds: list[int], epochs: int,
                 variants: list[str] | None = None) -> int:
    """``variants``: those to run besides fp32 (the baseline every table compares to)."""
    chosen = [v for v in (variants or VARIANTS) if v != "fp32"]
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="terngrad-acc-") as tmp:
        for name in settings:
            lines += run_setting(name, seeds, epochs, Path(tmp), chosen)
            print("\n".join(lines[-len(chosen) - 4:]), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {OUT}")
    return 0
