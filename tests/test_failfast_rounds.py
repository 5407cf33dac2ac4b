"""Fail-fast at 300 hosts over in-process fake agents (tests/fake_agent.py): what goes out
between a rank's failure and every host's stop, counted in requests and rounds, not in
seconds. Every stop is in flight at once (no waves behind a fan-out's thread limit), the
fresh clock samples before the verdict are asked only of the failed rank's host (not
two rounds to every host), and the curves' fetch starts no round during the stop."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeCluster, FakeTransport, later, stop_reply
from orchestrator import api
from orchestrator.agent import procs
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_JOB_FAILED
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.state import HostState, JobState
from orchestrator.watch import curvefetch, monitor
from orchestrator.wire import protocol, timeouts
from test_controller_fake import HOSTS as THREE_HOSTS
from test_controller_fake import inventory as three_hosts

HOSTS = 300      # past fan_out's 256 threads: a second wave would show
FAILING = 1      # rank 1 (host 1) exits 3; every other rank runs until the stop
HELD = 10.0      # a stop's reply waits this long at most for the others to arrive


def inventory(tmp_path: Path) -> str:
    lines = [f"  - {{address: 127.0.{1 + i // 250}.{1 + i % 250}, connection: local, "
             f"remote_dir: /r{i}, procs: 1}}" for i in range(HOSTS)]
    return "name: wide\nhosts:\n" + "\n".join(lines) + "\njob: {entrypoint: job.py}\n"


class Hosts:
    """The fake agents' answers, and what they were asked. Each stop's reply is held
    until every host's stop has arrived (or HELD seconds pass): the stops went out in
    one round only if `all_in` is set before the first reply."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: list[tuple[FakeChannel, int]] = []
        self.all_in = threading.Event()
        self.asked: Counter[tuple[int, str]] = Counter()
        self.stopped = threading.Event()

    def handlers(self) -> dict:
        return {"follow": self.follow, "stop": self.stop, "status": self.status,
                "clock": self.clock}

    def count(self, chan: FakeChannel, msg: dict) -> None:
        with self.lock:
            self.asked[(chan.host.index, msg["t"])] += 1

    def follow(self, chan: FakeChannel, msg: dict) -> None:
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
        if FAILING in msg["ranks"]:
            later(0.3, lambda: chan.push(protocol.event("exit", rank=FAILING, code=3,
                                                        time=time.time())))

        def end() -> None:
            self.stopped.wait(60)
            for r in msg["ranks"]:
                if r != FAILING:
                    chan.push(protocol.event("exit", rank=r, code=-15, time=time.time(),
                                             after_stop=True))
            chan.push(protocol.event("done", code=1, time=time.time()))
        threading.Thread(target=end, daemon=True).start()

    def stop(self, chan: FakeChannel, msg: dict) -> None:
        self.count(chan, msg)
        with self.lock:
            if not self.held and not self.stopped.is_set():   # the first stop
                later(HELD, self.release)   # waves: the replies come, all_in stays unset
            self.held.append((chan, msg["id"]))
            if len(self.held) == HOSTS:
                self.all_in.set()
        if self.all_in.is_set():
            self.release()

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        self.stopped.set()
        for chan, rid in held:
            chan.push(protocol.reply(rid, {"found": 1, "killed": 0, "left": [], "seconds": 0.0}))

    def status(self, chan: FakeChannel, msg: dict) -> None:
        self.count(chan, msg)
        ranks = [{"rank": r, "state": "exited", "last_line": "", "code": 3,
                  "error_file": "ValueError: bad batch"} for r in msg["ranks"]]
        chan.push(protocol.reply(msg["id"], {"supervisor": None, "host_exit": None,
                                             "time": time.time(), "ranks": ranks}))

    def clock(self, chan: FakeChannel, msg: dict) -> None:
        self.count(chan, msg)
        chan.push(protocol.reply(msg["id"], {"time": time.time()}))


