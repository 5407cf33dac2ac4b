"""The agent replaces the login shell sshd starts it in (`exec`): no shell waits beside
it on the host for the session's length (ssh/sshtransport.SSHTransport.open). bash does
that by itself for one command; sh (dash) does not, so the host logs in as the
benchmark's plain /bin/sh user (bench/common.py's bed)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.config.inventory import load
from orchestrator.session.session import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import Bed, bed_cluster, remote_base

pytestmark = pytest.mark.ssh
FIRST_OCTET = 230   # apart from the other clusters' addresses (their FIRST_OCTET)


def parent_comm(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
    return Path(f"/proc/{ppid}/comm").read_text().strip()


def test_the_agent_is_the_sessions_own_process() -> None:
    with bed_cluster(1, ["plain"], first_octet=FIRST_OCTET) as beds:
        sh = beds.shells["plain"]
        bed = Bed(beds.cluster, beds.cluster.hosts, sh, beds.python,
                  beds.cluster.root.parent / "work", remote_base(beds.cluster, sh) / "shell")
        session = Session(load(bed.inventory("shell", "pass\n"))).open()
        try:
            hello = session.links[0].hello
            assert hello is not None and hello.pid
            comm = parent_comm(hello.pid)
            assert comm.startswith("sshd"), f"the agent's parent is {comm!r}, not sshd's session"
        finally:
            session.close()
    assert beds.clean
