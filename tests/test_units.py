"""Unit tests of controller pieces that need no host: quoting, planning, parsing, ordering."""
from __future__ import annotations

import io
import shlex
import threading
import types
from pathlib import Path

from orchestrator.files.localfiles import LocalFile
from orchestrator.files.sync import plan
from orchestrator.remote.link import HostDone, Link
from orchestrator.remote.transport import remote_command
from orchestrator.watch.follow import HostStream, LineSink, Tracker
from orchestrator.watch.monitor import Monitor, follow_to_end, signal_name
from orchestrator.watch.rootcause import verdict
from orchestrator.wire import protocol


def test_remote_command_quotes_every_word_but_keeps_tilde() -> None:
    cmd = remote_command(["~/venv/bin/python", "-c", "print('a b'); $(rm -rf /)", "x;y"])
    assert cmd.startswith("~/")
    words = shlex.split(cmd)
    assert words[2] == "print('a b'); $(rm -rf /)"
    assert words[3] == "x;y"


def lf(rel: str, digest: str) -> LocalFile:
    return LocalFile(rel, "/nowhere/" + rel, 1, 0o644, digest)


def test_plan_sends_new_and_changed_deletes_extra() -> None:
    local = [lf("a", "1"), lf("b", "2"), lf("c", "3")]
    remote = {"a": [1, "1"], "b": [1, "old"], "gone": [1, "9"]}
    send, delete = plan(local, remote)
    assert [f.rel for f in send] == ["b", "c"]
    assert delete == ["gone"]


class Recorder(LineSink):
    """The product's LineSink turns output frames into lines; this records the calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def lines(self, host, rank, texts):
        self.calls.append(("L", rank, list(texts)))

    def rank_exit(self, host, rank, code, when):
        self.calls.append(("E", rank, code, when))

    def host_done(self, host, info):
        self.calls.append(("X", info))

    def host_lost(self, host, why):
        self.calls.append(("lost", why))


class FakeHost:
    index, label, python = 0, "h0", "python3"


def feed(link: Link, frames: bytes) -> None:
    """Frames as the agent sends them, through the link's own reader."""
    reader = protocol.FrameReader(io.BytesIO(frames).read)
    while (got := reader.read_frame()) is not None:
        link._dispatch(*got)


def test_parse_chunk_groups_lines_per_rank_and_keeps_order() -> None:
    rec = Recorder()
    stream = HostStream(link=None, job_dir="/j", ranks=[0, 1])  # type: ignore[arg-type]  # a test double
    link = Link.__new__(Link)
    link.host, link.sink, link.follow_ranks, link.follow_id = FakeHost(), None, frozenset(), None  # type: ignore[assignment]
    link.sink, link.follow_ranks = Tracker({0: stream}, rec), frozenset([0, 1])
    data = (protocol.output(0, b"a\nb c\n") + protocol.output(1, b"x\n") + protocol.event("beat")
            + protocol.output(0, b"\n") + protocol.output(1, b"long\nline", partial=True)
            + protocol.output(1, b"y\n\nz\n") + protocol.event("exit", rank=1, code=7, time=12.5)
            + protocol.event("done", code=1))
    feed(link, data)
    # one call per frame, in order; a partial frame is one piece, newlines and all
    assert rec.calls == [("L", 0, [b"a", b"b c"]), ("L", 1, [b"x"]), ("L", 0, [b""]),
                         ("L", 1, [b"long\nline"]), ("L", 1, [b"y", b"", b"z"]),
                         ("E", 1, 7, 12.5), ("X", HostDone(1))]
    assert stream.done


def first_failure(mon: Monitor):
    """(rank, code) of the root cause rank, as fail_fast decides it."""
    v = verdict(list(mon.exits.values()), mon.host_clocks(), mon.stop_started, {})
    return (v.failures[0].rank, v.failures[0].code) if v.failures else None


