"""Over real SSH: host text that would drive a terminal or read as rich markup, shown
literally by `orch status`; `orch logs --rank R` piped byte-exact; a stopped job reads
`stopped`; --json documents from a detached start to the stop."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import ORCH, Jobs, assert_nothing_left, orch, wait_until, write_job
from sshd_cluster import SshdCluster

pytestmark = pytest.mark.ssh

NASTY_JOB = """\
import os, sys, time
sys.stdout.buffer.write(b"title \\x1b]0;pwned\\x07 50%\\r[r9 evil] forged\\n")
sys.stdout.buffer.write(b"[/bold]\\n\\n")
sys.stdout.flush()
time.sleep(600)
"""
NASTY_LOG = b"title \x1b]0;pwned\x07 50%\r[r9 evil] forged\n[/bold]\n\n"


def test_host_text_is_shown_literally_and_piped_exactly(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-ux"
    write_job(tmp_path, NASTY_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "other.yaml", hosts=hosts, procs=1, name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", "--detach", "--json", "-c", inv.name)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["world_size"] == 2
    assert "orch logs -c other.yaml -f" in up.stderr     # the hint keeps -c
    raw = [*ORCH, "logs", "--rank", "1", "-c", inv.name]
    wait_until(lambda: subprocess.run(raw, cwd=tmp_path, capture_output=True,
                                      env=dict(os.environ)).stdout == NASTY_LOG, 30, "rank 1's log")
    status = orch(tmp_path, "status", "-c", inv.name)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    # shown literally, the blank line after it skipped
    assert "[/bold]" in status.stdout and "\x07" not in status.stdout
    stop = orch(tmp_path, "stop", "--json", "-c", inv.name, "--grace", "2")
    assert stop.returncode == 0 and json.loads(stop.stdout)["failed"] == {}, stop.stderr
    doc = json.loads(orch(tmp_path, "status", "--json", "-c", inv.name).stdout)
    assert [r["state"] for r in doc["ranks"]] == ["stopped", "stopped"], doc
    listed = json.loads(orch(tmp_path, "logs", "--list", "--json", "-c", inv.name).stdout)
    assert [r["log_bytes"] for r in listed["ranks"]] == [len(NASTY_LOG)] * 2, listed
    assert_nothing_left(hosts, name)
