"""~/.ssh/config aliases and ssh-agent, through real sshd hosts."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import Jobs, assert_nothing_left, orch, write_job
from sshd_cluster import SshdCluster, pid_alive

JOB = "import os\nprint('master', os.environ['MASTER_ADDR'], 'rank', os.environ['RANK'])\n"
pytestmark = pytest.mark.ssh


def bare_inventory(cluster: SshdCluster, tmp_path: Path, name: str, addresses: list[str]) -> Path:
    """Only addresses: user, port and key must come from the ssh config or the agent."""
    write_job(tmp_path, JOB)
    inv = cluster.write_inventory(tmp_path / "cluster.yaml", hosts=cluster.hosts[:len(addresses)],
                                  name=name)
    doc = yaml.safe_load(inv.read_text())
    doc["ssh"] = {"known_hosts": str(cluster.known_hosts), "connect_timeout": 5}
    for entry, address in zip(doc["hosts"], addresses):
        entry["address"] = address
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inv


def test_ssh_config_alias_user_port_and_key(sshd_cluster: SshdCluster, tmp_path: Path,
                                            jobs: Jobs) -> None:
    hosts = sshd_cluster.hosts[:2]
    config = tmp_path / "ssh_config"
    config.write_text("".join(
        f"Host node{i}\n  HostName {h.address}\n  Port {h.port}\n  User root\n"
        f"  IdentityFile {sshd_cluster.client_key}\n" for i, h in enumerate(hosts)))
    inv = bare_inventory(sshd_cluster, tmp_path, "e2e-sshconfig", ["node0", "node1"])
    jobs.add(inv, hosts, "e2e-sshconfig")
    env = dict(os.environ, ORCH_SSH_CONFIG=str(config))
    up = orch(tmp_path, "up", str(inv), env=env)
    assert up.returncode == 0, up.stderr
    # the alias was resolved: MASTER_ADDR is the HostName, which the other host can reach
    assert f"[r1 node1] master {hosts[0].address} rank 1" in up.stdout
    assert_nothing_left(hosts, "e2e-sshconfig")


def start_agent(tmp_path: Path, key: Path) -> tuple[subprocess.Popen, str]:
    sock = str(tmp_path / "agent.sock")
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not os.path.exists(sock) and time.time() < deadline:
        time.sleep(0.05)
    add = subprocess.run(["ssh-add", str(key)], env=dict(os.environ, SSH_AUTH_SOCK=sock),
                         capture_output=True, text=True)
    assert add.returncode == 0, add.stderr
    return agent, sock


def test_key_from_ssh_agent_only(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    host = sshd_cluster.hosts[0]
    config = tmp_path / "ssh_config"   # user and port, but no key: it must come from the agent
    config.write_text(f"Host agentbox\n  HostName {host.address}\n  Port {host.port}\n  User root\n")
    inv = bare_inventory(sshd_cluster, tmp_path, "e2e-agent", ["agentbox"])
    jobs.add(inv, [host], "e2e-agent")
    env = dict(os.environ, ORCH_SSH_CONFIG=str(config), HOME=str(tmp_path))  # no ~/.ssh keys
    env.pop("SSH_AUTH_SOCK", None)
    without = orch(tmp_path, "up", str(inv), env=env)
    assert without.returncode == 3 and "authentication failed" in without.stderr
    agent, sock = start_agent(tmp_path, sshd_cluster.client_key)
    try:
        up = orch(tmp_path, "up", str(inv), env=dict(env, SSH_AUTH_SOCK=sock))
        assert up.returncode == 0, up.stderr
        assert "[r0 agentbox] master" in up.stdout
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
    assert not pid_alive(agent.pid)
    assert_nothing_left([host], "e2e-agent")
