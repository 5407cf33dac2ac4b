"""The agent's bundle kept between commands. Building it (each shipped module compiled,
two zips) took about a tenth of a second of CPU at every `orch` command, for bytes that
depend only on the shipped sources, this Python and the build itself: they are kept in
the user's cache folder, one file per key, and read back when the key is the same.

Where: `$ORCH_CACHE_DIR`, else `$XDG_CACHE_HOME/orch`, else `~/.cache/orch`, each
only as an absolute path (`ORCH_CACHE_DIR=off` keeps nothing). The bundle is code every
host runs, so a file is used only where nobody else could have written it: the folder
and the file owned by this user, neither writable by group or others, the file a
regular one (a link is not followed) under MAX_BYTES, and its first line the sha256 of
the rest. Anything else, or any error, and the bundle is built as before (and kept,
where the folder can be made so).
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

MAX_BYTES = 32 << 20   # a bundle is ~0.25 MB: a bigger file is no bundle of ours
KEEP = 8               # bundles kept: several venvs or Pythons, each with its own key
PREFIX = "bundle-"


def folder() -> Path | None:
    """The cache folder, or None where caching is off (`off`, or no absolute path: a
    relative one would land in whatever folder orch runs in)."""
    own = os.environ.get("ORCH_CACHE_DIR")
    if own:
        return Path(own) if os.path.isabs(own) else None
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "orch"
    home = os.path.expanduser("~")   # "~" itself where neither HOME nor pwd has one
    return Path(home) / ".cache" / "orch" if os.path.isabs(home) else None


def key(parts: Iterable[bytes]) -> str:
    """sha256 over the parts, each length-prefixed (no two lists give one stream)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def cached(parts: Iterable[bytes], build: Callable[[], tuple[bytes, str]]
           ) -> tuple[bytes, str]:
    """(bytes, their sha256 hex) that `build` makes for these key parts: read back where
    kept and intact (the digest is the file's checked first line), else built (and kept
    where the folder is ours)."""
    where = folder()
    if where is None:
        return build()
    path = where / f"{PREFIX}{key(parts)[:40]}.zip"
    got = load(path)
    if got is None:
        got = build()
        save(path, *got)
    return got


def private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def load(path: Path) -> tuple[bytes, str] | None:
    """The kept bytes and their sha256 hex, or None: no file, not ours, not private, too
    big, or not intact."""
    try:
        if not private(os.stat(path.parent)):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not private(st) or st.st_size > MAX_BYTES:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    head, _, data = raw.partition(b"\n")
    digest = hashlib.sha256(data).hexdigest()
    return (data, digest) if head == digest.encode() else None


def save(path: Path, data: bytes, digest: str) -> None:
    """`data` under its sha256 hex `digest`, kept under a private name, then renamed over
    `path`; nothing on any error."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not private(os.stat(path.parent)):
            return
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(digest.encode() + b"\n" + data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return
    prune(path.parent, path.name)


def prune(where: Path, keep: str) -> None:
    """All but the KEEP newest bundles removed (and never `keep`, just written)."""
    try:
        kept = sorted(((p.stat().st_mtime, p) for p in where.glob(PREFIX + "*.zip")
                       if p.name != keep), reverse=True)
        for _, old in kept[KEEP - 1:]:
            old.unlink()
    except OSError:
        pass
