"""proxy_jump in the inventory, ProxyJump in ~/.ssh/config, and how a host's target and
its bastions are resolved (no host is contacted)."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import paramiko
import pytest

from orchestrator.config import inventory
from orchestrator.config.proxyjump import Jump, parse_chain, parse_jump
from orchestrator.errors import InventoryError, UsageError
from orchestrator.ssh.sshconfig import resolve_target


def cluster(tmp_path: Path, ssh: str = "", host: str = "") -> inventory.Cluster:
    text = textwrap.dedent("""\
        name: j
        ssh:
          user: me
          identity_file: keys/id
        {ssh}
        hosts:
          - address: 10.0.0.8
        {host}
          - address: 10.0.0.9
        job:
          entrypoint: train.py
        """).format(ssh=textwrap.indent(ssh, "  "), host=textwrap.indent(host, "    "))
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return inventory.load(path)


@pytest.mark.parametrize("text,jump", [
    ("gate", Jump(None, "gate", None)),
    ("ops@gate.example.org:2222", Jump("ops", "gate.example.org", 2222)),
    ("10.0.0.1", Jump(None, "10.0.0.1", None)),
    ("ops@[fd00::1]:22", Jump("ops", "fd00::1", 22)),
    ("ssh://ops@gate:22", Jump("ops", "gate", 22)),
])
def test_parse_jump(text: str, jump: Jump) -> None:
    assert parse_jump(text) == jump


@pytest.mark.parametrize("text", ["", "a b", "@gate", "gate:0", "gate:99999", "-oProxyCommand=x",
                                  "a@b@c", "gate:port"])
def test_parse_jump_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_jump(text)


def test_chain_and_none() -> None:
    assert parse_chain("a, b@c:2") == (Jump(None, "a", None), Jump("b", "c", 2))
    assert parse_chain("none") == () and parse_chain(["x"]) == (Jump(None, "x", None),)


def test_inventory_proxy_jump_forms(tmp_path: Path) -> None:
    c = cluster(tmp_path, ssh="proxy_jump: ops@gate:2222, inner\n",
                host="proxy_jump: [a@b, c]\n")
    assert c.hosts[0].ssh.proxy_jump == ("a@b", "c")
    assert c.hosts[1].ssh.proxy_jump == ("ops@gate:2222", "inner")
    c = cluster(tmp_path, host="proxy_jump: none\n")
    assert c.hosts[0].ssh.proxy_jump == () and c.hosts[1].ssh.proxy_jump is None


def test_inventory_proxy_jump_refused_with_line(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as err:
        cluster(tmp_path, host="proxy_jump: 'ops@gate:70000'\n")
    assert err.value.line == 8 and "port 70000" in err.value.message
    assert "proxy_jump: user@bastion:22" in err.value.hint


def test_identity_file_line_is_kept(tmp_path: Path) -> None:
    c = cluster(tmp_path, host="identity_file: other\n")
    assert c.hosts[0].ssh.identity_file_at == (str(tmp_path / "cluster.yaml"), 8)
    assert c.hosts[1].ssh.identity_file_at == (str(tmp_path / "cluster.yaml"), 4)


def config(text: str) -> paramiko.SSHConfig:
    return paramiko.SSHConfig.from_file(io.StringIO(textwrap.dedent(text)))


def test_proxyjump_from_ssh_config_and_bastion_alias(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    cfg = config("""\
        Host gate
          HostName gate.example.org
          Port 2200
          User ops
        Host 10.0.0.*
          ProxyJump gate,root@inner:23
        """)
    target = resolve_target(c.hosts[0], cfg)
    gate, inner = target.jumps
    assert (gate.hostname, gate.port, gate.user, gate.name) == (
        "gate.example.org", 2200, "ops", "gate")
    assert (inner.hostname, inner.port, inner.user) == ("inner", 23, "root")
    # the bastions are checked like the host: same known_hosts, policy and timeout
    assert {j.known_hosts for j in target.jumps} == {target.known_hosts}
    assert {j.policy for j in target.jumps} == {target.policy}
    assert gate.identity_files == target.identity_files == (str(tmp_path / "keys/id"),)


def test_inventory_proxy_jump_wins_over_ssh_config(tmp_path: Path) -> None:
    c = cluster(tmp_path, host="proxy_jump: none\n")
    cfg = config("Host 10.0.0.*\n  ProxyJump gate\n")
    assert resolve_target(c.hosts[0], cfg).jumps == ()
    assert [j.hostname for j in resolve_target(c.hosts[1], cfg).jumps] == ["gate"]


def test_bad_proxyjump_in_ssh_config_is_usage_error(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    with pytest.raises(UsageError, match="ProxyJump"):
        resolve_target(c.hosts[0], config("Host *\n  ProxyJump a b\n"))


def test_known_hosts_parsed_once_and_again_when_changed(tmp_path: Path) -> None:
    """Every host of a command shares one parse of known_hosts (parsing it per host was
    O(hosts x lines)); a changed file (accept-new, an edit) is parsed again."""
    from orchestrator.ssh.connect import known_host_keys
    path = tmp_path / "known_hosts"
    lines = [f"[10.0.0.{i}]:22 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{'A' * 42}{i % 10}\n"
             for i in range(3)]
    path.write_text("".join(lines[:2]))
    first = known_host_keys(str(path))
    assert known_host_keys(str(path)) is first
    assert len(first.keys()) == 2
    path.write_text("".join(lines))
    again = known_host_keys(str(path))
    assert again is not first and len(again.keys()) == 3


def test_invoke_is_imported_only_for_a_config_that_may_run_commands(tmp_path: Path) -> None:
    """paramiko imports invoke (asyncio, unittest.mock: 30-50 ms) only to run `Match
    exec`; orch holds it back at start and gives it back for a config that has one. One
    new process reads the plain config, then the one with `Match exec`."""
    probe = ("import os, sys, orchestrator.cli\nfrom orchestrator.ssh import sshconfig\n"
             "for path in sys.argv[1:]:\n"
             "    os.environ['ORCH_SSH_CONFIG'] = path\n"
             "    got = sshconfig.ssh_config().lookup('h')\n"
             "    print(got.get('user'), 'invoke' in sys.modules and sys.modules['invoke'] is not None)\n")
    plain, matching = tmp_path / "plain", tmp_path / "matching"
    plain.write_text("Host h\n  User plainuser\n")
    matching.write_text('Match exec "true"\n  User matched\n')
    out = subprocess.run([sys.executable, "-c", probe, str(plain), str(matching)],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["plainuser False", "matched True"], out.stdout + out.stderr


def test_the_open_file_limit_is_raised_to_the_hard_one_or_refused_before_connecting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand hosts under a login session's soft limit of 1,024: the soft limit is
    raised to the hard one; a hard limit below what the hosts need is one message (exit 2)
    before any connection, with the fix."""
    import resource

    from orchestrator.ssh import connect

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda what: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda what, pair: limits.update(now=pair))
    connect.check_fd_limit(1000)
    assert limits["now"] == (4096, 4096)
    limits["now"] = (512, 512)
    with pytest.raises(UsageError) as err:
        connect.check_fd_limit(1000)
    assert err.value.exit_code == 2
    assert "1000 hosts need about 1064 open files, and this session allows 512" in err.value.message
    assert "ulimit -n 2128" in err.value.hint
    connect.check_fd_limit(400)   # fits under 512: nothing to say
