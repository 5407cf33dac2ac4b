"""Benchmark `orch split-data` on a large ImageFolder against a split_dataset.sh-style loop.

    python bench/split.py     # 1000 classes x 1000 files, N=16, baseline on 100k files
    python bench/split.py --classes 100 --baseline-files 10000     # a quick run

Everything is generated under a temporary folder in /tmp (--dir) and removed at the end.
The baseline forks one `ln -s` per file (as split_dataset.sh does), so it is timed on a
smaller tree (--baseline-files) and orch is timed on that same tree too for the ratio;
the per-file rate is then extrapolated to the full tree.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.files import splitdata

# What a user would write from split_dataset.sh: run once per worker, `ls | sort | head | tail`
# per class, then `ln -s` per file. Like the original it drops each class's total % N remainder.
BASELINE_SH = r"""
set -eu
SRC=$1; OUT=$2; N=$3
for ((w = 0; w < N; w++)); do
  for cdir in $(ls -d "$SRC"/*/*/ | sort); do
    rel=${cdir#"$SRC"/}; rel=${rel%/}
    D="$OUT/worker_${w}_of_${N}/$rel"
    mkdir -p "$D"; cd "$D"
    total=$(ls "$cdir" | wc -l)
    size=$(( total / N ))
    files=$(ls "$cdir" | sort | head -n $(( (w + 1) * size )) | tail -n $size)
    for f in $files; do ln -s "$cdir$f"; done
  done
done
"""


def generate(root: Path, classes: int, per_class: int) -> int:
    """An ImageFolder under root/TrainData of tiny files; returns the number of files."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for c in range(classes):
        cdir = root / "TrainData" / f"class_{c:04d}"
        cdir.mkdir(parents=True)
        base = str(cdir) + "/img_"
        for i in range(per_class):
            fd = os.open(f"{base}{i:05d}.png", flags, 0o644)
            os.write(fd, b"x" * (1 + i % 7))
            os.close(fd)
    return classes * per_class


def count_links(root: Path) -> int:
    return sum(1 for d, _, files in os.walk(root) for f in files
               if os.path.islink(os.path.join(d, f)))


def time_orch(src: Path, out: Path, workers: int,
              threads: int) -> tuple[float, float, dict[str, float]]:
    """(wall seconds, CPU seconds of this process, phases)."""
    t, c = time.perf_counter(), time.process_time()
    result = splitdata.split(src, out, workers, threads=threads)
    return time.perf_counter() - t, time.process_time() - c, result.seconds


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_baseline(src: Path, out: Path, workers: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the shell and everything it forked)."""
    out.mkdir()
    t, c = time.perf_counter(), children_cpu()
    subprocess.run(["bash", "-c", BASELINE_SH, "baseline", str(src), str(out), str(workers)],
                   check=True)
    return time.perf_counter() - t, children_cpu() - c


def phases(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--per-class", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--baseline-files", type=int, default=100_000,
                    help="size of the tree the shell baseline is timed on (0: skip it)")
    ap.add_argument("--dir", default="/tmp", help="where the temporary tree goes (default: /tmp)")
    ap.add_argument("--no-thread-compare", action="store_true",
                    help="skip the single-thread orch run")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orch-split-bench-", dir=args.dir))
    try:
        run(args, tmp)
    finally:
        t = time.perf_counter()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"cleanup: removed {tmp} in {time.perf_counter() - t:.1f}s")
    return 0


def run(args: argparse.Namespace, tmp: Path) -> None:
    n = args.workers
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, "
          f"python {sys.version.split()[0]}, tmp {tmp}")
    t = time.perf_counter()
    total = generate(tmp / "big", args.classes, args.per_class)
    print(f"generate: {total} files ({args.classes} classes) in {time.perf_counter() - t:.1f}s")

    wall, cpu, secs = time_orch(tmp / "big", tmp / "out", n, 1)
    links = count_links(tmp / "out")
    if links != total:
        raise SystemExit(f"orch made {links} links for {total} files")
    print(f"orch split-data N={n}: {wall:.2f}s wall, {cpu:.2f}s cpu [{phases(secs)}] "
          f"-> {links} links, {total / wall:,.0f} files/s")
    shutil.rmtree(tmp / "out")  # tmpfs has few inodes to spare
    if not args.no_thread_compare:
        wall4, cpu4, secs4 = time_orch(tmp / "big", tmp / "out4", n, 4)
        print(f"orch split-data N={n}, 4 link threads: {wall4:.2f}s wall, {cpu4:.2f}s cpu "
              f"[{phases(secs4)}]")
        shutil.rmtree(tmp / "out4")
    if args.baseline_files <= 0:
        return
    classes = max(1, args.baseline_files // args.per_class)
    small = generate(tmp / "small", classes, args.per_class)
    small_wall, small_cpu, _ = time_orch(tmp / "small", tmp / "small-orch", n, 1)
    shell_wall, shell_cpu = time_baseline(tmp / "small", tmp / "small-shell", n)
    print(f"on {small} files: orch {small_wall:.2f}s wall / {small_cpu:.2f}s cpu; "
          f"shell loop (ls|sort, ln -s per file) {shell_wall:.1f}s wall / {shell_cpu:.1f}s cpu "
          f"({count_links(tmp / 'small-shell')} links) -> "
          f"orch {shell_wall / small_wall:.0f}x faster (wall), "
          f"{shell_cpu / small_cpu:.0f}x less cpu")
    projected = shell_wall * total / small
    print(f"shell loop projected to {total} files: {projected:.0f}s vs orch {wall:.2f}s measured "
          f"-> {projected / wall:.0f}x")


if __name__ == "__main__":
    raise SystemExit(main())