def bare_monitor(offsets: dict[int, float]) -> Monitor:
    from types import SimpleNamespace
    hosts = [SimpleNamespace(index=i, clock_offset=o) for i, o in offsets.items()]
    cluster = SimpleNamespace(hosts=[SimpleNamespace(label=f'h{i}') for i in offsets])
    return Monitor(cluster=cluster, state=SimpleNamespace(hosts=hosts, started=0.0))  # type: ignore[arg-type]  # a test double


def test_root_cause_is_earliest_failure_after_clock_correction() -> None:
    mon = bare_monitor({0: 0.0, 1: 10.0})   # host 1's clock runs 10 s ahead of ours
    mon.rank_exit(0, 3, 7, 100.0)    # host 0: rank 3 failed at 100
    mon.rank_exit(1, 5, 1, 105.0)    # host 1 says 105, which is 95 here: the earliest
    mon.rank_exit(0, 0, 0, 90.0)     # a clean exit is never the cause
    assert first_failure(mon) == (5, 1)
    assert mon.failed()


class ExitThatLetsAnotherIn:
    """A rank's exit read by the main loop while a link's reader thread records the next
    one: reading `code` records rank 99's exit, as a thread switch there would."""

    def __init__(self, mon: Monitor) -> None:
        self.mon, self.after_stop = mon, False

    @property
    def code(self) -> int:
        if 99 not in self.mon.exits:
            self.mon.rank_exit(0, 99, 0, 101.0)
        return 0


def test_a_rank_exit_recorded_while_the_main_loop_reads_the_exits_breaks_nothing() -> None:
    """The links' reader threads add exits while `failed()`/`user_stopped()` read them:
    the readers see a copy ("dictionary changed size during iteration" at 300 hosts)."""
    for ask in (Monitor.failed, Monitor.user_stopped):
        mon = bare_monitor({0: 0.0})
        mon.rank_exit(0, 1, 0, 100.0)
        mon.exits[2] = ExitThatLetsAnotherIn(mon)   # type: ignore[assignment]  # a test double
        mon.rank_exit(0, 3, 0, 100.5)
        assert ask(mon) is False
        assert 99 in mon.exits


def test_signal_kill_loses_ties_to_real_exit_codes() -> None:
    mon = bare_monitor({0: 0.0})
    mon.rank_exit(0, 1, -15, 50.0)
    mon.rank_exit(0, 2, 3, 50.0)
    assert first_failure(mon) == (2, 3)
    assert signal_name(-9) == "killed by SIGKILL"
    assert signal_name(7) == "exit code 7"


def test_exits_caused_by_our_own_stop_are_never_the_root_cause() -> None:
    mon = bare_monitor({0: 0.0})
    mon.rank_exit(0, 0, -15, 20.0, after_stop=True)   # the host says: after its stop
    mon.rank_exit(0, 1, -15, 20.1, after_stop=True)
    mon.stop_started = 19.5          # a host was lost; then we stopped the others
    assert first_failure(mon) is None


def test_a_torchrun_ended_by_a_stop_before_any_rank_is_a_user_stop() -> None:
    """One host, `orch stop` from elsewhere: the stop kills torchrun first, and its end
    (tagged after_stop by the host) may arrive before any rank's exit: still the user's
    stop, not a failure to restart after (CI saw a restart there)."""
    from orchestrator.remote.link import HostDone
    from orchestrator.wire import protocol
    mon = bare_monitor({0: 0.0})
    protocol.event("done", code=-9, time=20.0, lost=False, after_stop=True)  # the wire takes it
    mon.host_done(0, HostDone(-9, 20.0, after_stop=True))
    assert mon.failed() and mon.user_stopped()
    other = bare_monitor({0: 0.0})
    other.host_done(0, HostDone(-9, 20.0))        # torchrun killed, no stop received
    assert other.failed() and not other.user_stopped()
    lost = bare_monitor({0: 0.0, 1: 0.0})
    lost.host_done(0, HostDone(-9, 20.0, after_stop=True))
    lost.lost[1] = "no answer"                    # a lost host: our own stop followed
    assert not lost.user_stopped()


