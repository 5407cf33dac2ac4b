"""Files made ahead of a write that must cost little when it comes: an unnamed inode
(O_TMPFILE) in the folder, named only at the write, where JobDir.write_file links it
beside the name and renames it over, as it does a file it makes.

Why: a fail-fast on 1,000 hosts writes run/stop.json (the agent), each orphaned rank's
exit and run/host.exit (the supervisor) on every host in the same second. On ext4
without a journal a new inode is a scan of the inode bitmap that reads the inode table
for each recently deleted inode it passes (`recently_deleted`): 0.1 ms and more a file,
5% of such a stop's CPU on this project's benchmark machine. Made at the launch instead,
the stop only links and renames. An unnamed inode goes with its process, so a spare that
is never used leaves nothing behind; where O_TMPFILE or /proc/self/fd cannot be had (NFS,
an old kernel) the write makes its file as before. Stdlib only, Python 3.8."""
from __future__ import annotations

import os

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Callable

# (device, inode of the folder, name, mode) -> the spare's descriptor, one a name
SPARES = {}   # type: dict[tuple[int, int, str, int], int]
MOST = 64     # spares a process holds: a job with more ranks a host makes the rest later


def key(pfd: int, name: str, mode: int) -> tuple[int, int, str, int]:
    st = os.fstat(pfd)
    return st.st_dev, st.st_ino, name, mode


def make(pfd: int, name: str, mode: int) -> None:
    """A spare for `name` in the folder pfd, unless one is held already. Never raises:
    without one, the write makes its file as before."""
    flag = getattr(os, "O_TMPFILE", 0)
    try:
        k = key(pfd, name, mode)
        if not flag or k in SPARES or len(SPARES) >= MOST:
            return
        SPARES[k] = os.open(".", flag | os.O_WRONLY | os.O_CLOEXEC, mode, dir_fd=pfd)
    except OSError:   # no O_TMPFILE on this file system (NFS), or no room for an inode
        return


def write(pfd: int, name: str, tmp: str, mode: int, fill: Callable[[int], None]) -> bool:
    """`name` (made with `mode`) in pfd through its spare: `fill(fd)` writes it, then it
    is linked as `tmp` and renamed over `name`. True once written, False when there is no
    spare or it failed (then the caller writes as without one; nothing of the spare is
    left)."""
    if not SPARES:
        return False
    fd = SPARES.pop(key(pfd, name, mode), None)
    if fd is None:
        return False
    linked = False
    try:
        fill(fd)
        os.link("/proc/self/fd/%d" % fd, tmp, dst_dir_fd=pfd)   # (fails on a name there)
        linked = True
        os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        return True
    except OSError:
        if linked:
            try:
                os.unlink(tmp, dir_fd=pfd)
            except OSError:
                pass
        return False
    finally:
        os.close(fd)


def drop_all() -> None:
    """Close every spare (a forked process that writes none of them)."""
    for fd in SPARES.values():
        try:
            os.close(fd)
        except OSError:
            pass
    SPARES.clear()
