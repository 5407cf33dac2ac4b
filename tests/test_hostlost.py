"""The heartbeat's period and the host-lost rule at scale, without hosts or real waits:
the period scaled by the host count (and what the wire lets through), the agent's
`Beat`, the follow request that carries it, and `hostlost.Silence`, the watchdog's
rule: a host silent among talking ones is lost after the bound; a stalled controller
or most hosts silent together are the controller's silence."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from helpers import FakeClock, wait_until
from orchestrator.agent.follow import Beat
from orchestrator.errors import OrchError
from orchestrator.watch.clock import Clocks
from orchestrator.watch.follow import HostStream, Tracker, follow, watchdog
from orchestrator.watch.hostlost import ON_TIME, TICK, Silence
from orchestrator.wire import protocol, timeouts
from test_protocol import Collect, started

# ---------------------------------------------------------------- the period and the bound

@pytest.mark.parametrize("hosts, period, bound", [
    (1, 1.0, 15.0), (100, 1.0, 15.0), (300, 3.0, 25.0), (1000, 10.0, 60.0), (5000, 10.0, 60.0)])
def test_the_period_and_the_bound_grow_with_the_hosts(hosts: int, period: float,
                                                      bound: float) -> None:
    assert timeouts.heartbeat(hosts) == period and timeouts.host_lost(hosts) == bound
    assert bound >= max(timeouts.HOST_LOST, 5 * period)
    # the clock samples slow down alike: 5 s each up to 100 hosts, 50 s at 1,000
    assert timeouts.clock_period(hosts) == timeouts.CLOCK_PERIOD * period


class ClockLink:
    """A link whose host answers a `clock` request at once; counts them."""

    def __init__(self) -> None:
        self.asked = 0

    def submit(self, command: str) -> tuple[int, SimpleNamespace]:
        assert command == "clock"
        self.asked += 1
        done = threading.Event()
        done.set()
        return self.asked, SimpleNamespace(done=done, error=None, body={"time": time.time()},
                                           received=time.time())


@pytest.mark.parametrize("hosts, rounds", [(50, 5), (100, 5), (200, 2), (1000, 1)])
def test_the_first_clock_samples_are_fewer_for_many_hosts(
        hosts: int, rounds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five quick rounds up to 100 hosts; past that at most CLOCK_BURST requests in all,
    and later (five rounds to 1,000 hosts were 5,000 requests while the ranks start)."""
    monkeypatch.setattr(timeouts, "CLOCK_FIRST", 0.0)   # no wait: the rounds are counted
    links = {i: ClockLink() for i in range(hosts)}
    clocks = Clocks(links).start()   # type: ignore[arg-type]  # a test double
    try:
        wait_until(lambda: all(link.asked >= rounds for link in links.values()), 20,
                   "the first clock samples")
        time.sleep(0.5)   # a round more would be asked now (the period is 5 s or more)
    finally:
        clocks.close()
    assert {link.asked for link in links.values()} == {rounds}
    monkeypatch.undo()
    after, _ = timeouts.clock_first(hosts)
    assert after == timeouts.CLOCK_FIRST * timeouts.heartbeat(hosts)   # 2 s; 20 s at 1,000


def test_all_hosts_together_beat_at_most_the_rate_up_to_a_thousand() -> None:
    for hosts in (1, 50, 101, 250, 999, 1000):
        assert hosts / timeouts.heartbeat(hosts) <= timeouts.HEARTBEAT_RATE, hosts


@pytest.mark.parametrize("beat", [0.5, 10.5, float("nan"), True, "2"])
def test_the_wire_refuses_a_period_out_of_bounds(beat: Any) -> None:
    req = {"job_dir": "/j", "ranks": [0], "tail": -1, "mode": "events", "beat": beat}
    with pytest.raises(protocol.ProtocolError, match="'beat'"):
        protocol.check(req, protocol.REQUESTS["follow"], "request follow")
    req["beat"] = 7.5
    assert protocol.check(req, protocol.REQUESTS["follow"], "request follow") is req


