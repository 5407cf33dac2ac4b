"""`orch pull` on the host: list the job's output/ (or named paths under it) with each
file's size and sha256, then send the files the controller asks for. The checkpoint
keeper (session/keeper.py) asks the same of output/ or code/, for the files that
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
import os
import time

from orchestrator.agent.common import AgentError
from orchestrator.agent.ledger import LEDGER_CAP, sha256_fd, stat_key
from orchestrator.agent.listing import OUTPUT, Notes, list_globs, list_path
from orchestrator.agent.paths import JobDir, UnsafePath
from orchestrator.agent.procs import STOP_FILE, open_for_writing
from orchestrator.wire import globs, jsonc, protocol

MYPY = False
if MYPY:   # annotations only: typing's import (and its `re`) is ~11 ms of CPU in an agent
    from typing import Any

DIGESTS = {"output": "run/output-digests.json", "code": "run/code-pull-digests.json",
           globs.KEEP: "run/checkpoints-digests.json"}
HEX = frozenset("0123456789abcdef")


# ---------------------------------------------------------------- digests

def load_digests(jd: JobDir, folder: str = OUTPUT) -> dict[str, Any]:
    try:
        raw = jd.read(DIGESTS[folder], LEDGER_CAP)
        doc = jsonc.loads(raw.decode()) if raw is not None else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, list) and len(v) == 2
            and isinstance(v[0], str) and isinstance(v[1], str)}


def save_digests(jd: JobDir, cache: dict[str, Any], folder: str = OUTPUT) -> None:
    with contextlib.suppress(OSError):   # a cache: the next pull hashes again
        jd.write_file(DIGESTS[folder], jsonc.dumps(cache).encode())


def digest_of(jd: JobDir, rel: str, cache: dict[str, Any], folder: str = OUTPUT,
              limit: int | None = None) -> tuple[int, str] | None:
    """(size, sha256) of <folder>/<rel>, hashed only when (size, mtime, inode) changed;
    None when it is gone or became something else (a link) since the walk; (size, "")
    when it is larger than `limit` (not hashed)."""
    try:
        fd = jd.open_for_read(folder + "/" + rel)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if limit is not None and st.st_size > limit:
        os.close(fd)
        return st.st_size, ""
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
        return list_globs(jd, rests, folder, notes)
    for path in req.args["paths"] or [""]:
        if path and protocol.pull_path_problem(path):
            raise AgentError("cannot pull %r: %s" % (path, protocol.pull_path_problem(path)),
                             protocol.USAGE)
        list_path(jd, path, found, notes, folder)
    return found


# What this agent learned of the keeper's files, by path (it lives as long as the command:
# a whole attached run): the stat key of each file judged whole (judged once per save,
# not once per round), and the files seen held open for writing (written in place).
# Bounded: cleared when full, and the next rounds judge again.
WHOLE: dict[str, str] = {}
WRITTEN: set[str] = set()
MEMORY_CAP = 4096


class Settle:
    """Which files the checkpoint keeper may take now, so that a kept file is always a
    whole one.

    While the run on this host is intact (no stop received, no rank ended), a file is
    whole when it was not written in the last `settle` seconds, or when no process of
    this user holds it open for writing (agent/procs.open_for_writing) and its stat key
    did not change from before its digest to after that look: a checkpoint replaced by
    write-then-rename (written elsewhere, whole when it lands) or saved in place and
    closed. Without that second rule a job that saves more often than `settle` never has
    a file that old, and nothing is ever kept.

    Once a rank ended or a stop came, a writer may have died half way through a save: a
    file is then whole only when not written for `settle` seconds and never seen held
    open for writing (those in place are left as they were last taken). A file left out
    is named in the reply (`fresh_paths`): the restart line says why there is nothing to
    put back."""

    def __init__(self, jd: JobDir, folder: str, settle: float) -> None:
        self.jd, self.folder = jd, folder
        self.since, self.where = time.time() - settle, jd.show(folder) + "/"
        self.intact = run_intact(jd)
        self.waiting: list[str] = []
        self.fresh: list[str] = []
        self.count = 0

    def look(self, rel: str) -> None:
        """A file that may not be whole waits for `judge`."""
        st = self.stat(rel)
        if st is None or WHOLE.get(self.where + rel) == stat_key(st):
            return    # gone (the digest step skips it), or judged whole as it is now
        if st.st_mtime > self.since or not self.intact:
            self.waiting.append(rel)

    def judge(self, hashed: dict[str, str]) -> list[str]:
        """The waiting files that are not whole (`hashed`: their stat keys when
        digested); the others are remembered as whole."""
        keys = {rel: hashed[rel] for rel in self.waiting if rel in hashed}
        if not keys:
            return []
        written = open_for_writing({inode_of(key) for key in keys.values()})
        out = []
        for rel, key in sorted(keys.items()):
            st = self.stat(rel)
            held = inode_of(key) in written
            if held:
                remember(WRITTEN, self.written_key(rel, key))
            if st is None or stat_key(st) != key or held or not self.whole(rel, key, st):
                self.left_out(rel)
                out.append(rel)
            else:
                if len(WHOLE) >= MEMORY_CAP:
                    WHOLE.clear()
                WHOLE[self.where + rel] = key
        return out

    def whole(self, rel: str, key: str, st: os.stat_result) -> bool:
        """Not held open now: whole while the run is intact; after it, only settled and
        never seen written in place (this inode at this path)."""
        if self.intact:
            return True
        return st.st_mtime <= self.since and self.written_key(rel, key) not in WRITTEN

    def written_key(self, rel: str, key: str) -> str:
        return "%s%s\0%d:%d" % ((self.where, rel) + inode_of(key))

    def stat(self, rel: str) -> os.stat_result | None:
        try:
            return self.jd.lstat(self.folder + "/" + rel)
        except (OSError, UnsafePath):
            return None

    def left_out(self, rel: str) -> None:
        self.count += 1
        if len(self.fresh) < protocol.MAX_NOTES:
            shown = rel.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            self.fresh.append(shown[:255])


def remember(memory: set[str], key: str) -> None:
    if len(memory) >= MEMORY_CAP:
        memory.clear()
    memory.add(key)


def run_intact(jd: JobDir) -> bool:
    """No stop received and no rank ended on this host during this run (launch clears
    both records): every writer that was saving is still alive."""
    try:
        if jd.lstat(STOP_FILE) is not None:
            return False
        with jd.dirfd("run") as fd:
            return not any(n.startswith("rank-") and n.endswith(".exit") for n in os.listdir(fd))
    except (OSError, UnsafePath):
        return False


def inode_of(key: str) -> tuple[int, int]:
    """(device, inode) of a ledger stat key (size:mtime:inode:device:ctime)."""
    parts = key.split(":")
    return int(parts[3]), int(parts[2])


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
    settle = Settle(jd, folder, req.args.get("settle", 0))
    files: dict[str, list[Any]] = {}
    total = 0
    limit = req.args.get("max_size")
    for rel in sorted(found):
        if req.args.get("settle"):
            settle.look(rel)
        got = digest_of(jd, rel, old, folder, limit)
        if got is None:
            continue
        if not got[1]:
            notes.add(rel, "larger than %d bytes (not hashed)" % limit)
            continue
        kept[rel] = old[rel]
        if got[0] > protocol.MAX_PULL_SIZE:
            notes.add(rel, "larger than %d bytes" % protocol.MAX_PULL_SIZE)
            continue
        files[rel] = list(got)
        total += got[0]
    for rel in settle.judge({rel: old[rel][0] for rel in files}):
        total -= files.pop(rel)[0]
    if found:
        save_digests(jd, kept, folder)
    send_parts(req, files, folder)
    return {"root": jd.show(folder), "files": len(files), "bytes": total,
            "skipped": notes.items, "skipped_count": notes.count, "fresh": settle.count,
            "fresh_paths": settle.fresh}


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
