"""The follows an attached run begins at each host's launch (remote/early.py): what a host
sends before the watch attaches is kept and handed on once, in order; past the cap its
reader waits and loses nothing; a failed launch drops what was kept and nothing waits.
Then through the real Link on the fake transport: a host's follow is asked for as soon
as its own launch is answered, not once every host has started."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fake_agent import FakeChannel, FakeCluster, launch
from orchestrator.errors import EXIT_JOB_FAILED, EXIT_OK, HostError
from orchestrator.remote.early import MIN_CAP, TOTAL_CAP, Begun, Early, cap_per_host
from test_controller_fake import HOSTS, flat, inventory, orch


class Calls:
    """A sink that records every call, as the watch's Tracker would take it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        self.calls.append(("output", rank, data))

    def rank_exit(self, host: int, rank: int, code: int, when: float, **extra: Any) -> None:
        self.calls.append(("exit", rank, code, extra))

    def host_done(self, host: int, info: Any) -> None:
        self.calls.append(("done", host))

    def host_lost(self, host: int, why: str) -> None:
        self.calls.append(("lost", host, why))


def test_what_came_before_the_watch_is_handed_on_once_in_order_then_the_rest() -> None:
    early, sink = Early(cap=1 << 20), Calls()
    early.output(0, 1, False, b"a\n")
    early.rank_start(0, 1, 99)        # the sink has no rank_start: skipped, as the link does
    early.rank_exit(0, 1, 3, 5.0, after_stop=True)
    assert sink.calls == []
    early.attach(sink)
    early.output(0, 1, False, b"b\n")
    early.host_done(0, None)
    assert sink.calls == [("output", 1, b"a\n"), ("exit", 1, 3, {"after_stop": True}),
                          ("output", 1, b"b\n"), ("done", 0)]
    assert early.kept == [] and early.size == 0


def feed(early: Early, chunks: list[bytes]) -> None:
    """A host's reader handing on rank 0's output frames."""
    for chunk in chunks:
        early.output(0, 0, False, chunk)


def wait_blocked(t: threading.Thread, early: Early) -> None:
    """The caller's thread is waiting inside early (it kept what it could)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and early.size == 0:
        time.sleep(0.01)
    time.sleep(0.1)
    assert t.is_alive()


def test_past_the_cap_the_reader_waits_for_the_watch_and_loses_nothing() -> None:
    early, sink = Early(cap=10), Calls()
    chunks = [b"0123456\n", b"abcdefg\n", b"ABCDEFG\n"]
    t = threading.Thread(target=feed, args=(early, chunks))
    t.start()
    wait_blocked(t, early)
    assert len(early.kept) == 1          # the second chunk would pass the cap: it waits
    early.attach(sink)
    t.join(5)
    assert not t.is_alive()
    assert [c[2] for c in sink.calls] == chunks


def test_a_failed_launch_drops_what_was_kept_and_frees_a_waiting_reader() -> None:
    early = Early(cap=4)
    t = threading.Thread(target=feed, args=(early, [b"12345\n"] * 3))
    t.start()
    wait_blocked(t, early)
    early.drop()
    t.join(5)
    assert not t.is_alive() and early.kept == [] and early.size == 0
    early.host_lost(0, "gone")           # nothing is kept after a drop
    assert early.kept == []


def test_a_drop_once_watched_changes_nothing() -> None:
    """The launch's context drops its follows when it closes, watched or not."""
    early, sink = Early(cap=4), Calls()
    early.attach(sink)
    early.drop()
    early.output(0, 0, False, b"after the drop\n")
    early.output(0, 0, False, b"and past the cap\n")
    assert [c[2] for c in sink.calls] == [b"after the drop\n", b"and past the cap\n"]


def test_the_cap_is_shared_by_the_hosts_with_a_floor() -> None:
    assert cap_per_host(4) == TOTAL_CAP // 4
    assert cap_per_host(1000) == MIN_CAP
    assert cap_per_host(1000) * 1000 <= 64 << 20


class GoneLink:
    """A link whose agent is gone: a follow is refused at once."""

    sink: Any = None

    def follow(self, sink: Any, **fields: Any) -> None:
        self.sink = sink
        raise HostError("h: connection lost")


def test_a_follow_that_cannot_be_asked_is_the_hosts_loss_once_watched() -> None:
    begun, link, sink = Begun({"mode": "events"}, 2), GoneLink(), Calls()
    begun(1, link, "/j", [2, 3])   # type: ignore[arg-type]  # a test double
    begun.early[1].attach(sink)
    assert sink.calls == [("lost", 1, "h: connection lost")]


# ---------------------------------------------------------------- through the Link


def slow_launch(seconds: float, times: dict[str, float] | None = None):  # type: ignore[no-untyped-def]
    """The launch answered `seconds` late; `times["answered"]`: when."""
    def late(chan: FakeChannel, msg: dict) -> None:
        if times is not None:
            times["answered"] = time.monotonic()
        launch(chan, msg)

    def answer(chan: FakeChannel, msg: dict) -> None:
        threading.Timer(seconds, late, (chan, msg)).start()
    return answer


def test_a_host_is_followed_as_soon_as_its_launch_is_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The last host answers its launch 1 s late: the first hosts' follows were asked
    for before that, their ranks' lines and exits kept meanwhile and printed once."""
    fake, times = FakeCluster().install(monkeypatch), {}

    def follow(chan: FakeChannel, msg: dict) -> None:
        times["followed"] = time.monotonic()
        fake.follow(chan, msg)
    fake.on("launch", slow_launch(1.0, times), HOSTS[2]).on("follow", follow, HOSTS[0])
    assert orch("up", "-c", inventory(tmp_path), "--no-pull") == EXIT_OK
    assert times["followed"] < times["answered"] - 0.5, times
    first = [m for who, t, m in fake.log if who == HOSTS[0] and t == "follow"]
    assert len(first) == 1 and first[0]["mode"] == "events" and first[0]["tail"] == -1
    out = capsys.readouterr().out
    for rank in range(6):
        assert out.count(f"rank {rank} up") == 1, out


def test_a_crash_kept_before_the_watch_fails_the_job_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 exits 7 while the last host is still launching: the kept exit is the root
    cause once the watch attaches, and every host is stopped."""
    fake = FakeCluster(lambda label, rank, env: 7 if rank == 1 else None).install(monkeypatch)
    fake.on("launch", slow_launch(0.5), HOSTS[2])
    assert orch("up", "-c", inventory(tmp_path), "--no-pull") == EXIT_JOB_FAILED
    err = flat(capsys)
    assert "rank 1" in err and "exit code 7" in err and "Traceback" not in err, err
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 1)