def test_a_real_agent_refuses_a_bad_period_and_follows_with_a_good_one(tmp_path: Path) -> None:
    """`beat` as the wire types it: the controller does not send a bad one, and the
    agent (over pipes) answers one with a usage error naming the field; a period in
    bounds is followed (here to the end of a job that never ran)."""
    link = started(tmp_path)
    try:
        with pytest.raises(protocol.ProtocolError):   # this side never sends it
            link.request("follow", 30, job_dir=str(tmp_path), ranks=[0], tail=-1,
                         mode="events", beat=0.1)
        id, pending = link._register("follow")         # an agent sent it all the same
        link.send(protocol.message("follow", id=id, job_dir=str(tmp_path), ranks=[0],
                                   tail=-1, mode="events", beat=0.1))
        with pytest.raises(OrchError) as bad:
            link.wait(pending, 30)
        sink = Collect()
        link.follow(sink, job_dir=str(tmp_path), ranks=[0], tail=-1, mode="events", beat=2.0)
        wait_until(lambda: bool(sink.done or sink.lost), 30, "the follow's end")
    finally:
        link.close()
    assert "follow failed" in str(bad.value) and "'beat' must be 1-10 s" in str(bad.value), bad.value
    assert sink.lost == [] and len(sink.done) == 1, (sink.lost, sink.done)


# ---------------------------------------------------------------- the agent's beat

def test_the_agent_beats_after_a_quiet_period_and_not_while_frames_flow() -> None:
    sent: list[bytes] = []
    beat = Beat(4.0)
    now = time.monotonic()
    assert now - 4.0 <= beat.last <= now   # the first beat: somewhere in the first period
    beat.last -= 4.0                    # a quiet period passed
    beat.due(sent.append, sent=True)    # ... but this poll sent lines: they count
    assert sent == []
    beat.due(sent.append, sent=False)
    assert sent == []                   # quiet only since that poll
    beat.last -= 4.0
    beat.due(sent.append, sent=False)
    beat.due(sent.append, sent=False)   # once per period
    assert len(sent) == 1
    head = protocol.HEADER.size
    assert protocol.decode((sent[0][:1], sent[0][head:]), "a beat")["t"] == "beat"


# ---------------------------------------------------------------- the follow request

class StubLink:
    """What follow() and its watchdog use of a link."""

    def __init__(self, last_seen: float = 0.0) -> None:
        self.last_seen = last_seen
        self.fields: dict[str, Any] = {}
        self.lost_why: list[str] = []
        self.handing = False   # a frame of it still being handed on (Link.heard)
        self.sink: Any = None   # no follow begun at a launch (remote/early.py)

    def heard(self) -> float:
        return timeouts.CLOCK.now() if self.handing else self.last_seen

    def follow(self, sink: Any, **fields: Any) -> None:
        self.fields = fields

    def lost(self, why: str) -> None:
        self.lost_why.append(why)


class Lost:
    def __init__(self) -> None:
        self.lost: list[tuple[int, str]] = []

    def host_lost(self, host: int, why: str) -> None:
        self.lost.append((host, why))


def streams_of(links: dict[int, StubLink]) -> dict[int, HostStream]:
    return {i: HostStream(link=link, job_dir="/j", ranks=[i])  # type: ignore[arg-type]  # a test double
            for i, link in links.items()}


@pytest.mark.parametrize("mode", ["events", "snapshot"])
def test_the_follow_asks_each_host_for_the_period_of_its_host_count(mode: str) -> None:
    links = {i: StubLink() for i in range(300)}
    finished = follow(streams_of(links), Lost(), mode=mode)   # type: ignore[arg-type]  # a test double
    for s in streams_of(links).values():
        s.done = True
    want = {"beat": 3.0} if mode == "events" else {}
    assert all({k: v for k, v in link.fields.items() if k == "beat"} == want
               for link in links.values())
    for link in links.values():   # the request as sent passes the agent's check
        protocol.check({**link.fields, "ranks": [0]}, protocol.REQUESTS["follow"], "follow")
    assert finished is not None