def test_fail_fast_at_300_hosts_sends_every_stop_in_one_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the background clock rounds never start: every clock request counted is fail-fast's
    monkeypatch.setattr(timeouts, "CLOCK_FIRST", 3600.0)
    cluster = parse(inventory(tmp_path), tmp_path / "cluster.yaml")
    hosts = Hosts()
    sup = Supervisor(1, 1, None, 2, "run", 0.0)
    state = JobState("wide", "run", "cluster.yaml", 0.0, HOSTS, "127.0.1.1", 29500,
                     [HostState(h.index, h.label, f"/r{h.index}/wide", list(h.ranks), 0.0, sup)
                      for h in cluster.hosts])
    session = Session(cluster, state,
                      connector=lambda h: FakeTransport(h, hosts.handlers())).open()
    try:
        outcome = monitor.watch(session, state, lambda e: None)
    finally:
        session.close()
    assert outcome.code == EXIT_JOB_FAILED
    assert outcome.cause is not None and outcome.cause.rank is not None
    assert outcome.cause.rank.rank == FAILING, outcome.cause
    stops = {i for (i, t), n in hosts.asked.items() if t == "stop" and n == 1}
    assert stops == set(range(HOSTS)), f"{HOSTS - len(stops)} hosts not stopped once"
    assert hosts.all_in.is_set(), "the stops went out in waves: some waited for replies"
    clocks = {i: n for (i, t), n in hosts.asked.items() if t == "clock"}
    assert clocks == {FAILING: 2}, f"fresh clock samples asked of {len(clocks)} hosts"
    assert {i for (i, t) in hosts.asked if t == "status"} == {FAILING}


def test_no_round_of_the_curves_fetch_starts_during_the_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The curves' fetch asks every host every round (here every 50 ms); from the stop
    on, it starts no new round: each host gets at most the round in flight and the last
    one (after the watch) while its stop takes a second, and rank 0's pull besides."""
    monkeypatch.setattr(curvefetch, "INTERVAL", 0.05)
    fake = FakeCluster(lambda label, rank, env: 3 if rank == 3 else None).install(monkeypatch)

    def slow_stop(chan: FakeChannel, msg: dict) -> None:
        later(1.0, lambda: stop_reply(chan, msg))
    fake.on("stop", slow_stop)
    with pytest.raises(api.JobError):
        api.run(three_hosts(tmp_path), on_event=lambda e: None)
    with fake.lock:
        log = list(fake.log)
    first_stop = next(k for k, (_, t, _) in enumerate(log) if t == "stop")
    after = Counter(label for label, t, _ in log[first_stop:] if t == "pull_manifest")
    assert fake.asked("stop") == dict.fromkeys(THREE_HOSTS, 1)
    assert all(n <= 3 for n in after.values()), after   # in flight, the last, rank 0's pull
    assert sum(after.values()) <= 2 * len(THREE_HOSTS) + 1, after


def test_the_curves_rounds_thin_out_past_200_hosts() -> None:
    assert [curvefetch.round_interval(n) for n in (3, 200, 300, 1000)] == [2.0, 2.0, 3.0, 10.0]


@pytest.mark.timing
def test_the_agents_stop_sleeps_until_an_exit_instead_of_polling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_gone (the stop's wait for the signalled processes) sleeps on their pidfds:
    each one's /proc/<pid>/stat is read a few times while they run 2 s, not 20 to 100
    times a second (at 300 hosts on one machine those reads were cores' worth)."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd here: the stop polls, as before")
    children = [subprocess.Popen(["sleep", "2"]) for _ in range(3)]
    reads = Counter[int]()
    real = procs.proc_start_time

    def counted(pid: int) -> int | None:
        reads[pid] += 1
        return real(pid)
    monkeypatch.setattr(procs, "proc_start_time", counted)
    try:
        left = procs.wait_gone("/nonexistent/orch-job", None, time.time() + 30,
                               [c.pid for c in children])
    finally:
        for c in children:
            c.kill()
            c.wait()
    assert left == []
    assert all(reads[c.pid] < 15 for c in children), reads   # polling: 40 or more each
