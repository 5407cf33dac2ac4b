"""Host clocks against ours, measured NTP-style and kept up to date while a job runs.

A `clock` request is sent at t_send and answered with the host's time h; the reply
arrives at t_recv. The host read its clock somewhere in between, so

    offset = h - (t_send + t_recv) / 2      (host clock minus ours)

is off by at most (t_recv - t_send) / 2, the sample's uncertainty. Of the recent
samples the one with the smallest round trip is kept: a busy host or a queued reply
only widens a sample, it can never make a wrong offset look precise. Samples expire,
so a clock that steps or drifts during a long job is followed.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from orchestrator.remote.link import Link
from orchestrator.wire import timeouts

KEEP = 120.0          # seconds a sample stays usable
UNKNOWN = float("inf")


@dataclass(frozen=True)
class Sample:
    offset: float        # host clock minus ours
    uncertainty: float   # half the round trip
    taken: float         # our clock


@dataclass
class HostClock:
    """One host's offset: the recent sample with the smallest round trip."""

    samples: list[Sample] = field(default_factory=list)
    fallback: float = 0.0     # preflight's offset (round trip not kept): used until measured

    def add(self, t_send: float, host_time: float, t_recv: float) -> None:
        rtt = max(0.0, t_recv - t_send)
        self.samples.append(Sample(host_time - (t_send + t_recv) / 2, rtt / 2, t_recv))
        cutoff = t_recv - KEEP
        self.samples = [s for s in self.samples if s.taken >= cutoff][-256:]

    def best(self) -> Sample | None:
        return min(self.samples, key=lambda s: s.uncertainty, default=None)

    @property
    def offset(self) -> float:
        b = self.best()
        return self.fallback if b is None else b.offset

    @property
    def uncertainty(self) -> float:
        b = self.best()
        return UNKNOWN if b is None else b.uncertainty

    def ours(self, host_time: float) -> float:
        """A time read on the host, on our clock."""
        return host_time - self.offset


class Clocks:
    """Every followed host's clock, refreshed by a thread until `close()`."""

    def __init__(self, links: dict[int, Link], fallback: dict[int, float] | None = None) -> None:
        self.links = links
        self.hosts = {i: HostClock(fallback=(fallback or {}).get(i, 0.0)) for i in links}
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def measure(self, timeout: float = timeouts.CLOCK_REPLY, skip: Iterable[int] = ()) -> None:
        """One sample per host (but `skip`), all requests in flight at once."""
        sent = {}
        for i, link in self.links.items():
            if i in skip:
                continue
            try:
                t0 = time.time()
                sent[i] = (t0, link.submit("clock")[1])
            except Exception:  # a lost host: the watchdog reports it
                continue
        deadline = time.monotonic() + timeout
        for i, (t0, pending) in sent.items():
            if not pending.done.wait(max(0.0, deadline - time.monotonic())):
                continue
            if pending.error is None and pending.body is not None and pending.received:
                with self.lock:
                    self.hosts[i].add(t0, pending.body["time"], pending.received)

    def start(self) -> Clocks:
        """A few quick samples after a few seconds (timeouts.clock_first: the best of them
        is usually tight; not at once, where they would compete with every host's job
        starting), then one every timeouts.clock_period seconds, in the background (both
        fewer for many hosts). A failure is judged with fresh samples (`measure` in
        watch.fail_fast)."""
        every = timeouts.clock_period(len(self.links))
        after, first = timeouts.clock_first(len(self.links))

        def loop() -> None:
            if self.closed.wait(after):
                return
            for _ in range(first):
                if self.closed.is_set():
                    return
                self.measure()
            while not self.closed.wait(every):
                self.measure()
        threading.Thread(target=loop, daemon=True, name="clocks").start()
        return self

    def close(self) -> None:
        self.closed.set()

    def get(self, host: int) -> HostClock:
        with self.lock:
            c = self.hosts.get(host) or HostClock()
            return HostClock(list(c.samples), c.fallback)
