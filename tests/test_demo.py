"""The shipped cluster.yaml, exactly as `make demo` runs it: 2 local nodes, gloo, >= 0.95."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sshd_cluster import pids_with_env

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_shipped_demo_trains_to_target(tmp_path: Path) -> None:
    shutil.copy(REPO / "cluster.yaml", tmp_path / "cluster.yaml")
    (tmp_path / "worker").symlink_to(REPO / "worker")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env = dict(os.environ)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    gen = run(sys.executable, "-m", "worker.demo_data", "--out", "data/demo", "--seed", "0")
    assert gen.returncode == 0, gen.stderr
    split = run(sys.executable, "-m", "orchestrator", "split-data")
    assert split.returncode == 0, split.stderr
    up = run(sys.executable, "-m", "orchestrator", "up", "cluster.yaml")
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    assert "[r0 localhost#0]" in up.stdout and "[r1 localhost#1]" in up.stdout
    with open(tmp_path / ".orch-nodes/node0/demo/output/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["val_acc"]) >= 0.95
    # each node received only its own shard
    assert os.listdir(tmp_path / ".orch-nodes/node0/demo/data") == ["worker_0_of_2"]
    assert os.listdir(tmp_path / ".orch-nodes/node1/demo/data") == ["worker_1_of_2"]
    for node in ("node0", "node1"):
        job_dir = str(tmp_path / ".orch-nodes" / node / "demo")
        assert pids_with_env(f"ORCH_JOB_DIR={job_dir}") == []
