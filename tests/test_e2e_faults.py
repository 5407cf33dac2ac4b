"""Whatever the network does, orch prints one line per host with the cause and the fix
(exit 3), never a traceback nor paramiko's own messages; mistakes on this machine (key
file, known_hosts, ~/.ssh/config) are exit 2 with the file. Every case runs the CLI as a
user does, against a real socket: fault servers on 127.0.0.x (tests/fault_servers.py),
or the real sshd cluster.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import paramiko
import pytest
import yaml

import fault_servers as fs
from helpers import ORCH, orch
from sshd_cluster import SshdCluster, loopback

# Each case runs the CLI against SSH servers and waits out connect timeouts: not for
# `make test-fast`.
pytestmark = pytest.mark.ssh

TIMEOUT = 2          # connect_timeout in the inventories
BOUND_S = 20         # whole command, python start-up included, on a loaded 2-core machine

_octet = iter(range(60, 120))


def next_address() -> str:
    return loopback(next(_octet))   # 127.0.0.<k>; a pytest-xdist worker's own range


@pytest.fixture(scope="module")
def client_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = tmp_path_factory.mktemp("client") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


@pytest.fixture(scope="module")
def server_key(tmp_path_factory: pytest.TempPathFactory) -> paramiko.PKey:
    key = tmp_path_factory.mktemp("server") / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return paramiko.Ed25519Key.from_private_key_file(str(key))


@pytest.fixture
def servers() -> Iterator[Callable[..., fs.FaultServer]]:
    started: list[fs.FaultServer] = []

    def start(behaviour) -> fs.FaultServer:
        server = fs.FaultServer(next_address(), behaviour)
        started.append(server)
        return server
    yield start
    for server in started:
        server.stop()  # asserts its threads are gone


def write_inventory(path: Path, address: str, port: int, key: Path, known_hosts: Path,
                    **ssh) -> Path:
    doc = {"name": "faults",
           "ssh": {"user": "root", "identity_file": str(key), "known_hosts": str(known_hosts),
                   "connect_timeout": TIMEOUT, **ssh},
           "hosts": [{"address": address, "port": port, "remote_dir": str(path.parent / "r")}],
           "python": sys.executable,
           "job": {"entrypoint": "job.py"}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run(cwd: Path, *args: str, env: dict | None = None,
        prefix: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = orch(cwd, *args, env=env, command=[*prefix, *ORCH])
    return result, time.monotonic() - start


def assert_host_failed(result: subprocess.CompletedProcess, elapsed: float, address: str,
                       wanted: str) -> str:
    """exit 3, exactly one line naming the host (with `wanted`), its fix, nothing else."""
    err = result.stderr
    assert result.returncode == 3, err
    assert "Traceback" not in err and "Exception (client)" not in err, err
    assert "paramiko" not in err.lower(), err
    named = [line for line in err.splitlines() if address in line and "fix:" not in line]
    assert len(named) == 1, err
    assert wanted in named[0], err
    lines = err.splitlines()
    after = lines[lines.index(named[0]) + 1]
    assert after.strip().startswith("fix:"), err
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    return named[0]


# ---------------------------------------------------------------- the network misbehaves

CASES = {
    "silent": (lambda key: fs.silent, "no SSH banner came within 2 s"),
    "answer-after-timeout": (lambda key: fs.late_banner(TIMEOUT + 1.5), "no SSH banner came"),
    # a reset can reach the client as a reset or, under load, as a plain close
    "reset-after-connect": (lambda key: fs.reset_at_once, "before sshd sent its SSH banner"),
    "banner-then-stall": (lambda key: fs.banner_then_stall,
                          "the SSH key exchange did not finish within 2 s"),
    "auth-hangs": (fs.auth_stall, "authentication did not finish within 2 s"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fault_is_one_line_per_host(case: str, servers, client_key: Path,
                                    server_key: paramiko.PKey, tmp_path: Path) -> None:
    make, wanted = CASES[case]
    server = servers(make(server_key))
    known = tmp_path / "known_hosts"
    known.write_text(fs.known_hosts_line(server.address, server.port, server_key))
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, client_key, known)
    result, elapsed = run(tmp_path, "stop", "-c", str(inv))
    assert_host_failed(result, elapsed, server.address, wanted)
    assert server.accepted >= 1, "the case must have reached the server"
    if case == "answer-after-timeout":
        time.sleep(TIMEOUT)  # the late banner was sent to a client that had given up


def test_a_slow_key_exchange_gets_the_whole_connect_timeout(
        servers, client_key: Path, server_key: paramiko.PKey, tmp_path: Path) -> None:
    """paramiko ends a key exchange after its own 15 s with an EOFError: 200 logins at once
    on 2 cores were told "closed during the SSH key exchange" and tried again. The user's
    connect_timeout (17 s here) governs the key exchange too, and a timeout is said as one
    (not a close), without another try."""
    server = servers(fs.banner_then_stall)
    known = tmp_path / "known_hosts"
    known.write_text(fs.known_hosts_line(server.address, server.port, server_key))
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, client_key,
                          known, connect_timeout=17)
    result, elapsed = run(tmp_path, "stop", "-c", str(inv))
    assert result.returncode == 3, result.stderr
    assert "the SSH key exchange did not finish within 17 s" in result.stderr, result.stderr
    assert "closed" not in result.stderr, result.stderr
    assert server.accepted == 1, server.accepted
    assert 16.5 < elapsed < 60, elapsed


def test_key_refused_names_the_keys_tried(servers, client_key: Path, server_key: paramiko.PKey,
                                          tmp_path: Path) -> None:
    server = servers(fs.refuse_auth(server_key))
    known = tmp_path / "known_hosts"
    known.write_text(fs.known_hosts_line(server.address, server.port, server_key))
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, client_key, known)
    env = dict(os.environ)
    env.pop("SSH_AUTH_SOCK", None)
    result, elapsed = run(tmp_path, "stop", "-c", str(inv), env=env)
    pub = paramiko.Ed25519Key.from_private_key_file(str(client_key))
    line = assert_host_failed(result, elapsed, server.address, "authentication refused for user 'root'")
    assert f"tried {client_key} (SHA256:" in line and fs_fingerprint(pub) in line, line


def fs_fingerprint(key: paramiko.PKey) -> str:
    from orchestrator.ssh.sshtransport import fingerprint
    return fingerprint(key)


def test_connection_refused(client_key: Path, tmp_path: Path) -> None:
    address = next_address()
    port = fs.free_refused_port(address)
    inv = write_inventory(tmp_path / "cluster.yaml", address, port, client_key,
                          tmp_path / "known_hosts")
    result, elapsed = run(tmp_path, "stop", "-c", str(inv))
    assert_host_failed(result, elapsed, address, f"connection refused on port {port}")


def test_name_that_does_not_resolve(client_key: Path, tmp_path: Path) -> None:
    """`.invalid` never resolves; the command runs in a network namespace of its own with
    only a loopback interface, so not even the DNS query leaves this machine."""
    name = "no-such-host.invalid"
    inv = write_inventory(tmp_path / "cluster.yaml", name, 22, client_key, tmp_path / "known_hosts")
    prefix = ("unshare", "--net", "--")
    probe = subprocess.run(list(prefix) + ["true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr!r}")
    result, elapsed = run(tmp_path, "stop", "-c", str(inv), prefix=prefix)
    assert_host_failed(result, elapsed, name, f"cannot resolve the host name '{name}'")


# ---------------------------------------------------------------- real sshd

@pytest.mark.ssh
def test_paused_sshd_banner_timeout(sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    host = sshd_cluster.hosts[1]
    inv = write_inventory(tmp_path / "cluster.yaml", host.address, host.port,
                          sshd_cluster.client_key, sshd_cluster.known_hosts)
    host.pause()
    try:
        result, elapsed = run(tmp_path, "stop", "-c", str(inv))
    finally:
        host.resume()
    assert_host_failed(result, elapsed, host.address, "no SSH banner came within 2 s")


@pytest.mark.ssh
def test_reset_during_a_command(sshd_cluster: SshdCluster, servers, tmp_path: Path) -> None:
    """The proxy lets the login through, then resets while the command's input is sent
    (the agent script is ~28 kB; a login sends about 3 kB)."""
    host = sshd_cluster.hosts[2]
    proxy = servers(fs.reset_proxy((host.address, host.port), after_bytes=10_000))
    known = tmp_path / "known_hosts"
    known.write_text(f"[{proxy.address}]:{proxy.port} {host.host_key_pub}\n")
    inv = write_inventory(tmp_path / "cluster.yaml", proxy.address, proxy.port,
                          sshd_cluster.client_key, known)
    result, elapsed = run(tmp_path, "stop", "-c", str(inv))
    assert_host_failed(result, elapsed, proxy.address, "the connection was lost during the command")


def assert_tried_again(fault, sshd_cluster: SshdCluster, servers, tmp_path: Path) -> None:
    """The first two connections to a real sshd host meet `fault`; the third is relayed:
    `orch stop` works, after exactly three connections, within the bound."""
    host = sshd_cluster.hosts[2]
    proxy = servers(fault(2, (host.address, host.port)))
    known = tmp_path / "known_hosts"
    known.write_text(f"[{proxy.address}]:{proxy.port} {host.host_key_pub}\n")
    inv = write_inventory(tmp_path / "cluster.yaml", proxy.address, proxy.port,
                          sshd_cluster.client_key, known, connect_timeout=10)
    result, elapsed = run(tmp_path, "stop", "-c", str(inv))
    assert result.returncode == 0, result.stderr
    assert proxy.accepted == 3, proxy.accepted
    assert elapsed < BOUND_S, elapsed


@pytest.mark.ssh
def test_connections_dropped_before_the_banner_are_tried_again(
        sshd_cluster: SshdCluster, servers, tmp_path: Path) -> None:
    """sshd's MaxStartups resets a connection past its limit before the banner: orch
    connects again after a short random back-off (in waves), within the connect timeout,
    and the command works; a host that drops every try still fails with one line."""
    assert_tried_again(fs.drop_first, sshd_cluster, servers, tmp_path)


@pytest.mark.ssh
def test_connections_closed_during_the_key_exchange_are_tried_again(
        sshd_cluster: SshdCluster, servers, tmp_path: Path) -> None:
    """A loaded sshd closed a connection after its banner, during the key exchange: no
    login happened, so orch connects again (as for a drop before the banner) and the
    command works."""
    assert_tried_again(fs.close_in_kex_first, sshd_cluster, servers, tmp_path)


def test_orch_debug_shows_paramiko(servers, client_key: Path, tmp_path: Path) -> None:
    """ORCH_DEBUG=1 is the way to see paramiko's own log (it is silent otherwise)."""
    server = servers(fs.banner_then_stall)
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, client_key,
                          tmp_path / "known_hosts")
    result, _ = run(tmp_path, "stop", "-c", str(inv), env=dict(os.environ, ORCH_DEBUG="1"))
    assert result.returncode == 3 and "paramiko" in result.stderr, result.stderr


