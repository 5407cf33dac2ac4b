"""A closed stdout is the user's pipe, not a host: `orch logs | head -2` and the other
commands that print a lot, through a real shell pipe over the sshd cluster, end quietly
with 141 (128 + SIGPIPE, as the shell reports a tool that SIGPIPE ended), name no host,
and leave no traceback."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers import ORCH, Jobs, assert_nothing_left, job_dir, orch, wait_until, write_job
from sshd_cluster import FakeHost, SshdCluster

CHATTY_JOB = """\
import os, sys, time
rank = os.environ["RANK"]
for i in range(20000):
    print("rank", rank, "line", i, flush=True)
if os.environ.get("LONG"):
    for i in range(600):
        print("rank", rank, "tick", i, flush=True)
        time.sleep(0.5)
"""


def piped(cwd: Path, args: str, head: int, timeout: float = 60) -> tuple[int, str, str]:
    """`orch ARGS | head -N` in bash: (orch's exit status, what head printed, stderr)."""
    orch_cmd = " ".join(shlex.quote(w) for w in ORCH) + " " + args
    script = f"{orch_cmd} 2>err.txt | head -{head}; echo \"rc=${{PIPESTATUS[0]}}\" >&2"
    got = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ))
    rc = int(got.stderr.strip().rsplit("rc=", 1)[1])
    return rc, got.stdout, (cwd / "err.txt").read_text()


def rank_log(host: FakeHost, name: str, rank: int) -> Path:
    return job_dir(host, name) / "logs" / f"rank-{rank}.log"


def log_has(path: Path, text: str) -> bool:
    try:
        return text in path.read_text()
    except OSError:   # not written yet
        return False


def quiet(stderr: str) -> bool:
    return "Traceback" not in stderr and "connection lost" not in stderr \
        and "Broken pipe" not in stderr and "warning" not in stderr


@pytest.mark.ssh
def test_closed_pipe_is_never_a_host(sshd_cluster: SshdCluster, tmp_path: Path,
                                     jobs: Jobs) -> None:
    """One detached job serves every read (its 20000 lines a rank are all in the logs
    before the first pipe, then it ticks on for -f); a second up is the attached one
    whose reader leaves."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-pipes"
    write_job(tmp_path, CHATTY_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=2, name=name,
                                       env={"LONG": "1"})
    jobs.add(inv, hosts, name)
    detached = orch(tmp_path, "up", "--detach", timeout=300)
    assert detached.returncode == 0, detached.stderr
    # every rank has printed its 20000 lines and ticks: read on the hosts, not by an orch
    # command a poll (each is a CLI start and SSH logins); a deadline: a start takes
    # 15-40 s at load 10-30
    wait_until(lambda: all(log_has(rank_log(hosts[r // 2], name, r), "tick 1") for r in range(4)),
               240, "every rank's ticks", step=0.5)

    rc, shown, err = piped(tmp_path, "status", 1)   # all of it fits in the pipe: 0
    assert rc in (0, 141) and len(shown.splitlines()) == 1 and quiet(err), (rc, err)
    for args in ("logs", "logs --rank 2", "logs --tail 5000",
                 "exec -- seq 200000", "exec -- sh -c 'seq 200000; echo done'"):
        rc, shown, err = piped(tmp_path, args, 2)
        assert rc == 141 and len(shown.splitlines()) == 2, (args, rc, shown, err)
        assert quiet(err) and err.strip() == "", (args, err)

    # -f on a running job: ends as soon as head has its lines, the job goes on
    rc, shown, err = piped(tmp_path, "logs -f", 5, timeout=120)
    assert rc == 141 and len(shown.splitlines()) == 5 and err.strip() == "", (rc, shown, err)
    rc, shown, err = piped(tmp_path, "logs -f --rank 2 --tail 1", 3, timeout=120)
    assert rc == 141 and len(shown.splitlines()) == 3 and err.strip() == "", (rc, shown, err)
    status = orch(tmp_path, "status")
    assert status.stdout.count("running") == 4, status.stdout
    rc, shown, err = piped(tmp_path, "status --watch --json", 1, timeout=120)   # 2 s rounds
    assert rc == 141 and len(shown.splitlines()) == 1 and quiet(err), (rc, err)

    # an attached up whose reader leaves: stopped as a closed terminal stops it
    stop = orch(tmp_path, "stop", "--grace", "1")
    assert stop.returncode == 0, stop.stderr
    rc, shown, err = piped(tmp_path, "up", 3, timeout=120)
    assert rc == 141 and "connection lost" not in err and "Traceback" not in err, (rc, err)
    assert_nothing_left(hosts, name, wait=120)   # no process of it left on either host
    wait_until(lambda: orch(tmp_path, "status").stdout.count("running") == 0, 120,
               "status to read the job stopped", step=1.0)
