"""The agent of an attached `orch up` serves requests for the job's whole life: the
checkpoint keeper's listings every half second, `status --watch`, the network and hang
looks. None of them may leave a descriptor open behind it: a leak of one per request
ran a host's agent out of descriptors (a login's soft limit of 1,024) within minutes of
a run that keeps checkpoints, and then every read of the job's records failed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.config.inventory import parse
from orchestrator.files import pull
from orchestrator.remote.link import Link
from orchestrator.remote.transport import LocalTransport
from orchestrator.wire import globs

ROUNDS = 150


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_repeated_requests_leave_no_descriptor_open(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    job = remote / "job"
    for folder in ("output", "run", "logs", "code", globs.KEEP):
        (job / folder).mkdir(parents=True)
    (job / "output" / "ckpt.pt").write_bytes(b"x" * 100)
    (job / "logs" / "rank-0.log").write_bytes(b"a line\n")
    text = (f"name: fds\nhosts:\n  - address: localhost\n    connection: local\n"
            f"    remote_dir: {remote}\npython: {sys.executable}\njob:\n  entrypoint: job.py\n")
    link = Link(LocalTransport(parse(text, tmp_path / "cluster.yaml").hosts[0],
                               cwd=str(tmp_path)))
    hello = link.start(timeout=30)
    proc: subprocess.Popen = link.chan.proc  # type: ignore[union-attr]
    assert hello.pid == proc.pid
    try:
        def round_() -> None:
            pull.manifest(link, str(job), [], folder="output", globs=["*.pt"])
            pull.manifest(link, str(job), [], folder=globs.KEEP)
            link.request("status", 30, job_dir=str(job), ranks=[0])
            link.request("net_waits", 30, job_dir=str(job))
            link.request("stop", 30, job_dir=str(job), grace=1)
        round_()   # the first of each: its modules imported, its caches made
        before = open_fds(proc.pid)
        for _ in range(ROUNDS):
            round_()
        after = open_fds(proc.pid)
        assert after <= before + 2, (before, after, sorted(os.listdir(f"/proc/{proc.pid}/fd")))
    finally:
        link.close()
        proc.wait(10)
    assert proc.returncode is not None
