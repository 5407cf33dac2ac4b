"""The controller's end of one host's agent: a single channel that carries every step of
a command (requests and replies, file streams, follow events), read by one thread.

Nothing from the host is trusted: the frames are size-capped (protocol.FrameReader), at
most MAX_GARBAGE bytes may precede the hello, every reply is checked against its schema,
and any breach becomes one message naming the host and the command.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from orchestrator.errors import HostError, OrchError, for_category
from orchestrator.remote.bundle import agent_argv, agent_stdin, bundle, host_python, sources
from orchestrator.remote.transport import Channel, Transport
from orchestrator.wire import protocol, timeouts

# From a host: JSON, output and command-output frames within their caps, and file-data
# frames (only while a pull's stream is open, checked in _stream).
CAPS_IN = {protocol.JSON: protocol.MAX_JSON, protocol.DATA: protocol.MAX_DATA,
           protocol.OUTPUT: protocol.MAX_OUTPUT + protocol.RANK.size,
           protocol.STREAM_OUT: protocol.MAX_OUTPUT + protocol.RANK.size}
# A reply's body as the link hands it over: JSON checked against protocol.REPLIES[command];
# each caller decodes it into its reply's dataclass right there (session/replies.py, ...)
Body = dict[str, Any]
QUIET_SHELL = ("make the login shell quiet for non-interactive sessions (print nothing in "
               "~/.bashrc, ~/.profile or /etc/profile.d when $- has no `i`)")


@dataclass(frozen=True)
class PullFile:
    """A pulled file begins: its path, size and mode; `size` bytes of data follow."""

    path: str
    size: int
    mode: int


@dataclass(frozen=True)
class PullEnd:
    """A pulled file ends: the sha256 of the bytes the host sent ("" when the file
    changed size while it was read)."""

    path: str
    sha256: str


@dataclass(frozen=True)
class PullSkip:
    """A file asked for that the host could not open, and why."""

    path: str
    why: str


PullPart = Union[PullFile, PullEnd, PullSkip]


def pull_part(kind: str, body: Mapping[str, Any]) -> PullPart:
    """A pull stream's part, checked against protocol.PULL_STREAM[kind]."""
    if kind == "pull_file":
        return PullFile(body["p"], body["s"], body["m"])
    if kind == "pull_end":
        return PullEnd(body["p"], body["h"])
    return PullSkip(body["p"], body["why"])


@dataclass(frozen=True)
class HostDone:
    """A followed host's `done` event: its host exit code (None when the supervisor
    vanished: `lost`), on the host's clock `time`; `snapshot`: a one-shot read ended;
    `after_stop`: it ended after the host received a stop (the stop's doing); `curves`:
    the files under output/ the follow's `curves` globs matched (None: not asked)."""

    code: int | None
    time: float | None = None
    lost: bool = False
    snapshot: bool = False
    after_stop: bool = False
    curves: int | None = None

    @classmethod
    def of(cls, event: Mapping[str, Any]) -> HostDone:   # checked by protocol.EVENTS
        return cls(event["code"], event.get("time"), bool(event.get("lost")),
                   bool(event.get("snapshot")), bool(event.get("after_stop")),
                   event.get("curves"))


@dataclass(frozen=True)
class Hello:
    """The agent's first frame: the bundle's hash it runs, its pid and Python version
    (the agent's own facts, for tests and debugging; only `version` is checked)."""

    version: str
    pid: int | None = None
    python: str = ""

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Hello:
        pid, python = msg.get("pid"), msg.get("python")
        return cls(msg["version"], pid if type(pid) is int else None,
                   python if isinstance(python, str) else "")


@dataclass(frozen=True)
class ErrorReply:
    """A host's `error` answer to a request (protocol.ERROR)."""

    category: str
    message: str
    traceback: str = ""
    fix: str = ""

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> ErrorReply:
        return cls(msg["category"], msg["message"], msg.get("traceback", ""), msg.get("fix", ""))


