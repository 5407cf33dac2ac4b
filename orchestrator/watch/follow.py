"""follow(): the one log tail every printer uses (orch up, orch logs, orch logs -f).

Each host's agent (the link already open for the command) reads the rank log files in
place from a byte offset and streams them as output frames, with rank exits, the host's
end and a heartbeat as events (protocol.py); a line is sent once, in order, and nothing
is lost if the controller goes away (the files stay; a new follow re-reads).
"""
from __future__ import annotations

import os
import sys
import threading
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Protocol

from orchestrator.errors import OrchError
from orchestrator.remote.early import early_of
from orchestrator.remote.link import HostDone, Link
from orchestrator.ui.termsafe import for_terminal, visible
from orchestrator.watch.hostlost import TICK, Silence
from orchestrator.wire import timeouts

TAIL_KEEP = 20


class Sink(Protocol):
    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None: ...
    # a host's `after_stop=True` comes as a keyword only when set (see Link._event)
    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None: ...
    def host_done(self, host: int, info: HostDone) -> None: ...
    def host_lost(self, host: int, why: str) -> None: ...


def split_lines(partial: bool, data: bytes) -> list[bytes]:
    """The lines of an output frame: whole lines end with a newline; a partial frame is
    one piece of a long line (printed as a line of its own, with the same prefix)."""
    if partial:
        return [data]
    return (data[:-1] if data.endswith(b"\n") else data).split(b"\n")


class LineSink:
    """A sink that takes lines: output frames become `lines(host, rank, texts)` calls."""

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        self.lines(host, rank, split_lines(partial, data))

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        raise NotImplementedError


@dataclass
class HostStream:
    link: Link
    job_dir: str
    ranks: list[int]
    done: bool = False


class Tracker:
    """Between the links and a sink: marks a host done once (its end, or its loss)."""

    def __init__(self, streams: dict[int, HostStream], sink: Sink) -> None:
        self.streams, self.sink, self.lock = streams, sink, threading.Lock()

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        self.sink.output(host, rank, partial, data)

    def rank_start(self, host: int, rank: int, pid: int) -> None:
        started = getattr(self.sink, "rank_start", None)
        if started is not None:
            started(host, rank, pid)

    def rank_progress(self, host: int, ranks: list[int]) -> None:
        progress = getattr(self.sink, "rank_progress", None)
        if progress is not None:
            progress(host, ranks)

    def rank_exit(self, host: int, rank: int, code: int | None, when: float,
                  after_stop: bool = False) -> None:
        extra = {"after_stop": True} if after_stop else {}
        self.sink.rank_exit(host, rank, -1 if code is None else code, when, **extra)

    def _end(self, host: int) -> bool:
        with self.lock:
            first = not self.streams[host].done
            self.streams[host].done = True
        return first

    def host_done(self, host: int, info: HostDone) -> None:
        if self._end(host):
            self.sink.host_done(host, info)

    def host_lost(self, host: int, why: str) -> None:
        if self._end(host):
            self.sink.host_lost(host, why)


def watchdog(streams: dict[int, HostStream], tracker: Tracker, stop: threading.Event) -> None:
    """A host that sends not even a heartbeat for timeouts.host_lost seconds of the
    controller's own time is lost (hostlost.Silence: a stalled controller, or most hosts
    silent together, is the controller's silence)."""
    clock, hosts = timeouts.CLOCK, len(streams)
    silence = Silence(timeouts.host_lost(hosts), timeouts.heartbeat(hosts), clock.now())
    while not clock.wait(stop, TICK):
        seen = {i: s.link.heard() for i, s in streams.items() if not s.done}
        for index, why in silence.look(clock.now(), seen):
            tracker.host_lost(index, why)
            streams[index].link.lost(why)   # the closing `orch up` does not wait for its agent


