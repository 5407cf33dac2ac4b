"""Hangs over real sshd (`job.hang_timeout`): a SIGSTOPped rank, a rank sleeping inside
its training step while the others wait in gloo's all_reduce (on CPU), and a rank whose
output is quiet while its heartbeat moves (not a hang). The right rank is named within
hang_timeout + 10 s, orch exits 1, and nothing of the job is left.

Only the sleeping rank's job imports torch: what the others prove is orch's (a stopped
rank's state, output and heartbeats, the ranks' stacks), so their ranks wait for each
other on files instead of a process group, and start in a blink instead of 3-4 s of
CPU each (torchrun, the real launcher, still imports it on every host). That job runs on
two hosts, so a hang's stacks are gathered across hosts and the culprit named with its
host; the others need one host of three ranks (a rank stopped, or quiet, while two
others are elsewhere), one torchrun instead of two."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from helpers import Jobs, Running, assert_nothing_left, part_dir, write_job
from sshd_cluster import SshdCluster

pytestmark = [pytest.mark.ssh, pytest.mark.slow]
# hang_timeout: a rank is watched from its first line (hang.py), so this is above the
# jobs' longest quiet stretch by design (a step's wait for the others, a line's way to orch)
# on a machine at load 25, with room; their silent starts (a torch import took 12-25 s
# there) do not count
TIMEOUT = 20.0
START = 240       # seconds: an up's start (preflight, push, torch imports) at load 12

JOB = """\
import os, sys, time
rank, mode = int(os.environ["RANK"]), os.environ["MODE"]
world = int(os.environ["WORLD_SIZE"])
if mode == "sleep":   # the job whose ranks wait in gloo's all_reduce: the one that imports torch
    # silent, as most scripts are, through torch's import and the rendezvous: longer than
    # hang_timeout on a busy machine, and no hang (a rank is watched from its first line)
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
print("rank %d ready" % rank, flush=True)


def barrier(tag):
    # without torch: each rank's file in BARRIER (the fake hosts share this machine's
    # file system); a rank waits here until every rank has reached it, as in a collective
    os.close(os.open(os.path.join(os.environ["BARRIER"], "%s-%d" % (tag, rank)),
                     os.O_CREAT | os.O_WRONLY))
    names = [os.path.join(os.environ["BARRIER"], "%s-%d" % (tag, r)) for r in range(world)]
    while not all(os.path.exists(n) for n in names):
        time.sleep(0.05)


def train_step(i):
    if mode == "sleep" and rank == 2 and i == 5:
        time.sleep(600)
    if mode == "sleep":
        t = torch.ones(4)
        dist.all_reduce(t)
    else:
        barrier("step-%d" % i)


def quiet_work(seconds, touch_for):
    # no output; the heartbeat moves for touch_for seconds: progress all the same
    start = time.monotonic()
    while time.monotonic() < start + seconds:
        if time.monotonic() < start + touch_for:
            os.utime(os.environ["ORCH_HEARTBEAT"])
        time.sleep(0.5)


if mode == "quiet":
    if rank == 1:
        quiet_work(float(os.environ["QUIET_S"]), float(os.environ["TOUCH_S"]))
    else:   # the others print on as long (by the clock), so no rank's silence is the job's
        end, i = time.monotonic() + float(os.environ["QUIET_S"]), 0
        while time.monotonic() < end:
            print("rank %d working %d" % (rank, i), flush=True)
            time.sleep(0.5)
            i += 1
    barrier("done")
    print("rank %d done" % rank, flush=True)
    sys.exit(0)
for i in range(10 ** 6):
    train_step(i)
    print("rank %d step %d" % (rank, i), flush=True)
    time.sleep(0.2)
