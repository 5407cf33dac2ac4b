"""`orch up`'s checks made before any host is contacted: `--json` needs `--detach` (with
restarts too), `--dry-run` refuses what `up` refuses (`--restarts -1`), `--restarts`
with a job array, and a dry run's world size and data with `gpus: all`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import orch_in_process

INVENTORY = """\
name: t
ssh:
  known_hosts: known_hosts
hosts:
  - address: 10.0.0.8
    gpus: {gpus}
  - address: 10.0.0.9
    gpus: {gpus}
code:
  paths: [train.py]
data:
  shards: shards
job:
  entrypoint: train.py
{job}"""


def folder(tmp_path: Path, gpus: str = "0", job: str = "") -> Path:
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "known_hosts").write_text("")
    (tmp_path / "shards").mkdir(exist_ok=True)
    (tmp_path / "cluster.yaml").write_text(INVENTORY.format(gpus=gpus, job=job))
    return tmp_path


def test_json_needs_detach_even_with_restarts(tmp_path: Path) -> None:
    for job in ("  restarts: 2\n", ""):
        r = orch_in_process(folder(tmp_path, job=job), "up", "--json")
        assert r.returncode == 2 and "`up --json` needs --detach" in r.stderr, r.stderr
        assert json.loads(r.stdout)["exit_code"] == 2   # the error, as one JSON document
    r = orch_in_process(tmp_path, "up", "--json", "--restarts", "1")
    assert r.returncode == 2 and "needs --detach" in r.stderr, r.stderr


def test_dry_run_refuses_what_up_refuses(tmp_path: Path) -> None:
    r = orch_in_process(folder(tmp_path), "up", "--dry-run", "--restarts", "-1")
    assert r.returncode == 2 and "--restarts -1: must be 0 or more" in r.stderr, r.stderr


def test_restarts_are_refused_for_a_job_array(tmp_path: Path) -> None:
    job = "  array:\n    matrix: {fold: [0, 1]}\n"
    r = orch_in_process(folder(tmp_path, job=job), "up", "--dry-run", "--restarts", "2")
    assert r.returncode == 2 and "array of independent tasks" in r.stderr, r.stderr


def test_dry_run_with_gpus_all_says_the_world_size_is_counted_at_preflight(tmp_path: Path) -> None:
    r = orch_in_process(folder(tmp_path, gpus="all"), "up", "--dry-run")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert "world size counted at preflight" in first and "world size 2" not in r.stdout
    assert "worker_<r>_of_<W>" in r.stdout and "--nproc-per-node '<free GPUs>'" in r.stdout
    assert "split-data" not in r.stdout + r.stderr   # no hint for a world size not known yet


def test_status_watch_of_an_array_refreshes_until_ctrl_c(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.api import querying
    from orchestrator.api.outcomes import ArrayStatus, TaskStatus
    rounds: list[int] = []

    def array_status(cluster: object) -> ArrayStatus:
        rounds.append(1)
        return ArrayStatus("t", [TaskStatus(0, "--fold 0", "10.0.0.8", 0, "running", None, 1.0,
                                            f"epoch {len(rounds)}")], {})

    def sleep(seconds: float) -> None:
        if len(rounds) == 3:
            raise KeyboardInterrupt
    monkeypatch.setattr(querying, "array_status", array_status)
    monkeypatch.setattr("orchestrator.commands.status.time.sleep", sleep)
    job = "  array:\n    matrix: {fold: [0, 1]}\n"
    r = orch_in_process(folder(tmp_path, job=job), "status", "--watch", "--json")
    assert r.returncode == 0 and len(rounds) == 3, r.stderr
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [d["tasks"][0]["last_line"] for d in docs] == ["epoch 1", "epoch 2", "epoch 3"]