# ---------------------------------------------------------------- the rule

def looks(silence: Silence, seconds: float, step: float, start: float,
          frames: dict[int, float], talking: set[int]) -> list[tuple[int, str]]:
    """Looks every `step` s for `seconds` from `start`; the `talking` hosts' frames come
    every look; returns what was lost (each host passed until it is)."""
    out: list[tuple[int, str]] = []
    t = start
    while t < start + seconds - 1e-9:
        t += step
        for h in talking:
            frames[h] = t
        gone = {h for h, _ in out}
        out += silence.look(t, {h: at for h, at in frames.items() if h not in gone})
    return out


def test_a_silent_host_among_talking_ones_is_lost_after_the_bound_not_before() -> None:
    bound, period = timeouts.host_lost(1000), timeouts.heartbeat(1000)
    silence = Silence(bound, period, 0.0)
    frames = dict.fromkeys(range(1000), 0.0)
    talking = set(range(1, 1000))
    assert looks(silence, bound - TICK, TICK, 0.0, frames, talking) == []
    lost = looks(silence, 2 * TICK, TICK, bound - TICK, frames, talking)
    assert lost == [(0, "no answer for 60 s")]


def test_a_stalled_controller_loses_no_host_and_catches_up() -> None:
    """The watchdog looks 40 s late (the controller did not run; every frame waited):
    the stall counts ON_TIME, nothing is lost; the frames read at once, or a second
    later, keep every host. A host that truly stays silent is lost after the bound of
    running time."""
    bound = timeouts.host_lost(3)
    silence = Silence(bound, 1.0, 0.0)
    frames = {0: 0.0, 1: 0.0, 2: 0.0}
    assert looks(silence, 2.0, TICK, 0.0, frames, {0, 1, 2}) == []
    assert silence.look(42.0, frames) == []          # 40 s without a look, no frame read
    frames[1] = 42.5                                # the backlog read, host 1 first
    assert silence.look(42.5, frames) == []
    frames[0] = 43.0
    assert silence.look(43.0, frames) == []
    quiet = silence.heard[2].quiet
    assert quiet <= 2.0 + ON_TIME + 2 * TICK, quiet   # 40 s counted as ON_TIME
    lost = looks(silence, bound, TICK, 43.0, frames, {0, 1})
    assert [h for h, _ in lost] == [2]


def test_a_slow_controller_counts_its_looks_in_full_up_to_on_time() -> None:
    silence = Silence(15.0, 1.0, 0.0)
    frames = {0: 0.0, 1: 0.0}
    assert looks(silence, 15.0, ON_TIME, 0.0, frames, {1}) == []
    assert looks(silence, ON_TIME, ON_TIME, 15.0, frames, {1}) == [(0, "no answer for 15 s")]


def test_most_hosts_silent_together_wait_twice_the_bound() -> None:
    """Seven of ten hosts (the controller's readers behind, or its network down) wait
    twice the bound and are then named with the others; three of ten are lost at it."""
    silence = Silence(15.0, 1.0, 0.0)
    frames = dict.fromkeys(range(10), 0.0)
    assert looks(silence, 30.0, TICK, 0.0, frames, {7, 8, 9}) == []
    lost = looks(silence, 2 * TICK, TICK, 30.0, frames, {7, 8, 9})
    assert sorted(h for h, _ in lost) == list(range(7))
    assert {why for _, why in lost} == {"no answer for 30 s (nor from 6 of the 9 other hosts)"}
    few = Silence(15.0, 1.0, 0.0)
    frames = dict.fromkeys(range(10), 0.0)
    lost = looks(few, 15.0 + TICK, TICK, 0.0, frames, set(range(3, 10)))
    assert sorted(h for h, _ in lost) == [0, 1, 2]


@pytest.mark.parametrize("hosts", [1, 2])
def test_a_small_job_loses_its_silent_hosts_at_the_bound(hosts: int) -> None:
    silence = Silence(15.0, 1.0, 0.0)
    frames = dict.fromkeys(range(hosts), 0.0)
    lost = looks(silence, 15.0 + TICK, TICK, 0.0, frames, set())
    assert sorted(h for h, _ in lost) == list(range(hosts))


