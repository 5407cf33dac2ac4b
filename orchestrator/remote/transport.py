"""One seam between orch and a host: run a command, stream bytes in and out.

`LocalTransport` (subprocess, here) and `sshtransport.SSHTransport` (paramiko, imported
only by a command that contacts a host) implement `open()`; every
higher layer (preflight, sync, launch, follow, stop) is written once against `Transport`.
One transport per host is opened in parallel and reused for every step of a command.
"""
from __future__ import annotations

import io
import os
import shlex
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, cast

from orchestrator.config.inventory import Host

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

    def ready(self) -> bool:
        """Whether bytes the host sent wait here unread (a seam without a buffer: never)."""
        return False

    def room(self, n: int) -> bool:
        """Whether n bytes written now go without waiting for the host to read (a seam
        that cannot tell: yes)."""
        return True

    @abstractmethod
    def stderr_tail(self) -> bytes:
        """The last bytes (at most STDERR_KEEP) the command wrote to stderr so far."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """The command's exit code once it has ended, else None."""

    def wait_exit(self, timeout: float) -> int | None:
        """exit_code(), once the command ended or timeout seconds passed. A channel that
        can be told of its end overrides this poll: a thousand hosts' agents closing at
        once polled 50 times a second each."""
        deadline = time.monotonic() + timeout
        while (code := self.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return code


class Stream(Protocol):
    """A byte stream both ways: a socket, or an SSH channel (direct-tcpip)."""

    def recv(self, n: int) -> bytes: ...
    def sendall(self, data: bytes) -> Any: ...
    def shutdown(self, how: int) -> None: ...
    def close(self) -> None: ...


class TunnelRefused(Exception):
    """Nothing listens on the forwarded port on the host (the connection was refused)."""


class Transport(ABC):
    def __init__(self, host: Host) -> None:
        self.host = host

    @abstractmethod
    def open(self, argv: list[str], timeout: float | None = None) -> Channel: ...

    @abstractmethod
    def close(self) -> None: ...

    def tunnel(self, port: int, timeout: float) -> Stream:
        """A TCP connection to `port` on the host's loopback (`orch forward`); raises
        TunnelRefused when nothing listens there, HostError when the link is gone."""
        try:
            sock = socket.create_connection(("localhost", port), timeout=timeout)
        except ConnectionRefusedError:
            raise TunnelRefused("connection refused") from None
        sock.settimeout(None)
        return sock

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

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

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
