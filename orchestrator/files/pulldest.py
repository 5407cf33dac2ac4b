"""Where `orch pull` writes on this machine: one destination folder, no link inside it
ever followed.

The destination itself (`outputs/<name>/` or `-o DIR`) is resolved once, like a
remote_dir: it may be a link the user made. Below it every folder is opened with
O_NOFOLLOW relative to its parent's descriptor, each file is written beside its final
name (`<name>.orch-part-<pid>`, O_EXCL, no link followed), fsynced and renamed over the
name in the same folder descriptor: a link planted at the name is replaced, never
written through; a link planted in place of a folder is refused. One pull at a time
writes into a destination (flock on its folder); half-written files a killed pull left
are removed first.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

from orchestrator.agent.ledger import sha256_fd
from orchestrator.agent.paths import (
    DIR_FLAGS,
    PART,
    READ_FLAGS,
    create_excl,
    lstat_at,
    part_name,
    sweep_fd,
)
from orchestrator.errors import UsageError
from orchestrator.wire import protocol


class Refused(Exception):
    """A file that cannot be written where it belongs (a link or a file in the way)."""


class Dest:
    """A pull's destination folder, locked for this pull; close() (or `with`) ends it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise UsageError(f"{root}: cannot be used as the pull's destination "
                             f"({e.strerror or e})",
                             hint="pass another folder with -o DIR") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise UsageError(f"{root}: another `orch pull` is writing into this folder",
                             hint="wait for it to end, or pull into another folder "
                                  "with -o DIR") from None
        self.dirs: dict[str, int] = {}

    def __enter__(self) -> Dest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs = {}
        os.close(self.fd)   # releases the lock

    def show(self, rel: str) -> str:
        return str(self.root / rel)

    def sweep(self) -> int:
        """Remove what a killed pull left half-written (names with .orch-part-)."""
        return sweep_fd(os.dup(self.fd), lambda name: PART in name)

    # ------------------------------------------------------------ folders

    def folder(self, parent: str, create: bool) -> int:
        """The descriptor of folder `parent` (relative, "" for the root), kept open; each
        part opened without following a link. FileNotFoundError when missing and not
        `create`; Refused when a link or a file stands in the way."""
        if parent == "":
            return self.fd
        fd = self.dirs.get(parent)
        if fd is not None:
            return fd
        up, _, name = parent.rpartition("/")
        pfd = self.folder(up, create)
        fd = self._open_child(pfd, name, parent, create)
        if len(self.dirs) >= 64:
            for old in self.dirs.values():
                os.close(old)
            self.dirs = {}
        self.dirs[parent] = fd
        return fd

    def _open_child(self, pfd: int, name: str, rel: str, create: bool) -> int:
        for attempt in (0, 1):
            try:
                return os.open(name, DIR_FLAGS | os.O_CLOEXEC, dir_fd=pfd)
            except FileNotFoundError:
                if not create or attempt:
                    raise
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self.in_the_way(pfd, name, rel) from None
                raise
            # made meanwhile, or a link: the second open tells
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=pfd)
        raise AssertionError("unreachable")

    def in_the_way(self, pfd: int, name: str, rel: str) -> Refused:
        st = lstat_at(pfd, name)
        kind = "a symbolic link" if st is not None and stat.S_ISLNK(st.st_mode) else "not a folder"
        return Refused(f"{self.show(rel)} is {kind}; orch pull never writes through links in "
                       f"its destination (remove it, or pull into another folder with -o DIR)")

    # ------------------------------------------------------------ files

    def lstat(self, rel: str) -> os.stat_result | None:
        """The entry at rel itself; None when it (or a folder on its way) is missing.
        Refused when a link or a file stands where a folder belongs."""
        parent, _, name = rel.rpartition("/")
        try:
            st: os.stat_result | None = lstat_at(self.folder(parent, create=False), name)
            return st
        except FileNotFoundError:
            return None

    def remove(self, rel: str) -> None:
        """Unlink the entry at rel itself (a link is removed, never followed)."""
        parent, _, name = rel.rpartition("/")
        os.unlink(name, dir_fd=self.folder(parent, create=False))

    def digest(self, rel: str) -> str:
        """sha256 of the regular file at rel, read without following a link."""
        parent, _, name = rel.rpartition("/")
        return sha256_fd(os.open(name, READ_FLAGS | os.O_CLOEXEC,
                                 dir_fd=self.folder(parent, create=False)))

    def create(self, rel: str, mode: int) -> Writing:
        why = protocol.pull_path_problem(rel)   # checked before; here too: this one writes
        if why:
            raise Refused(f"{rel[:200]!r}: {why}")
        parent, _, name = rel.rpartition("/")
        pfd = self.folder(parent, create=True)
        tmp = part_name(name)
        return Writing(self, rel, pfd, name, tmp, create_excl(pfd, tmp, mode & 0o777))


class Writing:
    """One file being written beside its final name."""

    def __init__(self, dest: Dest, rel: str, pfd: int, name: str, tmp: str, fd: int) -> None:
        self.dest, self.rel, self.pfd, self.name, self.tmp, self.fd = dest, rel, pfd, name, tmp, fd

    def write(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def commit(self) -> os.stat_result:
        """fsync, then rename over the final name (a link there is replaced, not
        followed). A folder at the name is refused. Returns the file's stat."""
        try:
            os.fsync(self.fd)
            st = os.fstat(self.fd)
        finally:
            os.close(self.fd)
        try:
            os.rename(self.tmp, self.name, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
        except OSError:
            os.unlink(self.tmp, dir_fd=self.pfd)
            raise Refused(f"{self.dest.show(self.rel)} is a folder here but a file on the "
                          "host (move it away, or pull into another folder with -o DIR)") from None
        return st

    def abandon(self) -> None:
        """Close and remove the half-written file (best effort: a later pull sweeps it)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.pfd)


def set_aside(root: Path, suffix: str) -> Path:
    """Rename the folder `root` to `<root>.<suffix>` (one rename: nothing is copied or
    deleted), under its pull lock; the name taken is returned (`-2`, `-3`... if taken).
    A pull writing into it now: UsageError, nothing moved."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(f"{root}: another `orch pull` is writing into this folder",
                             hint="wait for it to end, then pull again") from None
        for n in range(1, 1000):
            aside = root.with_name(f"{root.name}.{suffix}" + (f"-{n}" if n > 1 else ""))
            if not os.path.lexists(aside):
                os.rename(root, aside)
                return aside
        raise UsageError(f"{root}: too many earlier runs named {root.name}.{suffix}-*",
                         hint="move some of them away, or pull with -o DIR")
    finally:
        os.close(fd)
