"""Files on the host: manifests (what orch pushed and is still there, agent/ledger.py) and
the receive stream (write beside, verify, rename; new top folders staged and renamed
whole). Every path goes through the job's JobDir (agent/paths.py): no link followed."""
from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import os
import stat
import time

from orchestrator.agent.common import AgentError, folder_of
from orchestrator.agent.common import StreamIdle as StreamIdle  # (raised here; tests name it here)
from orchestrator.agent.ledger import Ledger, same
from orchestrator.agent.paths import (
    EXCL_FLAGS,
    PART,
    Dirs,
    JobDir,
    create_excl,
    lstat_at,
    not_a,
    part_name,
    split_parent,
    write_all,
)
from orchestrator.agent.streams import StreamReader, broke
from orchestrator.agent.streams import drain as drain  # (tests name it here)
from orchestrator.wire import protocol, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Union

    from orchestrator.agent.main import Request

IdleReader = StreamReader   # its old name (tests name it here)
UMASK = os.umask(0)
os.umask(UMASK)
STAGING = ".orch-staging-"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpace(AgentError, OSError):
    """The host's disk (or quota) is full: one line naming the file, the folder and the fix."""

    def __init__(self, shown: str, size: int, folder: str) -> None:
        super().__init__("no space left on device writing %s (%d bytes) into %s%s"
                         % (shown, size, folder, free_space(folder)))
        self.fix = ("free space on that disk, or set `remote_dir` in cluster.yaml to a larger "
                    "one; the next push keeps the files that landed and sends only the rest")