def test_tail_offset_counts_lines_from_the_end(tmp_path) -> None:
    from orchestrator.agent.follow import tail_offset
    f = tmp_path / "log"
    for content, want in ((b"a\nb\nc\n", [b"", b"c\n", b"b\nc\n", b"a\nb\nc\n", b"a\nb\nc\n"]),
                          (b"a\nb", [b"", b"b", b"a\nb", b"a\nb", b"a\nb"])):
        f.write_bytes(content)
        with open(f, "rb") as log:
            assert [content[tail_offset(log, n):] for n in range(5)] == want
    f.write_bytes(b"".join(b"%d\n" % i for i in range(200_000)))
    with open(f, "rb") as log:
        assert f.read_bytes()[tail_offset(log, 3):] == b"199997\n199998\n199999\n"
    assert tail_offset(None, 3) == 0


def test_group_failures_keep_one_shared_exit_code() -> None:
    """"already running" (exit 2) from every host stays exit 2; mixed with an unreachable
    host, or an unexpected exception, it is a host failure (exit 3)."""
    from types import SimpleNamespace

    import pytest

    from orchestrator.errors import HostError, UsageError
    from orchestrator.remote.fanout import GroupResult
    hosts = tuple(SimpleNamespace(label=n, index=i, address=n, ssh=SimpleNamespace(port=22))
                  for i, n in enumerate("ab"))
    for failed, code in (({0: UsageError("a: already running"), 1: UsageError("b: already running")}, 2),
                         ({0: UsageError("a: already running"), 1: HostError("b: no answer")}, 3),
                         ({0: RuntimeError("boom")}, 3)):
        with pytest.raises(HostError) as err:
            GroupResult(failed=failed).raise_failures(hosts, "to start")  # type: ignore[arg-type]  # a test double
        assert err.value.exit_code == code, failed


def test_follow_reads_the_run_records_only_when_run_changed(tmp_path: Path, monkeypatch) -> None:
    """host/follow.RunDir: a poll reads the exit records after a change of run/ (a record
    renamed into place), and at least once a second; not on every quiet poll."""
    from orchestrator.agent import follow
    from orchestrator.agent.common import job_paths, write_atomic
    p = job_paths(str(tmp_path / "job"))
    (tmp_path / "job" / "run").mkdir(parents=True)
    clock = [1000.0]
    monkeypatch.setattr(follow, "time", types.SimpleNamespace(
        time=lambda: clock[0], time_ns=lambda: int(clock[0] * 1e9)))
    rundir = follow.RunDir(p["jd"])
    try:
        assert rundir.changed()                       # the first look
        clock[0] = (tmp_path / "job" / "run").stat().st_mtime + 0.5   # long after the last change
        assert rundir.changed()                       # the first mtime seen counts as new
        clock[0] += 0.05
        assert not rundir.changed()                   # quiet: nothing read
        write_atomic(p["jd"], "run/rank-0.exit", b'{"code": 0, "time": 1}')
        clock[0] = (tmp_path / "job" / "run").stat().st_mtime + 0.5
        assert rundir.changed()                       # a record landed
        clock[0] += 0.05
        assert not rundir.changed()
        clock[0] += 1.0
        assert rundir.changed()                       # once a second whatever happens
    finally:
        rundir.close()


