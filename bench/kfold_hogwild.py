"""Job-array workloads on this machine: AsyncKFold (many independent tasks) and HOGWILD!.

    .venv/bin/python bench/kfold_hogwild.py                  # both parts, a few minutes
    .venv/bin/python bench/kfold_hogwild.py --epochs 3 --per-class 80 --hogwild-epochs 6

(a) AsyncKFold: models (lenet, mobilenet) x schedules (cosine, warm) x 3 folds, each task a
    ``python -m worker.train --folds 3 --fold k`` on the demo data. Arms:
    - serial: the 12 tasks one after another (interleaved with the next arm per model, so
      that a change in the machine's load weighs on both);
    - orch array: ``orch up`` of a generated cluster.yaml whose ``job.array`` matrix is the
      same 12 tasks on one local host with procs: 2; each task's accuracy comes from
      ``orch results --json`` (the last row of the metrics.csv the task wrote);
    - 2 at a time (subprocess): the same commands, two running at any moment (a task starts
      when a slot frees; longest first), labelled as such: it measures what the array
      arm should reach.
    Every task runs with OMP_NUM_THREADS=1 in every arm, so a task does the same arithmetic
    in the same order wherever it runs: same seed, same final accuracy.
(b) HOGWILD!: ``python -m worker.hogwild --procs 1`` and ``--procs 2`` for the same epochs,
    OMP_NUM_THREADS=1 per process (1 core vs 2 cores), plain SGD (the paper's update), 3 runs
    each, interleaved (races make every 2-process run different); training time (spawn
    excluded) and the final validation accuracy and loss.

Prints markdown tables and writes bench/out/array.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = REPO / ".venv" / "bin" / "python"
ORCH = REPO / ".venv" / "bin" / "orch"
OUT = REPO / "bench" / "out"
MODELS, SCHEDULES, FOLDS = ("lenet", "mobilenet"), ("cosine", "warm"), 3


@dataclass
class Task:
    model: str
    schedule: str
    fold: int
    seconds: dict[str, float] = field(default_factory=dict)
    acc: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.schedule}-fold{self.fold}"

    def args(self) -> list[str]:
        return ["--model", self.model, "--lr-schedule", self.schedule, "--folds", str(FOLDS),
                "--fold", str(self.fold)]


def env1() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ORCH_DATA_DIR",
            "ORCH_OUTPUT_DIR", "ORCH_JOB")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), ORCH_NO_COLOR="1")
    return env


def make_data(root: Path, per_class: int, val_per_class: int = 10) -> Path:
    """Demo data split for one worker: <root>/shards/worker_0_of_1."""
    src, shards = root / "demo", root / "shards"
    run([str(PY), "-m", "worker.demo_data", "--out", str(src), "--seed", "0",
         "--train-per-class", str(per_class), "--val-per-class", str(val_per_class)])
    run([str(ORCH), "split-data", "--workers", "1", "--source", str(src), "--out", str(shards)])
    return shards


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=env1(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench/kfold_hogwild.py: {' '.join(cmd[:4])} ... failed:\n{done.stdout}{done.stderr}")


def common_args(args: argparse.Namespace) -> list[str]:
    return ["--epochs", str(args.epochs), "--batch-size", "32", "--optimizer", "adam", "--lr", "0.003",
            "--workers", "0", "--checkpoint-every", "0", "--seed", "0"]


def task_cmd(task: Task, args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    return [str(PY), "-m", "worker.train", *common_args(args), *task.args(),
            "--data-dir", str(data), "--output-dir", str(out / task.name)]


def final_acc(out: Path) -> float:
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return float(rows[-1]["val_acc"]) if rows else float("nan")


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env1(), stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def run_arm(arm: str, tasks: list[Task], slots: int, args: argparse.Namespace, data: Path,
            root: Path) -> float:
    """All tasks, ``slots`` at a time (longest first); returns the wall time."""
    out = root / arm
    out.mkdir(parents=True, exist_ok=True)
    queue = sorted(tasks, key=lambda t: t.model != "mobilenet") if slots > 1 else list(tasks)
    running: dict[subprocess.Popen, tuple[Task, float]] = {}
    t0 = time.perf_counter()
    while queue or running:
        while queue and len(running) < slots:
            task = queue.pop(0)
            proc = start(task_cmd(task, args, data, out), out / f"{task.name}.log")
            running[proc] = (task, time.perf_counter())
        time.sleep(0.05)
        for proc in [p for p in running if p.poll() is not None]:
            task, began = running.pop(proc)
            if proc.returncode:
                sys.exit(f"{arm}: task {task.name} failed; see {out / (task.name + '.log')}")
            task.seconds[arm] = time.perf_counter() - began
            task.acc[arm] = final_acc(out / task.name)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- orch array arm


def array_yaml(args: argparse.Namespace, root: Path, data_src: Path, shards: Path) -> Path:
    """A cluster.yaml whose job.array is the 12 tasks, on one local host with 2 slots."""
    argv = ", ".join(f'"{a}"' for a in [*common_args(args), "--folds", str(FOLDS)])
    text = f"""name: bench-array
