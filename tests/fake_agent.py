"""An in-process fake of a host's agent behind the real Link: unit tests of controller
logic (Session, watch) without processes or SSH. The fake speaks protocol.py frames;
each test scripts what its hosts answer."""
from __future__ import annotations

import queue
import struct
import threading
import time
from typing import Any, Callable

from orchestrator.config.inventory import Host
from orchestrator.errors import HostError
from orchestrator.remote.bundle import agent_stdin, bundle
from orchestrator.remote.transport import Channel, Transport
from orchestrator.session.session import Session
from orchestrator.wire import protocol

Handler = Callable[["FakeChannel", dict], None]


def clock(chan: FakeChannel, msg: dict) -> None:
    """The host's time, `skew` seconds off ours, answered after `clock_delay` seconds."""
    def answer() -> None:
        chan.push(protocol.reply(msg["id"], {"time": time.time() + chan.skew}))
    if chan.clock_delay:
        later(chan.clock_delay, answer)
    else:
        answer()


def unshare(chan: FakeChannel, msg: dict) -> None:
    chan.push(protocol.reply(msg["id"], {"removed": False}))


DEFAULTS: dict[str, Handler] = {"clock": clock, "unshare": unshare}


class FakeChannel(Channel):
    def __init__(self, host: Host, handlers: dict[str, Handler]) -> None:
        self.host, self.handlers = host, dict(DEFAULTS, **handlers)
        self.skew, self.clock_delay = 0.0, 0.0
        self.outq: queue.Queue = queue.Queue()
        self.inbuf, self.skip = bytearray(), len(agent_stdin())
        self.requests: list[dict] = []
        self.closed = False
        self.stdin_closed_at: float | None = None   # when the controller ended this agent
        self.push(protocol.hello(bundle()[1]))

    def push(self, data: bytes) -> None:
        self.outq.put(data)

    def write(self, data) -> None:
        self.inbuf += bytes(data)
        if self.skip:
            cut = min(self.skip, len(self.inbuf))
            del self.inbuf[:cut]
            self.skip -= cut
        while len(self.inbuf) >= 5:
            kind, size = struct.unpack(">cI", self.inbuf[:5])
            if len(self.inbuf) < 5 + size:
                return
            payload = bytes(self.inbuf[5:5 + size])
            del self.inbuf[:5 + size]
            if kind == protocol.JSON:
                msg = protocol.decode((kind, payload), "request")
                self.requests.append(msg)
                self.handlers[msg["t"]](self, msg)

    def close_stdin(self) -> None:
        if self.stdin_closed_at is None:
            self.stdin_closed_at = time.monotonic()
        self.close()

    def read(self, n: int = 1 << 20) -> bytes:
        data = self.outq.get()
        return data if data is not None else b""

    def finish(self):
        raise NotImplementedError

    def stderr_tail(self) -> bytes:
        return b""

    def exit_code(self) -> int | None:
        return 0 if self.closed else None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outq.put(None)


class FakeTransport(Transport):
    def __init__(self, host: Host, handlers: dict[str, Handler]) -> None:
        super().__init__(host)
        self.channel = FakeChannel(host, handlers)

    def open(self, argv: list[str], timeout: float | None = None) -> Channel:
        return self.channel

    def close(self) -> None:
        self.channel.close()


def later(seconds: float, fn: Callable[[], None]) -> None:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


def session_factory(handlers: dict[str, Callable[[FakeChannel, dict], None]],
                    down: int | None = None) -> Callable[..., Any]:
    """`open_session` for the commands (monkeypatched in): in-process agents answering
    with `handlers`; host `down` cannot be reached."""
    def connector(host: Any) -> FakeTransport:
        if host.index == down:
            raise HostError(f"{host.label}: connection refused")
        return FakeTransport(host, handlers)

    def open_session(cluster: Any, state: Any = None, hosts: Any = None) -> Session:
        return Session(cluster, state, connector=connector).open(hosts)
    return open_session
