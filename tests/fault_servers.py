"""Misbehaving "hosts" on loopback addresses, for the connection-fault tests.

Each `FaultServer` is a real TCP listener on 127.0.0.<k> (port chosen by the kernel)
served by threads of the test process: it accepts and says nothing, answers too late,
resets the connection, sends an SSH banner and stalls, or (with paramiko's server side)
completes the key exchange and stalls at authentication. `ResetProxy` relays to a real
sshd and resets the connection once the client has sent a given number of bytes.
"""
from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Callable

import paramiko
from paramiko.common import AUTH_FAILED  # not re-exported by the stubs

BANNER = b"SSH-2.0-OpenSSH_9.6 fault-test\r\n"


def reset(conn: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST, not a FIN."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class FaultServer:
    """A listener whose `behaviour(conn, stop_event)` runs in a thread per connection."""

    def __init__(self, address: str, behaviour: Callable[[socket.socket, threading.Event], None]):
        self.address = address
        self.behaviour = behaviour
        self.stopping = threading.Event()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((address, 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.threads: list[threading.Thread] = []
        self.conns: list[socket.socket] = []
        self.accepted = 0
        self._accept = threading.Thread(target=self._loop, daemon=True)
        self._accept.start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            th = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(th)
            th.start()

    def _serve(self, conn: socket.socket) -> None:
        # the client leaving mid-handshake (orch refusing an unknown host key) is a test's
        # expected end, not the server's error: paramiko raises EOFError then
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            self.behaviour(conn, self.stopping)

    def stop(self) -> None:
        self.stopping.set()
        # close() alone does not wake a thread blocked in accept(); shutdown() does (EINVAL)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        threads = [self._accept, *self.threads]
        for th in threads:
            th.join(10)
        assert not any(th.is_alive() for th in threads), "a fault-server thread is stuck"


# ---------------------------------------------------------------- behaviours

def silent(conn: socket.socket, stop: threading.Event) -> None:
    """Accepts TCP, never says anything (a hung sshd, or a port that is not sshd's)."""
    stop.wait()


def late_banner(delay: float) -> Callable[[socket.socket, threading.Event], None]:
    def behaviour(conn: socket.socket, stop: threading.Event) -> None:
        if not stop.wait(delay):
            conn.sendall(BANNER)
            stop.wait()
    return behaviour


def reset_at_once(conn: socket.socket, stop: threading.Event) -> None:
    reset(conn)


def _chunks(conn: socket.socket, *stops: threading.Event) -> Iterator[bytes]:
    """What conn receives, chunk by chunk, until the peer closes, a socket error, or one of
    `stops` is set (polled every 0.2 s: a blocked recv() would not notice it)."""
    conn.settimeout(0.2)
    while not any(e.is_set() for e in stops):
        try:
            data = conn.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return
        if not data:
            return
        yield data


def banner_then_stall(conn: socket.socket, stop: threading.Event) -> None:
    """Sends an SSH banner, reads what the client sends, never answers the key exchange."""
    conn.sendall(BANNER)
    for _ in _chunks(conn, stop):
        pass


class _StallAuth(paramiko.ServerInterface):
    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        self.stop.wait()  # the login never completes
        return AUTH_FAILED


class _RefuseAuth(_StallAuth):
    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return AUTH_FAILED


def _ssh_server(host_key: paramiko.PKey, interface: type[_StallAuth]
                ) -> Callable[[socket.socket, threading.Event], None]:
    """A real SSH server (paramiko's) whose logins `interface` answers, until stop."""
    def behaviour(conn: socket.socket, stop: threading.Event) -> None:
        t = paramiko.Transport(conn)
        t.add_server_key(host_key)
        try:
            t.start_server(server=interface(stop))
            stop.wait()
        finally:
            t.close()
    return behaviour


def auth_stall(host_key: paramiko.PKey) -> Callable[[socket.socket, threading.Event], None]:
    """A real SSH server (paramiko's) whose authentication never answers."""
    return _ssh_server(host_key, _StallAuth)


def refuse_auth(host_key: paramiko.PKey) -> Callable[[socket.socket, threading.Event], None]:
    """A real SSH server (paramiko's) that refuses every key."""
    return _ssh_server(host_key, _RefuseAuth)


def reset_proxy(upstream: tuple[str, int], after_bytes: int
                ) -> Callable[[socket.socket, threading.Event], None]:
    """Relays to a real sshd; resets both sides once the client sent `after_bytes`
    (past the login, while a command's input is being sent)."""
    def behaviour(conn: socket.socket, stop: threading.Event) -> None:
        up = socket.create_connection(upstream, timeout=5)
        sent = [0]
        done = threading.Event()

        def pump(src: socket.socket, dst: socket.socket, count: bool) -> None:
            for data in _chunks(src, stop, done):
                if count:
                    sent[0] += len(data)
                    if sent[0] > after_bytes:
                        break
                try:
                    dst.sendall(data)
                except OSError:
                    break
            done.set()
        back = threading.Thread(target=pump, args=(up, conn, False), daemon=True)
        back.start()
        pump(conn, up, True)
        back.join(5)
        reset(conn)
        reset(up)
    return behaviour


Behaviour = Callable[[socket.socket, threading.Event], None]


def _first_then_relay(count: int, upstream: tuple[str, int], first: Behaviour) -> Behaviour:
    """The first `count` connections get `first`; the later ones are relayed to a real sshd."""
    seen = [0]
    lock = threading.Lock()
    relay = reset_proxy(upstream, after_bytes=1 << 40)

    def behaviour(conn: socket.socket, stop: threading.Event) -> None:
        with lock:
            seen[0] += 1
            early = seen[0] <= count
        (first if early else relay)(conn, stop)
    return behaviour


def drop_first(count: int, upstream: tuple[str, int]) -> Behaviour:
    """sshd's MaxStartups as a client sees it: the first `count` connections are reset
    before any banner; the later ones are relayed to a real sshd."""
    return _first_then_relay(count, upstream, lambda conn, stop: reset(conn))


def _close_in_kex(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(BANNER)
    got = b""
    for chunk in _chunks(conn, stop):   # the client's banner, then its KEXINIT
        got += chunk
        if b"\n" in got and len(got.split(b"\n", 1)[1]) > 0:
            break
    conn.close()


def close_in_kex_first(count: int, upstream: tuple[str, int]) -> Behaviour:
    """A loaded sshd as a client saw it: the first `count` connections get the SSH banner,
    then are closed once the client's key exchange arrives; later ones are relayed."""
    return _first_then_relay(count, upstream, _close_in_kex)


def free_refused_port(address: str) -> int:
    """A port on address where nothing listens (bound once by us, then released)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def known_hosts_line(address: str, port: int, key: paramiko.PKey) -> str:
    return f"[{address}]:{port} {key.get_name()} {key.get_base64()}\n"
