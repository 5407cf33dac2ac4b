"""The job lifecycle over real SSH: fail-fast, stop (whole process trees, nothing
else), reattach after the controller died, Ctrl-C, logs, name reuse, host loss.

Every job is plain Python (no torch in the ranks) and every test proves at the end that
no process of its job is left on any host (`pids_with_env`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    ORCH,
    Jobs,
    agents_of,
    assert_nothing_left,
    job_dir,
    job_pids,
    marker,
    orch,
    prefixed,
    wait_until,
    write_job,
)
from sshd_cluster import SshdCluster, pid_alive, pids_with_env

pytestmark = pytest.mark.ssh


def rank_log(host, name: str, rank: int) -> Path:
    return Path(job_dir(host, name)) / "logs" / f"rank-{rank}.log"


def log_has(path: Path, *needles: str) -> bool:
    try:
        text = path.read_text()
    except OSError:
        return False
    return all(n in text for n in needles)


# ---------------------------------------------------------------- fail-fast

FAILFAST_JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
print("rank %d started" % rank, flush=True)
if rank == 3:
    time.sleep(1)
    print("CRASH_AT %r" % time.time(), flush=True)
    print("boom: disk on fire", file=sys.stderr, flush=True)
    sys.exit(7)
time.sleep(600)
"""


def test_fail_fast_stops_every_rank(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """Rank 3 fails on host 1; host 0's ranks (and rank 2 beside it) are stopped: two
    hosts of two (a third host was a torchrun more and proved nothing more)."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-failfast"
    write_job(tmp_path, FAILFAST_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=2, name=name)
    jobs.add(inv, hosts, name)
    run = jobs.start(tmp_path, "up", str(inv))
    code = run.finish(timeout=120)
    ended = time.time()
    assert code == 1, run.text()
    crash = [float(l.split()[-1]) for l in run.out if "CRASH_AT" in l]
    assert len(crash) == 1, run.text()
    assert ended - crash[0] <= 5.0, f"orch up returned {ended - crash[0]:.1f} s after the crash"
    report = "\n".join(run.err)
    cause = rf"rank 3 on host {re.escape(hosts[1].address)}\b.*exit code 7"
    assert re.search(cause, " ".join(report.split())), report
    assert "boom: disk on fire" in report
    # One line a user can grep for in a CI log (stderr is not a terminal here).
    assert any(re.search(cause, line) for line in run.err), f"root cause split over lines:\n{report}"
    assert_nothing_left(hosts, name)


# ---------------------------------------------------------------- orch stop

STOP_JOB = """\
import multiprocessing as mp, os, signal, subprocess, sys, time

def loader():
    time.sleep(600)

def graceful(signum, frame):  # a worker saving its checkpoint on SIGTERM
    print("SIGTERM: saving", flush=True)
    time.sleep(0.5)
    print("saved", flush=True)
    sys.exit(0)

if __name__ == "__main__":
    if sys.argv[1:] == ["other"]:   # the unrelated job: same script, its own ORCH_JOB_DIR
        time.sleep(600)
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('IGN ready', flush=True); time.sleep(600)")
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]),
            subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)]
    loaders = [mp.Process(target=loader) for _ in range(2)]  # data-loader-like workers
    for p in loaders:
        p.start()
    pids = [k.pid for k in kids] + [p.pid for p in loaders]
    signal.signal(signal.SIGTERM, graceful)
    print("CHILDREN " + " ".join(map(str, pids)), flush=True)
    time.sleep(600)
