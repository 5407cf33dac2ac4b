"""`orch forward` over real SSH: local ports relayed to a port on a job's host (a
direct-tcpip channel per connection, on orch's one connection), several at once and
several connections each; a port nobody listens on is said on the first connection, not
a hang; sshd that forbids forwarding is named with its fix; the command ends on Ctrl-C
with exit 130 and leaves nothing listening."""
from __future__ import annotations

import contextlib
import errno
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Jobs, orch, wait_until, write_job
from orchestrator import api
from orchestrator.errors import UsageError
from sshd_cluster import SshdCluster, free_port, loopback, pid_alive

pytestmark = pytest.mark.ssh

FIRST_OCTET = 120


class Echo:
    """A TCP server on 127.0.0.1 (the fake hosts' shared loopback) that echoes, upper-cased
    so an echo cannot be mistaken for the bytes sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    @staticmethod
    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data.upper())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def fwd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """2 sshd hosts that allow TCP forwarding (the session's cluster does not)."""
    root = tmp_path_factory.mktemp("sshd-fwd")
    port = free_port([loopback(FIRST_OCTET + i) for i in range(2)])
    cluster = SshdCluster(root, 2, port=port, first_octet=FIRST_OCTET,
                          sshd_options={"AllowTcpForwarding": "yes"}).start()
    try:
        yield cluster
    finally:
        pids = [h.pid for h in cluster.all_hosts()]
        cluster.stop()
    assert not [p for p in pids if pid_alive(p)], "an sshd survived"


@pytest.fixture
def echo() -> Iterator[Echo]:
    server = Echo()
    yield server
    server.close()


def talk(port: int, data: bytes) -> bytes:
    """Send data to 127.0.0.1:port, half-close, read the answer to its end. A connection
    closed by the other end before our half-close (a forward to a port nobody listens
    on, closed at once: the shutdown then finds it gone, ENOTCONN) answered nothing."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return b""
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise
            return b""
        out = bytearray()
        with contextlib.suppress(ConnectionResetError):   # closed with our bytes unread
            while block := s.recv(65536):
                out += block
        return bytes(out)


def inventory(cluster: SshdCluster, tmp: Path) -> Path:
    write_job(tmp, "print('hi')\n")
    return cluster.write_inventory(tmp / "cluster.yaml", name="fwd", procs=[2, 1])


def test_forwards_carry_bytes_both_ways_several_at_once(
        fwd_cluster: SshdCluster, echo: Echo, tmp_path: Path) -> None:
    inv = inventory(fwd_cluster, tmp_path)
    said: list[tuple[str, str]] = []
    dead = free_port(["127.0.0.1"])
    with api.forward(inv, [f"{echo.port}:0", f"{dead}:0"], rank=2,
                     report=lambda m, f: said.append((m, f))) as fwd:
        assert fwd.result.host == fwd_cluster.hosts[1].address      # rank 2's host
        live, refused = fwd.result.forwards
        assert live.remote_port == echo.port and live.local_port not in (0, echo.port)
        big = bytes(range(256)) * 8192                                # 2 MiB
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda: results.append(talk(live.local_port, big)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [big.upper()] * 4
        t0 = time.monotonic()
        assert talk(refused.local_port, b"anyone?") == b""          # closed at once
        assert time.monotonic() - t0 < 10
        wait_until(lambda: said, 5, "the refused connection to be said")
        message, fix = said[0]
        assert f"nothing listens on port {dead} there" in message and "start the server" in fix
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", live.local_port), timeout=2)


def test_bad_ports_and_selections_are_refused_before_connecting(
        fwd_cluster: SshdCluster, tmp_path: Path) -> None:
    inv = inventory(fwd_cluster, tmp_path)
    for ports, kw, words in ((["70000"], {}, "a port is 1 to 65535"),
                             (["80:90:100"], {}, "is not REMOTE_PORT[:LOCAL_PORT]"),
                             (["80"], {"rank": 7}, "rank 7 does not exist"),
                             (["80"], {"host": "0,1"}, "selects 2 hosts")):
        with pytest.raises(UsageError) as err:
            api.forward(inv, ports, **kw)
        assert words in err.value.message, err.value.message
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    with taken, pytest.raises(UsageError) as err:
        api.forward(inv, [f"80:{taken.getsockname()[1]}"])
    assert "cannot be used" in err.value.message and "name another local port" in err.value.hint


def test_sshd_that_forbids_forwarding_is_named_with_its_fix(
        sshd_cluster: SshdCluster, echo: Echo, tmp_path: Path) -> None:
    write_job(tmp_path, "print('hi')\n")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:1],
                                       name="fwd-no")
    said: list[tuple[str, str]] = []
    with api.forward(inv, [f"{echo.port}:0"], report=lambda m, f: said.append((m, f))) as fwd:
        assert talk(fwd.result.forwards[0].local_port, b"x") == b""
        wait_until(lambda: said, 5, "the refusal to be said")
    assert "sshd refuses to forward ports" in said[0][0]
    assert "AllowTcpForwarding yes" in said[0][1]


def test_the_command_prints_its_ports_and_ends_on_ctrl_c(
        fwd_cluster: SshdCluster, echo: Echo, tmp_path: Path, jobs: Jobs) -> None:
    inv = inventory(fwd_cluster, tmp_path)
    run = jobs.start(tmp_path, "forward", "-c", str(inv), "--json", f"{echo.port}:0")
    run.wait_for(r"^}$", timeout=60)
    doc = json.loads("\n".join(run.out))
    port = doc["forwards"][0]["local_port"]
    assert doc["host"] == fwd_cluster.hosts[0].address and doc["version"] == 1
    assert talk(port, b"hello") == b"HELLO"
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(30)
    assert code == 130, run.text()
    assert "Traceback" not in run.text()
    assert any("forwarding http://127.0.0.1:" in ln for ln in run.err), run.text()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    assert orch(tmp_path, "forward", "-c", str(inv), "--host", "9", "80").returncode == 2
