"""Rank 0's per-epoch record: the console line, metrics.csv and metrics.png."""
from __future__ import annotations

import csv
import os
from pathlib import Path

# The SPEC's columns first (accuracies as fractions, images_per_s summed over ranks,
# grad_bytes sent by one rank during the epoch), then extras.
COLUMNS = ("epoch", "time_s", "train_loss", "train_acc", "val_loss", "val_acc",
           "images_per_s", "lr", "grad_bytes", "epoch_time_s")


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _write(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def start(path: Path, resumed_epoch: int | None) -> None:
    """A fresh file with the header; on resume, keep the rows up to the resumed epoch.

    Rows written after the last checkpoint belong to epochs that will run again.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = [] if resumed_epoch is None else [
        r for r in read_rows(path) if int(r["epoch"]) <= resumed_epoch]
    _write(path, keep)


def append(path: Path, row: dict) -> None:
    with open(path, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore").writerow(row)
        f.flush()


def line(row: dict, epochs: int) -> str:
    return (f"epoch {row['epoch']:>3}/{epochs}  time {row['time_s']:7.1f}s  "
            f"epoch {row['epoch_time_s']:5.1f}s  {row['images_per_s']:8.0f} img/s  "
            f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
            f"val loss {row['val_loss']:.4f} acc {row['val_acc']:.4f}  lr {row['lr']:.3g}")


def plot(csv_path: Path, png_path: Path) -> None:
    """Accuracy and images/s against time, two panels."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster hosts
    import matplotlib.pyplot as plt

    rows = read_rows(csv_path)
    t = [float(r["time_s"]) for r in rows]
    fig, (acc_ax, ips_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    acc_ax.plot(t, [float(r["train_acc"]) for r in rows], "o-", label="train")
    acc_ax.plot(t, [float(r["val_acc"]) for r in rows], "o-", label="validation")
    acc_ax.set_ylabel("accuracy")
    acc_ax.set_ylim(0, 1.02)
    acc_ax.legend()
    acc_ax.grid(alpha=0.3)
    ips_ax.plot(t, [float(r["images_per_s"]) for r in rows], "o-", color="tab:green")
    ips_ax.set_ylabel("images/s (all ranks)")
    ips_ax.set_xlabel("time (s)")
    ips_ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
