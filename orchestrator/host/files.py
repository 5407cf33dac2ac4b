"""Files on the host: manifests (what a folder holds, digests cached) and the receive
stream (write beside, verify, rename; new top folders staged and renamed whole)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

from orchestrator import protocol
from orchestrator.host.common import read_json, write_atomic

UMASK = os.umask(0)
os.umask(UMASK)
STAGING = ".orch-staging-"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_path(root: str) -> str:
    """<job>/run/<folder>-digests.json: beside, not inside, the folder it describes
    (data/ holds the shards and nothing else)."""
    root = root.rstrip("/")
    return os.path.join(os.path.dirname(root), "run", os.path.basename(root) + "-digests.json")


def load_cache(root: str) -> dict:
    cache = read_json(cache_path(root))
    return cache if isinstance(cache, dict) else {}


def save_cache(root: str, cache: dict) -> None:
    path = cache_path(root)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, json.dumps(cache).encode(), 0o644)
    except OSError:
        pass


def walk_files(root: str):
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            continue
        for e in entries:
            r = rel + "/" + e.name if rel else e.name
            if e.is_dir(follow_symlinks=False) and e.name.startswith(STAGING):
                # a killed receiver's staging folder: never promoted
                shutil.rmtree(e.path, ignore_errors=True)
            elif e.is_dir(follow_symlinks=False):
                stack.append(r)
            elif ".orch-part-" in e.name:
                # left by a receiver that was killed (SIGKILL, host crash); manifests are
                # made before a push, when no receiver writes here
                os.unlink(e.path)
            elif e.is_file(follow_symlinks=False):
                yield r, e.stat(follow_symlinks=False)


def manifest(root: str) -> dict:
    """{relpath: [size, sha256]} of a folder; digests cached by (size, mtime, inode).

    A file changed by hand gets a new mtime and is hashed again; the cache makes a
    second `orch up` with nothing to send cost a stat per file, not a read.
    """
    root = os.path.realpath(os.path.expanduser(root))   # the same cache as receive's
    cache, fresh, files = load_cache(root), {}, {}
    for rel, st in walk_files(root):
        key = "%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino)
        digest = cache.get(rel)
        if isinstance(digest, list) and len(digest) == 2 and digest[0] == key:
            digest = digest[1]
        else:
            digest = sha256_file(os.path.join(root, rel))
        fresh[rel] = [key, digest]
        files[rel] = [st.st_size, digest]
    if os.path.isdir(root):
        save_cache(root, fresh)
    return {"root": root, "files": files}


def send_manifest(req, folder: str, root: str) -> str:
    """A folder's manifest as parts of at most MANIFEST_PART entries (a big data/ never
    makes one frame larger than the controller accepts); the resolved root."""
    found = manifest(root)
    items, step = list(found["files"].items()), protocol.MANIFEST_PART
    for i in range(0, max(len(items), 1), step):
        req.part("manifest", {"folder": folder, "files": dict(items[i:i + step])})
    return found["root"]


def run_manifest(req) -> dict:
    return {"root": send_manifest(req, "", req.args["root"])}


def safe_join(root: str, rel: str, checked: set) -> str:
    """Refuse any path that would land outside root (absolute, .., links). `checked`
    holds the parent folders (relative) already verified, so a stream of many files in
    few folders checks and resolves each folder once."""
    if not rel or rel[0] == "/" or "\\" in rel or "\0" in rel:
        raise ValueError("unsafe path %r" % rel)
    parent_rel, _, name = rel.rpartition("/")
    if name in ("", ".", ".."):
        raise ValueError("unsafe path %r" % rel)
    if parent_rel not in checked:
        if parent_rel and any(p in ("", ".", "..") for p in parent_rel.split("/")):
            raise ValueError("unsafe path %r" % rel)
        parent = root + "/" + parent_rel if parent_rel else root
        # resolve before creating: makedirs through a planted link would escape
        real_parent = os.path.realpath(parent)
        if real_parent != root and not real_parent.startswith(root + os.sep):
            raise ValueError("path %r leaves %s" % (rel, root))
        os.makedirs(parent, exist_ok=True)
        checked.add(parent_rel)
    return root + "/" + rel


def receive_file(reader, root: str, head: dict, cache: dict, checked: set,
                 staged: bool = False) -> None:
    """Write beside (.orch-part-), hash while writing, verify, then rename into place.
    A staged file (inside a staging folder no one reads) is written under its name."""
    path = safe_join(root, head["p"], checked)
    tmp = path if staged else "%s.orch-part-%d" % (path, os.getpid())
    h, mode = hashlib.sha256(), head["m"] & 0o7777
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        receive_bytes(reader, fd, h, head["s"], head["p"])
        if mode & UMASK:
            os.fchmod(fd, mode)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)   # a broken stream never leaves a half-written file behind
        raise
    os.close(fd)
    if h.hexdigest() != head["h"]:
        os.unlink(tmp)
        raise ValueError("digest mismatch for %s" % head["p"])
    if not staged:
        os.replace(tmp, path)
    cache[head["p"]] = ["%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino), h.hexdigest()]


def receive_bytes(reader, fd: int, h, left: int, name: str) -> None:
    """The file's bytes: data frames adding up to exactly `left` bytes."""
    while left:
        got = reader.read_frame()
        if got is None:
            raise EOFError("stream ended inside %s" % name)
        kind, data = got
        if kind != protocol.DATA or len(data) > left:
            raise protocol.ProtocolError("%s: expected %d more bytes of data" % (name, left))
        h.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        left -= len(data)


