"""A follow begun at a host's launch, before anything watches it.

An attached run (`orch up`, `api.run`) follows every host once every host has started.
At 1,000 hosts that put 1,000 follows' starts on the hosts' shared cores together, right
when an early crash has to be seen and acted on. Begun as each host's launch is answered,
the follows start while the other hosts still launch; what they send before the watch
takes over is kept here and handed on, in order, when it attaches.

What is kept is bounded: past `cap` bytes of rank output the host's reader waits (its
agent then waits on the connection's window; the lines stay in the rank logs), as it
waits behind a slow printer. A launch that fails drops what was kept and never waits.
"""
from __future__ import annotations

import threading
from typing import Any

from orchestrator.errors import OrchError
from orchestrator.remote.link import Link

# every host's kept output together stays under this (a host keeps at least MIN_CAP)
TOTAL_CAP = 32 << 20
MIN_CAP = 64 << 10


def cap_per_host(hosts: int) -> int:
    return max(MIN_CAP, TOTAL_CAP // max(1, hosts))


class Early:
    """A follow's sink until the real one attaches: every call kept, then replayed."""

    def __init__(self, cap: int) -> None:
        self.cap, self.size = cap, 0
        self.kept: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.sink: Any = None
        self.dropped = False
        self.cond = threading.Condition()

    def attach(self, sink: Any) -> None:
        """From now on `sink` hears this host's follow; what came before first, in order.
        Replayed under the lock, so a call arriving meanwhile waits for its turn."""
        with self.cond:
            for name, args, kwargs in self.kept:
                self._call(sink, name, args, kwargs)
            self.kept, self.size, self.sink = [], 0, sink
            self.cond.notify_all()

    def drop(self) -> None:
        """The launch failed: nothing kept, nothing waits, nothing more is kept."""
        with self.cond:
            self.kept, self.size, self.dropped = [], 0, True
            self.cond.notify_all()

    def _take(self, name: str, size: int, *args: Any, **kwargs: Any) -> None:
        with self.cond:
            while self.sink is None and not self.dropped and self.size and \
                    self.size + size > self.cap:
                self.cond.wait()
            sink = self.sink
            if sink is None:
                if not self.dropped:
                    self.kept.append((name, args, kwargs))
                    self.size += size
                return
        self._call(sink, name, args, kwargs)

    @staticmethod
    def _call(sink: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = getattr(sink, name, None)   # rank_start, rank_progress: optional for a sink
        if fn is not None:
            fn(*args, **kwargs)

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        self._take("output", len(data), host, rank, partial, data)

    def rank_start(self, host: int, rank: int, pid: int) -> None:
        self._take("rank_start", 0, host, rank, pid)

    def rank_progress(self, host: int, ranks: list[int]) -> None:
        self._take("rank_progress", 0, host, ranks)

    def rank_exit(self, host: int, rank: int, code: int | None, when: float,
                  **extra: Any) -> None:
        self._take("rank_exit", 0, host, rank, code, when, **extra)

    def host_done(self, host: int, info: Any) -> None:
        self._take("host_done", 0, host, info)

    def host_lost(self, host: int, why: str) -> None:
        self._take("host_lost", 0, host, why)


class Begun:
    """The follows an attached run begins as its hosts' launches are answered."""

    def __init__(self, fields: dict[str, Any], hosts: int) -> None:
        self.fields, self.cap = fields, cap_per_host(hosts)
        self.early: dict[int, Early] = {}

    def __call__(self, index: int, link: Link, job_dir: str, ranks: list[int]) -> None:
        early = self.early[index] = Early(self.cap)
        try:
            link.follow(early, job_dir=job_dir, ranks=ranks, **self.fields)
        except OrchError as e:   # the link is gone: the watch hears it as the host's loss
            early.host_lost(index, e.message)

    def drop(self) -> None:
        for early in self.early.values():
            early.drop()


def early_of(link: Link) -> Early | None:
    """The follow begun at this host's launch, when one was."""
    return link.sink if isinstance(link.sink, Early) else None

