"""A process by its pid: its stat fields, its start time (which tells it from a recycled
pid), and sleeping until one of some processes ends (pidfds) for the stop (agent/procs.py).
Stdlib only, Python 3.8."""
from __future__ import annotations

import os
import select
import time


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses):
    [0] is field 3 (the state), [1] the parent, [2] the process group, [19] the start
    time. None when the process is gone. Read with os.open: a stop reads a few dozen of
    these on every host at once, and a text file object cost twice the CPU of the read."""
    try:
        fd = os.open("/proc/%s/stat" % pid, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return data.rsplit(b")", 1)[1].decode("ascii", "replace").split()
    except IndexError:
        return None


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a live pid from a recycled one. None for a
    zombie: a container's init may never reap our double-forked supervisor."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class Exits:
    """The watched processes' ends as pidfds (Linux 5.3, Python 3.9): a stop sleeps until
    one of them ends, instead of reading each one's /proc/<pid>/stat 20 to 100 times a
    second. With 300 hosts' agents stopping at once on one machine, those reads were
    cores' worth of CPU, taken from the very processes being waited for. Without a
    pidfd for every watched process it sleeps `poll` seconds, as before."""

    def __init__(self) -> None:
        self.fds = {}   # type: dict[int, int]
        self.ended = set()   # type: set[int]   # pids whose pidfd the last sleep found ready
        self.poller = getattr(select, "poll", lambda: None)()

    def __enter__(self) -> Exits:
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in list(self.fds):
            self.drop(pid)

    def sleep(self, watch: dict[int, int | None], most: float, poll: float) -> None:
        for pid in [p for p in self.fds if p not in watch]:   # ended: its fd reads ready
            self.drop(pid)
        for pid, ticks in watch.items():
            if pid not in self.fds:
                self.open(pid, ticks)
        if self.poller is None:
            time.sleep(poll)
            return
        if any(p not in self.fds for p in watch):   # then only a look at the pidfds
            time.sleep(poll)
            most = 0.0
        ready = {fd for fd, _ in self.poller.poll(most * 1000)}
        self.ended = {pid for pid, fd in self.fds.items() if fd in ready}

    def alive(self, pid: int, ticks: int | None) -> bool:
        """pid is still the process that started at `ticks`. Its pidfd, once held, tells
        (an ended process's is ready at the last sleep) without a read of /proc/<pid>: a
        stop's processes are reaped while it watches them, and a reap waits for every
        reader of that pid's /proc entries to let go of them. A process that ends after
        that sleep wakes the next one at once."""
        if pid in self.fds:
            return pid not in self.ended
        return ticks is not None and proc_start_time(pid) == ticks

    def open(self, pid: int, ticks: int | None) -> None:
        opener = getattr(os, "pidfd_open", None)
        if opener is None or self.poller is None:
            return
        try:
            fd = opener(pid)
        except OSError:   # ended already, or no pidfd in this kernel
            return
        if proc_start_time(pid) != ticks:   # ended before the open: the pid is not its own
            os.close(fd)
            return
        self.fds[pid] = fd
        self.poller.register(fd, select.POLLIN)

    def drop(self, pid: int) -> None:
        self.ended.discard(pid)
        fd = self.fds.pop(pid)
        if self.poller is not None:
            self.poller.unregister(fd)
        os.close(fd)