def prune_empty_dirs(root: str) -> None:
    for d, subdirs, files in os.walk(root, topdown=False):
        if d != root and not os.listdir(d):
            os.rmdir(d)


class Staging:
    """A top-level folder (a shard, a code package) that the host does not have yet is
    written into a staging folder under its final names and renamed into place as a
    whole at the end: one rename per folder instead of one per file. Folders the host
    has are updated file by file (write beside, rename)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dir = "%s/%s%d" % (root, STAGING, os.getpid())
        self.tops: dict = {}
        self.checked: set = set()

    def wants(self, rel: str) -> bool:
        top = rel.split("/", 1)[0]
        if top not in self.tops:
            self.tops[top] = "/" in rel and not os.path.lexists(self.root + "/" + top)
            if self.tops[top]:
                os.makedirs(self.dir, exist_ok=True)
        return self.tops[top]

    def promote(self) -> None:
        """Every staged file was verified when written: move the folders into place
        (also after a broken stream, so that a resumed push sends only the rest)."""
        for top, staged in self.tops.items():
            if staged and os.path.lexists(self.dir + "/" + top):
                os.rename(self.dir + "/" + top, self.root + "/" + top)
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)


def receive_stream(reader, root: str, cache: dict, checked: set, staging: Staging) -> tuple:
    count, nbytes = 0, 0
    while True:
        head = reader.read_json("the end of the receive stream")
        kind = head["t"]
        if kind not in protocol.STREAM:
            raise protocol.ProtocolError("receive: unexpected message %r" % kind)
        protocol.check(head, protocol.STREAM[kind], "receive: " + kind)
        if kind == "end":
            return head, count, nbytes
        if staging.wants(head["p"]):
            receive_file(reader, staging.dir, head, cache, staging.checked, staged=True)
        else:
            receive_file(reader, root, head, cache, checked)
        count, nbytes = count + 1, nbytes + head["s"]


def drain(reader) -> None:
    """After a refused file: skip the rest of the stream, so that the next request is
    read as one (the controller sends to the end before it reads the reply)."""
    while True:
        got = reader.read_frame()
        if got is None or (got[0] == protocol.JSON and protocol.decode(got, "receive")["t"] == "end"):
            return


def apply_deletes(root: str, delete: list, cache: dict, checked: set) -> None:
    for rel in delete:
        path = safe_join(root, rel, checked)
        if os.path.lexists(path):
            os.unlink(path)
        cache.pop(rel, None)
    if delete:
        prune_empty_dirs(root)


def run_receive(req) -> dict:
    """Apply a stream: a `file` message and its data frames per file, then `end` (with
    the files to delete)."""
    root = os.path.expanduser(req.args["root"])
    os.makedirs(root, exist_ok=True)
    root = os.path.realpath(root)   # a remote_dir under a linked folder is fine
    cache, checked, staging = load_cache(root), set(), Staging(root)
    try:
        head, count, nbytes = receive_stream(req.reader, root, cache, checked, staging)
    except (ValueError, OSError) as e:
        finish_broken(root, cache, staging)
        if not isinstance(e, protocol.ProtocolError):
            drain(req.reader)
        raise
    except BaseException:
        finish_broken(root, cache, staging)
        raise
    staging.promote()
    apply_deletes(root, head["delete"], cache, checked)
    save_cache(root, cache)
    return {"files": count, "bytes": nbytes, "deleted": len(head["delete"])}


def finish_broken(root: str, cache: dict, staging: Staging) -> None:
    staging.promote()
    save_cache(root, cache)   # what did land is known next time
