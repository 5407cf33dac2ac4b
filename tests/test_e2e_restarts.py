"""Automatic restarts over real SSH (issue 22, item 2): after a rank's failure the whole
job starts again under the same name with ORCH_RESTART_COUNT=k; a lost host is replaced
by a spare that takes its ranks; with no spare, `job.min_hosts` lets the run go on with
fewer hosts; a host that fails twice is left out; `orch stop` from elsewhere ends the run
with no restart; `orch status` shows every restart, and `--json` carries them."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, orch, wait_until, write_job
from sshd_cluster import SshdCluster, own_cluster, pid_alive, pids_with_env

pytestmark = pytest.mark.ssh

FIRST_OCTET = 70
JOB = """\
import os, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["ORCH_RESTART_COUNT"])
print("rank %d attempt %d world %s" % (rank, attempt, os.environ["WORLD_SIZE"]), flush=True)
mode = sys.argv[1]
if mode == "fail-first" and rank == 1 and attempt == 0:
    sys.exit(3)
if mode == "always-1" and rank == 1:
    sys.exit(4)
if mode == "sleep-first-two" and attempt < 2:
    time.sleep(300)
if mode == "sleep":
    time.sleep(300)
"""


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """3 sshd hosts of this module's own: a test may kill one (a lost host)."""
    with own_cluster(tmp_path_factory.mktemp("sshd3"), 3, FIRST_OCTET) as cluster:
        yield cluster


def inventory(cluster: SshdCluster, tmp: Path, name: str, mode: str, *, spare: bool = False,
              job: dict | None = None, hosts: int = 2) -> Path:
    write_job(tmp, JOB)
    entries = [{"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir)}
               for h in cluster.hosts[:hosts]]
    if spare:
        h = cluster.hosts[2]
        entries.append({"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir),
                        "spare": True})
    return cluster.write_inventory(tmp / f"{name}.yaml", hosts=[], extra_hosts=entries,
                                   name=name, args=[mode],
                                   top={"job": {"entrypoint": "job.py", "args": [mode],
                                                **(job or {})}})


def lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "attempt" in ln and "rank" in ln]


