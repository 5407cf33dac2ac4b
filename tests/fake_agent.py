"""An in-process fake of a host's agent behind the real Link: unit tests of controller
logic (Session, watch) without processes or SSH. The fake speaks protocol.py frames;
each test scripts what its hosts answer."""
from __future__ import annotations

import queue
import struct
import threading
import time
from functools import partial
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
        # how each request is answered (a FakeCluster puts its own here)
        self.answer: Callable[[FakeChannel, dict], None] = self.dispatch
        self.spec: dict | None = None            # the launch spec this host was sent
        self.stopped = threading.Event()         # a stop reached this host
        self.receiving = (0, 0)                  # a push: its request id, files so far
        self.push(protocol.hello(bundle()[1]))

    def dispatch(self, chan: FakeChannel, msg: dict) -> None:
        self.handlers[msg["t"]](chan, msg)

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
                self.answer(self, msg)

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


def later(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()
    return timer


def session_maker(handlers: dict[str, Callable[[FakeChannel, dict], None]],
                  down: int | None = None,
                  asked: list[str] | None = None) -> Callable[..., Session]:
    """`new_session` for the commands (monkeypatched into api.jobs, which every call
    opens its sessions through): in-process agents answering with `handlers`; host
    `down` cannot be reached; `asked` gets each host's label as it is connected to."""
    def connector(host: Any) -> FakeTransport:
        if asked is not None:
            asked.append(host.label)
        if host.index == down:
            raise HostError(f"{host.label}: connection refused")
        return FakeTransport(host, handlers)

    def new_session(cluster: Any, state: Any = None) -> Session:
        return Session(cluster, state, connector=connector)
    return new_session


# ---------------------------------------------------------------- a whole fake cluster
#
# The commands open their own sessions (`orch up`, each attempt of a restart, the spares'
# preflight, `orch stop`): FakeCluster.install makes every Session without a connector
# reach in-process agents, one per host label, which answer each step of `up` as a
# healthy host does. A test changes what one host (or all) answers with `on(...)`, and
# reads what each host was asked in `log`.

RankPlan = Callable[[str, int, dict], "int | None"]


def preflight_body(chan: FakeChannel, msg: dict, **extra: Any) -> dict:
    """A healthy host's preflight reply (the master port where it was asked for)."""
    body: dict[str, Any] = {
        "python": "3.11.0", "executable": "/usr/bin/python3", "torch": "2.3.0",
        "job_dir": msg["job_dir"], "gpus": 0, "writable": None, "time": time.time() + chan.skew,
        "hostname": chan.host.label, "ssh_connection": "", "running": False}
    if msg["want_port"]:
        body.update(port=msg["master_port"] or 29500, port_free=True)
    body.update(extra)
    return body


def preflight(chan: FakeChannel, msg: dict) -> None:
    chan.push(protocol.reply(msg["id"], preflight_body(chan, msg)))


def receive(chan: FakeChannel, msg: dict) -> None:
    """A push: the stream's `file`, `link` and `files` items (data frames skipped) until
    its `end`."""
    chan.receiving = (msg["id"], 0)


def stream_file(chan: FakeChannel, msg: dict) -> None:
    rid, n = chan.receiving
    chan.receiving = (rid, n + 1)


def stream_batch(chan: FakeChannel, msg: dict) -> None:
    """A `files` batch: its files counted (its data frame skipped)."""
    rid, n = chan.receiving
    chan.receiving = (rid, n + len(msg["f"]))


def stream_end(chan: FakeChannel, msg: dict) -> None:
    rid, n = chan.receiving
    chan.push(protocol.reply(rid, {"files": n, "bytes": 0, "deleted": len(msg["delete"])}))


def launch(chan: FakeChannel, msg: dict) -> None:
    chan.spec = msg["spec"]
    chan.push(protocol.reply(msg["id"], {"supervisor": {
        "pid": 4242, "pgid": 4242, "start_ticks": None, "torchrun_pid": 4243,
        "run_id": msg["spec"]["run_id"], "started": time.time()}}))


def stop_reply(chan: FakeChannel, msg: dict) -> None:
    chan.stopped.set()
    chan.push(protocol.reply(msg["id"], {"found": 2, "killed": 0, "left": [], "seconds": 0.0}))


def status_reply(chan: FakeChannel, msg: dict) -> None:
    """Nothing of the job runs here (no supervisor): its ranks ended; the error file,
    if asked for, is empty."""
    ranks = [{"rank": r, "state": "exited", "last_line": "", "code": 1} for r in msg["ranks"]]
    chan.push(protocol.reply(msg["id"], {"supervisor": None, "host_exit": None,
                                         "time": time.time() + chan.skew, "ranks": ranks}))


def pull_manifest(chan: FakeChannel, msg: dict) -> None:
    chan.push(protocol.reply(msg["id"], {"root": "/", "files": 0, "bytes": 0, "skipped": [],
                                         "skipped_count": 0}))


def reply_with(body: dict) -> Handler:
    return lambda chan, msg: chan.push(protocol.reply(msg["id"], body))


HEALTHY: dict[str, Handler] = {
    "preflight": preflight, "receive": receive, "file": stream_file, "link": stream_file,
    "files": stream_batch, "end": stream_end, "launch": launch, "stop": stop_reply, "status": status_reply,
    "pull_manifest": pull_manifest,
    "setup": reply_with({"skipped": False, "code": 0, "failed": None, "shell": "/bin/sh",
                         "seconds": 0.0}),
    "probe": reply_with({"executable": "/usr/bin/python3", "torch": "2.3.0",
                         "entrypoint": None, "error": None}),
    "gpu_release": reply_with({"released": True}),
}


def lose(chan: FakeChannel, msg: dict) -> None:
    """The host is gone from now on (its connection drops): what waits on it fails."""
    chan.close()


def ignore(chan: FakeChannel, msg: dict) -> None:
    """The host takes the request and never answers (a frozen agent)."""


class FakeCluster:
    """Every host an in-process agent, answering by its label in every session a command
    opens (a restart's attempts, the spares' preflight).
    `ranks(label, rank, env)` says how each launched rank ends: an exit code (at once,
    after its first line) or None (it runs until a stop ends it); `env` is the launch
    spec's, so a test can tell a restart (ORCH_RESTART_COUNT) from the first attempt."""

    def __init__(self, ranks: RankPlan | None = None) -> None:
        self.ranks: RankPlan = ranks or (lambda label, rank, env: 0)
        self.overrides: dict[str | None, dict[str, Handler]] = {}
        self.down: set[str] = set()          # labels that refuse the connection
        self.tried: list[str] = []           # every connection asked for, by label
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, dict]] = []   # (label, request, message), in order
        self.exit_times: dict[int, float] = {}   # rank -> our time of its exit (default: now)
        self.late: dict[int, float] = {}         # rank -> seconds its exit event comes late
        self.skew: dict[str, float] = {}         # label -> its clock minus ours (seconds)

    def on(self, t: str, handler: Handler, label: str | None = None) -> FakeCluster:
        """`label`'s (None: every host's) answer to request `t`."""
        self.overrides.setdefault(label, {})[t] = handler
        return self

    def handler(self, label: str, t: str) -> Handler:
        for key in (label, None):
            if t in self.overrides.get(key, {}):
                return self.overrides[key][t]
        return {**HEALTHY, "follow": self.follow}.get(t) or DEFAULTS[t]

    def connector(self, host: Host) -> FakeTransport:
        self.tried.append(host.label)
        if host.label in self.down:
            raise HostError(f"{host.label}: connection refused",
                            hint="check that sshd runs there")
        transport = FakeTransport(host, {})
        transport.channel.answer = self.answer
        transport.channel.skew = self.skew.get(host.label, 0.0)
        return transport

    def answer(self, chan: FakeChannel, msg: dict) -> None:
        label = chan.host.label
        with self.lock:
            self.log.append((label, msg["t"], msg))
        self.handler(label, msg["t"])(chan, msg)

    def install(self, monkeypatch: Any) -> FakeCluster:
        """Every Session opened without a connector reaches these agents, not SSH."""
        monkeypatch.setattr(Session, "_ssh", lambda session, hosts: (self.connector, _nothing))
        return self

    def follow(self, chan: FakeChannel, msg: dict) -> None:
        """Each rank's first line, then its exit as `ranks` says (its event `late[rank]`
        seconds late, its time `exit_times[rank]`); the ranks that run on end when the
        host is stopped (after_stop); `done` once every rank has ended."""
        env = chan.spec.get("env", {}) if chan.spec else {}
        plan = {r: self.ranks(chan.host.label, r, env) for r in msg["ranks"]}
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
        timers: list[threading.Timer] = []
        for r, code in plan.items():
            if code is not None:
                when = self.exit_times.get(r, time.time()) + chan.skew
                ev = protocol.event("exit", rank=r, code=code, time=when)
                if r in self.late:
                    timers.append(later(self.late[r], partial(chan.push, ev)))
                else:
                    chan.push(ev)

        def end() -> None:
            for timer in timers:   # a host's `done` comes after all its exits
                timer.join(30)
            running = [r for r, code in plan.items() if code is None]
            if running:
                chan.stopped.wait(30)
            for r in running:
                chan.push(protocol.event("exit", rank=r, code=-15, time=time.time() + chan.skew,
                                         after_stop=True))
            worst = any(code for code in plan.values())
            chan.push(protocol.event("done", code=1 if worst or running else 0, time=time.time()))
        threading.Thread(target=end, daemon=True).start()

    def requests(self, t: str, label: str | None = None) -> list[dict]:
        with self.lock:
            return [m for who, kind, m in self.log if kind == t and label in (None, who)]

    def asked(self, t: str) -> dict[str, int]:
        """How many `t` requests each host got (hosts that got none left out)."""
        out: dict[str, int] = {}
        for who, kind, _ in list(self.log):
            if kind == t:
                out[who] = out.get(who, 0) + 1
        return out


def _nothing() -> None:
    pass
