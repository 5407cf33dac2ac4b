"""`orch forward`: local ports relayed to ports on a job's host over orch's SSH connection
(a direct-tcpip channel per local connection, as `ssh -L` opens; bastions included, no
new login). One listener per forward on 127.0.0.1 only; each accepted connection gets
its own channel and two pump threads. A port nobody listens on is told on the first
connection (the local one is closed at once), never a hang."""
from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.inventory import Host
from orchestrator.errors import HostError, UsageError
from orchestrator.remote.transport import Stream, Transport, TunnelRefused
from orchestrator.wire import timeouts

PUMP = 64 << 10        # bytes per read: what one SSH packet window moves well
Report = Callable[[str, str], None]   # (what happened, its fix): said, never raised


@dataclass(frozen=True)
class Spec:
    """REMOTE_PORT[:LOCAL_PORT] as written; local 0: a free port chosen here."""

    remote: int
    local: int

    @staticmethod
    def parse(text: str) -> Spec:
        parts = text.split(":")
        if len(parts) > 2 or not all(p.isdigit() and len(p) <= 5 for p in parts):
            raise UsageError(f"{text!r} is not REMOTE_PORT[:LOCAL_PORT]",
                             hint="orch forward 6006 (or 6006:16006, or 6006:0 for any free "
                                  "local port)")
        remote, local = int(parts[0]), int(parts[-1])
        if not 0 < remote < 65536 or not 0 <= local < 65536:
            raise UsageError(f"{text!r}: a port is 1 to 65535 (a local port of 0: any free one)",
                             hint="orch forward 6006")
        return Spec(remote, local)


class Forward:
    """One listener on 127.0.0.1:local relaying each connection to `remote` on the host."""

    def __init__(self, host: Host, transport: Transport, spec: Spec, report: Report) -> None:
        self.host, self.transport, self.spec, self.report = host, transport, spec, report
        self.listener = listen(spec.local)
        self.local = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.open_streams: set[Stream] = set()
        self.thread = threading.Thread(target=self.accept, daemon=True,
                                       name=f"forward-{self.local}")

    def start(self) -> Forward:
        self.thread.start()
        return self

    def accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return   # the listener was closed: the forward ends
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        """One local connection: its channel, then bytes both ways until either closes."""
        try:
            chan = self.transport.tunnel(self.spec.remote, timeouts.OPEN_SESSION)
        except TunnelRefused as e:
            conn.close()
            self.report(*refused(self.host, self.spec.remote, str(e)))
            return
        except (HostError, OSError, EOFError) as e:
            conn.close()
            self.report(f"{self.host.label}: cannot open a channel to port {self.spec.remote}: {e}",
                        "check the host's connection (`orch status`), then connect again")
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.relay(conn, chan)

    def relay(self, conn: socket.socket, chan: Stream) -> None:
        with self.lock:
            self.open_streams |= {conn, chan}
        back = threading.Thread(target=pump, args=(chan, conn), daemon=True)
        back.start()
        pump(conn, chan)
        back.join()
        for s in (conn, chan):
            with contextlib.suppress(OSError, EOFError):
                s.close()
        with self.lock:
            self.open_streams -= {conn, chan}

    def close(self) -> None:
        """No new connections; the open ones are closed (their pumps end)."""
        self.closed.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            streams = list(self.open_streams)
        for s in streams:
            with contextlib.suppress(OSError, EOFError):
                s.close()
        self.thread.join(5)


def pump(src: Stream, dst: Stream) -> None:
    """src's bytes into dst until src ends (or either fails); then dst's write side is
    shut, so the other direction sees the end too (half-close, as ssh -L does)."""
    try:
        while True:
            data = src.recv(PUMP)
            if not data:
                break
            dst.sendall(data)
    except (OSError, EOFError):
        pass
    with contextlib.suppress(OSError, EOFError):
        dst.shutdown(socket.SHUT_WR)


def listen(port: int) -> socket.socket:
    """A listener on 127.0.0.1 only (a forwarded port is this user's, never the LAN's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise UsageError(f"local port {port} cannot be used: {e.strerror}",
                         hint=f"name another local port: orch forward REMOTE:{port + 10000 if port < 55535 else 0}"
                              " (or :0 for any free one)") from None
    sock.listen(64)
    return sock


def refused(host: Host, port: int, why: str) -> tuple[str, str]:
    """The first connection's error, and what to do."""
    if "prohibit" in why.lower():
        return (f"{host.label}: sshd refuses to forward ports ({why})",
                "set `AllowTcpForwarding yes` in the host's sshd_config")
    return (f"{host.label}: nothing listens on port {port} there ({why})",
            f"start the server on the host first, listening on localhost:{port}")


def open_forwards(host: Host, base_dir: Path, specs: list[Spec], report: Report
                  ) -> tuple[Transport, list[Forward]]:
    """The host's SSH connection (its bastions too), then a started Forward per spec.
    Every local port is bound before any forward starts: a port in use is refused with
    nothing left open."""
    from orchestrator.ssh import connect, sshconfig  # paramiko only for a command that connects
    connect.check_local_files((host,))
    transport = connect.connect(host, sshconfig.ssh_config(), base_dir)
    made: list[Forward] = []
    try:
        for spec in specs:
            made.append(Forward(host, transport, spec, report))
    except BaseException:
        for f in made:
            f.close()
        transport.close()
        raise
    return transport, [f.start() for f in made]
