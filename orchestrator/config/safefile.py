"""Read a small local file that someone else may have placed: a regular file only, of a
bounded size, without ever blocking (a FIFO) or reading forever (/dev/zero). Write one of
orch's own local files whole (`write_whole`)."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path


class FileRefused(Exception):
    """Why the file cannot be read (not a regular file, or too big); the caller adds its name."""

    def __init__(self, message: str, too_big: bool = False) -> None:
        super().__init__(message)
        self.message, self.too_big = message, too_big


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. The kind is checked before
    opening (opening a device can do things) and again on the open file (it may have been
    swapped); opened without blocking, since a FIFO would wait for a writer forever.
    Raises FileNotFoundError, FileRefused, or OSError for other failures."""
    _check_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        _check_regular(info.st_mode)
        data = _read_at_most(fd, limit + 1) if info.st_size <= limit else b""
    finally:
        os.close(fd)
    if info.st_size > limit or len(data) > limit:
        raise FileRefused(f"the file is larger than {limit} bytes (the limit)", too_big=True)
    return data


def _check_regular(mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = ("a folder" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or other special file")
    raise FileRefused(f"not a regular file: it is {kind}")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_whole(path: Path, data: bytes, mode: int = 0o600) -> None:
    """`path` replaced whole by `data` (its folder made): a crash while writing leaves
    the previous file. The .tmp file is this process's and thread's own: two writers of
    one file at once (two threads, or two orch commands) through one shared .tmp name
    made one's rename find the other's file gone (ENOENT); now the last rename wins.
    Nothing is left behind when the write or the rename fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