class Stream:
    """What a host sends for one request before its reply, in the link's reader thread:
    the output of the command it runs (setup, exec: `S` frames with the request's id) or
    a pull's parts and file data. A receiver overrides what its request produces; all
    else from the host is a breach (ProtocolError ends the link)."""

    takes_data = False   # file-data frames carry no id: one such stream at a time per link

    def output(self, data: bytes) -> None:
        raise protocol.ProtocolError("command output for a request that runs no command")

    def part(self, part: PullPart) -> None:
        raise protocol.ProtocolError(f"a stream part {type(part).__name__} for a request "
                                     "that streams none")

    def data(self, payload: bytes | bytearray) -> None:
        raise protocol.ProtocolError("file data while nothing is pulled")


NO_STREAM = Stream()


class Dropped(Stream):
    """What is left of a stream whose receiver here failed (this side's disk, folder or
    code, never the host's doing): the host goes on to its reply, so its parts and data
    are taken and dropped, and the link stays in step."""

    def __init__(self, takes_data: bool) -> None:
        self.takes_data = takes_data

    def output(self, data: bytes) -> None:
        pass

    def part(self, part: PullPart) -> None:
        pass

    def data(self, payload: bytes | bytearray) -> None:
        pass


@dataclass
class Pending:
    """One request waiting for its reply; parts are collected as they come."""

    command: str
    done: threading.Event = field(default_factory=threading.Event)
    parts: list[Any] = field(default_factory=list)   # protocol.PARTS' manifest parts
    body: Body | None = None
    error: OrchError | None = None
    received: float = 0.0               # our clock when the reply arrived (clock samples)