"""


def spawned_children(logs: list[Path]) -> list[int]:
    """The pids each rank printed after starting its children."""
    wait_until(lambda: all(log_has(p, "CHILDREN", "IGN ready") for p in logs), 60,
               "every rank to start its children")
    return [int(pid) for path in logs
            for pid in path.read_text().split("CHILDREN ", 1)[1].split("\n")[0].split()]


def start_other_job(script: str, other_dir: str, name: str) -> subprocess.Popen:
    """Another job's process on the same host: the same command line, the same ORCH_JOB,
    only its ORCH_JOB_DIR differs (and shares our job dir as a prefix)."""
    proc = subprocess.Popen([sys.executable, "-u", script, "other"],
                            env={**os.environ, "ORCH_JOB_DIR": other_dir, "ORCH_JOB": name},
                            stdin=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: proc.pid in pids_with_env("ORCH_JOB_DIR=" + other_dir), 10,
               "the other job to start")
    return proc


def test_stop_ends_process_trees_and_nothing_else(sshd_cluster: SshdCluster, tmp_path: Path,
                                                  jobs: Jobs) -> None:
    """Two ranks on one host, each with its children (one ignores SIGTERM, one in a
    session of its own), beside another job's process. One host: the claim is about
    each rank's process tree (a stop reaching every host: the tests below); a second
    host was a torchrun more."""
    hosts, name = sshd_cluster.hosts[:1], "e2e-stop"
    write_job(tmp_path, STOP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=2, name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr
    logs = [rank_log(hosts[0], name, r) for r in range(2)]
    children = spawned_children(logs)
    marked = {p for pids in job_pids(hosts, name).values() for p in pids}
    assert len(children) == 8 and set(children) <= marked, "children carry the job's marker"
    jd = job_dir(hosts[0], name)
    other = start_other_job(f"{jd}/code/job.py", f"{jd}-other", name)
    try:
        stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
        assert stop.returncode == 0, stop.stderr
        assert "SIGKILL" in stop.stderr, stop.stderr   # the child that ignores SIGTERM
        assert_nothing_left(hosts, name)
        assert not [p for p in children if pid_alive(p)]
        for path in logs:   # SIGTERM and the grace period came before any SIGKILL
            assert log_has(path, "SIGTERM: saving\nsaved\n"), path.read_text()
        assert other.poll() is None, "orch stop ended another job's process"
        again = orch(tmp_path, "stop", str(inv))
        assert again.returncode == 0, again.stderr
        assert "nothing was running" in again.stderr
    finally:
        other.kill()
        other.wait(10)


# ---------------------------------------------------------------- reattach

REATTACH_JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
print("rank %d starting" % rank)
print("rank %d set up" % rank)
print("rank %d waiting" % rank, flush=True)
if rank != 4:
    time.sleep(600)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
for i in range(3):
    print("rank 4 done %d" % i, flush=True)
"""


