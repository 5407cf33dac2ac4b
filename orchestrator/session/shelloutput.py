"""The output of a command run on several hosts (setup, exec): whole lines printed with
a host prefix (made safe for a terminal), each host's last lines kept for a message,
and, when asked, its whole output kept up to a cap (`orch exec --json`)."""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import BinaryIO

from orchestrator.remote.link import Stream
from orchestrator.ui import termsafe

MAX_LINE = 64 << 10  # a longer line without a newline is printed in pieces
TAIL_LINE = 400  # characters of a line kept for a message


class Printer:
    """One writer for every host's lines, so that lines never interleave."""

    def __init__(self, out: BinaryIO | None = None, quiet: bool = False) -> None:
        self.out = out or sys.stdout.buffer
        self.quiet = quiet
        self.safe = _isatty(self.out)
        self.lock = threading.Lock()

    def write(self, prefix: bytes, lines: list[bytes]) -> None:
        if self.quiet or not lines:
            return
        if self.safe:
            lines = [termsafe.for_terminal(line) for line in lines]
        block = b"".join(prefix + line + b"\n" for line in lines)
        with self.lock:
            self.out.write(block)
            self.out.flush()


def _isatty(out: BinaryIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


class HostOutput(Stream):
    """Feed it the pieces of one host's output; it prints whole lines as they complete.
    As a link's stream, it gets its request's command output."""

    def __init__(self, printer: Printer, prefix: str, tail: int = 10, keep: int = 0) -> None:
        self.printer, self.prefix = printer, prefix.encode("utf-8", "replace") + b" "
        self.pending = bytearray()
        self.last: deque[bytes] = deque(maxlen=tail)
        self.keep, self.kept, self.dropped = keep, bytearray(), 0
        self.lock = threading.Lock()

    def output(self, data: bytes) -> None:
        self.feed(data)

    def feed(self, data: bytes) -> None:
        with self.lock:
            self._keep(data)
            self.pending += data
            lines = self._whole_lines()
            self.last.extend(line[:TAIL_LINE] for line in lines)
        self.printer.write(self.prefix, lines)

    def _keep(self, data: bytes) -> None:
        if not self.keep:
            return
        self.kept += data
        if len(self.kept) > self.keep:
            cut = len(self.kept) - self.keep
            del self.kept[:cut]
            self.dropped += cut

    def _whole_lines(self) -> list[bytes]:
        *lines, rest = bytes(self.pending).split(b"\n")
        while len(rest) > MAX_LINE:
            lines.append(rest[:MAX_LINE])
            rest = rest[MAX_LINE:]
        self.pending = bytearray(rest)
        return [line.rstrip(b"\r") for line in lines]

    def flush(self) -> None:
        """The command ended: a last line without a newline is printed too."""
        with self.lock:
            rest, self.pending = bytes(self.pending), bytearray()
            if rest:
                self.last.append(rest[:TAIL_LINE])
        if rest:
            self.printer.write(self.prefix, [rest])

    def tail_text(self) -> list[str]:
        """The last lines, safe to show (escaped control characters)."""
        return [
            termsafe.visible(line.decode("utf-8", "replace"), keep_sgr=False) for line in self.last
        ]

    def text(self) -> str:
        return self.kept.decode("utf-8", "replace")