def fields(hosts: int, mode: str = "events", unit: str | None = None, heartbeats: bool = False,
           curves: tuple[str, ...] = ()) -> dict[str, str | bool | float | list[str]]:
    """What a follow asks of each host besides its folder and ranks (see `follow`); an
    attached run's follows begun at the launch (remote/early.py) ask the same."""
    extra: dict[str, str | bool | float | list[str]] = {"unit": unit} if unit else {}
    if heartbeats:
        extra["heartbeats"] = True
    if curves and mode == "events":
        extra["curves"] = list(curves)
    if mode == "events":   # the only mode that beats; slower for many hosts
        extra["beat"] = timeouts.heartbeat(hosts)
    return {"tail": -1, "mode": mode, **extra}


def follow(streams: dict[int, HostStream], sink: Sink, tail: int = -1,
           mode: str = "events", unit: str | None = None,
           heartbeats: bool = False, curves: tuple[str, ...] = ()) -> Callable[[], bool]:
    """Start following every host; returns `finished()`, true once every host is done.
    mode "events" follows until the job ends; "snapshot" prints what is there and stops.
    unit "task": a job array's tasks (their numbers stand where ranks do).
    heartbeats: the hosts report the ranks that touched their heartbeat file (a sink's
    `rank_progress(host, ranks)`), for the hang watch. curves: globs under output/ whose
    files each host counts in its `done` (`Link.ended.curves`: the curves' last look).
    A host whose follow began at its launch (remote/early.py) is not asked again: what
    it sent so far reaches the sink first."""
    tracker, stop = Tracker(streams, sink), threading.Event()
    extra = dict(fields(len(streams), mode, unit, heartbeats, curves), tail=tail)
    for index, s in streams.items():
        s.link.last_seen = timeouts.CLOCK.now()
        early = early_of(s.link)
        if early is not None:
            early.attach(tracker)
            continue
        try:
            s.link.follow(tracker, job_dir=s.job_dir, ranks=list(s.ranks), **extra)
        except OrchError as e:
            tracker.host_lost(index, e.message)
    if mode == "events":
        threading.Thread(target=watchdog, args=(streams, tracker, stop), daemon=True).start()

    def finished() -> bool:
        done = all(s.done for s in streams.values())
        if done:
            stop.set()
        return done
    return finished


# ---------------------------------------------------------------- printing

COLORS = (31, 32, 33, 34, 35, 36, 91, 92, 93, 94, 95, 96)


def use_color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and not os.environ.get("ORCH_NO_COLOR")


class PrefixPrinter(LineSink):
    """Prints `[r3 host] line` (`[t3 host]` for task 3 of an array, tag "t"), a colour per
    rank; keeps each rank's last lines."""

    def __init__(self, labels: dict[int, str], out: BinaryIO | None = None,
                 tty: bool | None = None, tag: str = "r") -> None:
        self.out = out or sys.stdout.buffer
        self.tag = tag
        self.labels = labels
        self.color = use_color()
        # on a terminal, rank output cannot move the cursor, retitle the window or hide
        # a prefix (termsafe); piped, the bytes after the prefix are the rank's own
        self.tty = sys.stdout.isatty() if tty is None else tty
        # a live status line steps aside while lines print
        self.above: Callable[[], AbstractContextManager[None]] = nullcontext
        self.lock = threading.Lock()
        self.tails: dict[int, deque[Any]] = {}

    def prefix(self, host: int, rank: int) -> bytes:
        return self.prefix_of(self.labels[host], rank)

    def prefix_of(self, label: str, rank: int) -> bytes:
        tag = f"[{self.tag}{rank} {label}]"
        if self.tty:
            tag = visible(tag, keep_sgr=False)
        if self.color:
            tag = f"\x1b[{COLORS[rank % len(COLORS)]}m{tag}\x1b[0m"
        return tag.encode() + b" "

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.print_as(self.labels[host], rank, texts)

    def print_as(self, label: str, rank: int, texts: list[bytes]) -> None:
        pre = self.prefix_of(label, rank)
        shown = [for_terminal(t) for t in texts] if self.tty else texts
        block = b"".join(pre + t + b"\n" for t in shown)
        with self.lock, self.above():
            self.tails.setdefault(rank, deque(maxlen=TAIL_KEEP)).extend(texts[-TAIL_KEEP:])
            self.out.write(block)
            self.out.flush()

    def tail(self, rank: int) -> list[str]:
        return [t.decode("utf-8", "replace") for t in self.tails.get(rank, ())]