def test_follow_wakes_when_the_supervisor_ends(tmp_path: Path) -> None:
    """host/follow.SupervisorEnd: once every rank ended, the follow's sleep ends when the
    supervisor does (its pidfd), not at the next poll; without a live supervisor the
    sleep is the plain one."""
    import json
    import os
    import subprocess
    import threading
    import time

    import pytest

    from orchestrator.agent import follow
    from orchestrator.agent.common import job_paths, write_atomic
    from orchestrator.agent.procs import proc_start_time
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open in this python")
    p = job_paths(str(tmp_path / "job"))
    (tmp_path / "job" / "run").mkdir(parents=True)
    sup = subprocess.Popen(["sleep", "60"])
    try:
        write_atomic(p["jd"], "run/supervisor.json", json.dumps(
            {"pid": sup.pid, "start_ticks": proc_start_time(sup.pid)}).encode())
        end = follow.SupervisorEnd()
        end.watch(p)
        assert end.fd is not None
        end.sleep(0.01)
        assert not end.ended                          # alive: the whole sleep
        threading.Timer(0.3, sup.kill).start()
        t0 = time.monotonic()
        end.sleep(30)
        assert end.ended and time.monotonic() - t0 < 10
        assert end.fd is None                         # once: the next sleeps are plain
        end.sleep(0.01)
        assert not end.ended
        gone = follow.SupervisorEnd()                 # no supervisor alive: plain sleeps
        gone.watch(p)
        assert gone.fd is None
    finally:
        sup.kill()
        sup.wait()


class StubLink:
    """What the host-lost watchdog reads of a link: when it last heard from the host."""

    def __init__(self, last_seen: float) -> None:
        self.last_seen = last_seen
        self.lost_why: list[str] = []

    def heard(self) -> float:
        return self.last_seen

    def lost(self, why: str) -> None:
        self.lost_why.append(why)


def test_host_lost_watchdog_on_a_fake_clock(monkeypatch) -> None:
    """No frame for HOST_LOST (15 s of fake time, no real wait): the host is lost, once,
    and its link told; a host that keeps beating is not; not a check early."""
    import threading

    from helpers import FakeClock
    from orchestrator.watch.follow import watchdog
    from orchestrator.wire import timeouts

    clock = FakeClock(start=1000.0)
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    links = {i: StubLink(1000.0) for i in (0, 1)}
    streams = {i: HostStream(link=link, job_dir="/j", ranks=[i])  # type: ignore[arg-type]  # a test double
               for i, link in links.items()}
    rec = Recorder()
    stop = threading.Event()
    dog = threading.Thread(target=watchdog, args=(streams, Tracker(streams, rec), stop), daemon=True)
    dog.start()
    clock.wait_for_checks(1)
    try:
        for _ in range(int(timeouts.HOST_LOST / 0.25) - 1):    # up to HOST_LOST - 0.25 s
            clock.step(0.25)
            links[1].last_seen = clock.now()                   # host 1's heartbeat
        assert rec.calls == [] and links[0].lost_why == []
        for _ in range(8):                                     # past HOST_LOST, and on
            clock.step(0.25)
            links[1].last_seen = clock.now()
    finally:
        stop.set()
        dog.join(10)
    why = f"no answer for {timeouts.HOST_LOST:.0f} s"
    assert rec.calls == [("lost", why)] and links[0].lost_why == [why], (rec.calls, links[0].lost_why)
    assert streams[0].done and not streams[1].done and links[1].lost_why == []


def test_hosts_that_ended_together_are_released_after_one_look_at_the_failures() -> None:
    """1,000 hosts whose ranks all ended well in one wake of the loop: each is let go
    (rank 0's kept for the pull), with one look at the failures, not one per host (each
    look reads every exit: a million reads at 1,000 hosts)."""
    class Mon:
        hang = None

        def __init__(self) -> None:
            self.host_codes = {i: 0 for i in range(1000)}
            self.wake, self.looks = threading.Event(), 0
            self.wake.set()

        def failed(self) -> bool:
            self.looks += 1
            return False

    released: list[int] = []
    session = types.SimpleNamespace(
        cluster=types.SimpleNamespace(host_of=lambda rank: types.SimpleNamespace(index=0)),
        release=released.append)
    rounds = iter([False, True])
    mon = Mon()
    assert follow_to_end(session, mon, lambda: next(rounds)) is None  # type: ignore[arg-type]
    assert released == list(range(1, 1000))
    assert mon.looks <= 3, mon.looks