def test_a_failed_rank_restarts_the_whole_job_which_then_succeeds(
        cluster3: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    inv = inventory(cluster3, tmp_path, "heal", "fail-first", job={"restarts": 2})
    jobs.add(inv, cluster3.hosts[:2], "heal")
    up = orch(tmp_path, "up", str(inv), "--no-pull", timeout=240)
    text = up.stdout + up.stderr
    assert up.returncode == 0, text
    assert "root cause rank 1" in text and "exit code 3" in text
    assert (f"restart 1 of 2 in 2 s after: rank 1 on {cluster3.hosts[1].address} failed "
            "(exit code 3)") in text
    assert "attempt 2 of 3 (ORCH_RESTART_COUNT=1)" in text
    assert "rank 0 attempt 1 world 2" in text and "rank 1 attempt 1 world 2" in text
    status = orch(tmp_path, "status", "-c", str(inv), "--json")
    restarts = json.loads(status.stdout)["restarts"]
    assert [(r["attempt"], r["of"], r["hosts"]) for r in restarts] == [
        (1, 2, [h.address for h in cluster3.hosts[:2]])]
    shown = orch(tmp_path, "status", "-c", str(inv))
    assert "attempt 2 of 3 (restart 1) at" in shown.stdout + shown.stderr
    assert_nothing_left(cluster3.hosts, "heal")


def test_no_restart_left_ends_with_the_failure_and_a_host_failing_twice_is_left_out(
        cluster3: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """Rank 1 fails on every attempt: its host takes a strike each time; at the second
    it is left out and the spare takes rank 1, which fails there too; then no restart
    is left."""
    inv = inventory(cluster3, tmp_path, "strikes", "always-1", spare=True,
                    job={"restarts": 2})
    jobs.add(inv, cluster3.hosts, "strikes")
    up = orch(tmp_path, "up", str(inv), "--no-pull", timeout=300)
    text = up.stdout + up.stderr
    assert up.returncode == 1, text
    a, b, c = (h.address for h in cluster3.hosts)
    assert f"restart 1 of 2 in 2 s after: rank 1 on {b} failed (exit code 4); hosts: {a}, {b}" in text
    assert f"restart 2 of 2 in 4 s after: rank 1 on {b} failed (exit code 4); hosts: {a}, {c}" in text
    assert "no restart left (2 made)" in text
    assert f"root cause rank 1 on host {c}" in text
    assert_nothing_left(cluster3.hosts, "strikes")


def test_orch_stop_from_elsewhere_ends_the_run_with_no_restart(
        cluster3: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """One host: the claim is about the run's end (a stop is no failure to restart
    after), which a second host's torchrun would not change."""
    inv = inventory(cluster3, tmp_path, "stopme", "sleep", job={"restarts": 3}, hosts=1)
    jobs.add(inv, cluster3.hosts[:1], "stopme")
    run = jobs.start(tmp_path, "up", str(inv), "--no-pull")
    run.wait_for(r"rank 0 attempt 0", timeout=120)
    assert orch(tmp_path, "stop", "-c", str(inv), "--grace", "1").returncode == 0
    code = run.finish(60)
    text = run.text()
    assert code == 1, text
    assert "stopped with `orch stop`: no restart" in text and "restart 1" not in text
    assert "job 'stopme' failed" not in text, text   # the stop is said as a stop
    assert_nothing_left(cluster3.hosts, "stopme")


def kill_host(cluster: SshdCluster, index: int, name: str) -> None:
    """The host dies: its sshd, every session under it and the job's processes there."""
    host = cluster.hosts[index]
    doomed = host.descendants() + pids_with_env(f"ORCH_JOB_DIR={host.remote_dir / name}")
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: not any(pid_alive(p) for p in doomed), 10, "the host's processes end")


def test_a_lost_host_is_replaced_by_the_spare_then_min_hosts_goes_on_with_fewer(
        cluster3: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """One run, two lost hosts. Host 1 dies: the spare (host 2), made ready beside the
    first attempt, takes its ranks. Then the spare dies too: no spare is left, and
    `job.min_hosts: 1` lets the run go on with host 0 alone (world size 1), to its end."""
    inv = inventory(cluster3, tmp_path, "spare", "sleep-first-two", spare=True,
                    job={"restarts": 2, "min_hosts": 1})
    jobs.add(inv, cluster3.hosts, "spare")
    a, b, c = (h.address for h in cluster3.hosts)
    run = jobs.start(tmp_path, "up", str(inv), "--no-pull")
    run.wait_for(r"rank 1 attempt 0", timeout=120)
    spare_code = cluster3.hosts[2].remote_dir / "spare" / "code" / "job.py"
    wait_until(lambda: any("spares ready" in ln for ln in run.err), 60,
               f"the spare is made ready beside the running job\n{run.text()}")
    assert spare_code.exists() and not (spare_code.parent.parent / "logs" / "rank-1.log").exists()
    t0 = time.monotonic()
    kill_host(cluster3, 1, "spare")
    run.wait_for(rf"\[r1 {re.escape(c)}\] rank 1 attempt 1 world 2", timeout=180)
    print(f"\nfrom the host's death to the spare's rank 1: {time.monotonic() - t0:.1f} s")
    log = cluster3.hosts[2].remote_dir / "spare" / "logs" / "rank-1.log"
    assert "rank 1 attempt 1 world 2" in log.read_text()
    # the spare dies the way host 1 did (its sshd too: the next preflight cannot reach it)
    kill_host(cluster3, 2, "spare")
    code = run.finish(180)
    text = run.text()
    assert code == 0, text
    shown = [ln.split("; no checkpoint")[0] for ln in run.err if ln.startswith("restart ")]
    a, b, c = (re.escape(h) for h in (a, b, c))
    assert len(shown) == 2, text
    assert re.fullmatch(rf"restart 1 of 2 in 2 s after: host {b} .*; hosts: {a}, {c}", shown[0])
    assert re.fullmatch(rf"restart 2 of 2 in 4 s after: host {c} .*; hosts: {a}", shown[1])
    assert "rank 0 attempt 2 world 1" in text
    assert_nothing_left([cluster3.hosts[0]], "spare")
    # the dead hosts' sshds stay down: the module's cluster is stopped at its end
