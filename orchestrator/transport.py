"""One seam between orch and a host: run a command, stream bytes in and out.

`SSHTransport` (paramiko) and `LocalTransport` (subprocess) implement `open()`; every
higher layer (preflight, sync, launch, follow, stop) is written once against `Transport`.
One transport per host is opened in parallel and reused for every step of a command.
"""
from __future__ import annotations

import base64
import io
import os
import shlex
import socket
import subprocess
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import paramiko

from orchestrator import timeouts
from orchestrator.errors import EXIT_HOST, HostError, OrchError, UsageError
from orchestrator.inventory import Host

CHUNK = 1 << 20
STDERR_KEEP = 64 << 10   # what a command may print to stderr is kept up to this (the end)


@dataclass(frozen=True)
class Result:
    code: int
    stdout: bytes
    stderr: bytes


class Channel(ABC):
    """A running command: bytes to its stdin, bytes from its stdout."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def close_stdin(self) -> None: ...

    @abstractmethod
    def read(self, n: int = CHUNK) -> bytes:
        """Up to n bytes of stdout; b"" at the end. Raises TimeoutError after the timeout."""

    @abstractmethod
    def finish(self) -> Result:
        """Drain what is left, wait for the exit code."""

    @abstractmethod
    def close(self) -> None: ...

    # Not abstract: a channel that cannot block forever (local pipes) needs no timeout.
    def settimeout(self, timeout: float | None) -> None:  # noqa: B027
        """How long read() may wait; None: forever (a follow that heartbeats)."""

    @abstractmethod
    def stderr_tail(self) -> bytes:
        """The last bytes (at most STDERR_KEEP) the command wrote to stderr so far."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """The command's exit code once it has ended, else None."""


class Transport(ABC):
    def __init__(self, host: Host) -> None:
        self.host = host

    @abstractmethod
    def open(self, argv: list[str], timeout: float | None = None) -> Channel: ...

    @abstractmethod
    def close(self) -> None: ...

    def run(self, argv: list[str], stdin: bytes = b"", timeout: float | None = None) -> Result:
        chan = self.open(argv, timeout)
        try:
            if stdin:
                chan.write(stdin)
            chan.close_stdin()
            return chan.finish()
        finally:
            chan.close()


# ---------------------------------------------------------------- local

class LocalChannel(Channel):
    def __init__(self, argv: list[str], cwd: str | None, timeout: float | None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=cwd)
        # all three are PIPEs, so never None; the buffered types give read1()
        self._stdin = cast(io.BufferedWriter, self.proc.stdin)
        self._stdout = cast(io.BufferedReader, self.proc.stdout)
        self._stderr = cast(io.BufferedReader, self.proc.stderr)
        self.timeout = timeout
        self._err = bytearray()
        # stderr is drained on the side so a chatty command can never block on it
        self._err_thread = threading.Thread(target=self._drain_err, daemon=True)
        self._err_thread.start()

    def _drain_err(self) -> None:
        for block in iter(lambda: self._stderr.read1(CHUNK), b""):
            self._err += block
            del self._err[:-STDERR_KEEP]

    def stderr_tail(self) -> bytes:
        return bytes(self._err)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def write(self, data: bytes | memoryview) -> None:
        self._stdin.write(data)
        self._stdin.flush()   # a request must reach the agent now, not at close

    def close_stdin(self) -> None:
        try:
            self._stdin.close()
        except BrokenPipeError:
            pass

    def read(self, n: int = CHUNK) -> bytes:
        return self._stdout.read1(n)

    def finish(self) -> Result:
        out = self._stdout.read()
        code = self.proc.wait(self.timeout)
        self._err_thread.join(5)
        return Result(code, out, bytes(self._err))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self._stdin, self._stdout):
            try:
                f.close()
            except OSError:
                pass


class LocalTransport(Transport):
    """`connection: local`: the same commands, run as child processes of orch."""

    def __init__(self, host: Host, cwd: str | None = None) -> None:
        super().__init__(host)
        self.cwd = cwd

    def open(self, argv: list[str], timeout: float | None = None) -> Channel:
        argv = [os.path.expanduser(argv[0])] + argv[1:]
        return LocalChannel(argv, self.cwd, timeout)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- ssh

def remote_command(argv: list[str]) -> str:
    """Quote every word for the remote shell; a leading ~/ stays unquoted so it expands."""
    words = []
    for arg in argv:
        if arg.startswith("~/"):
            words.append("~/" + shlex.quote(arg[2:]))
        else:
            words.append(shlex.quote(arg))
    return " ".join(words)


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

    def stderr_tail(self) -> bytes:
        err = bytearray()
        while self.chan.recv_stderr_ready() and len(err) < 4 * STDERR_KEEP:
            err += self.chan.recv_stderr(CHUNK)
        return bytes(err[-STDERR_KEEP:])

    def exit_code(self) -> int | None:
        return self.chan.recv_exit_status() if self.chan.exit_status_ready() else None

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
        chan.exec_command(remote_command(argv))
        return SSHChannel(chan, timeout)

    def close(self) -> None:
        self.client.close()


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
