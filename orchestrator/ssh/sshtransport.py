"""The SSH side of the transport seam (transport.py): a paramiko channel as a `Channel`,
and the host-key policies (strict, accept-new) with their fingerprints.

Kept apart from transport.py so that paramiko (0.1 s of every `orch` start) is imported
only by commands that open an SSH connection (connect.py), not by `--help`, a broken
inventory or `split-data`."""
from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import paramiko
from paramiko.packet import Packetizer

from orchestrator.config.inventory import Host
from orchestrator.errors import EXIT_HOST, HostError, OrchError, UsageError
from orchestrator.remote.transport import (
    CHUNK,
    STDERR_KEEP,
    Channel,
    Result,
    Stream,
    Transport,
    TunnelRefused,
    remote_command,
)
from orchestrator.wire import timeouts

# bytes one recv may take for the packets after the one asked for: most packets the
# hosts send are small (a frame, a window adjust), and a bigger one is read at its size
# (each recv allocates what it may take, then shrinks to what came: kept small)
READ_AHEAD = 4 << 10


class ReadAhead:
    """The connection's socket as a packetizer reads it: one recv takes what the kernel
    holds (up to READ_AHEAD) and the next reads are served from it. paramiko reads each
    packet in two exact-size recvs (its first block, then the rest), each a poll and a
    recv with the GIL let go and taken again: at 1,000 hosts, hundreds of thousands of
    system calls and thread switches for packets that had arrived together. A send is
    one write where it can be (send); everything else (close, timeouts) is the socket's
    (or a bastion channel's) own."""

    def __init__(self, sock: Any) -> None:
        self.sock, self.buf, self.pos = sock, b"", 0
        self.is_socket = isinstance(sock, socket.socket)   # not a bastion's channel

    def recv(self, n: int) -> bytes:
        if self.pos >= len(self.buf):
            got: bytes = self.sock.recv(max(n, READ_AHEAD))
            if len(got) <= n:
                return got   # (b"" at the end: paramiko's EOFError)
            self.buf, self.pos = got, 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def send(self, data: bytes) -> int:
        # A socket with a timeout (ours always have one) polls before each send: the GIL
        # let go and taken again twice. Its descriptor is non-blocking, so a write either
        # goes at once or says the buffer is full, with the GIL let go once; only then
        # does the socket's own send wait. (fileno is -1 once the socket is closed.)
        fd = self.sock.fileno() if self.is_socket else -1
        if fd >= 0 and self.sock.gettimeout() is not None:
            try:
                return os.write(fd, data)
            except BlockingIOError:
                pass
        return int(self.sock.send(data))

    def close(self) -> None:
        self.sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class QuietPacketizer(Packetizer):
    """paramiko's packetizer, with two wake-ups per connection less.

    The key exchange's timeout is a deadline, read where paramiko reads its timer's flag
    (each read of the socket, which wakes at least once a second while connecting),
    instead of a threading.Timer: a thread per connection, 1,000 threads started and
    woken at 1,000 hosts only to set a flag.

    No keepalive goes out while the host talks: paramiko sends one when nothing went out
    for a period, but a packet that came in within it says as much for what the
    keepalive is for (a NAT's idle timer sees traffic either way, and a host that
    answers is there). A followed job's hosts beat every few seconds: at 1,000 hosts,
    100 keepalives a second were sent for nothing."""

    _deadline: float | None = None
    _done = False
    _period = 0.0
    _heard = 0.0

    def __init__(self, socket: Any) -> None:
        super().__init__(ReadAhead(socket))  # type: ignore[arg-type]  # the calls it makes

    def start_handshake(self, timeout: float) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + float(timeout)

    def handshake_timed_out(self) -> bool:
        return self._deadline is not None and not self._done \
            and time.monotonic() >= self._deadline

    def complete_handshake(self) -> None:
        if self._deadline is not None:
            self._done = True

    def set_keepalive(self, interval: float, callback: Callable[[], object]) -> None:
        self._period = interval
        super().set_keepalive(interval, callback)

    def read_message(self) -> tuple[int, paramiko.Message]:
        got = super().read_message()
        self._heard = time.monotonic()
        return got

    def _check_keepalive(self) -> None:
        if self._period and time.monotonic() < self._heard + self._period:
            return
        super()._check_keepalive()  # type: ignore[misc]  # (not in its stubs)


