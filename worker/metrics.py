"""Rank 0's per-epoch record: the console line, metrics.csv and metrics.png, and with
--tensorboard the same columns as TensorBoard scalars."""
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


TENSORBOARD_DIR = "tensorboard"   # <output>/tensorboard/: --tensorboard's event files


def require_tensorboard() -> None:
    """--tensorboard on a host whose python lacks the tensorboard package: one line."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        from worker.errors import WorkerError
        raise WorkerError("--tensorboard: the tensorboard package is not installed in this "
                          "host's python", hint="install it on the hosts (pip install "
                          "tensorboard, e.g. in setup:), or leave --tensorboard out") from None


class Scalars:
    """Rank 0's TensorBoard scalars: each numeric column of an epoch's row, at step
    `epoch`, under <output>/tensorboard/. On resume, the epochs after the checkpoint are
    purged (they run again), as metrics.csv drops their rows."""

    def __init__(self, output_dir: Path, resumed_epoch: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        purge = None if resumed_epoch is None else resumed_epoch + 1
        self.writer = SummaryWriter(str(output_dir / TENSORBOARD_DIR), purge_step=purge)

    def add(self, row: dict) -> None:
        for key in COLUMNS:
            if key != "epoch" and isinstance(row.get(key), (int, float)):
                self.writer.add_scalar(key, row[key], int(row["epoch"]))
        self.writer.flush()   # the controller fetches the file while the job runs

    def close(self) -> None:
        self.writer.close()


def line(row: dict, epochs: int) -> str:
    return (f"epoch {row['epoch']:>3}/{epochs}  time {row['time_s']:7.1f}s  "
            f"epoch {row['epoch_time_s']:5.1f}s  {row['images_per_s']:8.0f} img/s  "
            f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
            f"val loss {row['val_loss']:.4f} acc {row['val_acc']:.4f}  lr {row['lr']:.3g}")


def title(model: str, world: int, extra: str = "") -> str:
    """The plot's title: the job (ORCH_JOB, when orch runs it), model and process count."""
    job = os.environ.get("ORCH_JOB")
    parts = [job] if job else []
    parts += [model, f"{world} process{'es' if world != 1 else ''}"]
    return " | ".join(parts + ([extra] if extra else []))


def plot(csv_path: Path, png_path: Path, heading: str = "") -> None:
    """Loss, accuracy and images/s against time, three panels under ``heading``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster hosts
    import matplotlib.pyplot as plt

    rows = read_rows(csv_path)
    t = [float(r["time_s"]) for r in rows]
    fig, (loss_ax, acc_ax, ips_ax) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for ax, key, label in ((loss_ax, "loss", "loss"), (acc_ax, "acc", "accuracy")):
        ax.plot(t, [float(r[f"train_{key}"]) for r in rows], "o-", label="train")
        ax.plot(t, [float(r[f"val_{key}"]) for r in rows], "o-", label="validation")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
    loss_ax.set_ylim(bottom=0)
    acc_ax.set_ylim(0, 1.02)
    ips_ax.plot(t, [float(r["images_per_s"]) for r in rows], "o-", color="tab:green")
    ips_ax.set_ylabel("images/s (all ranks)")
    ips_ax.set_ylim(bottom=0)  # a throughput axis that starts at 0 does not exaggerate dips
    ips_ax.set_xlabel("time (s)")
    ips_ax.grid(alpha=0.3)
    if heading:
        fig.suptitle(heading)
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
