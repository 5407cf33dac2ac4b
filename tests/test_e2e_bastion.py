"""Hosts reachable only through a bastion (`proxy_jump`, or ProxyJump in ~/.ssh/config):
real sshds in network namespaces (tests/netns_cluster.py), orch run in the client
namespace as a user runs it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import helpers
from helpers import job_pids, wait_until, write_job
from netns_cluster import HIDDEN, LINK, NetnsCluster
from orchestrator.config.hostranges import fold
from sshd_cluster import pid_alive

pytestmark = pytest.mark.ssh
BASTION = f"root@{LINK}.2"
JOB = ("import os, time\nprint('hello from rank', os.environ['RANK'], flush=True)\n"
       "time.sleep(120)\n")


@pytest.fixture(scope="module")
def netns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True)
    if probe.returncode != 0 or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns)")
    cluster = NetnsCluster(tmp_path_factory.mktemp("netns"), 2).start()
    pids = [s.proc.pid for s in cluster.all_sshds()]
    yield cluster
    cluster.stop()   # raises if a pid, a namespace or a veth is left
    assert not [p for p in pids if pid_alive(p)]


def inventory(netns: NetnsCluster, path: Path, name: str, proxy_jump: object | None = None,
              **ssh: object) -> Path:
    opts = {"user": "root", "identity_file": str(netns.client_key),
            "known_hosts": str(netns.known_hosts), "connect_timeout": 5, **ssh}
    if proxy_jump is not None:
        opts["proxy_jump"] = proxy_jump
    if not (path.parent / "job.py").exists():
        write_job(path.parent, JOB)
    doc = {"name": name, "ssh": opts,
           "hosts": [{"address": h.address, "remote_dir": str(h.remote_dir)} for h in netns.hosts],
           "python": sys.executable, "code": {"paths": ["job.py"]}, "job": {"entrypoint": "job.py"}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def orch(netns: NetnsCluster, cwd: Path, *args: str, ssh_config: Path | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, ORCH_SSH_CONFIG=str(ssh_config or os.devnull))
    return helpers.orch(cwd, *args, env=env, timeout=timeout, run=netns.run_in_client)


def test_direct_connection_to_hidden_hosts_fails(netns: NetnsCluster, tmp_path: Path) -> None:
    inv = inventory(netns, tmp_path / "cluster.yaml", "direct")
    result = orch(netns, tmp_path, "stop", "-c", str(inv))
    assert result.returncode == 3, result.stderr
    # the same failure on every host: one line, the hosts folded (127.0.1.[1-2]: ...)
    folded = fold([h.address for h in netns.hosts])
    assert any(folded in line and "Network is unreachable" in line
               for line in result.stderr.splitlines()), result.stderr


@pytest.mark.slow
def test_up_logs_stop_through_the_bastion(netns: NetnsCluster, tmp_path: Path) -> None:
    name = "bastion-job"
    inv = inventory(netns, tmp_path / "cluster.yaml", name, proxy_jump=BASTION)
    try:
        up = orch(netns, tmp_path, "up", "-c", str(inv), "--detach")
        assert up.returncode == 0, up.stderr
        wait_until(lambda: all(job_pids(netns.hosts, name).values()), 30, "both ranks running")

        # the same job, reached through ~/.ssh/config's ProxyJump instead of the inventory's
        config = tmp_path / "ssh_config"
        config.write_text(f"Host {HIDDEN}.*\n  ProxyJump {BASTION}\n")
        plain = inventory(netns, tmp_path / "plain.yaml", name)
        follow = netns.popen_in_client(
            [sys.executable, "-m", "orchestrator", "logs", "-f", "-c", str(plain)], cwd=tmp_path,
            env=dict(os.environ, ORCH_SSH_CONFIG=str(config)), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            # two hosts, one connection to the bastion: it is shared. Once both hosts'
            # lines have come, both hosts' connections exist (through the bastion)
            out: list[str] = []
            assert follow.stdout is not None
            reader = threading.Thread(target=lambda: out.extend(
                raw.decode(errors="replace") for raw in iter(follow.stdout.readline, b"")),  # type: ignore[union-attr]  # checked above
                daemon=True)
            reader.start()
            wanted_live = {f"[r{rank} {h.address}] hello from rank {rank}\n"
                           for rank, h in enumerate(netns.hosts)}
            wait_until(lambda: wanted_live <= set(out), 60, f"logs -f to show {wanted_live}")
            assert netns.established(f"{LINK}.2") == 1
        finally:
            follow.terminate()
            follow.wait(20)
        wanted = [f"[r{rank} {h.address}] hello from rank {rank}"
                  for rank, h in enumerate(netns.hosts)]

        def logged() -> bool:
            logs = orch(netns, tmp_path, "logs", "-c", str(plain), ssh_config=config)
            assert logs.returncode == 0, logs.stderr
            return all(w in logs.stdout for w in wanted)
        wait_until(logged, 60, f"orch logs to show {wanted}", step=1)

        stop = orch(netns, tmp_path, "stop", "-c", str(inv), "--grace", "1")
        assert stop.returncode == 0, stop.stderr
        assert f"job '{name}' stopped on 2 hosts" in stop.stderr
        assert not any(job_pids(netns.hosts, name).values())
    finally:
        for pids in job_pids(netns.hosts, name).values():
            for pid in pids:
                os.kill(pid, 9)


def test_chain_of_bastions_and_their_host_keys(netns: NetnsCluster, tmp_path: Path) -> None:
    """`a,b`: b is only reachable through a; each bastion's key is checked like a host's."""
    second = netns.add_extra("bastion2", f"{HIDDEN}.12", forwarding=True)
    chain = [BASTION, f"root@{second.address}"]
    inv = inventory(netns, tmp_path / "cluster.yaml", "chain", proxy_jump=chain)
    ok = orch(netns, tmp_path, "stop", "-c", str(inv))
    assert ok.returncode == 0, ok.stderr
    assert "nothing was running" in ok.stderr

    lines = netns.known_hosts.read_text().splitlines()
    known = tmp_path / "known_hosts"   # everything but the second bastion's key
    known.write_text("".join(line + "\n" for line in lines if not line.startswith(second.address + " ")))
    strict = inventory(netns, tmp_path / "strict.yaml", "chain", proxy_jump=",".join(chain),
                       known_hosts=str(known))
    refused = orch(netns, tmp_path, "stop", "-c", str(strict))
    assert refused.returncode == 3, refused.stderr
    assert "Traceback" not in refused.stderr
    for h in netns.hosts:
        line = next((x for x in refused.stderr.splitlines() if h.address in x and "fix:" not in x),
                    refused.stderr)
        assert f"via bastion root@{second.address}" in line and "host key not trusted" in line
        assert "SHA256:" in line
    accept = inventory(netns, tmp_path / "accept.yaml", "chain", proxy_jump=chain,
                       known_hosts=str(known), host_key_policy="accept-new")
    recorded = orch(netns, tmp_path, "stop", "-c", str(accept))
    assert recorded.returncode == 0, recorded.stderr
    assert known.read_text().count(second.known_hosts_line()) == 1