def free_space(folder: str) -> str:
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    return ", %d bytes free of %d" % (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


if MYPY:
    Reader = Union[protocol.FrameReader, StreamReader]


def receive_lock(jd: JobDir, folder: str, wait: float = timeouts.RECEIVE_LOCK) -> int:
    """One receiver per folder: a push (or a manifest) waits for an earlier receiver whose
    connection broke to give up (it does within RECEIVE_IDLE). The lock ends with its
    process. Returns the descriptor to close."""
    # the owner's alone: any user who can open a file can flock it, and one who held
    # this lock would keep every push out of the folder
    fd = jd.open_for_write("run/%s-receive.lock" % folder, 0o600, append=True)
    try:
        if os.fstat(fd).st_mode & 0o077:   # made by an orch before this rule
            os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                err = AgentError("an earlier push into %s is still being received (its "
                                 "connection broke) and did not end within %g s"
                                 % (jd.show(folder), wait))
                err.fix = "try again in a minute"   # type: ignore[attr-defined]
                raise err from None
            time.sleep(0.1)


def is_leftover(name: str) -> bool:
    """Names only orch gives: a killed receiver's staging folder or half-written file."""
    return name.startswith(STAGING) or PART in name


def manifest(jd: JobDir, folder: str, expect: str | None = None) -> dict[str, Any]:
    """{relpath: [size, sha256 or "link:<target>"]} of what orch pushed into the folder
    and is still there (agent/ledger.py); digests kept by (size, mtime, inode).

    Files the job wrote there are not listed, so the controller never deletes them. A
    receiver that did not finish (its journal is there), or a host upgraded from the old
    digest cache, gets its staging folders and .orch-part- files removed first;
    manifests are made before a push, when no receiver writes here.

    `expect`: the controller's manifest_token of what it will push. When the folder
    holds exactly that, the answer is {"root", "files": {}, "same": True}: from the
    ledger's signature alone while every file's stat key stands (no JSON read, no file
    hashed), else from the full manifest (which then writes the signature anew).
    """
    if jd.lstat(folder) is None:
        return {"root": jd.show(folder), "files": {}}
    lock = receive_lock(jd, folder)
    try:
        if expect is not None and same(jd, folder, expect):
            return {"root": jd.show(folder), "files": {}, "same": True}
        ledger = Ledger(jd, folder)
        if ledger.interrupted or not ledger.found:
            jd.sweep(folder, is_leftover)
        if not ledger.found:   # the cache of orch before the ledger: every file, the job's too
            jd.unlink("run/%s-digests.json" % folder)
        files = ledger.manifest()
        wrote = ledger.save()
        if expect is not None and protocol.manifest_token(
                (rel, e[1]) for rel, e in files.items()) == expect:
            if not wrote:
                ledger.write_sig()   # missing or stale: the next check is the quick one
            return {"root": jd.show(folder), "files": {}, "same": True}
    finally:
        os.close(lock)
    return {"root": jd.show(folder), "files": files}


def send_manifest(req: Request, part_folder: str, jd: JobDir, folder: str,
                  expect: str | None = None) -> str:
    """A folder's manifest as parts of at most MANIFEST_PART entries (a big data/ never
    makes one frame larger than the controller accepts); the folder as the host shows it.
    `expect`: the controller's manifest_token of what it will push; when the folder
    holds exactly that, one part says `same` and carries no entries (a hundred thousand
    files are 10 MB of JSON the controller then neither receives nor parses)."""
    found = manifest(jd, folder, expect)
    shown: str = found["root"]
    if found.get("same"):
        req.part("manifest", {"folder": part_folder, "files": {}, "same": expect})
        return shown
    items, step = list(found["files"].items()), protocol.MANIFEST_PART
    for i in range(0, max(len(items), 1), step):
        req.part("manifest", {"folder": part_folder, "files": dict(items[i:i + step])})
    return shown


def run_manifest(req: Request) -> dict[str, Any]:
    jd, folder = folder_of(req.args["root"])
    return {"root": send_manifest(req, "", jd, folder)}


def receive_file(reader: Reader, dirs: Dirs, base: str, head: dict[str, Any],
                 staged: bool = False) -> tuple[Any, ...]:
    """Write beside (.orch-part-, O_EXCL, no link followed), hash while writing, verify,
    then rename into place in the same folder descriptor. A staged file (inside a
    staging folder no one reads) is written under its name. Returns (stat, digest)."""
    parent, name = split_parent(base + "/" + head["p"])
    pfd = dirs.fd(parent)
    tmp = name if staged else part_name(name)
    # a fresh digest was taken from these very bytes (protocol.STREAM): not hashed again
    h, mode = None if head.get("fresh") is True else hashlib.sha256(), head["m"] & 0o777
    if head["s"] < 0:
        raise ValueError("bad size %r for %s" % (head["s"], head["p"]))
    fd = create_excl(pfd, tmp, mode)
    try:
        receive_bytes(reader, fd, h, head["s"], head["p"])
        if mode & UMASK:
            os.fchmod(fd, mode)
        st = os.fstat(fd)
    except BaseException as e:
        os.close(fd)
        os.unlink(tmp, dir_fd=pfd)   # a broken stream never leaves a half-written file behind
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            top = base.split("/", 1)[0]   # code or data, also from a staging folder
            raise NoSpace(top + "/" + head["p"], head["s"], dirs.jd.show(top)) from None
        raise
    os.close(fd)
    if h is not None and h.hexdigest() != head["h"]:
        os.unlink(tmp, dir_fd=pfd)
        raise ValueError("digest mismatch for %s" % head["p"])
    if not staged:
        place(dirs.jd, pfd, tmp, name, base + "/" + head["p"])
        # the rename moved the file's ctime on (ledger.stat_key has it): recorded as placed
        st = lstat_at(pfd, name) or st
    return st, head["h"]


def place(jd: JobDir, pfd: int, tmp: str, name: str, rel: str) -> None:
    """Rename tmp over name (a file or link there is replaced, never followed); a folder
    there (the job's) is refused with a fix."""
    try:
        os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
    except OSError:
        os.unlink(tmp, dir_fd=pfd)
        st = lstat_at(pfd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise not_a("file", jd.show(rel)) from None
        raise


def receive_link(dirs: Dirs, base: str, head: dict[str, Any]) -> tuple[Any, ...]:
    """{"p": rel, "link": target}: rel becomes a link to target (inside the folder only,
    checked by JobDir.symlink). Returns (stat of the link, "link:<target>")."""
    target = head["link"]
    st = dirs.jd.symlink(base + "/" + head["p"], target)
    return st, "link:" + target


def receive_bytes(reader: Reader, fd: int, h: Any, left: int, name: str) -> None:
    """The file's bytes: data frames adding up to exactly `left` bytes."""
    while left:
        got = reader.read_frame()
        if got is None:
            raise EOFError("stream ended inside %s" % name)
        kind, data = got
        if kind != protocol.DATA or len(data) > left:
            raise broke(reader, "%s: expected %d more bytes of data" % (name, left))
        if h is not None:
            h.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        left -= len(data)


def prune_empty_dirs(jd: JobDir, base: str, removed: list[Any]) -> None:
    """Remove the folders that deleting `removed` left empty (never base itself, never a
    folder that still holds anything, such as the job's own files)."""
    parents: set[str] = set()
    for rel in removed:
        parts = rel.split("/")[:-1]
        parents.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for d in sorted(parents, key=lambda r: -r.count("/")):
        jd.rmdir(base + "/" + d)


class Staging:
    """A top-level folder (a shard, a code package) that the host does not have yet is
    written into a staging folder under its final names and renamed into place as a
    whole at the end: one rename per folder instead of one per file. Folders the host
    has are updated file by file (write beside, rename)."""

    def __init__(self, dirs: Dirs, base: str) -> None:
        self.dirs, self.jd, self.base = dirs, dirs.jd, base
        self.dir = "%s/%s%d" % (base, STAGING, os.getpid())
        self.tops: dict[str, bool] = {}
        self.landed: list[Any] = []   # (rel, stat, digest) of staged files: recorded once in place

    def wants(self, rel: str) -> bool:
        top = rel.split("/", 1)[0]
        if top not in self.tops:
            self.tops[top] = "/" in rel and self.jd.lstat(self.base + "/" + top) is None
            if self.tops[top]:
                self.dirs.fd(self.dir)
        return self.tops[top]

    def promote(self, ledger: Ledger) -> None:
        """Every staged file was verified when written: move the folders into place
        (also after a broken stream, so that a resumed push sends only the rest), and
        record them by writing the ledger at once.

        Not through the journal: the journal exists so that a receiver killed half way
        leaves a record of what it placed. Here the record is the ledger itself, written
        (save(), atomic) right after the renames instead of a journal line, so a kill
        lands on one of the same three states as with the journal line: before a rename
        (the staging folder is swept by the next manifest, nothing recorded), between
        the renames and the record (the files are in place and unknown: never reported,
        never deleted, sent again by the next push; the journal that begin() opened is
        still there, so the next manifest still sweeps leftovers), or after it (all
        recorded). Only the bytes differ: one JSON line of every staged file less (a
        tenth of the host's CPU in a first push of 100,000 small files), and the save at
        the end of the receive then writes nothing unless deletes follow."""
        moved = set()
        for top, staged in self.tops.items():
            if staged and self.jd.lstat(self.dir + "/" + top) is not None:
                self.jd.replace(self.dir + "/" + top, self.base + "/" + top)
                moved.add(top)
        everything = moved == {top for top, staged in self.tops.items() if staged}
        ledger.record_many(self.landed if everything else
                           [(rel, st, digest) for rel, st, digest in self.landed
                            if rel.split("/", 1)[0] in moved], journal=False)
        if any(self.tops.values()):
            self.dirs.close()
            self.jd.rmtree(self.dir)
        if moved:
            ledger.save()


def receive_stream(reader: Reader, dirs: Dirs, base: str, ledger: Ledger,
                   staging: Staging) -> tuple[Any, ...]:
    count, nbytes = 0, 0
    while True:
        head = reader.read_json("the end of the receive stream")
        kind = head["t"]
        if kind not in protocol.STREAM:
            raise protocol.ProtocolError("receive: unexpected message %r" % kind)
        protocol.check(head, protocol.STREAM[kind], "receive: " + kind)
        if kind == "end":
            return head, count, nbytes
        if kind == "files":
            got = receive_batch(reader, dirs, base, head["f"], ledger, staging,
                                head.get("fresh") is True)
            count, nbytes = count + len(head["f"]), nbytes + got
            continue
        staged = staging.wants(head["p"])   # the path is checked where it is opened
        where = staging.dir if staged else base
        if kind == "link":
            st, digest = receive_link(dirs, where, head)
        else:
            st, digest = receive_file(reader, dirs, where, head, staged)
        if staged:
            staging.landed.append((head["p"], st, digest))
        else:
            ledger.record(head["p"], st, digest)
        count, nbytes = count + 1, nbytes + head.get("s", 0)


def batch_data(reader: Reader, entries: list[Any]) -> memoryview:
    """The bytes of a `files` batch: its entries checked ([path, size, sha256, mode]),
    then its one data frame, whose length must be their sizes' sum."""
    if len(entries) > protocol.MAX_BATCH_FILES:
        raise protocol.ProtocolError("receive: a batch of %d files" % len(entries))
    total = 0
    for e in entries:
        if not (type(e) is list and len(e) == 4 and type(e[0]) is str and type(e[1]) is int
                and e[1] >= 0 and type(e[2]) is str and type(e[3]) is int):
            raise protocol.ProtocolError("receive: a batch entry is not [path, size, sha256, "
                                         "mode]: %.200r" % (e,))
        total += e[1]
    if not total:
        return memoryview(b"")
    got = reader.read_frame()
    if got is None:
        raise EOFError("stream ended inside a batch of files")
    if got[0] != protocol.DATA or len(got[1]) != total:
        raise broke(reader, "receive: a batch's data is not the %d bytes of its files" % total)
    return memoryview(got[1])


def receive_batch(reader: Reader, dirs: Dirs, base: str, entries: list[Any], ledger: Ledger,
                  staging: Staging, fresh: bool = False) -> int:
    """Small files sent as one batch: each verified before a byte of it is written
    (its bytes are all here; not when `fresh`: protocol.STREAM), then written as
    receive_file writes (beside, or under its name in a staging folder), and recorded in
    one ledger write. Returns the bytes.

    The loop runs once a file (100,000 in a first push of a sharded dataset), so what
    does not change from one file to the next is decided once a folder: the list a
    file is added to (staged or placed), the folder's descriptor and path."""
    data, pos = batch_data(reader, entries), 0
    placed: list[Any] = []
    sha256, at, pfd, staged, where = hashlib.sha256, None, -1, False, base
    add = placed.append
    try:
        for rel, size, digest, mode in entries:
            end = pos + size
            chunk, pos = data[pos:end], end
            if not fresh and sha256(chunk).hexdigest() != digest:
                raise ValueError("digest mismatch for %s" % rel)
            folder, _, name = rel.rpartition("/")
            if folder != at or name in ("", ".", "..") or "\0" in name:
                # a batch is a few folders' files in order: the folder is checked,
                # opened and judged for staging once; split_parent refuses a bad name
                staged = staging.wants(rel)
                where = staging.dir if staged else base
                parent, name = split_parent(where + "/" + rel)
                pfd, at = dirs.fd(parent), folder
                add = staging.landed.append if staged else placed.append
            add((rel, write_small(dirs, pfd, name, chunk, mode & 0o777, staged, where, rel),
                 digest))
    finally:
        ledger.record_many(placed)   # also what landed before a refused file
    return pos


def write_small(dirs: Dirs, pfd: int, name: str, data: memoryview, mode: int, staged: bool,
                where: str, rel: str) -> Any:
    """One verified small file: O_EXCL beside its name (under it when staged), written,
    renamed into place; a failure leaves nothing half-written. `where`: the folder it
    goes into, `rel` its path there. Returns its stat."""
    tmp = name if staged else part_name(name)
    try:   # create_excl's first try, inline: a call less a file; a name taken goes to it
        fd = os.open(tmp, EXCL_FLAGS, mode, dir_fd=pfd)
    except FileExistsError:
        fd = create_excl(pfd, tmp, mode)
    try:
        done = os.write(fd, data) if data else 0   # a small file: one write (no slice, no loop)
        if done < len(data):   # a short write: the rest
            write_all(fd, data[done:])
        if mode & UMASK:
            os.fchmod(fd, mode)
        st = os.fstat(fd)
    except BaseException as e:
        os.close(fd)
        os.unlink(tmp, dir_fd=pfd)
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            top = where.split("/", 1)[0]   # code or data, also from a staging folder
            raise NoSpace(top + "/" + rel, len(data), dirs.jd.show(top)) from None
        raise
    os.close(fd)
    if staged:
        return st
    place(dirs.jd, pfd, tmp, name, where + "/" + rel)
    return lstat_at(pfd, name) or st   # the rename moved ctime on (ledger.stat_key has it)


def apply_deletes(jd: JobDir, base: str, ledger: Ledger, delete: list[Any]) -> int:
    """Delete only what orch pushed (in the ledger): a file or link the job made, or an
    excluded path, stays whatever the controller asks."""
    removed = []
    for rel in delete:
        split_parent(rel)   # an unsafe path is an error, even when unknown here
        if ledger.owns(rel):
            if jd.unlink(base + "/" + rel):
                removed.append(rel)
            ledger.forget(rel)
    prune_empty_dirs(jd, base, removed)
    return len(removed)


def run_receive(req: Request) -> dict[str, Any]:
    """Apply a stream: a `file` message and its data frames per file (a `link` message
    for a link), then `end` with the files to delete. A failure, here or half way, is
    answered at once and the rest of the stream skipped (agent/streams.py)."""
    jd, base = folder_of(req.args["root"])
    os.close(jd.open_dir(base, create=True))   # a remote_dir under a linked folder is fine
    lock = receive_lock(jd, base)
    # a receive makes millions of objects that hold no cycle (the ledger's entries, each
    # file's stat): the cyclic collector's passes over them were a quarter of the host's
    # CPU at 1,000,000 files, and three quarters of its end (ledger, signature) after the
    # last byte, which the controller's stall watchdog waits through
    collecting = gc.isenabled()
    gc.disable()
    try:
        return receive_into(req.stream, jd, base)
    finally:
        if collecting:
            gc.enable()
        os.close(lock)


def receive_into(reader: Reader, jd: JobDir, base: str) -> dict[str, Any]:
    ledger, dirs = Ledger(jd, base), Dirs(jd, create=True)
    ledger.begin()
    staging = Staging(dirs, base)
    try:
        head, count, nbytes = receive_stream(reader, dirs, base, ledger, staging)
    except BaseException:   # a refused file, a full disk: the agent skips the rest (agent/streams.py)
        after_failure(reader, lambda: staging.promote(ledger), dirs, ledger)
        raise
    if isinstance(reader, StreamReader):
        reader.disarm()   # the stream is over: what is left is this host's own work
    try:
        staging.promote(ledger)
        deleted = apply_deletes(jd, base, ledger, head["delete"])
    finally:
        dirs.close()
        ledger.save()   # what did land is known next time
    return {"files": count, "bytes": nbytes, "deleted": deleted}


def after_failure(reader: Reader, promote: Any, dirs: Dirs, ledger: Ledger) -> None:
    """After a stream that failed: what landed promoted and recorded (a resumed push
    sends only the rest). A failure here too (the same full disk) must not hide the
    first one, the cause the user is told: what it left is consistent (a file in place
    and not recorded is sent again) and the next manifest sweeps what is half done."""
    if isinstance(reader, StreamReader):
        reader.disarm()
    try:
        promote()
    except OSError:
        pass
    finally:
        dirs.close()
    try:
        ledger.save()
    except OSError:
        pass