hosts:
  - address: localhost
    connection: local
    procs: 2
    remote_dir: {root / 'node'}
python: {PY}
code:
  paths: [worker]
  exclude: ["*.pyc", "__pycache__"]
data:
  source: {data_src}
  shards: {shards}
job:
  entrypoint: worker.train
  args: [{argv}]
  env: {{OMP_NUM_THREADS: "1"}}
  array:
    matrix: {{model: [{', '.join(MODELS)}], lr-schedule: [{', '.join(SCHEDULES)}], fold: [0, 1, 2]}}
    procs_per_task: 1
"""
    path = root / "cluster.yaml"
    path.write_text(text)
    (root / "worker").symlink_to(REPO / "worker")  # code.paths are relative to the yaml
    return path


def orch_arm(args: argparse.Namespace, root: Path, data: Path,
             tasks: list[Task]) -> tuple[float | None, str]:
    """(wall seconds, note) of ``orch up`` on the array inventory (None when it failed);
    each task's accuracy from ``orch results --json``."""
    arm_root = root / "orch"
    arm_root.mkdir()
    cfg = array_yaml(args, arm_root, root / "demo", data)
    t0 = time.perf_counter()
    done = subprocess.run([str(ORCH), "up", str(cfg)], env=env1(), capture_output=True, text=True,
                          cwd=arm_root, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode == 2:
        first = (done.stderr.strip() or done.stdout.strip()).splitlines()[:1]
        return None, f"not available (orch up exit 2: {first[0] if first else ''})"
    if done.returncode:
        return None, f"failed (orch up exit {done.returncode})"
    results = subprocess.run([str(ORCH), "results", "-c", str(cfg), "--json"], env=env1(),
                             capture_output=True, text=True, cwd=arm_root, timeout=600)
    if results.returncode:
        return None, f"failed (orch results exit {results.returncode}: {results.stderr.strip()[:200]})"
    def key(p: dict[str, str]) -> tuple[str, str, str]:
        return p["model"], p["lr-schedule"], p["fold"]
    by_params = {key(r["params"]): r for r in json.loads(results.stdout)["tasks"]}
    for task in tasks:
        row = by_params[(task.model, task.schedule, str(task.fold))]
        task.acc["orch"] = float(row["metrics"].get("val_acc", "nan"))
    return wall, "orch up with job.array"


# ---------------------------------------------------------------- HOGWILD!


HOGWILD_OPTS = ["--batch-size", "32", "--lr", "0.05", "--momentum", "0", "--lr-schedule", "cosine"]


def hogwild(procs: int, args: argparse.Namespace, data: Path, root: Path, run_no: int) -> dict[str, float]:
    out = root / f"hogwild-{procs}-{run_no}"
    cmd = [str(PY), "-m", "worker.hogwild", "--procs", str(procs), "--epochs", str(args.hogwild_epochs),
           *HOGWILD_OPTS,
           "--seed", "0", "--data-dir", str(data), "--output-dir", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env1(), capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"hogwild --procs {procs} failed:\n{done.stdout}{done.stderr}")
    with open(out / "metrics.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    return {"train_s": float(last["time_s"]), "wall_s": wall, "val_acc": float(last["val_acc"]),
            "val_loss": float(last["val_loss"]), "train_loss": float(last["train_loss"])}


# ---------------------------------------------------------------- the machine's parallelism

SPIN = ("import time, torch\ntorch.set_num_threads(1)\na = torch.randn(192, 192)\n"
        "t = time.perf_counter()\nfor _ in range(12000):\n    a @ a\n"
        "print(time.perf_counter() - t)")


def spin(n: int) -> list[float]:
    """Seconds of a fixed 1-thread matmul loop, run by n processes at once."""
    procs = [subprocess.Popen([str(PY), "-c", SPIN], env=env1(), stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    return [float(proc.communicate()[0]) for proc in procs]


def parallelism() -> float:
    """How much faster 2 one-thread processes get through 2 units of work than 1 does,
    right now: 2.0 on 2 idle cores, less when other programs share the machine."""
    one = sorted(spin(1)[0] for _ in range(3))[1]
    two = sorted(max(spin(2)) for _ in range(3))[1]
    return 2 * one / two  # medians of 3


# ---------------------------------------------------------------- report


def kfold_tables(tasks: list[Task], walls: dict[str, float], orch_note: str,
                 avail: float) -> list[str]:
    serial = walls["serial"]
    lines = [f"Parallelism the machine offered (2 one-thread processes vs 1, measured before): "
             f"{avail:.2f}x of an ideal 2.00x.", "",
             "| arm | wall time | vs serial |", "|---|---|---|"]
    lines.append(f"| serial (1 at a time) | {serial:.1f} s | 1.00x |")
    orch = walls.get("orch")
    lines.append("| orch array (`orch up`, job.array, procs 2) | "
                 + (f"{orch:.1f} s | {serial / orch:.2f}x faster ({orch / serial:.2f} of serial) |"
                    if orch else f"{orch_note} | - |"))
    par = walls["pair"]
    lines.append(f"| 2 at a time (subprocess fallback) | {par:.1f} s | "
                 f"{serial / par:.2f}x faster ({par / serial:.2f} of serial) |")
    lines += ["", "| model | schedule | fold | serial acc | orch array acc | 2-at-a-time acc | "
              "largest difference | serial task s | 2-at-a-time task s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for t in tasks:
        orch_acc = t.acc.get("orch", float("nan"))
        diff = max(abs(t.acc["pair"] - t.acc["serial"]), abs(orch_acc - t.acc["serial"]))
        lines.append(f"| {t.model} | {t.schedule} | {t.fold} | {t.acc['serial']:.4f} | "
                     f"{orch_acc:.4f} | {t.acc['pair']:.4f} | {diff:.4f} | "
                     f"{t.seconds['serial']:.1f} | {t.seconds['pair']:.1f} |")
    lines += ["", "| model | schedule | mean accuracy over the 3 folds (serial) |", "|---|---|---|"]
    for m in MODELS:
        for s in SCHEDULES:
            accs = [t.acc["serial"] for t in tasks if t.model == m and t.schedule == s]
            lines.append(f"| {m} | {s} | {sum(accs) / len(accs):.4f} |")
    return lines


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _spread(runs: list[dict[str, float]], key: str) -> str:
    v = [r[key] for r in runs]
    return f"{sum(v) / len(v):.4f} ({min(v):.4f}-{max(v):.4f})"


def hogwild_table(runs: dict[int, list[dict[str, float]]], avail: float) -> list[str]:
    """Per process count: median training time, mean (min-max) final accuracy and loss."""
    base = _median([r["train_s"] for r in runs[1]])
    lines = [f"Parallelism the machine offered (measured before): {avail:.2f}x of an ideal 2.00x. "
             f"{len(runs[1])} runs per row (interleaved): median times, mean (min-max) of the rest.", "",
             "| processes | training time | speed-up | final val acc | final val loss | "
             "final train loss | wall (with spawn) |", "|---|---|---|---|---|---|---|"]
    for n, rs in runs.items():
        t = _median([r["train_s"] for r in rs])
        lines.append(f"| {n} | {t:.1f} s | {base / t:.2f}x | {_spread(rs, 'val_acc')} | "
                     f"{_spread(rs, 'val_loss')} | {_spread(rs, 'train_loss')} | "
                     f"{_median([r['wall_s'] for r in rs]):.1f} s |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=4, help="epochs per AsyncKFold task")
    p.add_argument("--per-class", type=int, default=90, help="demo training images per class")
    p.add_argument("--hogwild-epochs", type=int, default=16)
    p.add_argument("--hogwild-runs", type=int, default=3, help="runs per process count")
    p.add_argument("--hogwild-per-class", type=int, default=300)
    p.add_argument("--skip-kfold", action="store_true")
    p.add_argument("--skip-hogwild", action="store_true")
    args = p.parse_args()
    report = [f"# bench/kfold_hogwild.py ({os.cpu_count()} cores)", ""]
    with tempfile.TemporaryDirectory(prefix="orch-bench-array-") as tmp:
        root = Path(tmp)
        if not args.skip_kfold:
            report += kfold_part(args, root / "kfold")
        if not args.skip_hogwild:
            report += hogwild_part(args, root / "hogwild")
    text = "\n".join(report) + "\n"
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "array.md").write_text(text)
    print(f"wrote {OUT / 'array.md'}")
    return 0


def kfold_part(args: argparse.Namespace, root: Path) -> list[str]:
    root.mkdir(parents=True)
    data = make_data(root, args.per_class)
    tasks = [Task(m, s, k) for m in MODELS for s in SCHEDULES for k in range(FOLDS)]
    avail = parallelism()
    print(f"parallelism available: {avail:.2f}x", flush=True)
    walls = {"serial": 0.0, "pair": 0.0}
    # Interleaved per model (serial then 2-at-a-time, then the other way round), so that a
    # change in the machine's load during the run weighs on both arms alike.
    for i, model in enumerate(MODELS):
        chunk = [t for t in tasks if t.model == model]
        for arm, slots in ((("serial", 1), ("pair", 2)) if i % 2 == 0 else (("pair", 2), ("serial", 1))):
            walls[arm] += run_arm(arm, chunk, slots, args, data, root)
            print(f"{model}: {arm} {walls[arm]:.1f} s so far", flush=True)
    orch_wall, orch_note = orch_arm(args, root, data, tasks)
    if orch_wall is not None:
        walls["orch"] = orch_wall
    print(f"orch array: {orch_note}", flush=True)
    return [f"## AsyncKFold: {len(tasks)} tasks ({', '.join(MODELS)} x {', '.join(SCHEDULES)} x "
            f"{FOLDS} folds), {args.epochs} epochs each, Adam lr 0.003, batch 32, "
            f"{args.per_class} images per class x 6 classes, OMP_NUM_THREADS=1 per task in every "
            "arm", "",
            *kfold_tables(tasks, walls, orch_note, avail), ""]


def hogwild_part(args: argparse.Namespace, root: Path) -> list[str]:
    root.mkdir(parents=True)
    data = make_data(root, args.hogwild_per_class, 100)  # 600 validation images: 1 point = 6
    avail = parallelism()
    print(f"parallelism available: {avail:.2f}x", flush=True)
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for run_no in range(args.hogwild_runs):
        for procs in (1, 2):
            runs[procs].append(hogwild(procs, args, data, root, run_no))
            print(f"hogwild --procs {procs}: {runs[procs][-1]}", flush=True)
    return [f"## HOGWILD!: lenet, {args.hogwild_epochs} epochs, {' '.join(HOGWILD_OPTS)}, "
            f"{args.hogwild_per_class} training + 100 validation images per class x 6 classes, "
            "OMP_NUM_THREADS=1 "
            "per process", "", *hogwild_table(runs, avail), ""]


if __name__ == "__main__":
    sys.exit(main())
