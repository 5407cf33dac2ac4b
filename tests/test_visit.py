"""Over in-process fake agents: Session.visit, a one-shot question of every host (`orch
status`) holds at most `limit` agents at once, lets every one go, and tells a host not
reached (the session's `failed`) from one that did not answer (the result's); a launch
goes to every host before any reply is awaited (ask_all)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from fake_agent import FakeTransport
from orchestrator.config.inventory import parse
from orchestrator.errors import HostError
from orchestrator.session.session import Session
from orchestrator.wire import protocol

HOSTS = 40


def inventory(tmp_path: Path):
    hosts = "\n".join(f"  - {{address: 127.0.2.{i + 1}, connection: local, remote_dir: /r{i}}}"
                      for i in range(HOSTS))
    return parse(f"name: many\nhosts:\n{hosts}\njob: {{entrypoint: job.py}}\n",
                 tmp_path / "cluster.yaml")


class Counted:
    """A connector whose transports count how many hosts are held at once."""

    def __init__(self, handlers: dict, down: int) -> None:
        self.handlers, self.down = handlers, down
        self.lock = threading.Lock()
        self.alive = self.peak = 0
        self.made: list[FakeTransport] = []

    def __call__(self, host) -> FakeTransport:
        if host.index == self.down:
            raise HostError(f"{host.label}: connection refused")
        transport = FakeTransport(host, self.handlers)
        plain_close, closed = transport.close, threading.Event()

        def close() -> None:
            if not closed.is_set():
                closed.set()
                with self.lock:
                    self.alive -= 1
            plain_close()
        transport.close = close         # type: ignore[method-assign]
        with self.lock:
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            self.made.append(transport)
        return transport


def status(chan, msg: dict) -> None:
    if chan.host.index == 7:   # reached, but its agent cannot answer
        chan.push(protocol.error(msg["id"], protocol.HOST, "no such job folder"))
        return
    time.sleep(0.02)   # a host's answer takes a while: the turns overlap
    chan.push(protocol.reply(msg["id"], {"supervisor": None, "host_exit": None,
                                         "time": time.time(), "ranks": []}))


def test_visit_holds_at_most_limit_hosts_and_lets_every_one_go(tmp_path: Path) -> None:
    cluster = inventory(tmp_path)
    connector = Counted({"status": status}, down=3)
    session = Session(cluster, connector=connector)
    result = session.visit(session.status_on, limit=8)
    assert 2 <= connector.peak <= 8, connector.peak   # overlapping, and never past the limit
    assert sorted(result.ok) == [i for i in range(HOSTS) if i not in (3, 7)]
    assert list(result.failed) == [7] and "no such job folder" in str(result.failed[7])
    assert list(session.failed) == [3] and "connection refused" in str(session.failed[3])
    assert connector.alive == 0 and len(connector.made) == HOSTS - 1
    assert all(t.channel.stdin_closed_at is not None for t in connector.made)   # each agent ended
    assert session.links == {}   # nothing left for close()
    session.close()


def test_a_launch_reaches_every_host_before_any_reply_is_awaited(tmp_path: Path) -> None:
    """300 hosts, more than a fan-out's 256 threads: every host holds its launch reply
    until all 300 launches have arrived. In waves, the last 44 would be sent only once
    the first 256 had answered, and none ever would."""
    from orchestrator.session.preflight import HostInfo, PreflightReport
    hosts = "\n".join(f"  - {{address: 127.0.{2 + i // 250}.{1 + i % 250}, connection: local, "
                      f"remote_dir: /r{i}}}" for i in range(300))
    cluster = parse(f"name: wide\nhosts:\n{hosts}\njob: {{entrypoint: job.py}}\n",
                    tmp_path / "cluster.yaml")
    arrived: list = []
    lock, everyone = threading.Lock(), threading.Event()

    def launch(chan, msg: dict) -> None:
        def answer() -> None:
            everyone.wait(20)
            chan.push(protocol.reply(msg["id"], {"supervisor": {
                "pid": 10, "pgid": 10, "start_ticks": None, "torchrun_pid": 11,
                "run_id": msg["spec"]["run_id"], "started": time.time()}}))
        with lock:
            arrived.append(chan.host.index)
            if len(arrived) == len(cluster.hosts):
                everyone.set()
        threading.Thread(target=answer, daemon=True).start()
    session = Session(cluster, connector=lambda h: FakeTransport(h, {"launch": launch})).open()
    try:
        infos = {h.index: HostInfo(f"/r{h.index}/wide", "/usr/bin/python3", "2.0", 0, 0.0,
                                   False, "", {}) for h in cluster.hosts}
        t0 = time.monotonic()
        _, supervisors = session.launch(PreflightReport(infos, 29500))
        assert time.monotonic() - t0 < 15 and everyone.is_set()
    finally:
        session.close()
    assert sorted(supervisors) == list(range(300)) and sorted(arrived) == list(range(300))


def test_hosts_let_go_take_their_last_looks_a_few_at_a_time(tmp_path: Path) -> None:
    """release() returns at once for every host; their last looks run in the background,
    LOOKS_AT_ONCE at most together (all of them at once loaded every host together)."""
    from orchestrator.session import session as session_mod
    cluster = inventory(tmp_path)
    session = Session(cluster, connector=lambda h: FakeTransport(h, {})).open()
    lock, now, peak, done = threading.Lock(), [0], [0], []

    def hook(index: int):   # type: ignore[no-untyped-def]
        def look(link) -> None:   # type: ignore[no-untyped-def]
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            time.sleep(0.05)
            with lock:
                now[0] -= 1
                done.append(index)
        return look
    session.before_release.append(hook)
    t0 = time.monotonic()
    for i in range(HOSTS):
        session.release(i)
    assert time.monotonic() - t0 < 1.0 and session.links == {}
    session.close()
    for th in session.releasing:
        th.join(10)
    assert sorted(done) == list(range(HOSTS))
    assert 2 <= peak[0] <= session_mod.LOOKS_AT_ONCE, peak


def test_close_waits_for_hosts_let_go_by_one_deadline(tmp_path: Path) -> None:
    """Hosts let go whose last looks hang: close() waits for them all by one deadline
    (about CLOSE + 1 s), not that long for each in turn."""
    cluster = inventory(tmp_path)
    session = Session(cluster, connector=lambda h: FakeTransport(h, {})).open()
    hung = threading.Event()

    def hook(index: int):   # type: ignore[no-untyped-def]
        def look(link) -> None:   # type: ignore[no-untyped-def]
            hung.wait(30)
        return look
    session.before_release.append(hook)
    for i in range(10):
        session.release(i)
    t0 = time.monotonic()
    session.close()
    took = time.monotonic() - t0
    hung.set()
    assert took < 4.0, took
