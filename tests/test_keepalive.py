"""The SSH keepalive at scale, without hosts: its period grows with the host count so that
all connections together wake the controller at most KEEPALIVE_RATE times a second (up
to 1,500 hosts), and never so long that an idle connection goes quiet for the idle
timeout of a NAT or a firewall; the period reaches each connection (Session -> connect ->
Target -> paramiko's transport). Through real sshd: tests/test_connect_idle.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import paramiko
import pytest

from orchestrator.config.inventory import load
from orchestrator.session.session import Session
from orchestrator.ssh import connect
from orchestrator.wire import timeouts

NAT_IDLE = 60.0   # the shortest idle timeout of common NATs and firewalls (many: 300 s)


@pytest.mark.parametrize("hosts, period", [
    (1, 5.0), (64, 5.0), (300, 5.0), (501, 6.0), (1000, 10.0), (1500, 15.0), (5000, 15.0)])
def test_the_period_grows_with_the_hosts(hosts: int, period: float) -> None:
    assert timeouts.keepalive(hosts) == period


def test_all_connections_wake_at_most_the_rate_up_to_1500_hosts() -> None:
    for hosts in (1, 99, 100, 101, 499, 500, 501, 999, 1000, 1001, 1500):
        period = timeouts.keepalive(hosts)
        assert hosts / period <= timeouts.KEEPALIVE_RATE, hosts
        assert period == int(period), hosts   # paramiko's interval is whole seconds


def test_an_idle_connection_is_never_quiet_near_a_nat_timeout() -> None:
    """A wake can come just before the keepalive is due, so the longest quiet stretch is
    twice the period: at most 30 s, half the shortest common idle timeout."""
    assert all(timeouts.keepalive(h) <= timeouts.KEEPALIVE_MAX for h in range(1, 10_000, 7))
    assert 2 * timeouts.KEEPALIVE_MAX <= NAT_IDLE / 2


def test_idle_sets_paramikos_interval_and_the_sockets_wake() -> None:
    calls: list[Any] = []
    sock = SimpleNamespace(settimeout=lambda s: calls.append(("timeout", s)))
    t = SimpleNamespace(sock=sock, set_keepalive=lambda i: calls.append(("keepalive", i)))
    connect.idle(t, 10.0)   # type: ignore[arg-type]  # the two things idle touches
    assert calls == [("keepalive", 10), ("timeout", 10.0)]


def test_connect_gives_the_target_the_period_of_the_host_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []

    def connect_ssh(host: Any, target: Any, bastions: Any) -> Any:
        seen.append(target.keepalive)
        return "transport"
    monkeypatch.setattr(connect, "connect_ssh", connect_ssh)
    host = load(_inventory(tmp_path, 1)).hosts[0]
    config = paramiko.SSHConfig()
    assert connect.connect(host, config, tmp_path) == "transport"
    assert connect.connect(host, config, tmp_path, hosts=1000) == "transport"
    assert seen == [timeouts.KEEPALIVE, 10.0]


def test_a_session_connects_with_its_clusters_host_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host's period is the whole cluster's, even when only some are opened."""
    counts: list[int] = []
    monkeypatch.setattr(connect, "connect",
                        lambda h, config, base, bastions, hosts: counts.append(hosts))
    cluster = load(_inventory(tmp_path, 300))
    opener, seal = Session(cluster)._ssh(cluster.hosts[:2])
    opener(cluster.hosts[0])
    seal()
    assert counts == [300]


def _inventory(tmp_path: Path, hosts: int) -> Path:
    (tmp_path / "job.py").write_text("")
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: k\nhosts:\n  - node[1-{hosts}]\njob:\n  entrypoint: job.py\n")
    return path
