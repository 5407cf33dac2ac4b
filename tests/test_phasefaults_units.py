"""The logic behind the phase faults (tests/test_e2e_phasefaults.py) without SSH: `orch
status` over the in-process fake agent after an `up` that was killed once its launch
request had reached the hosts (no state saved) still tells the truth; on the host side,
a rank no launch reached reads `not started`, and a job whose stop was cut short still
runs while any of its processes lives."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_agent import session_maker
from orchestrator.agent import procs as host_procs
from orchestrator.agent import status as host_status
from orchestrator.agent.common import job_paths
from orchestrator.api import jobs as api_jobs
from orchestrator.commands import logs as logs_cmd
from orchestrator.commands import status as status_cmd
from orchestrator.errors import EXIT_HOST, EXIT_OK, UsageError
from orchestrator.wire import protocol

INVENTORY = """name: killed
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: localhost, connection: local, remote_dir: /r1, procs: 1}
job: {entrypoint: job.py}
"""


def use_hosts(monkeypatch: pytest.MonkeyPatch, ranks: dict[int, dict] | None,
              down: int | None = None) -> list[dict]:
    """Every host answers `status` with `ranks` (rank -> info; None: nothing ever ran
    there); host `down` cannot be reached. Returns the requests the hosts got."""
    seen: list[dict] = []

    def status(chan, msg: dict) -> None:
        seen.append(msg)
        rows = [dict({"rank": r, "state": "not started", "last_line": "", "pid": None,
                      "log_bytes": None}, **(ranks or {}).get(r, {})) for r in msg["ranks"]]
        sup = {"pid": 99, "run_id": "x"} if ranks else None
        chan.push(protocol.reply(msg["id"], {"supervisor": sup, "host_exit": None,
                                             "time": time.time(), "ranks": rows}))

    monkeypatch.setattr(api_jobs, "new_session", session_maker({"status": status}, down))
    return seen


def status(tmp_path: Path) -> int:
    (tmp_path / "cluster.yaml").write_text(INVENTORY)
    return status_cmd.run(argparse.Namespace(config=str(tmp_path / "cluster.yaml"), file=None,
                                             json=True))


def test_status_without_state_shows_a_job_that_runs(tmp_path: Path, capsys,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The hosts' raw answers (rank 2 "exited" with code 0) become the controller's
    states, each rank with its own pid, asked of the host that runs it."""
    now = time.time()
    running = {r: {"state": "running", "pid": 100 + r, "started": now - 10 * (r + 1),
                   "last_line": f"rank {r} up"} for r in range(2)}
    running[2] = {"state": "exited", "code": 0, "pid": 102, "started": now - 30.0,
                  "ended": now - 5.5, "last_line": "rank 2 done"}
    seen = use_hosts(monkeypatch, running)
    assert not (tmp_path / ".orch").exists()
    assert status(tmp_path) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["host"], r["state"], r["pid"], r["last_line"]) for r in doc["ranks"]] == [
        (0, "localhost#0", "running", 100, "rank 0 up"), (1, "localhost#0", "running", 101, "rank 1 up"),
        (2, "localhost#1", "exited 0", 102, "rank 2 done")]
    assert doc["ranks"][2]["runtime_s"] == 24.5   # ended - started: a rank that ended
    assert sorted(tuple(m["ranks"]) for m in seen) == [(0, 1), (2,)]
    # asked at the inventory's job folders, as `orch stop` does without a state
    assert sorted(m["job_dir"] for m in seen) == ["/r0/killed", "/r1/killed"]


def test_status_without_state_or_any_run_says_not_started(tmp_path: Path, capsys,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    use_hosts(monkeypatch, None)
    with pytest.raises(UsageError, match="has not been started") as err:
        status(tmp_path)
    assert err.value.exit_code == 2 and "orch up" in (err.value.hint or "")
    assert capsys.readouterr().out == ""


def test_logs_without_state_or_any_run_says_not_started(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`orch logs` asks the hosts as `status` does, on the same agents (one login)."""
    seen = use_hosts(monkeypatch, None)
    (tmp_path / "cluster.yaml").write_text(INVENTORY)
    args = argparse.Namespace(config=str(tmp_path / "cluster.yaml"), file=None, json=False,
                              rank=1, task=None, follow=False, tail=-1, list=False)
    with pytest.raises(UsageError, match="has not been started") as err:
        logs_cmd.run(args)
    assert err.value.exit_code == 2 and [m["t"] for m in seen] == ["status"]


def test_status_without_state_and_a_host_down_is_exit_3(tmp_path: Path, capsys,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing can be said of the host that did not answer: its ranks are unreachable."""
    use_hosts(monkeypatch, None, down=1)
    assert status(tmp_path) == EXIT_HOST
    doc = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in doc["ranks"]] == ["not started", "not started", "unreachable"]
    assert len(doc["unreachable"]) == 1, doc


def test_a_rank_no_launch_reached_reads_not_started(tmp_path: Path) -> None:
    """A host the killed `up` never sent its launch to: `not started`, not `lost`; once a
    launch reached it, a rank without a pid or a supervisor has vanished: `lost`."""
    root = tmp_path / "job"
    for d in ("run", "logs"):
        (root / d).mkdir(parents=True)
    p = job_paths(str(root))
    assert host_status.rank_status(p, 0, 0, None)["state"] == "not started"
    (root / "run" / "launch.json").write_text("{}")
    assert host_status.rank_status(p, 0, 0, None)["state"] == "lost"
    assert host_status.rank_status(p, 0, 0, {"pid": 1})["state"] == "starting"


def test_a_job_runs_while_any_marked_process_lives(tmp_path: Path) -> None:
    """After a stop cut short, the supervisor is gone but ranks wait out their grace:
    the job still runs (preflight and launch refuse a second copy beside them)."""
    root = tmp_path / "job"
    (root / "run").mkdir(parents=True)
    (root / "run" / "launch.json").write_text("{}")   # launched here (no launch: no scan)
    p = job_paths(str(root))
    assert not host_procs.job_running(p)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "ORCH_JOB_DIR": p["job"]})
    try:
        wait = time.monotonic() + 10
        while not host_procs.job_running(p) and time.monotonic() < wait:
            time.sleep(0.02)
        assert host_procs.job_running(p)
        other = job_paths(str(tmp_path / "jo"))   # a prefix of the marker is another job
        assert not host_procs.job_running(other)
    finally:
        rank.kill()
        rank.wait()
    assert not host_procs.job_running(p)
