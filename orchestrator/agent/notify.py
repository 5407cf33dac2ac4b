"""inotify on a job's logs/ and run/ folders, for the follow's quiet waits (Linux).

A follow that polls its rank logs 5 times a second costs its host about 3 ms of CPU a
second: nothing on one machine, but on a fake cluster of 1,000 hosts sharing 2 cores it
is more than the cores have, and on a real host it is a wake-up for nothing. With a
watch on both folders the follow sleeps until a rank writes a line, touches its
heartbeat, or a record (pid, exit, host.exit) lands by its rename.

The stdlib has no inotify binding: this calls libc through _ctypes (agent/libc.py; the
import of ctypes' package was 5 ms of CPU at every follow's start). The folders are
watched through the descriptors the agent opened without following a link
(/proc/self/fd/N). Anything missing (not Linux, no _ctypes, the user's
fs.inotify.max_user_instances spent) leaves `watch()` None, and the follow polls as
before. Stdlib only, Python 3.8.
"""
from __future__ import annotations

import os
import struct

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x80, 0x100, 0x200
IN_Q_OVERFLOW, IN_ONLYDIR = 0x4000, 0x01000000
MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE
EVENT = struct.Struct("=iIII")   # struct inotify_event: wd, mask, cookie, len; then the name
READ = 64 << 10


class Watch:
    """One inotify instance over some folders. `fd` is readable when anything changed
    in them; `drain()` says which of them did (by their index in `dir_fds`) and the
    names of the files."""

    def __init__(self, fd: int, wds: dict[int, int]) -> None:
        self.fd, self.wds = fd, wds

    def drain(self) -> tuple[set[int], set[str]]:
        """(the folders that changed, the names changed in them) since the last drain;
        an overflowed queue counts as every folder changed."""
        folders, names = set(), set()   # type: set[int], set[str]
        while True:
            try:
                data = os.read(self.fd, READ)
            except BlockingIOError:
                return folders, names
            if not data:
                return folders, names
            parse(data, self.wds, folders, names)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def parse(data: bytes, wds: dict[int, int], folders: set[int], names: set[str]) -> None:
    pos = 0
    while pos + EVENT.size <= len(data):
        wd, mask, _, size = EVENT.unpack_from(data, pos)
        pos += EVENT.size
        name = data[pos:pos + size].split(b"\0", 1)[0]
        pos += size
        if mask & IN_Q_OVERFLOW:
            folders.update(wds.values())
        elif wd in wds:
            folders.add(wds[wd])
            names.add(os.fsdecode(name))


def watch(dir_fds: list[int]) -> Watch | None:
    """A watch over the open folders `dir_fds`, or None where inotify cannot be had."""
    try:
        from orchestrator.agent import libc
        init, add = libc.function("inotify_init1"), libc.function("inotify_add_watch")
    except (ImportError, OSError, AttributeError):
        return None
    fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:   # EMFILE: this user's max_user_instances are spent
        return None
    wds = {}   # type: dict[int, int]
    for index, dir_fd in enumerate(dir_fds):
        wd = add(fd, ("/proc/self/fd/%d" % dir_fd).encode(), MASK | IN_ONLYDIR)
        if wd < 0:   # ENOSPC: max_user_watches; no /proc
            os.close(fd)
            return None
        wds[wd] = index
    return Watch(fd, wds)


def wait(fds: list[Any], timeout: float) -> list[Any]:
    """The descriptors of `fds` readable within `timeout` seconds."""
    import select
    return select.select(fds, [], [], max(0.0, timeout))[0]
