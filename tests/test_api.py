"""The Python API (orchestrator.api) runs the README's example: up, status, logs, stop
over a `connection: local` host, with the CLI's exit codes and --json documents."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from orchestrator import api
from orchestrator.errors import OrchError
from sshd_cluster import pids_with_env

JOB = 'import os, time\nprint("hello from rank", os.environ["RANK"], flush=True)\ntime.sleep(60)\n'


def inventory(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(JOB)
    path = tmp_path / "cluster.yaml"
    path.write_text("name: apidemo\n"
                    "hosts:\n  - {address: localhost, connection: local, remote_dir: nodes/a}\n"
                    f"python: {sys.executable}\n"
                    "code: {paths: [job.py]}\n"
                    "job: {entrypoint: job.py}\n")
    return path


@pytest.mark.slow
def test_readme_example_up_status_logs_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    inv = inventory(tmp_path)
    job = api.up(inv)
    assert job.code == 0 and job.doc["world_size"] == 1, job
    job_dir = job.doc["hosts"][0]["job_dir"]
    deadline = time.monotonic() + 60
    while b"hello from rank 0" not in api.logs(inv, rank=0):
        assert time.monotonic() < deadline, api.status(inv)
        time.sleep(0.5)
    running = api.status(inv)
    assert running.code == 0 and running.doc["ranks"][0]["state"] == "running", running
    assert api.logs(inv, rank=0) == b"hello from rank 0\n"
    stopped = api.stop(inv, grace=2)
    assert stopped.code == 0, stopped
    assert api.status(inv).doc["ranks"][0]["state"] == "stopped"
    assert not pids_with_env(f"ORCH_JOB_DIR={job_dir}"), "a process of the job survived"


def test_mistakes_raise_the_cli_error(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("name: x\nhosts: []\njob: {entrypoint: w}\n")
    with pytest.raises(OrchError) as err:
        api.status(bad)
    assert err.value.exit_code == 2 and str(bad) in str(err.value)
