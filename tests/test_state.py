"""A damaged `.orch/<name>/state.json` is named with the way to recover, never a
traceback: status and logs stop with exit 2, stop still stops the job (by the marker
of its processes under the inventory's job folders)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import (
    Jobs,
    assert_nothing_left,
    job_pids,
    orch,
    orch_in_process,
    wait_until,
    write_job,
)
from orchestrator.config import inventory
from orchestrator.session import state
from orchestrator.session.replies import Supervisor
from sshd_cluster import SshdCluster

GOOD: dict[str, Any] = {
    "name": "st", "run_id": "r1", "inventory": "/x/cluster.yaml", "started": 1.5,
    "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500,
    "hosts": [{"index": 0, "label": "localhost", "job_dir": "/x/st", "ranks": [0],
               "clock_offset": 0.0, "supervisor": {"pid": 1, "pgid": 1, "start_ticks": None,
                                                    "torchrun_pid": 2, "run_id": "r1",
                                                    "started": 4.5}}],
    "attempts": [{"attempt": 1, "of": 2, "why": "rank 0 exited 1", "at": 9.5,
                  "hosts": ["localhost"]}]}


def damaged_variants() -> dict[str, str]:
    text = json.dumps(GOOD)
    wrong_type = dict(GOOD, world_size="one")
    missing = {k: v for k, v in GOOD.items() if k != "hosts"}
    bad_host = dict(GOOD, hosts=[dict(GOOD["hosts"][0], ranks="0")])
    return {"truncated": text[: len(text) // 2], "not-json": "hello\n", "a-list": "[1, 2]",
            "wrong-type": json.dumps(wrong_type), "missing-key": json.dumps(missing),
            "host-wrong-type": json.dumps(bad_host), "null": "null", "empty": "",
            "host-not-object": json.dumps(dict(GOOD, hosts=[7])),
            "bool-for-int": json.dumps(dict(GOOD, master_port=True)),
            "supervisor-partial": json.dumps(dict(GOOD, hosts=[dict(GOOD["hosts"][0],
                                                                     supervisor={"pid": 1})])),
            "attempt-wrong-shape": json.dumps(dict(GOOD, attempts=[{"attempt": "1"}]))}


def local_cluster(tmp_path: Path) -> inventory.Cluster:
    write_job(tmp_path, "import time\ntime.sleep(60)\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "name": "st", "python": sys.executable,
        "hosts": [{"address": "localhost", "connection": "local",
                   "remote_dir": str(tmp_path / "n")}],
        "code": {"paths": ["job.py"]}, "job": {"entrypoint": "job.py"}}))
    return inventory.load(path)


def test_good_state_round_trips(tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path)
    cluster.state_dir.mkdir(parents=True)
    state.state_path(cluster).write_text(json.dumps(GOOD))
    st = state.load(cluster)
    assert st is not None and st.hosts[0].job_dir == "/x/st" and st.master_port == 29500
    # decoded once, into the types the controller reads (not dicts)
    assert st.hosts[0].supervisor == Supervisor(1, 1, None, 2, "r1", 4.5)
    assert st.attempts == [state.Attempt(1, 2, "rank 0 exited 1", 9.5, ("localhost",))]
    state.save(cluster, st)
    full = dict(GOOD, selection="", hosts=[dict(GOOD["hosts"][0], gpu_ids=None)])
    assert json.loads(state.state_path(cluster).read_text()) == full   # the defaults added


@pytest.mark.parametrize("variant", sorted(damaged_variants()))
def test_damaged_state_is_named_with_the_recovery(variant: str, tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path)
    cluster.state_dir.mkdir(parents=True)
    path = state.state_path(cluster)
    path.write_text(damaged_variants()[variant])
    with pytest.raises(state.StateDamaged) as err:
        state.load(cluster)
    assert str(path) in err.value.message and "damaged" in err.value.message
    assert "orch stop -c" in err.value.hint and err.value.exit_code == 2
    warnings: list[str] = []
    assert state.load_or_warn(cluster, warnings.append) is None and len(warnings) == 1


def test_missing_state_is_none_and_unreadable_is_damaged(tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path)
    assert state.load(cluster) is None
    state.state_path(cluster).mkdir(parents=True)   # a folder where the file should be
    with pytest.raises(state.StateDamaged, match="cannot be read"):
        state.load(cluster)


@pytest.mark.parametrize("command", [["status"], ["logs"], ["logs", "--rank", "0"]])
def test_status_and_logs_refuse_a_damaged_state(command: list[str], tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path)
    cluster.state_dir.mkdir(parents=True)
    path = state.state_path(cluster)
    path.write_text('{"name": "st", "hosts": [')
    result = orch_in_process(tmp_path, *command, "-c", str(cluster.path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{path}: the job state is damaged" in result.stderr
    assert "fix: `orch stop` still stops the job" in result.stderr  # ./cluster.yaml needs no -c


@pytest.mark.ssh
@pytest.mark.slow
def test_stop_works_with_a_damaged_state(sshd_cluster: SshdCluster, tmp_path: Path,
                                         jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "state-damaged"
    write_job(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr
    wait_until(lambda: all(job_pids(hosts, name).values()), 30, "the job's processes")
    path = tmp_path / ".orch" / name / "state.json"
    path.write_text(path.read_text()[:40])   # truncated, as by a full disk
    stop = orch(tmp_path, "stop", str(inv), "--grace", "1")
    assert stop.returncode == 0, stop.stderr
    assert "Traceback" not in stop.stderr
    assert "damaged" in stop.stderr and "inventory's job folders" in stop.stderr
    assert f"job '{name}' stopped on 2 hosts" in stop.stderr
    assert_nothing_left(hosts, name)
