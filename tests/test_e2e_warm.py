"""Warm start over real SSH (the fake sshd cluster): `orch up --detach` runs each host's
job in the torchrun started at its preflight (agent/warm.py) with the real
torch.distributed.run; ORCH_WARM_START=0 starts it cold; `orch stop` leaves nothing,
warm torchruns included; an `up` while another agent holds the job folder's lock (an
`up` of it under way) is refused and leaves no warm torchrun behind."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import (
    Jobs,
    agents_of,
    assert_nothing_left,
    job_dir,
    orch,
    wait_until,
    warm_pids,
    write_job,
)
from orchestrator.config.inventory import host_part
from sshd_cluster import SshdCluster
from test_warm import end, hold_lock

TAG = "orch-warm-torchrun"
WAIT_JOB = """\
import json, os, sys, time
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ORCH_JOB_DIR")
print("INFO " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
deadline = time.time() + 120
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.1)
"""


def rank_info(jd: Path, rank: int) -> dict:
    log = jd / "logs" / f"rank-{rank}.log"

    def line() -> str | None:
        text = log.read_text() if log.exists() else ""
        return next((x for x in text.splitlines() if x.startswith("INFO ")), None)
    found = wait_until(line, 60, f"rank {rank}'s INFO line in {log}")
    assert isinstance(found, str)
    return json.loads(found[5:])


def torchrun_argv(jd: Path, address: str) -> list[str]:
    sup = json.loads((jd / "run" / host_part(address) / "supervisor.json").read_text())
    return Path(f"/proc/{sup['torchrun_pid']}/cmdline").read_bytes().decode().split("\0")[:-1]


def environ(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")


def before_launch(jd: Path, start: str) -> None:
    """While host 0 hangs in its login (so nothing can be launched anywhere), host 1 has
    passed its preflight: torchrun runs warm there (not yet a process of the job), or,
    with ORCH_WARM_START=0, nothing runs there."""
    if start == "warm":
        pids = wait_until(lambda: warm_pids(jd), 30, f"a warm torchrun in {jd}")
        assert isinstance(pids, list) and len(pids) == 1, pids
        assert not any(e.startswith("ORCH_JOB_DIR=") for e in environ(pids[0]))
    else:   # (that none starts later either: supervisor_started, after the launch)
        wait_until(jd.exists, 30, f"host 1's preflight to make {jd}")
        assert not warm_pids(jd)
    assert not (jd / "run" / "launch.json").exists()


def uptime() -> int:
    """Hundredths of a second since boot: the clock of /proc/<pid>/stat's start times,
    which both truncate to its resolution (10 ms): two events in one tick read the same."""
    seconds, hundredths = Path("/proc/uptime").read_text().split()[0].split(".")
    return int(seconds) * 100 + int(hundredths)


def next_tick(t: int) -> None:
    """Wait until uptime() has left the tick t: whatever starts after this reads later
    than t, and whatever started before the reading of t reads t or earlier."""
    wait_until(lambda: uptime() > t, 5, f"uptime past {t}", step=0.005)


def supervisor_started(jd: Path, address: str) -> int:
    """When the job's supervisor (warm: started at preflight and kept) started, on
    uptime()'s clock."""
    sup = json.loads((jd / "run" / host_part(address) / "supervisor.json").read_text())
    assert isinstance(sup["start_ticks"], int), sup
    return int(sup["start_ticks"] * 100 // os.sysconf("SC_CLK_TCK"))


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_up_detach_runs_in_the_warm_torchrun(sshd_cluster: SshdCluster, tmp_path: Path,
                                             jobs: Jobs, monkeypatch: pytest.MonkeyPatch,
                                             start: str) -> None:
    hosts, name, go = sshd_cluster.hosts[:2], f"e2e-warm-{start}", tmp_path / "go"
    write_job(tmp_path, WAIT_JOB)
    # host 0 hangs a while at its login: its connect must wait, not time out
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name,
                                       args=[str(go)], top={"ssh": {"connect_timeout": 30}})
    jobs.add(inv, hosts, name)
    monkeypatch.setenv("ORCH_WARM_START", "0" if start == "cold" else "1")
    dirs = [job_dir(h, name) for h in hosts]
    hosts[0].pause()
    try:
        up = jobs.start(tmp_path, "up", str(inv), "--detach")
        before_launch(dirs[1], start)
        # nothing can be launched before host 0 answers; the clock has 10 ms ticks, so
        # host 0 resumes only once it has left the tick read here: a process started
        # before this reading is stamped `paused` or earlier, one started after the
        # resume later than `paused`, never the same tick
        paused = uptime()
        next_tick(paused)
    finally:
        hosts[0].resume()
    assert up.finish(120) == 0, up.text()
    # host 1's supervisor: warm, the one its preflight started while host 0 hung; cold,
    # none was started then: the job's was started by the launch, after host 0 came back
    born = supervisor_started(dirs[1], hosts[1].address)
    assert (born <= paused) == (start == "warm"), (start, born, paused)
    for rank, (jd, h) in enumerate(zip(dirs, hosts)):
        info = rank_info(jd, rank)
        assert info == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "ORCH_JOB_DIR": str(jd)}, info
        # the job's torchrun is the launcher's (without a prewarm, started at the launch)
        argv = torchrun_argv(jd, h.address)
        assert argv[-2:] == [TAG, str(jd)] and "torch.distributed.run" not in argv, argv
    stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left(hosts, name, wait=5)
    assert not agents_of(dirs)
    if start == "warm":
        refused_while_locked(tmp_path, inv, hosts, name)


def refused_while_locked(tmp_path: Path, inv: Path, hosts: list, name: str) -> None:
    """Another agent holds host 0's job folder (its `up` is between preflight and launch):
    this `up` is refused there; host 1, whose preflight passed and started torchrun warm,
    ends it with its agent."""
    holder = hold_lock(job_dir(hosts[0], name), host_part(hosts[0].address))
    try:
        again = orch(tmp_path, "up", str(inv))
    finally:
        end(holder)
    assert again.returncode == 2, again.stderr
    # said as a held folder (another `up` of the job there), not as the job running
    assert f"another `orch up` of it holds its job folder on {hosts[0].address}" in again.stderr, \
        again.stderr
    assert "already running" not in again.stderr, again.stderr
    assert hosts[1].address not in again.stderr, again.stderr
    assert_nothing_left(hosts, name, wait=5)
    assert not agents_of([job_dir(h, name) for h in hosts])
