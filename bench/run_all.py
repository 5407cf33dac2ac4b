"""Run every benchmark in bench/ one after the other (`make bench`); each prints its table.

Each compares orch with the baseline a user would reach for, in the same run, as a ratio.
They take minutes and load both cores: run them on a quiet machine.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["launch.py", "lifecycle.py", "push.py", "split.py", "loader.py", "terngrad.py",
           "kfold_hogwild.py", "gpu.py"]  # gpu.py: skipped (exit 0) without CUDA


def main() -> int:
    # --scale adds bench/scale.py (16-128 fake hosts, ~13 minutes): `make bench BENCH_ARGS=--scale`;
    # --faults bench/faults.py (4-64 fake hosts, two login shells, ~10 minutes);
    # --recovery bench/recovery.py (real torch on 4 netns hosts + a spare, restarts, ~4 minutes)
    benches = BENCHES + (["scale.py"] if "--scale" in sys.argv[1:] else []) + (
        ["faults.py"] if "--faults" in sys.argv[1:] else []) + (
        ["recovery.py"] if "--recovery" in sys.argv[1:] else [])
    failed = []
    for name in benches:
        if not (HERE / name).exists():
            continue
        print(f"\n=== bench/{name} ===", flush=True)
        if subprocess.run([sys.executable, str(HERE / name)], cwd=HERE.parent).returncode:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
