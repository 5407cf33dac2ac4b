"""The fake cluster behaves like real SSH hosts, for OpenSSH and for paramiko."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from helpers import wait_until
from sshd_cluster import (
    FakeHost,
    SshdCluster,
    accepts,
    free_port,
    loopback,
    loopback_net,
    pid_alive,
    pids_with_env,
    ssh_cmd,
    worker_ports,
)

pytestmark = pytest.mark.ssh  # every test here starts sshd


def _ssh(cluster: SshdCluster, host: FakeHost, command: str, timeout: float = 20):
    return subprocess.run([*ssh_cmd(cluster), host.address, command],
                          capture_output=True, text=True, timeout=timeout)


def _paramiko(cluster: SshdCluster, host: FakeHost, timeout: float = 5) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.load_host_keys(str(cluster.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(host.address, port=host.port, username="root",
                   key_filename=str(cluster.client_key), look_for_keys=False,
                   allow_agent=False, timeout=timeout, banner_timeout=timeout,
                   auth_timeout=timeout)
    return client


def test_openssh_reaches_every_host(sshd_cluster: SshdCluster) -> None:
    assert [h.address for h in sshd_cluster.hosts] == [loopback(k) for k in (2, 3, 4, 5)]
    for host in sshd_cluster.hosts:
        result = _ssh(sshd_cluster, host, "echo $SSH_CONNECTION")
        assert result.returncode == 0, result.stderr
        # proves we reached this host's own sshd, not another one
        assert result.stdout.split()[2:] == [host.address, str(host.port)]


def test_known_hosts_lists_exactly_the_trusted_hosts(sshd_cluster: SshdCluster,
                                                     untrusted_host: FakeHost) -> None:
    lines = sshd_cluster.known_hosts.read_text().splitlines()
    assert lines == [f"[{h.address}]:{h.port} {h.host_key_pub}" for h in sshd_cluster.hosts]
    assert untrusted_host.host_key_pub not in sshd_cluster.known_hosts.read_text()
    assert untrusted_host not in sshd_cluster.hosts


def test_untrusted_host_fails_host_key_verification(sshd_cluster: SshdCluster,
                                                    untrusted_host: FakeHost) -> None:
    result = _ssh(sshd_cluster, untrusted_host, "true")
    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        _paramiko(sshd_cluster, untrusted_host)


def test_paramiko_connects_with_reject_policy(sshd_cluster: SshdCluster) -> None:
    host = sshd_cluster.hosts[1]
    client = _paramiko(sshd_cluster, host)
    try:
        _, stdout, _ = client.exec_command("echo $SSH_CONNECTION")
        assert stdout.read().decode().split()[2] == host.address
        assert stdout.channel.recv_exit_status() == 0
    finally:
        client.close()


def test_pause_makes_host_hang_and_resume_restores(sshd_cluster: SshdCluster) -> None:
    host = sshd_cluster.hosts[2]
    client = _paramiko(sshd_cluster, host)
    _, stdout, _ = client.exec_command("sleep 30 & echo $!; wait")
    sleep_pid = int(stdout.readline())
    host.pause()
    try:
        assert sleep_pid in host.descendants()
        # a SIGSTOP takes effect when its process next runs (a sleeper is woken to stop):
        # the state is polled until both show it
        wait_until(lambda: _state(sleep_pid) == "T" and _state(host.pid) == "T", 10,
                   "state T (stopped) of both sshd and the sleep under it")
        t0 = time.monotonic()
        with pytest.raises((paramiko.SSHException, OSError)):
            _paramiko(sshd_cluster, host, timeout=1).close()
        assert time.monotonic() - t0 < 5
    finally:
        host.resume()
        client.close()
        os.kill(sleep_pid, signal.SIGTERM)
    wait_until(lambda: _state(sleep_pid) != "T", 10, "the sleep to run again after resume()")
    _paramiko(sshd_cluster, host).close()
    assert _ssh(sshd_cluster, host, "true").returncode == 0


def _state(pid: int) -> str:
    """The process state letter, or "gone" once it has ended and been reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):   # reaped before, or while, it was read
        return "gone"


def test_each_xdist_worker_has_addresses_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pytest-xdist the hosts are 127.0.0.<k>; each worker of a run, and the same
    worker of another run, gets a /24 of its own (disjoint from bench/'s 127.0.1-4.*)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert loopback_net() == "127.0.0" and loopback(2) == "127.0.0.2"
    nets = set()
    for run in ("run-a", "run-b"):
        monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)
        for worker in ("gw0", "gw1", "gw2", "gw3"):
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
            nets.add(loopback_net())
            assert loopback(7) == loopback_net() + ".7"
    assert len(nets) == 8, nets
    assert all(n.startswith("127.") and not n.startswith("127.0.") for n in nets), nets


def test_each_xdist_worker_picks_ports_from_a_share_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port on the same address (torchrun's master on 127.0.0.1) in two workers at
    once: their shares of the range do not overlap; outside xdist, the whole range."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert worker_ports(29600, 29900) == (29600, 29900)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    shares = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        shares.append(set(range(*worker_ports(29600, 29900))))
        assert free_port(["127.0.0.1"], 29600, 29900) in shares[-1]
    assert all(len(s) == 100 for s in shares) and len(set.union(*shares)) == 300


def test_unreachable_refuses_connections() -> None:
    address, port = SshdCluster.unreachable()
    assert not accepts(address, port)


def test_write_inventory_follows_spec(sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    path = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:2], procs=[2, 1], name="t1",
        args=["--x", "1"], env={"A": "b"}, extra_hosts=[{"address": "10.0.0.1"}],
        top={"remote_dir": "/ignored", "ssh": {"host_key_policy": "accept-new"}})
    doc = yaml.safe_load(path.read_text())
    assert doc["ssh"] == {"user": "root", "identity_file": str(sshd_cluster.client_key),
                          "known_hosts": str(sshd_cluster.known_hosts),
                          "host_key_policy": "accept-new", "connect_timeout": 5,
                          "port": sshd_cluster.port}
    assert doc["hosts"] == [
        {"address": loopback(2), "procs": 2, "remote_dir": str(sshd_cluster.hosts[0].remote_dir)},
        {"address": loopback(3), "procs": 1, "remote_dir": str(sshd_cluster.hosts[1].remote_dir)},
        {"address": "10.0.0.1"}]
    assert doc["job"] == {"entrypoint": "job.py", "args": ["--x", "1"], "env": {"A": "b"}}
    assert doc["name"] == "t1" and doc["remote_dir"] == "/ignored"
    assert Path(doc["python"]).is_absolute() and doc["code"] == {"paths": ["job.py"]}


def test_stop_leaves_no_process(tmp_path: Path) -> None:
    port = free_port([loopback(40)])
    cluster = SshdCluster(tmp_path, 1, port=port, first_octet=40).start()
    host = cluster.hosts[0]
    marker = f"ORCH_TEST_MARK={tmp_path.name}"
    # a session with a running command: stop() must take it down too
    session = subprocess.Popen([*ssh_cmd(cluster), host.address, f"env {marker} sleep 60"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: pids_with_env(marker))
        tree = [host.pid, *host.descendants()]
        assert len(tree) >= 3  # listener, session sshd(s), the command
        cluster.stop()
        assert not [p for p in tree if pid_alive(p)]
        assert not pids_with_env(marker)
        assert not accepts(host.address, port)
    finally:
        session.wait(timeout=10)


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