# ---------------------------------------------------------------- mistakes on this machine

def line_of(path: Path, key: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1)
                if line.strip().startswith(key + ":"))


def assert_local_mistake(result: subprocess.CompletedProcess, *wanted: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for text in wanted:
        assert text in result.stderr, result.stderr
    assert "fix:" in result.stderr


def test_missing_identity_file_is_exit_2_before_connecting(servers, tmp_path: Path) -> None:
    server = servers(fs.silent)
    missing = tmp_path / "no_such_key"
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, missing,
                          tmp_path / "known_hosts")
    result, _ = run(tmp_path, "stop", "-c", str(inv))
    assert_local_mistake(result, f"{inv}:{line_of(inv, 'identity_file')}: ", str(missing),
                         "no such file")
    assert server.accepted == 0, "the key is checked before any host is contacted"


def test_unreadable_identity_file(servers, tmp_path: Path) -> None:
    server = servers(fs.silent)
    unreadable = tmp_path / "keydir"   # root reads any file: a folder cannot be read as one
    unreadable.mkdir()
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, unreadable,
                          tmp_path / "known_hosts")
    result, _ = run(tmp_path, "stop", "-c", str(inv))
    assert_local_mistake(result, f"{inv}:{line_of(inv, 'identity_file')}: ", "cannot be read")
    assert server.accepted == 0


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only file system (as root, file modes alone do not stop writes)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {mounted.stderr!r}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_accept_new_with_unwritable_known_hosts(servers, client_key: Path, server_key,
                                                read_only_dir: Path, tmp_path: Path) -> None:
    server = servers(fs.refuse_auth(server_key))
    known = read_only_dir / "known_hosts"
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, client_key,
                          known, host_key_policy="accept-new")
    result, _ = run(tmp_path, "stop", "-c", str(inv))
    assert_local_mistake(result, str(known), "cannot record the new host key")
    assert "authentication" not in result.stderr, "the unrecorded key must not be used"


@pytest.mark.parametrize("content,wanted", [
    ("Host node*\n  User root\n  Port\n", ":3: the SSH config cannot be used"),
    (None, "cannot read the SSH config"),
])
def test_bad_ssh_config_is_exit_2(content: str | None, wanted: str, servers,
                                  client_key: Path, tmp_path: Path) -> None:
    server = servers(fs.silent)
    config = tmp_path / "ssh_config"
    if content is None:
        config.mkdir()   # exists, cannot be read as a file
    else:
        config.write_text(content)
    inv = write_inventory(tmp_path / "cluster.yaml", server.address, server.port, client_key,
                          tmp_path / "known_hosts")
    result, _ = run(tmp_path, "stop", "-c", str(inv), env=dict(os.environ, ORCH_SSH_CONFIG=str(config)))
    assert_local_mistake(result, str(config), wanted)
    assert server.accepted == 0