class Link:
    def __init__(self, transport: Transport, label: str = "", part: str = "") -> None:
        self.transport, self.host = transport, transport.host
        self.name = transport.host.label
        self.argv_label, self.part = label, part
        self.python_fallback = False        # python3 when `python:` is missing (setup makes it)
        self.chan: Channel | None = None
        self.boot: threading.Thread | None = None   # writes the loader and the bundle
        self.wlock = threading.RLock()
        self.plock = threading.Lock()
        # one pull stream at a time (file data carries no request id): the checkpoint
        # keeper and the curves' fetch take turns on one link (files/pull.receive)
        self.pull_lock = threading.Lock()
        self.pending: dict[int, Pending] = {}
        self.ids = itertools.count(1)
        self.sink: Any = None               # follow events go here (see follow.Sink)
        self.follow_id: int | None = None
        self.ended: HostDone | None = None   # the follow's `done`, once it came
        self.follow_ranks: frozenset[int] = frozenset()
        self.streams: dict[int, Stream] = {}   # request id -> what the host streams for it
        self.hello: Hello | None = None
        self.started = threading.Event()
        self.dead: OrchError | None = None
        # on the watchdogs' clock (timeouts.CLOCK: the monotonic one, or a test's fake one,
        # which then never reads a frame's stamp in its future)
        self.last_seen = timeouts.CLOCK.now()
        self.last_heard = time.time()       # the same moment on the wall clock (root cause)
        self.handing = False                # a frame of this host is being handed on (heard)

    # ------------------------------------------------------------ start

    def start(self, timeout: float = timeouts.AGENT_START) -> Hello:
        """Start the agent (one session) and wait for its hello; the bundle's hash must
        match ours, so the host runs exactly this controller's code."""
        python = host_python(self.host, self.argv_label) if self.argv_label else self.host.python
        argv = agent_argv(python, self.argv_label, self.python_fallback, self.part)
        self.chan = self.transport.open(argv, timeout)
        self.chan.settimeout(None)   # the reader thread waits; callers time out on events
        threading.Thread(target=self._read, daemon=True, name=f"link-{self.name}").start()
        # written beside: the bundle (~340 KB with its bytecode) is more than a pipe
        # holds, and a login shell that never reads its stdin must not block us here
        self.boot = threading.Thread(target=self._write_boot, daemon=True,
                                     name=f"boot-{self.name}")
        self.boot.start()
        if not self.started.wait(timeout):
            self.close()
            raise HostError(f"{self.name}: the agent did not start within {timeout:g} s "
                            "(the login shell or python hangs, or the host is overloaded)",
                            hint="check that `ssh HOST python3 -c pass` returns at once")
        if self.dead:
            raise self.dead
        assert self.hello is not None   # started is set only by the hello or a failure
        return self.hello

    def _write_boot(self) -> None:
        """The loader and the bundle; requests queue behind them on the write lock (the
        hello, which start() waits for, comes only after the agent read all of it)."""
        assert self.chan is not None
        try:
            with self.wlock:
                self.chan.write(agent_stdin())
        except Exception:  # the channel is gone: the reader reports why
            pass

    def _write_sources(self) -> None:
        """The sources' zip, asked for once by the loader after it read the bundle (the
        boot's write has returned or is about to: the lock waits for it)."""
        assert self.chan is not None
        with self.wlock:
            self.chan.write(sources()[0])

    def _read(self) -> None:
        assert self.chan is not None
        reader = protocol.FrameReader(self.chan.read, caps=CAPS_IN)
        try:
            self._hello(reader)
            while True:
                got = reader.read_frame()
                if got is None:
                    return self._fail(HostError(f"{self.name}: the agent's connection ended"))
                self.last_seen, self.last_heard = timeouts.CLOCK.now(), time.time()
                self.handing = True
                try:
                    self._dispatch(*got)
                finally:
                    self.handing = False
        except protocol.ProtocolError as e:
            self._fail(HostError(f"{self.name}: the agent sent something orch does not "
                                 f"accept: {e}", hint="the host's agent may be broken; "
                                 "run with ORCH_DEBUG=1 and report it"))
        except OrchError as e:
            self._fail(e)
        except Exception as e:  # a closed channel, a socket error: the host is gone
            self._fail(HostError(f"{self.name}: connection lost: {e}"))

    def heard(self) -> float:
        """When this host last spoke, on the watchdogs' clock: now while one of its frames
        is still being handed on, or more of its bytes wait unread here. A printer that
        falls behind (a flood of rank lines, a slow terminal) holds this link's reader
        inside a frame for as long as it is behind; the host, still talking, is not the
        one that went silent (bench/linerate.py: two healthy hosts of 50 were called
        lost that way, and the job stopped)."""
        chan = self.chan
        if self.handing or (chan is not None and chan.ready()):
            return timeouts.CLOCK.now()
        return self.last_seen

    def _hello(self, reader: protocol.FrameReader) -> None:
        try:
            reader.skip_to_magic()
            first = reader.read_json("the agent's hello")
            if first.get("t") == "sources":   # its Python has other bytecode than ours
                self._write_sources()
                reader.skip_to_magic()
                first = reader.read_json("the agent's hello")
            hello = protocol.check(first, {"version": str}, "hello")
        except protocol.Garbage as g:
            raise self._no_agent(g) from None
        except EOFError:
            raise self._no_agent(protocol.Garbage(0, b"", True)) from None
        if hello["version"] != bundle()[1]:
            raise HostError(f"{self.name}: the agent runs another version "
                            f"({hello['version'][:12]}, ours {bundle()[1][:12]})")
        self.hello = Hello.of(hello)
        self.started.set()

    def _no_agent(self, g: protocol.Garbage) -> HostError:
        """Why no agent answered: python missing, it failed, or the shell is chatty."""
        assert self.chan is not None
        time.sleep(0.05)   # the exit status and stderr come right after the stream's end
        err = self.chan.stderr_tail().decode("utf-8", "replace").strip()
        code = self.chan.exit_code()
        python = self.host.python
        if not g.ended:
            return HostError(f"{self.name}: the login shell or `{python}` printed more than "
                             f"{protocol.MAX_GARBAGE // 1024} KiB before the agent started: "
                             f"{g.sample[:200]!r}", hint=QUIET_SHELL)
        if code == 127 or ("not found" in err and "Traceback" not in err):
            return HostError(f"{self.name}: python interpreter `{python}` not found",
                             hint="install python3 there or set `python:` (e.g. a venv's bin/python)")
        why = err[-800:] or (f"it printed {g.sample[:200]!r}" if g.count else "")
        return HostError(f"{self.name}: the agent did not start with `{python}` "
                         f"(exit code {code}): {why or 'no output'}",
                         hint="orch needs Python >= 3.8 on the host; check `python:`")

    def _fail(self, error: OrchError) -> None:
        if self.dead is None:
            self.dead = error
        self.started.set()
        with self.plock:
            waiting, self.pending = list(self.pending.values()), {}
        for p in waiting:
            p.error = p.error or error
            p.done.set()
        if self.sink is not None and self.follow_id is not None:
            self.follow_id = None
            self.sink.host_lost(self.host.index, error.message)

    def lost(self, why: str) -> None:
        """The host stopped answering (not even a heartbeat): whatever waits on it fails,
        nothing more is asked of it, and closing does not wait for its agent to end."""
        self._fail(HostError(f"{self.name}: {why}"))

    # ------------------------------------------------------------ incoming

    def _dispatch(self, kind: bytes, payload: bytes | bytearray) -> None:
        if kind == protocol.DATA:
            return self._to_stream(None, lambda s: s.data(payload))
        if kind == protocol.STREAM_OUT:
            id, _, data = protocol.split_output(payload)
            return self._to_stream(id, lambda s: s.output(bytes(data)))
        if kind == protocol.OUTPUT:
            rank, partial, data = protocol.split_output(payload)
            if self.sink is None or rank not in self.follow_ranks:
                raise protocol.ProtocolError(f"output of rank {rank}, which is not followed here")
            self.sink.output(self.host.index, rank, partial, data)
            return
        msg = protocol.decode((kind, payload), "a message")
        t = msg["t"]
        if t in ("reply", "error", "part"):
            self._answer(t, msg)
        elif t in protocol.EVENTS:
            self._event(t, protocol.check(msg, protocol.EVENTS[t], f"event {t}"))
        else:
            raise protocol.ProtocolError(f"unexpected message {t!r}")

    def _stream(self, id: int | None) -> tuple[int | None, Stream]:
        """(id, stream) of request `id`; for file data (no id), the one that takes data.
        None open: NO_STREAM, which refuses everything."""
        with self.plock:
            if id is None:
                return next(((i, s) for i, s in self.streams.items() if s.takes_data),
                            (None, NO_STREAM))
            return id, self.streams.get(id, NO_STREAM)

    def _to_stream(self, id: int | None, call: Any) -> None:
        """`call(stream)` on request `id`'s stream. A breach by the host (ProtocolError)
        ends the link; any other failure is this side's receiver's (a local disk, a bug
        here): that request fails with it once the host has replied, the rest of its
        stream is dropped, and the host stays usable."""
        id, stream = self._stream(id)
        try:
            call(stream)
        except protocol.ProtocolError:
            raise
        except Exception as e:
            if id is None:
                raise
            with self.plock:
                p = self.pending.get(id)
                self.streams[id] = Dropped(stream.takes_data)
            if p is not None and p.error is None:
                p.error = e if isinstance(e, OrchError) else OrchError(
                    f"{self.name}: {p.command}: this machine failed to take what the host "
                    f"sent: {type(e).__name__}: {e}", hint="the host is fine; run it again, "
                    "and if it fails the same way, report it with ORCH_DEBUG=1")

    def _answer(self, t: str, msg: Mapping[str, Any]) -> None:
        """A reply, error or part frame (decoded JSON, its fields checked here)."""
        with self.plock:
            p = self.pending.get(msg.get("id"))  # type: ignore[arg-type]
        if p is None:
            if t == "error" and msg.get("id") is None:   # the agent itself gave up
                raise HostError(f"{self.name}: {msg.get('message')}")
            raise protocol.ProtocolError(f"a {t} for no request (id {msg.get('id')!r})")
        what = f"the reply to `{p.command}`"
        if t == "part":
            protocol.check(msg, {"kind": str, "body": dict}, what)
            if msg["kind"] in protocol.PULL_STREAM:
                part = pull_part(msg["kind"], protocol.check(
                    msg["body"], protocol.PULL_STREAM[msg["kind"]], what))
                self._to_stream(msg["id"], lambda s: s.part(part))
                return
            if msg["kind"] not in protocol.PARTS or len(p.parts) >= protocol.MAX_PARTS:
                raise protocol.ProtocolError(f"{what}: unexpected part {msg['kind']!r}")
            p.parts.append(protocol.check(msg["body"], protocol.PARTS[msg["kind"]], what))
            return
        if t == "error":
            self._error_reply(p, ErrorReply.of(protocol.check(msg, protocol.ERROR, what)))
        else:
            body = protocol.check(msg, {"body": dict}, what)["body"]
            p.body = protocol.check(body, protocol.REPLIES[p.command], what)
        self._finish(msg["id"], p)

    def _error_reply(self, p: Pending, err: ErrorReply) -> None:
        text = f"{self.name}: {p.command} failed: {err.message}"
        if os.environ.get("ORCH_DEBUG") == "1" and err.traceback:
            text += "\n  host traceback:\n    " + err.traceback.strip().replace("\n", "\n    ")
        p.error = for_category(err.category)(text, hint=err.fix)
        if p.command == "follow" and self.sink is not None:
            self.follow_id = None
            self.sink.host_lost(self.host.index, f"follow failed: {err.message}")

    def _finish(self, id: int, p: Pending) -> None:
        p.received = time.time()
        with self.plock:
            self.pending.pop(id, None)
            self.streams.pop(id, None)
        p.done.set()

    def _event(self, t: str, msg: Mapping[str, Any]) -> None:
        """A follow event, checked against protocol.EVENTS[t], to the sink."""
        if self.sink is None:
            raise protocol.ProtocolError(f"event {t!r} while nothing is followed")
        if t == "exit":
            if msg["rank"] not in self.follow_ranks:
                raise protocol.ProtocolError(f"exit of rank {msg['rank']}, which is not followed here")
            # after_stop only when set: sinks that do not care keep a 4-argument rank_exit
            extra = {"after_stop": True} if msg.get("after_stop") else {}
            self.sink.rank_exit(self.host.index, msg["rank"], msg["code"], msg["time"],
                                **extra)
        elif t == "start":
            if msg["rank"] not in self.follow_ranks:
                raise protocol.ProtocolError(f"start of rank {msg['rank']}, which is not followed here")
            started = getattr(self.sink, "rank_start", None)   # optional for a sink
            if started is not None:
                started(self.host.index, msg["rank"], msg["pid"])
        elif t == "progress":
            if not set(msg["ranks"]) <= self.follow_ranks:
                raise protocol.ProtocolError("progress of a rank which is not followed here")
            progress = getattr(self.sink, "rank_progress", None)   # optional for a sink
            if progress is not None:
                progress(self.host.index, sorted(set(msg["ranks"])))
        elif t == "done":
            fid, self.follow_id = self.follow_id, None
            self.ended = HostDone.of(msg)   # before the sink hears it: a release reads it
            self.sink.host_done(self.host.index, self.ended)
            if fid is not None:
                with self.plock:
                    self.pending.pop(fid, None)

    # ------------------------------------------------------------ outgoing

    def send(self, data: bytes | memoryview) -> None:
        while self.boot is not None and self.boot.is_alive() and not self.dead:
            self.boot.join(0.05)   # behind the bundle, unless the host is found broken
        assert self.chan is not None
        # the lock may be held by a writer stuck on a host that stopped reading (a frozen
        # sshd): once that host is called lost, give up instead of queueing behind it
        while not self.wlock.acquire(timeout=0.5):
            if self.dead:
                raise self.dead
        try:
            if self.dead:
                raise self.dead
            self.chan.write(data)
        finally:
            self.wlock.release()

    def submit(self, command: str, stream: Stream | None = None,
               **fields: Any) -> tuple[int, Pending]:
        """Send a request; its Pending fills in when the reply comes. `stream` gets what
        the host streams for it until the reply (a command's output, a pull's files)."""
        id, p = self._register(command, stream)
        self.send(protocol.request(command, id, **fields))
        return id, p

    def try_submit(self, command: str, **fields: Any) -> bool:
        """Send a request only if it goes at once: not behind another writer (one stuck
        on a host that stopped reading holds the write lock), not into a full window, not
        before the agent runs. False: not sent. For a last word at a close, which must
        never wait on a busy or frozen host (Ctrl-C during a push)."""
        if self.chan is None or self.dead or (self.boot is not None and self.boot.is_alive()):
            return False
        if not self.wlock.acquire(blocking=False):
            return False
        try:
            id, _ = self._register(command)
            data = protocol.request(command, id, **fields)
            if self.dead or not self.chan.room(len(data)):
                with self.plock:
                    self.pending.pop(id, None)
                return False
            self.chan.write(data)
            return True
        finally:
            self.wlock.release()

    def _register(self, command: str, stream: Stream | None = None) -> tuple[int, Pending]:
        """A request's id and Pending, in place before it is sent: its reply may be read first."""
        if self.dead:
            raise self.dead
        id, p = next(self.ids), Pending(command)
        with self.plock:
            if stream is not None and stream.takes_data:
                assert not any(s.takes_data for s in self.streams.values()), \
                    "one file-data stream at a time per link"
            self.pending[id] = p
            if stream is not None:
                self.streams[id] = stream
        return id, p

    def wait(self, p: Pending, timeout: float | None, bound: float | None = None) -> Body:
        """The reply; HostError when none came within `timeout`, said as `bound` seconds
        where the wait is what was left of a bound shared with other hosts."""
        if not p.done.wait(timeout):
            said = bound if bound is not None else timeout
            raise HostError(f"{self.name}: no answer to `{p.command}` within {said:g} s",
                            hint="check that the host is still reachable")
        if p.error is not None:
            raise p.error
        assert p.body is not None
        return p.body

    def request(self, command: str, timeout: float | None, **fields: Any) -> Body:
        return self.wait(self.submit(command, **fields)[1], timeout)

    def follow(self, sink: Any, **fields: Any) -> None:
        """Stream rank output and events into sink until the `done` event."""
        self.sink, self.follow_ranks = sink, frozenset(fields["ranks"])
        # follow_id is set before the request goes: the host's first events, or a refused
        # one that loses the host, may be read before send() returns, and the loss must
        # reach the sink (else the monitor waits for a host that is gone)
        self.follow_id, _ = self._register("follow")
        try:
            self.send(protocol.request("follow", self.follow_id, **fields))
        except BaseException:
            self.follow_id = None
            raise

    def close(self, wait: float = timeouts.CLOSE) -> None:
        """End the agent: its stdin closes, it finishes a running stop, then exits."""
        if self.close_input():
            self.finish(wait)

    def close_input(self) -> bool:
        """The agent's stdin closed (it ends once a running stop finished); False when
        there is nothing left to wait for (no agent: its channel is closed now)."""
        if self.chan is None:
            return False
        if self.boot is not None and self.boot.is_alive():
            # the host never read its bundle (no agent runs there): closing its stdin
            # would wait behind the blocked write; closing the channel ends both
            self.chan.close()
            return False
        try:
            self.chan.close_stdin()
        except Exception:  # closing is best effort: the host may be gone
            pass
        return True

    def finish(self, wait: float) -> None:
        """After close_input: the agent's end waited for (at most `wait`, not at all on a
        dead link), then its channel closed."""
        assert self.chan is not None
        try:
            if wait and not self.dead:
                self.chan.wait_exit(wait)
        except Exception:  # closing is best effort: the host may be gone
            pass
        self.chan.close()
