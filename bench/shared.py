"""Shared job folders: 4 sshd hosts whose `remote_dir` is one folder (what NFS home
folders look like) against 4 hosts with a folder each: bytes pushed for code and data,
and `orch up` time, first (everything sent) and again (nothing changed).

    .venv/bin/python bench/shared.py [--hosts 4] [--files 400] [--kib 8] [--reps 3]

Code is the repository's worker/ plus a tiny job; data is an ImageFolder of `--files`
files per class (2 classes) split by `orch split-data` into one shard per rank. The job
prints one line per rank and exits. Run it alone: every fake host shares these cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ORCH, REPO, VENV_PY, median, print_table, timed_run
from sshd_cluster import SshdCluster, free_port

JOB = 'import os\nprint("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)\n'


def make_data(root: Path, files: int, kib: int) -> None:
    for cls in ("a", "b"):
        folder = root / "TrainData" / cls
        folder.mkdir(parents=True)
        for i in range(files):
            (folder / f"{i:05d}.bin").write_bytes(os.urandom(kib * 1024))


def inventory(cluster: SshdCluster, work: Path, name: str, shared: bool) -> Path:
    one = str(work / f"shared-{name}")
    extra = {"data": {"source": str(work / "src"), "shards": str(work / "shards")},
             "code": {"paths": ["job.py", "worker"]}}
    path = cluster.write_inventory(work / f"{name}.yaml", name=name, entrypoint="job.py",
                                   top=extra)
    if shared:   # every host's remote_dir is the same folder
        text = path.read_text()
        for h in cluster.hosts:
            text = text.replace(f"remote_dir: {h.remote_dir}", f"remote_dir: {one}")
        path.write_text(text)
    return path


def pushed(work: Path, name: str) -> tuple[int, int]:
    """(code bytes, data bytes) sent by the last up, from .orch/<name>/last_sync.json."""
    record = json.loads((work / ".orch" / name / "last_sync.json").read_text())
    code = sum(h.get("code", {}).get("bytes", 0) for h in record.values())
    data = sum(h.get("data", {}).get("bytes", 0) for h in record.values())
    return code, data


def one_up(work: Path, inv: Path, name: str) -> tuple[float, int, int]:
    run = timed_run([str(ORCH), "up", str(inv), "--no-pull"], cwd=work, timeout=600)
    if not run.ok:
        raise SystemExit(f"orch up failed:\n{run.tail(3000)}")
    return (run.seconds, *pushed(work, name))


def measure(cluster: SshdCluster, work: Path, shared: bool, reps: int) -> dict[str, list]:
    out: dict[str, list] = {"first_s": [], "again_s": [], "code": [], "data": []}
    for rep in range(reps):
        name = f"{'shared' if shared else 'private'}-{rep}"
        inv = inventory(cluster, work, name, shared)
        first, code, data = one_up(work, inv, name)
        again, _, _ = one_up(work, inv, name)
        out["first_s"].append(first)
        out["again_s"].append(again)
        out["code"].append(code)
        out["data"].append(data)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--kib", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="orch-bench-shared-"))
    octet = 40
    port = free_port([f"127.0.0.{octet + i}" for i in range(args.hosts)])
    cluster = SshdCluster(work / "sshd", args.hosts, port=port, first_octet=octet).start()
    try:
        (work / "job.py").write_text(JOB)
        shutil.copytree(REPO / "worker", work / "worker",
                        ignore=shutil.ignore_patterns("__pycache__"))
        make_data(work / "src", args.files, args.kib)
        subprocess.run([str(ORCH), "split-data", "--workers", str(args.hosts), "--source",
                        str(work / "src"), "--out", str(work / "shards")], check=True,
                       capture_output=True, cwd=work)
        private = measure(cluster, work, False, args.reps)
        shared = measure(cluster, work, True, args.reps)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for key, what in (("code", "code bytes pushed"), ("data", "data bytes pushed"),
                      ("first_s", "first up (s)"), ("again_s", "up again, nothing changed (s)")):
        p, s = median(private[key]), median(shared[key])
        rows.append([what, f"{p:,.2f}" if key.endswith("_s") else f"{p:,.0f}",
                     f"{s:,.2f}" if key.endswith("_s") else f"{s:,.0f}", f"{s / p:.2f}"])
    print_table(f"{args.hosts} hosts: one shared job folder vs a folder each (median of "
                f"{args.reps}; load {os.getloadavg()[0]:.2f})",
                ["", "private", "shared", "shared / private"], rows)
    print("python:", VENV_PY, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