class SSHChannel(Channel):
    def __init__(self, chan: paramiko.Channel, timeout: float | None) -> None:
        self.chan = chan
        chan.settimeout(timeout)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        # memoryview slices: sendall of bytes would re-slice (copy) on every packet
        for i in range(0, len(view), CHUNK):
            self.chan.sendall(view[i:i + CHUNK])  # type: ignore[arg-type]  # stubs say bytes; any buffer works

    def close_stdin(self) -> None:
        self.chan.shutdown_write()

    def room(self, n: int) -> bool:
        # SSH's window: what the host has said it will take; past it a write waits
        return not self.chan.closed and self.chan.out_window_size >= n

    def settimeout(self, timeout: float | None) -> None:
        self.chan.settimeout(timeout)

    def read(self, n: int = CHUNK) -> bytes:
        try:
            return self.chan.recv(n)
        except socket.timeout as e:
            raise TimeoutError("no answer") from e

    def finish(self) -> Result:
        out = bytearray()
        for block in iter(lambda: self.read(), b""):
            out += block
        code = self.chan.recv_exit_status()
        err = bytearray()
        # stderr arrives before the exit status on the channel, so it is all buffered now
        while self.chan.recv_stderr_ready():
            err += self.chan.recv_stderr(CHUNK)
        return Result(code, bytes(out), bytes(err))

    def ready(self) -> bool:
        return self.chan.recv_ready()

    def stderr_tail(self) -> bytes:
        err = bytearray()
        while self.chan.recv_stderr_ready() and len(err) < 4 * STDERR_KEEP:
            err += self.chan.recv_stderr(CHUNK)
        return bytes(err[-STDERR_KEEP:])

    def exit_code(self) -> int | None:
        return self.chan.recv_exit_status() if self.chan.exit_status_ready() else None

    def wait_exit(self, timeout: float) -> int | None:
        # paramiko sets status_event when the exit status arrives or the channel closes
        self.chan.status_event.wait(timeout)
        return self.exit_code()

    def close(self) -> None:
        self.chan.close()


class SSHTransport(Transport):
    def __init__(self, host: Host, client: paramiko.SSHClient) -> None:
        super().__init__(host)
        self.client = client

    def open(self, argv: list[str], timeout: float | None = None) -> Channel:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise HostError(f"{self.host.label}: the SSH connection was lost")
        chan = transport.open_session(timeout=timeout or timeouts.OPEN_SESSION)
        # `exec`: the login shell sshd runs the command in becomes the command instead of
        # waiting beside it for the whole session (sh and dash do not do that by
        # themselves): one process less on every host for every command, and what the
        # channel's end signals is the agent itself. Any shell has `exec`; a missing
        # program still ends 127 with "not found" (Link._no_agent)
        chan.exec_command("exec " + remote_command(argv))
        return SSHChannel(chan, timeout)

    def tunnel(self, port: int, timeout: float) -> Stream:
        """A direct-tcpip channel to localhost:port as the host sees it (what `ssh -L`
        opens), on this connection: bastions included, no new login."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise HostError(f"{self.host.label}: the SSH connection was lost")
        try:
            chan = transport.open_channel("direct-tcpip", ("localhost", port),
                                          ("127.0.0.1", 0), timeout=timeout)
        except paramiko.ChannelException as e:   # sshd's answer: 2 = connect failed
            raise TunnelRefused(e.text or "connect failed") from None
        chan.settimeout(None)
        return chan

    def close(self) -> None:
        self.client.close()


log = logging.getLogger("orchestrator.ssh")

def fingerprint(key: paramiko.PKey) -> str:
    """SHA256:... as `ssh-keygen -l` and OpenSSH's own prompts show it."""
    import hashlib
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class HostKeyRefused(OrchError):
    """An unknown host key under the strict policy: the host is not reached (exit 3)."""

    exit_code = EXIT_HOST


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown keys are refused, showing what the user must check and how to trust it."""

    def __init__(self, known_hosts: str, port: int) -> None:
        self.known_hosts, self.port = known_hosts, port

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        name = hostname if hostname.startswith("[") else known_hosts_name(hostname, self.port)
        raise HostKeyRefused(
            f"host key not trusted: {name} offers {key.get_name()} {fingerprint(key)}, "
            f"which is not in {self.known_hosts}",
            hint=f"check the fingerprint on the host (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub), then "
            f"`ssh-keyscan -p {self.port} {hostname.strip('[]').split(']')[0]} >> {self.known_hosts}`"
            f", or set `host_key_policy: accept-new` in cluster.yaml")


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Like OpenSSH's StrictHostKeyChecking=accept-new: record new keys, refuse changed ones
    (a changed key never reaches this policy: paramiko raises BadHostKeyException)."""

    _lock = threading.Lock()

    def __init__(self, known_hosts: str, port: int) -> None:
        self.known_hosts, self.port = known_hosts, port

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        name = hostname if hostname.startswith("[") else known_hosts_name(hostname, self.port)
        line = f"{name} {key.get_name()} {key.get_base64()}\n"
        try:
            with self._lock:
                Path(self.known_hosts).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                with open(self.known_hosts, "a") as f:
                    f.write(line)
        except OSError as exc:
            # a mistake on this machine, not the host's: exit 2, and the key is not trusted
            raise UsageError(
                f"{self.known_hosts}: cannot record the new host key of {name} "
                f"({key.get_name()} {fingerprint(key)}): {exc.strerror or exc}",
                hint=f"make {self.known_hosts} (and its folder) writable, or set "
                     "`ssh.known_hosts` to a writable file") from None
        client.get_host_keys().add(name, key.get_name(), key)
        # as OpenSSH's "Permanently added", with what to compare against the host's own key
        log.warning("permanently added the host key of %s (%s %s) to %s",
                    name, key.get_name(), fingerprint(key), self.known_hosts)
