"""The frames of the wire between the controller and the agent: bytes in, bytes out.

Both sides import this module (the agent receives it in its bundle, as all of wire/).
Python 3.8, stdlib only. What a JSON frame may say is protocol.py's.

A frame is 1 byte kind + 4 bytes big-endian payload length + payload:

    J  a JSON object; its "t" names the message (requests, replies, events)
    D  raw file bytes (a receive stream: the bytes of the file announced before)
    O  rank output: 4-byte rank, 1 flag byte, then the bytes exactly as the rank wrote
       them. Output is data, never parsed, so nothing a rank prints can forge a frame.
    S  a command's output (setup, exec): 4-byte request id, 1 flag byte (0), then the
       bytes as the command wrote them (stdout and stderr together); agent -> controller.

The agent's first frame is a hello, announced by MAGIC: whatever a login shell prints
before the agent starts is skipped (up to MAX_GARBAGE bytes). Every frame kind has a
size cap, checked before its payload is read, so a host can never make the controller
buffer more than a fixed amount.
"""
from __future__ import annotations

import struct

from orchestrator.wire import jsonc

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Callable

MAGIC = b"\x00\x7fORCH-AGENT\x00"
HEADER = struct.Struct(">cI")
RANK = struct.Struct(">IB")          # rank, flags of an output frame
JSON, DATA, OUTPUT, STREAM_OUT = b"J", b"D", b"O", b"S"
PARTIAL = 1                          # output flag: a piece of a line, more follows

MAX_JSON = 8 << 20                   # one JSON frame
MAX_DATA = 1 << 20                   # one file-data frame
MAX_OUTPUT = 64 << 10                # the bytes of one output frame
MAX_GARBAGE = 64 << 10               # what may come before the agent's hello
CAPS = {JSON: MAX_JSON, DATA: MAX_DATA, OUTPUT: MAX_OUTPUT + RANK.size}


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow (size, kind, fields)."""


class Garbage(ProtocolError):
    """Bytes before the hello, beyond MAX_GARBAGE or up to the end of the stream."""

    def __init__(self, count: int, sample: bytes, ended: bool) -> None:
        super().__init__("%d bytes before the agent's hello" % count)
        self.count, self.sample, self.ended = count, sample, ended


def frame(kind: bytes, payload: bytes) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def message(t: str, **fields: Any) -> bytes:
    """A JSON frame of message type t."""
    fields["t"] = t
    return frame(JSON, jsonc.dumps(fields).encode())


def output(rank: int, data: bytes, partial: bool = False) -> bytes:
    return frame(OUTPUT, RANK.pack(rank, PARTIAL if partial else 0) + data)


def command_output(id: int, data: bytes) -> bytes:
    """An S frame: a piece of the output of the command that request `id` runs."""
    return frame(STREAM_OUT, RANK.pack(id, 0) + data)


def split_output(payload: bytes | bytearray) -> tuple[Any, ...]:
    """(rank, partial, data) of an output frame's payload."""
    if len(payload) < RANK.size:
        raise ProtocolError("output frame of %d bytes has no rank" % len(payload))
    rank, flags = RANK.unpack_from(payload)
    return rank, bool(flags & PARTIAL), payload[RANK.size:]


def hello(version: str, **fields: Any) -> bytes:
    return MAGIC + message("hello", version=version, **fields)


class FrameReader:
    """Frames from a byte source: `read(n)` returns up to n bytes, b"" at the end.
    Buffers at most one frame plus one read; every size is checked against `caps`."""

    def __init__(self, read: Callable[[int], bytes], caps: dict[bytes, int] | None = None,
                 chunk: int = 1 << 16,
                 readinto: Callable[[memoryview], int] | None = None) -> None:
        """`readinto(view)`, when given, fills a big payload in place: one copy less
        per file-data frame than going through the buffer."""
        self._read, self.caps, self.chunk = read, caps or CAPS, chunk
        self._readinto = readinto
        self.buf, self.pos = bytearray(), 0
        self.back: tuple[bytes, bytes | bytearray] | None = None   # unread(): read next

    def unread(self, got: tuple[bytes, bytes | bytearray]) -> None:
        """Give a frame back: the next read_frame returns it (the agent's stream reader
        found a request where a stream item belongs: the request is served next)."""
        self.back = got

    def _fill(self, n: int) -> bool:
        """At least n unread bytes buffered; False if the stream ended first."""
        while len(self.buf) - self.pos < n:
            if self.pos and self.pos >= len(self.buf) // 2:
                del self.buf[:self.pos]
                self.pos = 0
            data = self._read(max(self.chunk, n - (len(self.buf) - self.pos)))
            if not data:
                return False
            self.buf += data
        return True

    def _take(self, n: int) -> bytes:
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def skip_to_magic(self, limit: int = MAX_GARBAGE) -> int:
        """Skip what comes before MAGIC (a chatty login shell); the bytes skipped."""
        while True:
            at = self.buf.find(MAGIC, self.pos)
            if 0 <= at - self.pos <= limit:
                skipped = at - self.pos
                self.pos = at + len(MAGIC)
                return skipped
            seen = len(self.buf) - self.pos
            if seen > limit + len(MAGIC) or not self._fill(seen + 1):
                ended = seen <= limit + len(MAGIC)
                raise Garbage(seen, bytes(self.buf[self.pos:self.pos + 400]), ended)

    def read_frame(self) -> tuple[bytes, bytes | bytearray] | None:
        """(kind, payload), or None at a clean end of stream (between frames)."""
        if self.back is not None:
            got, self.back = self.back, None
            return got
        if not self._fill(HEADER.size):
            if len(self.buf) > self.pos:
                raise ProtocolError("stream ended inside a frame header")
            return None
        kind, size = HEADER.unpack_from(self.buf, self.pos)
        cap = self.caps.get(kind)
        if cap is None:
            raise ProtocolError("unknown frame kind %r" % kind)
        if size > cap:
            raise ProtocolError("a %s frame of %d bytes is over the limit of %d"
                                % (kind.decode("latin-1"), size, cap))
        self.pos += HEADER.size
        if self._readinto is not None and size - (len(self.buf) - self.pos) >= self.chunk:
            return kind, self._read_big(size, self._readinto)
        if not self._fill(size):
            raise ProtocolError("stream ended inside a frame of %d bytes" % size)
        return kind, self._take(size)

    def _read_big(self, size: int, readinto: Callable[[memoryview], int]) -> bytearray:
        out = bytearray(size)
        got = len(self.buf) - self.pos
        out[:got] = self.buf[self.pos:]
        del self.buf[:]
        self.pos = 0
        view = memoryview(out)
        while got < size:
            n = readinto(view[got:])
            if not n:
                raise ProtocolError("stream ended inside a frame of %d bytes" % size)
            got += n
        return out

    def read_json(self, what: str) -> dict[str, Any]:
        """The next frame, which must be a JSON object."""
        got = self.read_frame()
        if got is None:
            raise EOFError("stream ended before %s" % what)
        return decode(got, what)


def decode(got: tuple[bytes, bytes | bytearray], what: str) -> dict[str, Any]:
    kind, payload = got
    if kind != JSON:
        raise ProtocolError("%s: expected a JSON frame, got kind %r" % (what, kind))
    try:
        obj = jsonc.loads(payload.decode("utf-8"))
    except ValueError as e:
        raise ProtocolError("%s: not JSON (%s)" % (what, e)) from e
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError("%s: not a message object" % what)
    return obj
