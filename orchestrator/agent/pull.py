"""`orch pull` on the host: list the job's output/ (or named paths under it) with each
file's size and sha256, then send the files the controller asks for. The checkpoint
keeper (session/checkpoints.py) asks the same of output/ or code/, for the files that
match its globs (wire/globs.py) and were not written in the last `settle` seconds, and
of checkpoints/ (the keeper host's copy, `job.checkpoint_to: host`) for the relay.

A link is neither followed nor sent (it is skipped and named in the reply), nor is
anything that is not a regular file. Every path goes through the job's JobDir
(agent/paths.py). Digests are kept in run/output-digests.json by (size, mtime, inode), so a
second pull hashes only what changed (code/'s in run/code-pull-digests.json: the name
run/code-digests.json is an old cache that agent/files.py removes). Stdlib only, Python 3.8.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat as st_mod
import time
from typing import Any, Callable

from orchestrator.agent.common import AgentError
from orchestrator.agent.ledger import LEDGER_CAP, sha256_fd, stat_key
from orchestrator.agent.paths import DIR_FLAGS, JobDir, UnsafePath
from orchestrator.wire import globs, protocol

OUTPUT = "output"
DIGESTS = {"output": "run/output-digests.json", "code": "run/code-pull-digests.json",
           globs.KEEP: "run/checkpoints-digests.json"}
HEX = frozenset("0123456789abcdef")


class Notes:
    """What was skipped: the first MAX_PULL_NOTES named, all counted."""

    def __init__(self, wanted: Callable[[str], bool] | None = None) -> None:
        self.items: list[Any] = []
        self.count = 0
        self.wanted = wanted   # with globs: only what they match is worth naming

    def add(self, rel: str, why: str) -> None:
        if self.wanted is not None and not self.wanted(rel):
            return
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
                    raise too_many(rel.split("/", 1)[0] or "the folder")
            else:
                notes.add(path, kind_of(e))
    finally:
        os.close(fd)


def too_many(where: str) -> AgentError:
    return AgentError("%s holds more than %d files: more than one pull lists"
                      % (where, protocol.MAX_PULL_FILES), protocol.USAGE)


def list_path(jd: JobDir, path: str, found: dict[str, Any], notes: Notes,
              folder: str = OUTPUT, must: bool = True) -> None:
    """The files of <folder>/<path> (the folder itself when path is ""): a folder walked,
    a file listed, a link skipped. A named path that is not there is a usage error
    (`must`), or nothing (a glob's root)."""
    rel = folder + "/" + path if path else folder
    try:
        st = jd.lstat(rel)
    except UnsafePath as e:   # a link on the way: never followed
        notes.add(path, str(e))
        return
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is None:
        if path and must:
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

def load_digests(jd: JobDir, folder: str = OUTPUT) -> dict[str, Any]:
    try:
        raw = jd.read(DIGESTS[folder], LEDGER_CAP)
        doc = json.loads(raw.decode()) if raw is not None else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, list) and len(v) == 2
            and isinstance(v[0], str) and isinstance(v[1], str)}


def save_digests(jd: JobDir, cache: dict[str, Any], folder: str = OUTPUT) -> None:
    with contextlib.suppress(OSError):   # a cache: the next pull hashes again
        jd.write_file(DIGESTS[folder], json.dumps(cache).encode())


def digest_of(jd: JobDir, rel: str, cache: dict[str, Any],
              folder: str = OUTPUT) -> tuple[int, str] | None:
    """(size, sha256) of <folder>/<rel>, hashed only when (size, mtime, inode) changed;
    None when it is gone or became something else (a link) since the walk."""
    try:
        fd = jd.open_for_read(folder + "/" + rel)
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

def folder_of(req: Any) -> str:
    folder: str = req.args.get("folder", OUTPUT)
    if folder not in globs.FOLDERS and folder != globs.KEEP:
        raise AgentError("cannot pull from %r: only output/, code/ or checkpoints/" % folder,
                         protocol.USAGE)
    return folder


def list_all(req: Any, jd: JobDir, folder: str, notes: Notes) -> dict[str, Any]:
    """{rel: None}: the named paths (all of the folder when none), or what the globs match."""
    found: dict[str, Any] = {}
    rests = req.args.get("globs")
    if rests is not None:
        for rest in rests:
            list_path(jd, globs.root(rest), found, notes, folder, must=False)
        return {rel: None for rel in found if globs.matches_any(rests, rel)}
    for path in req.args["paths"] or [""]:
        if path and protocol.pull_path_problem(path):
            raise AgentError("cannot pull %r: %s" % (path, protocol.pull_path_problem(path)),
                             protocol.USAGE)
        list_path(jd, path, found, notes, folder)
    return found


def is_fresh(jd: JobDir, rel: str, since: float) -> bool:
    """Written after `since` (a file still being written, by a job that does not write
    beside and rename): left for the next round."""
    try:
        st = jd.lstat(rel)
    except (OSError, UnsafePath):
        return False
    return st is not None and st.st_mtime > since


def run_manifest(req: Any) -> dict[str, Any]:
    """Parts of {rel: [size, sha256]} (rel relative to the folder: output/ by default),
    then the totals and what was skipped; `fresh`: files left out as written less than
    `settle` seconds ago."""
    jd, folder = JobDir(req.args["job_dir"]), folder_of(req)
    rests = req.args.get("globs")
    notes = Notes(None if rests is None else lambda rel: globs.matches_any(rests, rel))
    found = list_all(req, jd, folder, notes)
    old = load_digests(jd, folder)
    partial = bool(req.args["paths"]) or rests is not None
    kept = dict(old) if partial else {}   # a whole walk drops what is gone
    since = time.time() - req.args.get("settle", 0)
    files, total, fresh = {}, 0, 0
    for rel in sorted(found):
        if req.args.get("settle") and is_fresh(jd, folder + "/" + rel, since):
            fresh += 1
            continue
        got = digest_of(jd, rel, old, folder)
        if got is None:
            continue
        kept[rel] = old[rel]
        if got[0] > protocol.MAX_PULL_SIZE:
            notes.add(rel, "larger than %d bytes" % protocol.MAX_PULL_SIZE)
            continue
        files[rel] = list(got)
        total += got[0]
    if found:
        save_digests(jd, kept, folder)
    send_parts(req, files, folder)
    return {"root": jd.show(folder), "files": len(files), "bytes": total,
            "skipped": notes.items, "skipped_count": notes.count, "fresh": fresh}


def send_parts(req: Any, files: dict[str, Any], folder: str = OUTPUT) -> None:
    items, step = list(files.items()), protocol.MANIFEST_PART
    for i in range(0, len(items), step):
        req.part("manifest", {"folder": folder, "files": dict(items[i:i + step])})


def run_send(req: Any) -> dict[str, Any]:
    """Each asked file: `pull_file`, its bytes as data frames, `pull_end` with their
    sha256; `pull_skip` when it cannot be opened (gone, now a link)."""
    jd, folder = JobDir(req.args["job_dir"]), folder_of(req)
    count, nbytes = 0, 0
    for rel in req.args["files"]:
        why = protocol.pull_path_problem(rel)
        fd = None
        if not why:
            try:
                fd = jd.open_for_read(folder + "/" + rel)
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
