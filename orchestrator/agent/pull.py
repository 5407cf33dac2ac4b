"""`orch pull` on the host: list the job's output/ (or named paths under it) with each
file's size and sha256, then send the files the controller asks for.

A link is neither followed nor sent (it is skipped and named in the reply), nor is
anything that is not a regular file. Every path goes through the job's JobDir
(agent/paths.py). Digests are kept in run/output-digests.json by (size, mtime, inode), so a
second pull hashes only what changed. Stdlib only, Python 3.8.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat as st_mod
from typing import Any

from orchestrator.agent.common import AgentError
from orchestrator.agent.ledger import LEDGER_CAP, sha256_fd, stat_key
from orchestrator.agent.paths import DIR_FLAGS, JobDir, UnsafePath
from orchestrator.wire import protocol

OUTPUT = "output"
DIGESTS = "run/output-digests.json"
HEX = frozenset("0123456789abcdef")


class Notes:
    """What was skipped: the first MAX_PULL_NOTES named, all counted."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.count = 0

    def add(self, rel: str, why: str) -> None:
        self.count += 1
        if len(self.items) < protocol.MAX_PULL_NOTES:
            shown = rel.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            self.items.append({"p": shown[:300], "why": why})


# ---------------------------------------------------------------- the walk

def kind_of(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "a symbolic link (links are not pulled)"
    return "not a regular file"


def walk(fd: int, rel: str, found: dict[str, Any], notes: Notes) -> None:
    """Regular files under the folder fd (closed here) into found {rel: None}."""
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            path = rel + "/" + e.name if rel else e.name
            why = protocol.pull_path_problem(path)
            if why:
                notes.add(path, why)
            elif e.is_dir(follow_symlinks=False):
                try:
                    child = os.open(e.name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue   # replaced or removed meanwhile
                walk(child, path, found, notes)
            elif e.is_file(follow_symlinks=False):
                found[path] = None
                if len(found) > protocol.MAX_PULL_FILES:
                    raise too_many()
            else:
                notes.add(path, kind_of(e))
    finally:
        os.close(fd)


def too_many() -> AgentError:
    return AgentError("output/ holds more than %d files: more than one pull lists"
                      % protocol.MAX_PULL_FILES, protocol.USAGE)


def list_path(jd: JobDir, path: str, found: dict[str, Any], notes: Notes) -> None:
    """The files of output/<path> (output/ itself when path is ""): a folder walked, a
    file listed, a link skipped. A named path that is not there is a usage error."""
    rel = OUTPUT + "/" + path if path else OUTPUT
    try:
        st = jd.lstat(rel)
    except UnsafePath as e:   # a link on the way: never followed
        notes.add(path, str(e))
        return
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is None:
        if path:
            raise AgentError("%s: no such file or folder" % jd.show(rel), protocol.USAGE)
        return
    if st_mod.S_ISDIR(st.st_mode):
        walk(jd.open_dir(rel), path, found, notes)
    elif st_mod.S_ISREG(st.st_mode):
        found[path] = None
    else:
        notes.add(path, "a symbolic link (links are not pulled)" if st_mod.S_ISLNK(st.st_mode)
                  else "not a regular file")


# ---------------------------------------------------------------- digests

def load_digests(jd: JobDir) -> dict[str, Any]:
    try:
        raw = jd.read(DIGESTS, LEDGER_CAP)
        doc = json.loads(raw.decode()) if raw is not None else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, list) and len(v) == 2
            and isinstance(v[0], str) and isinstance(v[1], str)}


def save_digests(jd: JobDir, cache: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):   # a cache: the next pull hashes again
        jd.write_file(DIGESTS, json.dumps(cache).encode())


def digest_of(jd: JobDir, rel: str, cache: dict[str, Any]) -> tuple[int, str] | None:
    """(size, sha256) of output/<rel>, hashed only when (size, mtime, inode) changed;
    None when it is gone or became something else (a link) since the walk."""
    try:
        fd = jd.open_for_read(OUTPUT + "/" + rel)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    key, hit = stat_key(st), cache.get(rel)
    if hit and hit[0] == key:
        os.close(fd)
        return st.st_size, hit[1]
    digest = sha256_fd(fd)   # closes fd
    cache[rel] = [key, digest]
    return st.st_size, digest


# ---------------------------------------------------------------- requests

def run_manifest(req: Any) -> dict[str, Any]:
    """Parts of {rel: [size, sha256]} (rel relative to output/), then the totals and
    what was skipped."""
    jd = JobDir(req.args["job_dir"])
    found: dict[str, Any] = {}
    notes = Notes()
    for path in req.args["paths"] or [""]:
        if path and protocol.pull_path_problem(path):
            raise AgentError("cannot pull %r: %s" % (path, protocol.pull_path_problem(path)),
                             protocol.USAGE)
        list_path(jd, path, found, notes)
    old = load_digests(jd)
    kept = dict(old) if req.args["paths"] else {}   # a whole walk drops what is gone
    files, total = {}, 0
    for rel in sorted(found):
        got = digest_of(jd, rel, old)
        if got is None:
            continue
        kept[rel] = old[rel]
        if got[0] > protocol.MAX_PULL_SIZE:
            notes.add(rel, "larger than %d bytes" % protocol.MAX_PULL_SIZE)
            continue
        files[rel] = list(got)
        total += got[0]
    if found:
        save_digests(jd, kept)
    send_parts(req, files)
    return {"root": jd.show(OUTPUT), "files": len(files), "bytes": total,
            "skipped": notes.items, "skipped_count": notes.count}


def send_parts(req: Any, files: dict[str, Any]) -> None:
    items, step = list(files.items()), protocol.MANIFEST_PART
    for i in range(0, len(items), step):
        req.part("manifest", {"folder": OUTPUT, "files": dict(items[i:i + step])})


def run_send(req: Any) -> dict[str, Any]:
    """Each asked file: `pull_file`, its bytes as data frames, `pull_end` with their
    sha256; `pull_skip` when it cannot be opened (gone, now a link)."""
    jd = JobDir(req.args["job_dir"])
    count, nbytes = 0, 0
    for rel in req.args["files"]:
        why = protocol.pull_path_problem(rel)
        fd = None
        if not why:
            try:
                fd = jd.open_for_read(OUTPUT + "/" + rel)
            except OSError as e:
                why = "gone" if isinstance(e, FileNotFoundError) else str(e)
        if fd is None:
            req.part("pull_skip", {"p": rel, "why": why})
            continue
        try:
            nbytes += send_file(req, fd, rel)
        finally:
            os.close(fd)
        count += 1
    return {"files": count, "bytes": nbytes}


def send_file(req: Any, fd: int, rel: str) -> int:
    """The file's size as it is now, then exactly that many bytes. A file that shrank
    while read is padded (the stream stays in step) and its digest sent empty: the
    controller drops it."""
    st = os.fstat(fd)
    size = min(st.st_size, protocol.MAX_PULL_SIZE)
    req.part("pull_file", {"p": rel, "s": size, "m": st.st_mode & 0o777})
    h, left = hashlib.sha256(), size
    while left:
        block = os.read(fd, min(left, protocol.MAX_DATA))
        if not block:
            break
        h.update(block)
        req.out.send(protocol.frame(protocol.DATA, block))
        left -= len(block)
    short = left > 0
    while left:
        n = min(left, protocol.MAX_DATA)
        req.out.send(protocol.frame(protocol.DATA, bytes(n)))
        left -= n
    req.part("pull_end", {"p": rel, "h": "" if short else h.hexdigest()})
    return size
