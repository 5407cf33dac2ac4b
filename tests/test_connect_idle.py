"""An idle connection's transport thread sleeps a keepalive period between wake-ups (not
paramiko's 0.1 s), sends its keepalive at those wakes, and closing the connection ends
that thread at once, not a sleep later."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.inventory import load
from orchestrator.ssh import connect, sshconfig
from orchestrator.ssh.sshtransport import SSHTransport
from orchestrator.wire import timeouts
from sshd_cluster import SshdCluster


def test_an_idle_transport_sleeps_long_and_its_close_wakes_it(
        sshd_cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeouts, "keepalive", lambda hosts: 120.0)   # beyond the wait below
    (tmp_path / "job.py").write_text("")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:1])
    host = load(inv).hosts[0]
    link = connect.connect(host, sshconfig.ssh_config(), tmp_path)
    assert isinstance(link, SSHTransport)
    transport = link.client.get_transport()
    assert transport is not None and transport.is_alive()
    assert transport.sock.gettimeout() == 120.0
    result = link.open(["true"], 30).finish()   # the connection works as before
    assert result.code == 0
    link.close()
    deadline = time.monotonic() + 60   # without the wake, the thread sleeps 120 s
    while transport.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not transport.is_alive()


def test_an_idle_connection_sends_its_keepalive_at_its_wakes(
        sshd_cluster: SshdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """paramiko checks whether a keepalive is due only when its socket's timeout passes:
    with that timeout at the period, an idle connection still sends one each period
    (or two: a wake may come just before it is due), and sshd keeps the connection."""
    monkeypatch.setattr(timeouts, "keepalive", lambda hosts: 1.0)
    (tmp_path / "job.py").write_text("")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:1])
    link = connect.connect(load(inv).hosts[0], sshconfig.ssh_config(), tmp_path, hosts=1000)
    assert isinstance(link, SSHTransport)
    try:
        transport = link.client.get_transport()
        assert transport is not None and transport.sock.gettimeout() == 1.0
        sent: list[str] = []
        request = transport.global_request

        def counted(kind: str, data: Any = None, wait: bool = True) -> Any:
            sent.append(kind)
            return request(kind, data, wait)
        monkeypatch.setattr(transport, "global_request", counted)
        deadline = time.monotonic() + 60   # 1-2 s each; a loaded machine may wake late
        while len(sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sent[:3] == ["keepalive@lag.net"] * 3
        assert link.open(["true"], 30).finish().code == 0   # still connected
    finally:
        link.close()


def test_wait_exit_returns_at_the_exit_or_none_at_the_timeout(
        sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    """The channel's wait_exit (what Link.close waits with) sleeps on paramiko's event:
    the exit code once the command ended, None while it still runs."""
    (tmp_path / "job.py").write_text("")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:1])
    link = connect.connect(load(inv).hosts[0], sshconfig.ssh_config(), tmp_path)
    try:
        running = link.open(["sleep", "30"], 30)
        assert running.wait_exit(0.2) is None
        running.close()
        ended = link.open(["sh", "-c", "exit 7"], 30)
        ended.close_stdin()
        assert ended.wait_exit(30) == 7
    finally:
        link.close()