# ---------------------------------------------------------------- the watchdog thread

def watched(links: dict[int, StubLink], clock: FakeClock
            ) -> tuple[dict[int, HostStream], Lost, threading.Event, threading.Thread]:
    """The host-lost watchdog over links, started on the fake clock (its first check
    waited for): the streams, what it found lost, its stop, its thread."""
    streams, rec, stop = streams_of(links), Lost(), threading.Event()
    dog = threading.Thread(target=watchdog, args=(streams, Tracker(streams, rec), stop),  # type: ignore[arg-type]  # a test double
                           daemon=True)
    dog.start()
    clock.wait_for_checks(1)
    return streams, rec, stop, dog


def test_the_watchdog_at_300_hosts_waits_their_bound_on_a_fake_clock(monkeypatch) -> None:
    """300 hosts beat every 3 s; host 0 goes silent: lost after 25 s (not the 15 s of a
    small job), once, its link told; nobody else."""
    clock = FakeClock(start=1000.0)
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    links = {i: StubLink(1000.0) for i in range(300)}
    streams, rec, stop, dog = watched(links, clock)
    try:
        for n in range(1, int(25.0 / TICK) + 3):
            clock.step(TICK)
            if n % 12 == 0:                          # every 3 s
                for link in list(links.values())[1:]:
                    link.last_seen = clock.now()
            if n == int(25.0 / TICK) - 1:
                assert rec.lost == [], n
    finally:
        stop.set()
        dog.join(10)
    assert rec.lost == [(0, "no answer for 25 s")] and links[0].lost_why == ["no answer for 25 s"]
    assert streams[0].done and not any(s.done for i, s in streams.items() if i)


def test_a_host_whose_frame_is_still_being_printed_is_not_lost(monkeypatch) -> None:
    """The printer fell behind: host 0's reader has been inside one of its frames for
    longer than the bound. Its host talked; we are slow: not lost. Once the frame is
    handed on and the host says nothing more for the bound, it is."""
    clock = FakeClock(start=1000.0)
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    links = {i: StubLink(1000.0) for i in range(4)}
    links[0].handing = True
    _, rec, stop, dog = watched(links, clock)
    try:
        for _ in range(1, int(40.0 / TICK)):
            clock.step(TICK)
            for link in list(links.values())[1:]:
                link.last_seen = clock.now()
        assert rec.lost == []
        links[0].last_seen, links[0].handing = clock.now(), False
        for _ in range(int(16.0 / TICK)):
            clock.step(TICK)
            for link in list(links.values())[1:]:
                link.last_seen = clock.now()
    finally:
        stop.set()
        dog.join(10)
    assert rec.lost == [(0, "no answer for 15 s")]


def test_a_link_is_heard_while_its_reader_is_inside_a_frame(tmp_path: Path, monkeypatch) -> None:
    """A real agent's reply, its handing on held up (a printer behind): heard() is now,
    however old the frame; once handed on, heard() is the frame's arrival again."""
    link = started(tmp_path)
    inside, release = threading.Event(), threading.Event()
    dispatch = link._dispatch

    def slow(kind: bytes, payload: Any) -> None:
        inside.set()
        release.wait(30)
        dispatch(kind, payload)
    monkeypatch.setattr(link, "_dispatch", slow)
    try:
        _, pending = link.submit("status", job_dir=str(tmp_path / "nojob"), ranks=[0])
        assert inside.wait(30)
        arrived = link.last_seen
        time.sleep(0.3)
        assert link.handing and link.heard() - arrived >= 0.3
        release.set()
        try:
            link.wait(pending, 30)
        except OrchError:   # no such job: its answer is all this test needs
            pass
        wait_until(lambda: not link.handing, 10, "the frame handed on")
        assert link.heard() == link.last_seen
    finally:
        release.set()
        link.close()
