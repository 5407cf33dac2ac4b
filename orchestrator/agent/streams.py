"""The stream that follows a request (`receive`, `keep_receive`, `restore`): items and
data frames from the controller up to the stream's `end`, or its `abort` when the
controller gives up half way (a local file it cannot read).

A stream is always read to its end, whatever happens on the host: a request refused
before its first item (a link planted at its folder, a lock, a bad field), a file
refused half way (a full disk, a permission, a digest) or a breach of the stream. The
agent answers with one error at once (the controller may cut the stream short on
seeing it), then skips what is left (`drain`), so the next frame it reads is the next
request and the host stays usable: the controller can still stop its job. A request
where a stream item belongs (the controller gave up on the stream without ending it)
ends the stream too, and is served next. Stdlib only, Python 3.8.
"""
from __future__ import annotations

import threading

from orchestrator.agent.common import AgentError, StreamIdle
from orchestrator.wire import protocol

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    import signal
    from typing import Any
else:   # signal's enums are 6-8 ms of CPU and ~0.4 MiB in every agent: the C module
    import _signal as signal

# the requests a stream follows (agent/main.py reads each through a StreamReader)
STREAMED = frozenset(("receive", "keep_receive", "restore"))
ENDS = ("end", "abort")
ITEMS = frozenset(protocol.STREAM) | {"abort"}


class Aborted(AgentError):
    """The controller ended the stream with `abort`: what landed before it stays."""

    def __init__(self, why: str) -> None:
        super().__init__("the controller ended the stream: %s" % why[:500], protocol.USAGE)


class StreamReader:
    """The request's frame reader with a deadline per frame (SIGALRM, in the agent's
    main thread only): a stream that stops half way ends the receiver in bounded time,
    keeping what landed, instead of blocking it (and its folder's lock) until sshd
    notices. It knows when the stream ended (`ended`: its end, its abort, or a request
    where an item belongs, handed back to the agent's reader to be served next)."""

    def __init__(self, reader: protocol.FrameReader, idle: float) -> None:
        self.reader, self.idle = reader, idle
        self.armed = threading.current_thread() is threading.main_thread()
        self.old: Any = None
        self.ended = False
        self.why: str | None = None   # the controller's abort, when it sent one

    def __enter__(self) -> "StreamReader":
        if self.armed:
            self.old = signal.signal(signal.SIGALRM, self._expired)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)

    def disarm(self) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _expired(self, signum: int, frame: Any) -> None:
        raise StreamIdle("the receive stream stopped: nothing came for %g s" % self.idle)

    def read_frame(self) -> Any:
        """The next frame; a JSON one where data belongs is looked at: an end, an abort
        or a request ends the stream (the caller refuses the frame)."""
        got = self._next()
        if got is not None and got[0] == protocol.JSON:
            self._saw(protocol.decode(got, "the stream"), got)
        return got

    def _next(self) -> Any:
        """The next frame as the reader gives it (None at the channel's end, which ends
        the stream), under the idle timer."""
        if self.ended:
            raise protocol.ProtocolError("read past the end of the stream")
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, self.idle)
        got = self.reader.read_frame()
        if got is None:
            self.ended = True
            self.disarm()
        return got

    def read_json(self, what: str) -> Any:
        """The next item (a JSON frame). An abort raises Aborted; a request raises
        ProtocolError (it is served next)."""
        got = self._next()
        if got is None:
            raise EOFError("stream ended before %s" % what)
        msg = protocol.decode(got, what)
        self._saw(msg, got)
        if self.why is not None:
            raise Aborted(self.why)
        if msg["t"] not in ITEMS:
            raise protocol.ProtocolError("%s: the request %r came before it" % (what, msg["t"]))
        return msg

    def _saw(self, msg: dict[str, Any], got: Any) -> None:
        """Whether a JSON frame ends the stream: its end, its abort, or a request (the
        controller gave up on the stream without ending it), given back to be read next."""
        t = msg["t"]
        if t in ITEMS and t not in ENDS:
            return
        self.ended = True
        self.disarm()   # the stream is over: what is left is this host's own work
        if t == "abort":
            why = msg.get("why")
            self.why = why if isinstance(why, str) else "no reason given"
        elif t != "end":
            self.reader.unread(got)

    def broke(self, what: str) -> Exception:
        """The error for a frame that is not the data `what` needs: the controller's
        abort when that is what came, else a breach of the stream."""
        if self.why is not None:
            return Aborted(self.why)
        return protocol.ProtocolError(what)


def drain(reader: Any) -> None:
    """Skip what is left of the stream, to its end (the controller always ends one it
    started, after an error reply too), so that the next frame is read as a request."""
    if not isinstance(reader, StreamReader):   # a plain frame reader (unit tests)
        while True:
            got = reader.read_frame()
            if got is None or (got[0] == protocol.JSON
                               and protocol.decode(got, "the stream")["t"] in ENDS):
                return
    while not reader.ended:
        reader.read_frame()


def broke(reader: Any, what: str) -> Exception:
    """StreamReader.broke for any reader (a plain one: a breach)."""
    if isinstance(reader, StreamReader):
        return reader.broke(what)
    return protocol.ProtocolError(what)