def status(cwd: Path, inv: Path) -> dict:
    result = orch(cwd, "status", "--json", "-c", str(inv))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_reattach_after_controller_killed(sshd_cluster: SshdCluster, tmp_path: Path,
                                          jobs: Jobs) -> None:
    hosts, name, go = sshd_cluster.hosts[:2], "e2e-reattach", tmp_path / "go"
    write_job(tmp_path, REATTACH_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=3, name=name,
                                       args=[str(go)])
    jobs.add(inv, hosts, name)
    up = jobs.start(tmp_path, "up", str(inv))
    up.wait_for(r"^\[r\d \S+\] rank \d waiting$", count=6)
    # what could end the workers with their controller: its agents on the hosts, in
    # their SSH sessions (the detached supervisors carry the agent's argv too, but they
    # are no sshd's descendants)
    agents = set(agents_of([job_dir(h, name) for h in hosts])) & {
        pid for h in hosts for pid in h.descendants()}
    assert len(agents) == len(hosts), agents
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait(10)
    # the workers must not notice that their controller is gone: its agents end first
    wait_until(lambda: not [p for p in agents if pid_alive(p)], 30,
               "the killed controller's agents to end")
    assert all(job_pids(hosts, name).values()), "the job died with its controller"

    st = status(tmp_path, inv)
    assert [(r["rank"], r["host"], r["local_rank"], r["state"]) for r in st["ranks"]] == [
        (rank, hosts[rank // 3].address, rank % 3, "running") for rank in range(6)], st
    for r in st["ranks"]:
        assert r["pid"] in pids_with_env(marker(hosts[r["rank"] // 3], name)), r
        assert r["last_line"] == f"rank {r['rank']} waiting", r

    logs = jobs.start(tmp_path, "logs", "--rank", "4", "-f", "-c", str(inv))
    logs.wait_for(r"^rank 4 waiting$")
    go.touch()
    assert logs.finish(timeout=30) == 0, logs.text()
    assert logs.out == ["rank 4 starting", "rank 4 set up", "rank 4 waiting"] + [
        f"rank 4 done {i}" for i in range(3)], logs.text()

    rows = status(tmp_path, inv)["ranks"]
    assert [r["state"] for r in rows] == ["running"] * 4 + ["exited 0", "running"], rows
    assert rows[4]["last_line"] == "rank 4 done 2" and rows[4]["code"] == 0, rows[4]
    stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left(hosts, name)


# ---------------------------------------------------------------- Ctrl-C

SLEEP_JOB = """\
import os, time
print("rank %s ready" % os.environ["RANK"], flush=True)
time.sleep(600)
"""


def test_ctrl_c_stops_the_job_everywhere(sshd_cluster: SshdCluster, tmp_path: Path,
                                         jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[2:4], "e2e-ctrlc"
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    up = jobs.start(tmp_path, "up", str(inv))
    up.wait_for(r"\] rank \d ready$", count=2)
    up.proc.send_signal(signal.SIGINT)
    assert up.finish(timeout=40) == 130, up.text()
    assert "interrupted" in "\n".join(up.err)
    assert not (tmp_path / "outputs").exists(), "an interrupted up pulled rank 0's output/"
    assert_nothing_left(hosts, name)


def test_stop_with_one_host_unreachable_stops_the_others(sshd_cluster: SshdCluster,
                                                         tmp_path: Path, jobs: Jobs) -> None:
    """One of two hosts hangs (sshd SIGSTOPped): `orch stop` stops the job on the other,
    names the hung one, exits 3; once it is back, `orch stop` again ends the rest. The
    hung host is the first one (and the master's): the stop of the host after it is not
    held up by it (a third host was a torchrun more, proving nothing more)."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-stop-partial"
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name,
                                       top={"ssh": {"connect_timeout": 3}})
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr
    wait_until(lambda: all(job_pids(hosts, name).values()), 60, "every rank running")
    hung = hosts[0]
    hung.pause()
    try:
        stop = orch(tmp_path, "stop", str(inv), "--grace", "1", timeout=120)
        left = job_pids(hosts, name)
    finally:
        hung.resume()
    assert stop.returncode == 3, stop.stdout + stop.stderr
    assert hung.address in stop.stderr and "Traceback" not in stop.stderr, stop.stderr
    assert "1 of 2 hosts failed to stop" in stop.stderr, stop.stderr
    assert not left[hosts[1].address], left
    assert left[hung.address], "the unreachable host's ranks cannot have been stopped"
    again = orch(tmp_path, "stop", str(inv), "--grace", "1")
    assert again.returncode == 0, again.stderr
    assert_nothing_left(hosts, name)


# ---------------------------------------------------------------- logs

LINES = 100_000
CHATTY_JOB = f"""\
import os, sys
if os.environ["RANK"] == "0":
    sys.stdout.write("".join("line %06d\\n" % i for i in range({LINES})))
else:
    for i in range(3):
        print("other %d" % i)
"""


def test_logs_of_a_rank_that_printed_100k_lines(sshd_cluster: SshdCluster, tmp_path: Path,
                                                jobs: Jobs) -> None:
    host, name = sshd_cluster.hosts[0], "e2e-logs"
    write_job(tmp_path, CHATTY_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[host], procs=2, name=name)
    jobs.add(inv, [host], name)
    up = orch(tmp_path, "up", str(inv))
    assert up.returncode == 0, up.stderr
    lines = prefixed(up.stdout.splitlines())
    assert [t for r, _, t in lines if r == 0] == [f"line {i:06d}" for i in range(LINES)]

    cmd = " ".join(map(str, ORCH)) + f" logs --rank 0 -c {inv} | wc -l"
    counted = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env=dict(os.environ))
    assert counted.stdout.strip() == str(LINES), counted.stderr
    one = orch(tmp_path, "logs", "--rank", "1", "-c", str(inv))
    assert one.returncode == 0 and one.stdout == "other 0\nother 1\nother 2\n", one
    tail = orch(tmp_path, "logs", "--rank", "0", "--tail", "2", "-c", str(inv))
    assert tail.stdout == "line 099998\nline 099999\n", tail.stdout[:300]
    tail = orch(tmp_path, "logs", "--rank", "1", "--tail", "2", "-c", str(inv))
    assert tail.stdout == "other 1\nother 2\n", tail.stdout

    every = orch(tmp_path, "logs", "-c", str(inv))
    assert every.returncode == 0, every.stderr
    lines = prefixed(every.stdout.splitlines())   # fails on any line without a prefix
    assert {label for _, label, _ in lines} == {host.address}
    assert [t for r, _, t in lines if r == 1] == [f"other {i}" for i in range(3)]
    assert sum(1 for r, _, _ in lines if r == 0) == LINES
    assert_nothing_left([host], name)


def test_logs_unknown_rank(sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:3],
                                       procs=2, name="e2e-logs99")
    result = orch(tmp_path, "logs", "--rank", "99", "-c", str(inv))
    assert result.returncode == 2, result.stderr
    assert "rank 99" in result.stderr and "0 to 5" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_status_of_a_job_never_started(sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:2],
                                       name="e2e-neverstarted")
    """Every host answered and none holds a trace of a run: "not started", exit 2, with
    the `orch up` that starts it (docs/reference/cli.md); --json: the error document."""
    result = orch(tmp_path, "status", "--json", "-c", str(inv))
    assert "Traceback" not in result.stderr
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not been started" in result.stderr and "orch up" in result.stderr, result.stderr
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 2 and "not been started" in doc["error"] and "ranks" not in doc, doc


# ---------------------------------------------------------------- job names

WAIT_JOB = """\
import os, sys, time
print("waiting", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
print("done", flush=True)
"""


def test_running_name_refused_finished_name_reused(sshd_cluster: SshdCluster, tmp_path: Path,
                                                   jobs: Jobs) -> None:
    host, name, go = sshd_cluster.hosts[3], "e2e-names", tmp_path / "go"
    write_job(tmp_path, WAIT_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[host], name=name,
                                       args=[str(go)])
    jobs.add(inv, [host], name)
    first = orch(tmp_path, "up", str(inv), "--detach")
    assert first.returncode == 0, first.stderr
    wait_until(lambda: log_has(rank_log(host, name, 0), "waiting"), 60, "the job to start")
    running = set(pids_with_env(marker(host, name)))

    again = orch(tmp_path, "up", str(inv))
    assert again.returncode != 0, again.stderr
    assert "already running" in again.stderr and "orch stop" in again.stderr, again.stderr
    assert running <= set(pids_with_env(marker(host, name))), "the refused up touched the job"

    go.touch()
    wait_until(lambda: not any(job_pids([host], name).values()), 30, "the job to finish")
    reuse = orch(tmp_path, "up", str(inv))
    assert reuse.returncode == 0, reuse.stderr
    # the new run's output only: the finished run's log lines are not replayed
    assert reuse.stdout.splitlines() == [f"[r0 {host.address}] waiting",
                                         f"[r0 {host.address}] done"], reuse.stdout
    assert_nothing_left([host], name)


# ---------------------------------------------------------------- host loss

def test_lost_host_fails_the_job(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[1:3], "e2e-hostloss"
    lost = hosts[1]
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    up = jobs.start(tmp_path, "up", str(inv))
    up.wait_for(r"\] rank \d ready$", count=2)
    lost.pause()
    paused_at = time.monotonic()
    try:
        code = up.finish(timeout=45)
        took = time.monotonic() - paused_at
    finally:
        lost.resume()
    assert code == 1, up.text()
    assert took <= 30, f"orch up noticed the lost host after {took:.0f} s"
    report = "\n".join(up.err)
    assert re.search(rf"{re.escape(lost.address)}\b.*lost", report), report
    # the lost host's ranks may still run: said so, with the stop that works as printed
    flat = " ".join(report.split())
    assert "not stopped" in flat.lower() and "`orch stop` ends them" in flat, report
    stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left(hosts, name)
