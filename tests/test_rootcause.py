"""The root cause over in-process fake agents (tests/fake_agent.py) whose clocks are 5 s
off ours, with a preflight offset that is wrong, and with a consequence's exit event
arriving before the real failure's: the failing rank is always named; orch's own stop
never is; a host that went silent first is named; the lost-host report says what was
not stopped and how to finish it."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import fake_agent
from fake_agent import FakeChannel, FakeTransport, later
from orchestrator.commands.uprender import attach
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_JOB_FAILED
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.state import HostState, JobState
from orchestrator.watch.clock import HostClock
from orchestrator.watch.rootcause import Exit, verdict
from orchestrator.wire import protocol, timeouts

SUP = Supervisor(1, 1, None, 2, "run", 0.0)   # a launched host's supervisor

INVENTORY = """name: fake
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: localhost, connection: local, remote_dir: /r1, procs: 2}
job: {entrypoint: job.py}
"""
SKEW = {0: 5.0, 1: -5.0}     # host 0 runs 5 s ahead of us, host 1 5 s behind


def run_job(tmp_path: Path, handlers: dict) -> tuple[int, dict, dict]:
    """attach() over two fake hosts with SKEW; the state's offsets are 0 (as if preflight
    had measured them before the clocks stepped). (exit code, transports, requests)."""
    cluster = parse(INVENTORY, tmp_path / "cluster.yaml")
    transports: dict[int, FakeTransport] = {}

    def connector(host):
        t = FakeTransport(host, handlers)
        t.channel.skew = SKEW[host.index]
        transports[host.index] = t
        return t
    state = JobState("fake", "run", str(tmp_path / "cluster.yaml"), 0.0, 4, "127.0.0.1", 29500,
                     [HostState(h.index, h.label, f"/r{h.index}/fake", list(h.ranks), 0.0, SUP)
                      for h in cluster.hosts])
    session = Session(cluster, state, connector=connector).open()
    try:
        code = attach(session, state)
    finally:
        session.close()
    requests = {i: [m["t"] for m in t.channel.requests] for i, t in transports.items()}
    return code, transports, requests


def handlers(*, fail: tuple[int, int, float, float] | None, stopped: threading.Event,
             silent: int | None = None, consequence: tuple[int, int, float] | None = None) -> dict:
    """fail = (rank, code, seconds after start, seconds its event is delayed);
    consequence = (rank, code, seconds after start): a failure caused by the first one
    (an NCCL error) whose event arrives at once; `silent`: a host that sends nothing
    after its first lines (frozen). Every other rank runs until a stop ends it."""
    t0 = time.time()

    def follow(chan: FakeChannel, msg: dict) -> None:
        skew = chan.skew
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
        if chan.host.index == silent:
            return                               # frozen: no beat, no exit, ever
        ended = set()
        failed = threading.Event()   # the failure's exit event is out
        if fail and fail[0] in msg["ranks"]:
            rank, code, at, delay = fail
            ended.add(rank)

            def exit_event() -> None:
                chan.push(protocol.event("exit", rank=rank, code=code, time=t0 + at + skew))
                failed.set()
            later(since(t0, at + delay), exit_event)
        if consequence and consequence[0] in msg["ranks"]:
            crank, ccode, cat = consequence
            ended.add(crank)
            later(since(t0, cat), lambda: chan.push(protocol.event(
                "exit", rank=crank, code=ccode, time=t0 + cat + skew)))

        def beat() -> None:
            while not stopped.wait(0.3):
                chan.push(protocol.event("beat", time=time.time() + skew))

        def end() -> None:
            stopped.wait(30)
            if fail and fail[0] in msg["ranks"]:   # a host's `done` comes after all its exits
                failed.wait(30)
            stop_at = time.time() + skew
            for r in msg["ranks"]:
                if r not in ended:   # killed by the stop: tagged by the host
                    chan.push(protocol.event("exit", rank=r, code=-15, time=stop_at + 0.01,
                                             after_stop=True))
            chan.push(protocol.event("done", code=1))
        threading.Thread(target=beat, daemon=True).start()
        threading.Thread(target=end, daemon=True).start()

    def stop(chan: FakeChannel, msg: dict) -> None:
        if chan.host.index == silent:
            return                               # frozen: the stop is never answered
        stopped.set()
        chan.push(protocol.reply(msg["id"], {"found": 2, "killed": 0, "left": [], "seconds": 0.1}))

    def status(chan: FakeChannel, msg: dict) -> None:
        ranks = [{"rank": r, "state": "exited", "last_line": "", "code": 3} for r in msg["ranks"]]
        chan.push(protocol.reply(msg["id"], {"supervisor": None, "host_exit": None,
                                             "time": time.time(), "ranks": ranks}))
    def clock(chan: FakeChannel, msg: dict) -> None:
        if chan.host.index != silent:
            fake_agent.clock(chan, msg)
    return {"follow": follow, "stop": stop, "status": status, "clock": clock}


def since(t0: float, at: float) -> float:
    """Seconds from now until `at` seconds after t0: every timer of a job counts from the
    same start, however late (under load) a host's follow begins."""
    return max(0.0, t0 + at - time.time())


