"""`api.run` and `api.follow` over the fake cluster (tests/fake_agent.FakeCluster): the
events of a run in order, their times on the controller's clock (a host's clock an hour
off), JobError's root cause as a value for a rank failure, a lost host and a hang, a
restart seen as events, Ctrl-C, and a follow attached mid-run. Nothing waits for a
timeout: the watchdogs' clock (timeouts.CLOCK) is a fake one the tests move."""
from __future__ import annotations

import _thread
import threading
import time
from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeCluster
from helpers import FakeClock
from orchestrator import api
from orchestrator.api import healing
from orchestrator.watch import monitor
from orchestrator.watch.hang import HangWatch
from orchestrator.wire import protocol, timeouts
from test_controller_fake import HOSTS, SPARE, inventory, lose_while_running, lost_for_good
from test_up_golden import HANG, hung_follow, stacks


def run(path: str, **kw: object) -> tuple[list[api.Event], BaseException | None]:
    got: list[api.Event] = []
    try:
        api.run(path, on_event=got.append, **kw)  # type: ignore[arg-type]
    except (api.JobError, KeyboardInterrupt) as e:
        return got, e
    return got, None


def kinds(events: list[api.Event]) -> list[str]:
    return [type(e).__name__ for e in events]


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The watchdogs' clock (the push's stall, host-lost, the hang watch): it moves only
    when a test advances it."""
    fake = FakeClock()
    monkeypatch.setattr(timeouts, "CLOCK", fake)
    return fake


def test_the_events_of_a_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCluster().install(monkeypatch)
    fake.skew[HOSTS[1]] = 3600.0   # its clock an hour ahead: its exits' times are its own
    t0 = time.time()
    events, err = run(inventory(tmp_path))
    t1 = time.time()
    assert err is None and capsys.readouterr() == ("", ""), "api.run prints nothing"
    names = kinds(events)
    assert names[:4] == ["Synced"] * 3 + ["Started"], names
    assert names[-3:] == ["Succeeded", "Pulled", "Finished"], names
    middle = [e for e in events[4:-3]]
    assert sorted(kinds(middle)) == ["RankExited"] * 6 + ["RankLine"] * 6, names
    for rank in range(6):   # each rank's line before its exit, on its host
        mine = [e for e in middle if getattr(e, "rank", None) == rank]
        assert kinds(mine) == ["RankLine", "RankExited"], mine
        line = mine[0]
        assert isinstance(line, api.RankLine)
        assert line.host == HOSTS[rank // 2] and line.text == f"rank {rank} up"
    times = [e.time for e in events]   # on the controller's clock, the skewed host's too
    assert all(t0 - 1 <= t <= t1 + 1 for t in times), [(type(e).__name__, e.time - t0)
                                                       for e in events]
    assert times == sorted(times) or max(a - b for a, b in zip(times, times[1:])) < 1.0
    ended = [e for e in middle if isinstance(e, api.RankExited)]
    assert all(0 <= e.runtime < t1 - t0 + 1 for e in ended), ended
    end = events[-1]
    assert isinstance(end, api.Finished)
    result = end.result
    assert result.code == 0
    assert [(r.rank, r.code) for r in result.ranks] == [(r, 0) for r in range(6)]
    assert len(result.attempts) == 1 and result.attempts[0].cause is None
    assert result.pulled is not None and result.pull_error == ""


def test_a_rank_failure_is_a_job_error_with_its_root_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCluster(lambda label, rank, env: 3 if rank == 3 else None).install(monkeypatch)
    events, err = run(inventory(tmp_path), pull=False)
    assert isinstance(err, api.JobError) and err.exit_code == 1
    cause = err.cause
    assert isinstance(cause, api.RootCause) and cause.kind == "rank"
    first = cause.rank
    assert first is not None
    assert (first.rank, first.host, first.local_rank, first.code) == (3, HOSTS[1], 1, 3)
    assert first.last_lines == ("rank 3 up",)
    assert list(err.failures) == [3] and err.failures[3].code == 3
    assert isinstance(err.result, api.RunResult) and err.result.code == 1
    assert "rank 3 on 127.0.0.2 failed (exit code 3)" in str(err)
    # then the stopped ranks' exits, and the lines of hosts whose follow answered after
    # rank 3's host (each host's follow is its own thread: on a loaded machine a host's
    # first lines may come after the stop began)
    stopping = kinds(events).index("Stopping")
    after = [k for k in kinds(events)[stopping:] if k not in ("RankExited", "RankLine")]
    assert after == ["Stopping", "RootCause", "Stopped", "Finished"], after
    lines = sorted(e.rank for e in events if isinstance(e, api.RankLine))
    assert lines == list(range(6)), lines   # each rank's line once, none lost


def test_a_lost_host_is_a_job_error_naming_it(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    fake.on("follow", lose_while_running, HOSTS[1])
    events, err = run(inventory(tmp_path), pull=False)
    assert isinstance(err, api.JobError)
    assert err.cause.kind == "silent" and err.cause.silent == (HOSTS[1],)
    lost = [e for e in events if isinstance(e, api.HostLost)]
    assert [e.host for e in lost] == [HOSTS[1]]
    stopped = next(e for e in events if isinstance(e, api.Stopped))
    assert [label for label, _ in stopped.not_stopped] == [HOSTS[1]]


def test_a_hang_is_a_job_error_with_the_stacks_and_the_culprit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """A 10-minute hang_timeout passed on the fake clock once every rank has printed:
    found at once, not after ten minutes."""
    # a link stamps its frames on the real clock: ten fake minutes on would make every
    # host silent for the host-lost watchdog, which is not what this test looks at
    monkeypatch.setattr(timeouts, "HOST_LOST", 3600.0)
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    fake.on("follow", hung_follow(threading.Event())).on("stacks", stacks)
    progressed: set[int] = set()

    class Watch(HangWatch):
        def progress(self, rank: int, heartbeat: bool = False) -> None:
            super().progress(rank, heartbeat)
            if rank not in progressed:
                progressed.add(rank)
                if len(progressed) == 6:   # every rank's line is in, then nothing more
                    clock.advance(601)
    monkeypatch.setattr(monitor, "HangWatch", Watch)
    t0 = time.monotonic()
    events, err = run(inventory(tmp_path, HANG.replace("hang_timeout: 1", "hang_timeout: 600")),
                      pull=False)
    assert time.monotonic() - t0 < 300, "the hang was waited for on the real clock"
    assert isinstance(err, api.JobError) and err.cause.kind == "hang"
    hang = err.cause.hang
    assert [(c.rank, c.host, c.local_rank) for c in hang.culprits] == [(3, HOSTS[1], 1)]
    assert sorted(hang.report.stacks) == list(range(6))
    assert "train_step" in hang.report.stacks[3].text
    names = kinds(events)
    assert names.index("HangSuspected") < names.index("Hang") < names.index("Stopped")


def test_a_restart_on_a_spare_is_seen_as_events(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(healing, "backoff", lambda attempt: 0.0)
    fake = FakeCluster(lambda label, rank, env: (
        None if env["ORCH_RESTART_COUNT"] == "0" else 0)).install(monkeypatch)
    lost_for_good(fake, HOSTS[1])
    events, err = run(inventory(tmp_path, SPARE), restarts=1, pull=False)
    assert err is None
    restart = next(e for e in events if isinstance(e, api.Restarting))
    assert (restart.attempt, restart.restarts) == (1, 1)
    assert restart.cause == f"host {HOSTS[1]} went silent"
    assert restart.hosts == (HOSTS[0], "127.0.0.9", HOSTS[2])
    started = [e for e in events if isinstance(e, api.Started)]
    assert [(s.attempt, [h.label for h in s.hosts]) for s in started] == [
        (0, list(HOSTS)), (1, [HOSTS[0], "127.0.0.9", HOSTS[2]])]
    spares = next(e for e in events if isinstance(e, api.Spares))
    assert spares.ready == ("127.0.0.9",)
    end = events[-1]
    assert isinstance(end, api.Finished)
    result = end.result
    assert [a.why for a in result.attempts] == [f"host {HOSTS[1]} went silent", ""]


def test_ctrl_c_stops_the_job_everywhere_then_is_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    once = threading.Event()

    def press(e: api.Event) -> None:
        if isinstance(e, api.RankLine) and not once.is_set():
            once.set()
            _thread.interrupt_main()
    events: list[api.Event] = []

    def seen(e: api.Event) -> None:
        events.append(e)
        press(e)
    with pytest.raises(KeyboardInterrupt):
        api.run(inventory(tmp_path), on_event=seen)
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 1), fake.log
    stopped = [e for e in events if isinstance(e, api.Stopped)]
    assert [s.why for s in stopped] == ["interrupt"] and len(stopped[0].reports) == 3


def exits_later(seen: threading.Event):   # type: ignore[no-untyped-def]
    """Each rank prints a line; once the follower has `seen` them all, a second line, then
    rank 3 fails and the others end well."""
    def follow(chan: FakeChannel, msg: dict) -> None:
        threading.Thread(target=run, args=(chan, msg), daemon=True).start()

    def run(chan: FakeChannel, msg: dict) -> None:
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
        seen.wait(30)
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d later\n" % r))
            chan.push(protocol.event("exit", rank=r, code=3 if r == 3 else 0, time=time.time()))
        chan.push(protocol.event("done", code=1 if 3 in msg["ranks"] else 0, time=time.time()))
    return follow


def test_follow_attaches_to_a_running_job(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A detached job followed from its state: every rank's lines, its exits, and once
    it ended the root cause; nothing is stopped (follow only watches)."""
    fake = FakeCluster().install(monkeypatch)
    seen = threading.Event()
    fake.on("follow", exits_later(seen))
    path = inventory(tmp_path)
    api.up(path)
    events: list[api.Event] = []
    for e in api.follow(path):   # the job runs on until the first lines are read here
        events.append(e)
        if kinds(events).count("RankLine") == 6:
            assert not any(isinstance(x, api.RankExited) for x in events), events
            seen.set()
    lines = [(e.rank, e.text) for e in events if isinstance(e, api.RankLine)]
    assert sorted(lines) == sorted([(r, f"rank {r} up") for r in range(6)]
                                   + [(r, f"rank {r} later") for r in range(6)])
    assert sorted(e.rank for e in events if isinstance(e, api.RankExited)) == list(range(6))
    cause = events[-1]
    assert isinstance(cause, api.RootCause) and cause.kind == "rank"
    assert cause.rank is not None and cause.rank.rank == 3
    assert not fake.requests("stop")


def test_bad_options_are_refused_before_any_host_is_asked(tmp_path: Path) -> None:
    path = inventory(tmp_path)
    with pytest.raises(api.UsageError, match="hang_timeout must be a number of seconds"):
        api.run(path, hang_timeout=0)
    with pytest.raises(api.UsageError, match="restarts=-1: must be 0 or more"):
        api.run(path, restarts=-1)