"""


def start(cluster: SshdCluster, tmp_path: Path, jobs: Jobs, name: str, env: dict[str, str],
          procs: list[int], *extra: str, top: dict | None = None) -> tuple[list, Running]:
    """3 ranks: on 2 hosts with procs [2, 1] (ranks 0, 1 on the first, rank 2 on the
    second), or on one host with [3]."""
    hosts = cluster.hosts[:len(procs)]
    write_job(tmp_path, JOB)
    inv = cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=procs,
                                  name=name, env={**env, "BARRIER": barrier_dir(tmp_path)},
                                  top=top)
    jobs.add(inv, hosts, name)
    return hosts, jobs.start(tmp_path, "up", str(inv), "--no-pull", *extra)


def barrier_dir(tmp_path: Path) -> str:
    """Where the torch-free ranks leave the files they wait on (the job's barrier)."""
    path = tmp_path / "barrier"
    path.mkdir(exist_ok=True)
    return str(path)


def wait_err(run: Running, pattern: str, timeout: float) -> float:
    """The time (monotonic) at which a stderr line matched; fail if none within timeout."""
    regex, deadline = re.compile(pattern), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(regex.search(line) for line in list(run.err)):
            return time.monotonic()
        if run.proc.poll() is not None:
            time.sleep(0.3)
            if any(regex.search(line) for line in list(run.err)):
                return time.monotonic()
            break
        time.sleep(0.05)
    raise AssertionError(f"no stderr line matched {pattern!r}\n{run.text()}")


def rank_pid(host: object, name: str, rank: int) -> int:
    rec = json.loads((part_dir(host, name) / f"rank-{rank}.pid").read_text())  # type: ignore[arg-type]
    return int(rec["pid"])


def test_a_stopped_rank_is_named(sshd_cluster: SshdCluster, tmp_path: Path,
                                 jobs: Jobs) -> None:
    name = "hang-stop"
    hosts, up = start(sshd_cluster, tmp_path, jobs, name, {"MODE": "steps"}, [3],
                      "--hang-timeout", str(TIMEOUT))
    up.wait_for(r"\] rank 2 step 3$", timeout=START)
    os.kill(rank_pid(hosts[0], name, 2), signal.SIGSTOP)
    stopped = time.monotonic()
    named = wait_err(up, r"root cause rank 2 on host", TIMEOUT + 30)
    code = up.finish(timeout=60)
    report = "\n".join(up.err)
    assert code == 1, up.text()
    assert named - stopped <= TIMEOUT + 10, f"named after {named - stopped:.1f} s\n{report}"
    assert re.search(rf"root cause rank 2 on host {re.escape(hosts[0].address)} \(local rank 2\): "
                     r"stopped \(SIGSTOP", report), report
    assert "root cause rank 0" not in report and "root cause rank 1" not in report, report
    assert_nothing_left(hosts, name, wait=10)
    print(report)
    print(f"stopped rank named {named - stopped:.1f} s after SIGSTOP (hang_timeout {TIMEOUT:g})")


def test_a_rank_asleep_in_its_step_is_named_while_the_others_wait_in_all_reduce(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    name = "hang-sleep"
    hosts, up = start(sshd_cluster, tmp_path, jobs, name, {"MODE": "sleep"}, [2, 1],
                      "--hang-timeout", str(TIMEOUT))
    up.wait_for(r"\] rank 2 step 4$", timeout=START)
    asleep = time.monotonic()   # rank 2 sleeps in step 5 from about now
    named = wait_err(up, r"root cause rank 2 on host", TIMEOUT + 30)
    code = up.finish(timeout=60)
    report = "\n".join(up.err)
    assert code == 1, up.text()
    assert named - asleep <= TIMEOUT + 10, f"named after {named - asleep:.1f} s\n{report}"
    assert re.search(r"root cause rank 2 on host .*: in train_step \(job\.py:\d+\) while 2 "
                     r"other ranks are in all_reduce", report), report
    assert re.search(r'File ".*job\.py", line \d+ in train_step', report), report
    assert re.search(r"ranks 0, 1: all_reduce", report), report
    log = (hosts[1].remote_dir / name / "logs" / "rank-2.log").read_text()
    assert "orch: hang:" in log and "in train_step" in log, log[-2000:]
    log0 = (hosts[0].remote_dir / name / "logs" / "rank-0.log").read_text()
    assert "in all_reduce" in log0, log0[-2000:]
    assert_nothing_left(hosts, name, wait=10)
    print(report)
    print(f"sleeping rank named {named - asleep:.1f} s after it fell asleep")


@pytest.mark.parametrize("touch", [True, False], ids=["heartbeat", "heartbeat-stops"])
def test_a_quiet_rank_whose_heartbeat_moves_is_no_hang(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs, touch: bool) -> None:
    """Rank 1 prints nothing for hang_timeout + 6 s but touches its heartbeat while the
    others print on: no hang. With job.hang_timeout in cluster.yaml, not the flag.
    The control: its heartbeat stops after 2 s, and rank 1 is named."""
    name = "quiet-" + ("beat" if touch else "still")
    quiet = TIMEOUT + 6
    env = {"MODE": "quiet", "QUIET_S": str(quiet), "TOUCH_S": str(quiet if touch else 2)}
    hosts, up = start(sshd_cluster, tmp_path, jobs, name, env, [3],
                      top={"job": {"hang_timeout": TIMEOUT}})
    code = up.finish(timeout=START)
    report = "\n".join(up.err)
    if touch:
        assert code == 0, up.text()
        assert "root cause" not in report and "made progress" not in report, up.text()
        assert len([line for line in up.out if line.endswith(" done")]) == 3, up.text()
    else:
        assert code == 1, up.text()
        assert "hang: rank 1 made no progress (output or heartbeat)" in report, report
        assert re.search(r"root cause rank 1 on host .*: in quiet_work \(job\.py:\d+\) while 2 "
                         r"other ranks are in <module>", report), report
    assert_nothing_left(hosts, name, wait=10)
