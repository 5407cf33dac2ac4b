"""Over real SSH: host text that would drive a terminal or read as rich markup, shown
literally by `orch status`; `orch logs --rank R` piped byte-exact; a stopped job reads
`stopped`; --json documents from a detached start to the stop."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ClusterShell.NodeSet import NodeSet

from helpers import ORCH, Jobs, assert_nothing_left, job_dir, job_pids, orch, wait_until, write_job
from sshd_cluster import SshdCluster, free_port

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
    """One host of two ranks: what is shown is one rank's text, not a host's; a second
    host was a torchrun more (3 s of CPU) and a login more for each command."""
    hosts, name = sshd_cluster.hosts[:1], "e2e-ux"
    write_job(tmp_path, NASTY_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "other.yaml", hosts=hosts, procs=2, name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", "--detach", "--json", "-c", inv.name)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["world_size"] == 2
    assert "orch logs -c other.yaml -f" in up.stderr     # the hint keeps -c
    # waited for on the host (an `orch logs` a poll was a CLI start and a login each), then
    # piped once: byte-exact
    log = job_dir(hosts[0], name) / "logs" / "rank-1.log"
    wait_until(lambda: log.exists() and log.read_bytes() == NASTY_LOG, 60, "rank 1's log",
               step=0.2)
    raw = [*ORCH, "logs", "--rank", "1", "-c", inv.name]
    piped = subprocess.run(raw, cwd=tmp_path, capture_output=True, env=dict(os.environ),
                           timeout=120)
    assert piped.returncode == 0 and piped.stdout == NASTY_LOG, piped
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


def test_stop_while_one_hosts_sshd_refuses_says_its_ranks_run_on(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """`orch stop` while host 1 refuses SSH (the inventory sends it to a closed port, as a
    stopped sshd would): host 0 is stopped, host 1's ranks are named as still running,
    with the `orch stop -c ...` that finishes it; that command, once it is back, does."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-ux-stop"
    write_job(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    inv = sshd_cluster.write_inventory(tmp_path / "two.yaml", hosts=hosts, procs=2, name=name)
    jobs.add(inv, hosts, name)
    assert orch(tmp_path, "up", "--detach", "-c", inv.name).returncode == 0
    wait_until(lambda: all(job_pids(hosts, name).values()), 30, "the job on both hosts")
    good = inv.read_text()
    closed = free_port([hosts[1].address], start=2900, stop=3000)
    inv.write_text(good.replace(f"address: {hosts[1].address}\n",
                                f"address: {hosts[1].address}\n  port: {closed}\n"))
    stop = orch(tmp_path, "stop", "-c", inv.name, "--grace", "2")
    assert stop.returncode == 3, stop.stderr
    assert "1 of 2 hosts failed to stop" in stop.stderr and "Traceback" not in stop.stderr
    assert re.search(rf"ranks 2-3 on {re.escape(hosts[1].address)}\S* are NOT stopped and "
                     "may still be running", stop.stderr), stop.stderr
    assert "`orch stop -c two.yaml` again finishes the stop" in stop.stderr, stop.stderr
    left = job_pids(hosts, name)
    assert not left[hosts[0].address] and left[hosts[1].address], left
    inv.write_text(good)
    again = orch(tmp_path, "stop", "-c", inv.name, "--grace", "2")
    assert again.returncode == 0, again.stderr
    assert_nothing_left(hosts, name)


def test_logs_follow_ended_by_sigterm_says_one_line(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """`orch logs -f` over two hosts, ended by SIGTERM: `orch: interrupted`, exit 130, no
    "agent's connection ended" warning per host (two hosts are hosts enough: a third was
    a torchrun more)."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-ux-logs"
    write_job(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    inv = sshd_cluster.write_inventory(tmp_path / "two.yaml", hosts=hosts, procs=1, name=name)
    jobs.add(inv, hosts, name)
    assert orch(tmp_path, "up", "--detach", "-c", inv.name).returncode == 0
    logs = jobs.start(tmp_path, "logs", "-f", "-c", inv.name)
    logs.wait_for(r"^\[r\d \S+\] up$", count=2)
    logs.proc.send_signal(signal.SIGTERM)
    assert logs.finish(30) == 130, logs.text()
    assert logs.err == ["orch: interrupted"], logs.text()
    assert orch(tmp_path, "stop", "-c", inv.name, "--grace", "2").returncode == 0
    assert_nothing_left(hosts, name)


def test_identical_failures_on_three_hosts_are_one_block(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """A wrong port everywhere, then a failing `setup:` everywhere: each is one block with
    the hosts folded (`3 hosts: 127.0.0.[2-4]: ...`), its hint keeping `-c`."""
    hosts, name = sshd_cluster.hosts[:3], "e2e-ux-group"
    write_job(tmp_path, "print('never')\n")
    closed = free_port([h.address for h in hosts], start=2900, stop=3000)
    inv = sshd_cluster.write_inventory(tmp_path / "grp.yaml", hosts=hosts, name=name,
                                       top={"ssh": {"port": closed}})
    jobs.add(inv, hosts, name)
    folded = str(NodeSet.fromlist([h.address for h in hosts]))
    up = orch(tmp_path, "up", "-c", inv.name)
    assert up.returncode == 3, up.stderr
    assert (f"  - 3 hosts: {folded}: connection refused on port {closed}: nothing listens there"
            in up.stderr.splitlines()), up.stderr
    assert up.stderr.count("connection refused") == 1 and "Traceback" not in up.stderr

    # SHLVL=1: the setup's bash does not read ~/.bashrc again. The fake hosts share
    # root's home, and its `pyenv init` (`pyenv rehash`) raced between the three hosts
    # once in CI and printed on one of them, so their outputs differed; separate
    # machines each have their own home
    inv = sshd_cluster.write_inventory(tmp_path / "grp.yaml", hosts=hosts, name=name,
                                       env={"SHLVL": "1"},
                                       top={"setup": ["echo no such package >&2; exit 3"]})
    up = orch(tmp_path, "up", "-c", inv.name, timeout=180)
    assert up.returncode == 3, up.stderr
    assert (f"  - 3 hosts: {folded}: `echo no such package >&2; exit 3` exited with code 3; its "
            "last lines:" in up.stderr), up.stderr
    assert up.stderr.count("| no such package") == 1, up.stderr
    assert ("(the whole output is in <job dir>/logs/setup.log on each host), then run "
            "`orch up -c grp.yaml` again") in up.stderr, up.stderr


def test_a_relative_python_is_taken_from_the_code_folder(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """`python: ../pyenv/bin/python` on an SSH host is `<job dir>/pyenv/bin/python` for the
    agent, the checks and the ranks, on the first `up` already (no code/ there yet)."""
    hosts, name = sshd_cluster.hosts[:1], "e2e-ux-relpy"
    write_job(tmp_path, "import sys\nprint('python', sys.executable, flush=True)\n")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name,
                                       top={"python": "../pyenv/bin/python"})
    jobs.add(inv, hosts, name)
    pybin = Path(job_dir(hosts[0], name)) / "pyenv" / "bin"
    pybin.mkdir(parents=True)
    (pybin / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')   # keeps the venv
    (pybin / "python").chmod(0o755)
    up = orch(tmp_path, "up", "--no-pull", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"python {sys.executable}" in up.stdout, up.stdout
    assert_nothing_left(hosts, name)