def flat(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_skewed_clocks_and_a_late_event_still_name_the_failing_rank(tmp_path, capsys) -> None:
    """Rank 1 (host 0, 5 s ahead) exits 3 at 0.6 s, its event 0.8 s late; rank 2 (host 1,
    5 s behind) fails 0.3 s later as a consequence and is heard first. By preflight's
    (stale, zero) offsets rank 2 would look 10 s earlier; the measured offsets say rank 1."""
    stopped = threading.Event()
    code, _, requests = run_job(tmp_path, handlers(fail=(1, 3, 0.6, 0.8), stopped=stopped,
                                                   consequence=(2, 1, 0.9)))
    err = flat(capsys)
    assert code == EXIT_JOB_FAILED
    assert "root cause rank 1 on host localhost#0 (local rank 1): exit code 3" in err, err
    assert "stopped the job on every host" in err
    assert all(r.count("clock") >= 2 and r.count("stop") == 1 for r in requests.values()), requests


def test_a_rank_our_stop_killed_is_never_the_cause(tmp_path, capsys) -> None:
    """Host 1's ranks die of the stop (SIGTERM) at host times 5 s before the failure as
    preflight's offset reads them; the host's after_stop tag keeps them out."""
    stopped = threading.Event()
    code, _, _ = run_job(tmp_path, handlers(fail=(0, 3, 0.5, 0.0), stopped=stopped))
    err = flat(capsys)
    assert code == EXIT_JOB_FAILED
    assert "root cause rank 0 on host localhost#0" in err and "SIGTERM" not in err, err


def test_a_frozen_host_is_the_root_cause_and_the_report_says_it_was_not_stopped(
        tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(timeouts, "HOST_LOST", 1.0)
    stopped = threading.Event()
    code, _, requests = run_job(tmp_path, handlers(fail=None, stopped=stopped, silent=1))
    err = flat(capsys)
    assert code == EXIT_JOB_FAILED
    assert "root cause host localhost#1: it went silent before any rank failed" in err, err
    assert "then rank" not in err and "root cause rank" not in err, err
    assert "stopped the job on 1 of 2 hosts" in err and "every host" not in err, err
    assert "NOT stopped on localhost#1" in err and "may still be running" in err
    assert "orch stop" in err and "ends them once the host is reachable again" in err, err
    assert "stop" not in requests[1] and requests[0].count("stop") == 1, requests


def test_a_failure_after_a_host_went_silent_is_a_consequence(tmp_path, capsys, monkeypatch) -> None:
    """Host 1 freezes at once; rank 0 on host 0 fails 1.5 s later (a collective timed
    out), more than a heartbeat after host 1's last frame: the silent host is named, the
    rank's failure is listed as what followed."""
    monkeypatch.setattr(timeouts, "HOST_LOST", 30.0)   # the failure is seen first
    monkeypatch.setattr(timeouts, "STOP_EXTRA", 0.5)
    # the silent host never answers the stop nor ends: the grace and the drain are waited
    # out whole (fake agents: nothing to give time to)
    monkeypatch.setattr(timeouts, "FAILFAST_GRACE", 0.2)
    monkeypatch.setattr(timeouts, "DRAIN", 0.5)
    stopped = threading.Event()
    code, _, _ = run_job(tmp_path, handlers(fail=(0, 1, 1.5, 0.0), stopped=stopped, silent=1))
    assert code == EXIT_JOB_FAILED
    err = flat(capsys)
    assert "root cause host localhost#1" in err, err
    assert "then rank 0 on localhost#0 (exit code 1): a consequence" in err, err
    assert "NOT stopped on localhost#1 (lost: no answer to the stop" in err, err


# ---------------------------------------------------------------- the logic alone

def clock(offset: float, unc: float) -> HostClock:
    c = HostClock()
    c.add(100.0 - unc, 100.0 + offset, 100.0 + unc)
    return c


def test_failures_closer_than_the_clock_uncertainty_are_reported_together() -> None:
    clocks = {0: clock(5.0, 0.03), 1: clock(-5.0, 0.03)}
    exits = [Exit(0, 3, 1, 205.02), Exit(1, 7, 1, 195.0), Exit(1, 6, -15, 190.0, after_stop=True)]
    v = verdict(exits, clocks, None, {})
    assert [f.rank for f in v.failures] == [7, 3] and not v.later
    # with tight clocks the same 20 ms are an order
    v = verdict(exits, {0: clock(5.0, 0.001), 1: clock(-5.0, 0.001)}, None, {})
    assert [f.rank for f in v.failures] == [7] and [f.rank for f in v.later] == [3]


def test_the_min_round_trip_sample_wins_and_old_samples_expire() -> None:
    c = HostClock()
    c.add(0.0, 10.5, 1.0)        # rtt 1 s: offset 10 +- 0.5
    c.add(2.0, 12.02, 2.04)      # rtt 40 ms: offset 10.0 +- 0.02
    c.add(3.0, 14.0, 3.5)        # a slow reply (offset 10.75 +- 0.25) changes nothing
    assert c.offset == pytest.approx(10.0) and c.uncertainty == pytest.approx(0.02)
    c.add(500.0, 520.1, 500.2)   # much later: the clock stepped; the old samples are gone
    assert c.offset == pytest.approx(20.0) and len(c.samples) == 1


def test_a_host_lost_after_the_failure_is_not_the_cause() -> None:
    clocks = {0: clock(0.0, 0.01), 1: clock(0.0, 0.01)}
    v = verdict([Exit(0, 0, 3, 100.0)], clocks, None, {1: 100.5})
    assert [f.rank for f in v.failures] == [0] and v.also_lost == (1,) and not v.silent
    v = verdict([Exit(0, 0, 3, 100.0)], clocks, None, {1: 90.0})
    assert v.silent == (1,) and [f.rank for f in v.later] == [0]


def test_a_host_that_ended_well_is_released_and_not_stopped_later(tmp_path, capsys) -> None:
    """Host 1's ranks exit 0 and its torchrun ends (done, code 0): its agent is closed at
    once (watch.attach -> Session.release), not at the end. Rank 0 on host 0 fails later:
    the fail-fast stop goes to host 0 only, and the root cause is still rank 0."""
    stopped = threading.Event()
    base = handlers(fail=(0, 3, 0.8, 0.0), stopped=stopped)
    chans: dict[int, FakeChannel] = {}
    stop_at: list[float] = []

    def follow(chan: FakeChannel, msg: dict) -> None:
        chans[chan.host.index] = chan
        if chan.host.index == 0:
            # rank 0 fails only once host 1's agent was closed (or 10 s without it): an
            # order, not a wall-clock bound, so a loaded machine cannot fail the test
            def fail_later() -> None:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and (
                        1 not in chans or chans[1].stdin_closed_at is None):
                    time.sleep(0.01)
                base["follow"](chan, msg)
            threading.Thread(target=fail_later, daemon=True).start()
            return
        for r in msg["ranks"]:
            chan.push(protocol.event("exit", rank=r, code=0, time=time.time() + chan.skew))
        chan.push(protocol.event("done", code=0, time=time.time() + chan.skew))

    def stop(chan: FakeChannel, msg: dict) -> None:
        stop_at.append(time.monotonic())
        base["stop"](chan, msg)
    code, transports, requests = run_job(tmp_path, dict(base, follow=follow, stop=stop))
    err = flat(capsys)
    assert code == EXIT_JOB_FAILED
    assert "root cause rank 0 on host localhost#0" in err, err
    assert "stop" not in requests[1] and requests[0].count("stop") == 1, requests
    closed = transports[1].channel.stdin_closed_at
    assert closed is not None and len(stop_at) == 1 and closed < stop_at[0], \
        "host 1's agent was kept until the end"


def test_an_orch_stop_from_elsewhere_is_said_as_a_stop_not_a_failure(tmp_path) -> None:
    """torchrun killed by another command's `orch stop` before its ranks reported (one
    host): the cause is the stop, and no line calls the job failed."""
    from orchestrator.commands.uprender import cause_text
    from orchestrator.watch import events as ev
    cluster = parse(INVENTORY, tmp_path / "cluster.yaml")
    stop = ev.RootCause(0.0, "host", host="localhost#0", host_code=-9, user_stop=True,
                        host_log="run/host-0/torchrun.log")
    text = cause_text(cluster, stop)
    assert "was stopped by `orch stop`" in text and "ended with -9 after the stop" in text
    assert "failed" not in text and "before its ranks" not in text, text
    assert stop.summary() == "it was stopped by `orch stop`"
    unknown = ev.RootCause(0.0, "unknown", user_stop=True)
    assert "failed" not in cause_text(cluster, unknown)
    failed = ev.RootCause(0.0, "host", host="localhost#0", host_code=-9,
                          host_log="run/host-0/torchrun.log")
    assert "failed" in cause_text(cluster, failed) and "before its ranks" in cause_text(cluster, failed)
