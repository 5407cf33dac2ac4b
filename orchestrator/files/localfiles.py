"""The local half of a push: which files of this machine go to the hosts, and as what.

Code (`code.paths`, minus `code.exclude` and `.gitignore`: ignore.py) and data shards follow one
rule for symlinks (`resolve_link`): a link whose target stays inside the tree being
pushed (the code path, the shard folder) is pushed as a link, never as the content it
points to; any other link is refused with its path and a fix, before a host is touched.
The one exception, for shards made by `orch split-data` (absolute links into the data
source), lives in shards.py and passes `content_root` here.
"""
from __future__ import annotations

import errno
import hashlib
import marshal
import os
import stat
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from orchestrator.config.safefile import write_whole
from orchestrator.errors import DataError
from orchestrator.files.ignore import IgnoreRules

BATCH = 1 << 20


class LocalFile(NamedTuple):
    """A named tuple, not a dataclass: a million of them are made per `up`, and a frozen
    dataclass's __init__ was a quarter of a nothing-changed listing."""
    rel: str        # path on the host, relative to the destination folder
    path: str       # where the bytes are here (links already resolved)
    size: int
    mode: int
    digest: str
    link: str | None = None   # set: push a symlink with this (relative) target, no bytes
    data: bytes | None = None   # the bytes that were hashed (a small file on a cold cache):
    #                             the push sends them without reading the file again
    key: bytes | None = None    # set (with digest ""): not hashed yet, by a deferring
    #                             listing; the push hashes it as it reads it (fill), and the
    #                             cache remembers the digest under this stat key of the listing
    #                             (UNSTATTED: none taken yet, the size is the split's)
    root: str | None = None     # with UNSTATTED: the data source it must stay in (open_listed)


def link_file(rel: str, path: str, target: str) -> LocalFile:
    """A link to push as a link; its digest is "link:<target>", as the host's ledger
    records it, so an unchanged link on the host is not sent again."""
    return LocalFile(rel, path, 0, 0o777, "link:" + target, link=target)


UNSTATTED = b""   # LocalFile.key of a shard file listed without a stat (open_listed)
# a listed file opened for reading: never through a last link (one is judged first), and
# never blocking (a FIFO where a file was is refused, not waited on)
OPEN_LISTED = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
RESPLIT = "restore it, or split the data again (`orch split-data`)"
RACY_NS = 2_000_000_000   # a file changed this recently is hashed again next time (below)
CACHE_VERSION = 2
HOLD = 64 << 20      # bytes of small files a listing keeps after hashing them (LocalFile.data)
HOLD_FILE = 1 << 16  # the largest file kept so


KEY = struct.Struct("<QQqqq")   # stat_key, packed: one bytes object per file in the cache
ENTRY = KEY.size + 32           # a cache entry: the key, then the sha256's bytes


def stat_key(st: os.stat_result) -> bytes:
    """What must be unchanged for a remembered digest to stand: the file (device, inode),
    its size, and both clocks. mtime alone can be set back (`touch -d`, `cp -p`, a tool
    that restores it); ctime cannot be set by a user and moves on every write, chmod or
    rename, and a new file at the same path has another inode. Stricter than rsync's
    quick check (size + mtime): a false "changed" costs one hash, a false "unchanged"
    would leave a host with old bytes. Packed: compared as is, never formatted."""
    return KEY.pack(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def racy(st: os.stat_result) -> bool:
    """Changed within the clocks' granularity of now: a write in the same tick after
    the hash would leave every field of the key as it was (git's "racily clean"), so
    such a file's digest is not remembered."""
    return max(st.st_mtime_ns, st.st_ctime_ns) >= time.time_ns() - RACY_NS


class DigestCache:
    """sha256 of local files, remembered by stat_key across runs: a marshal file under
    .orch/ ({"version": 2, "entries": {path: stat_key + the 32 bytes of the digest},
    "memo": {...}}): two objects a file, loaded in a fraction of the JSON's time. `memo` keeps other checks whose
    answer stands while a stat key does (shards.py: a split checked, a shard folder's
    links). A cache that does not load as that is no cache: everything is hashed again.
    `hold`: bytes of small files hashed here to keep in LocalFile.data (a cold push of
    many small files then reads each file once). `defer`: a shard file not known here
    is listed unhashed (LocalFile.key) and hashed by the push as it reads it (`fill`):
    a first push's bytes then start to flow while the rest is still read and hashed."""

    def __init__(self, path: Path, hold: int = 0, defer: bool = False,
                 lazy: bool = False) -> None:
        self.path, self.hold, self.defer = path, hold, defer
        # `lazy` (with defer): a shard file not in the cache is listed without its stat,
        # for a push that opens it at once (`orch up`; a dry run checks every file)
        self.lazy = lazy
        self.lock = threading.Lock()
        self.entries, self.memo = load_cache(path)
        self.dirty = False

    def digest(self, path: str, st: os.stat_result) -> str:
        return self.hashed(path, st)[0]

    def hashed(self, path: str, st: os.stat_result) -> tuple[str, bytes | None]:
        """(digest, the bytes when this call read them and they are kept, else None)."""
        known = self.known(path, st)
        if known is not None:
            return known, None
        if st.st_size > HOLD_FILE or self.hold < st.st_size:
            digest, data = sha256_of(path), None
        else:
            data = read_small(path, st.st_size)
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != st.st_size:   # changed since its stat: neither kept nor remembered
                return digest, None
            with self.lock:
                self.hold -= len(data)
        self.remember(path, st, digest)
        return digest, data

    def known(self, path: str, st: os.stat_result) -> str | None:
        """The digest remembered for path at this stat_key, else None."""
        hit = self.entries.get(path)   # a dict read is atomic: no lock for the common case
        if type(hit) is bytes and len(hit) == ENTRY and hit[:KEY.size] == stat_key(st):
            return hit[KEY.size:].hex()
        return None

    def remember(self, path: str, st: os.stat_result, digest: str) -> None:
        """st: the stat taken before the bytes were read (a change during the read moves
        the key on, so the next run hashes again)."""
        if racy(st):
            return
        with self.lock:
            self.entries[path] = stat_key(st) + bytes.fromhex(digest)
            self.dirty = True

    def learn(self, path: str, key: bytes, digest: str) -> None:
        """remember() for a deferred file: key is the stat key its listing took, before
        the push read the bytes (a change since moves the key on: hashed again next time)."""
        self.learn_many([(path, key, bytes.fromhex(digest))], time.time_ns())

    def learn_many(self, learned: list[tuple[str, bytes, bytes]], since: int) -> None:
        """learn() of many (path, stat key, sha256 bytes) at once; `since`: a time before
        any of them was read (a file changed within RACY_NS of it is not remembered)."""
        limit = since - RACY_NS
        unpack = KEY.unpack
        with self.lock:
            for path, key, digest in learned:
                _dev, _ino, _size, mtime, ctime = unpack(key)
                if mtime < limit and ctime < limit:
                    self.entries[path] = key + digest
                    self.dirty = True

    def save(self) -> None:
        """Under the lock from the write to the rename: the listing and a push that
        started before it ended may both save. The .tmp file is this thread's own: two
        caches of one file (the checkpoint keeper's and a restart's put-back) save at
        once, and a shared name made one's rename find the other's file gone (ENOENT).
        The last rename wins: a cache may lose entries, never be torn."""
        with self.lock:
            if not self.dirty:
                return
            doc = {"version": CACHE_VERSION, "entries": self.entries, "memo": self.memo}
            write_whole(self.path, marshal.dumps(doc), 0o666)   # the umask decides, as before
            self.dirty = False


def load_cache(path: Path) -> tuple[dict[str, object], dict[str, object]]:
    """(entries, memo) of a cache file; empty ones when it is missing or not one
    (an older orch's JSON, a torn write): only a slower run follows. Their values are
    as the file held them: each is checked where it is read (DigestCache.known,
    shards.load_split, shards.LinkTexts)."""
    try:
        doc = marshal.loads(path.read_bytes())
    except (OSError, ValueError, EOFError, TypeError):
        return {}, {}
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION or \
            not isinstance(doc.get("entries"), dict) or not isinstance(doc.get("memo"), dict):
        return {}, {}
    return doc["entries"], doc["memo"]


def read_small(path: str, size: int) -> bytes:
    """A small file's bytes to its end: one read of size + 1 bytes answers "that was
    all" for a regular file (a shorter read is its end); os.read, no file object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})",
                        hint=read_fix(e, "leave it out of what is pushed")) from None
    return read_fd(fd, size, path)


def read_fd(fd: int, size: int, path: str) -> bytes:
    """read_small() of an open descriptor, which it closes."""
    try:
        data = os.read(fd, size + 1)
        if len(data) > size:   # it grew since its stat: read on to its end
            chunks = [data]
            while chunks[-1]:
                chunks.append(os.read(fd, BATCH))
            data = b"".join(chunks)
        return data
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})",
                        hint=read_fix(e, "leave it out of what is pushed")) from None
    finally:
        os.close(fd)


def fill(f: LocalFile, cache: DigestCache | None, keep: int) -> tuple[LocalFile, bytes | None]:
    """A deferred file (digest "", key set) hashed now: (the file with its digest, its
    bytes when it has at most `keep` of them, else None: read again to be sent). A file
    that changed size since its listing goes as read (its digest is of those bytes) and
    is not remembered."""
    if f.size <= keep:
        key, size, got = read_deferred(f)
        data, digest = got, hashlib.sha256(got).hexdigest()
    elif f.key == UNSTATTED:
        fd, st = open_listed(f)
        key, size, data, digest = stat_key(st), st.st_size, None, sha256_fd(fd, f.path)
    else:
        key, size, data, digest = f.key, f.size, None, sha256_of(f.path)
    if cache is not None and key is not None and (data is None or len(data) == size):
        cache.learn(f.path, key, digest)
    size = size if data is None else len(data)
    # tuple.__new__: LocalFile's own __new__ is a Python function, a cost per file
    return tuple.__new__(LocalFile, (f.rel, f.path, size, f.mode, digest, f.link, data,
                                     None, None)), data


def read_deferred(f: LocalFile) -> tuple[bytes | None, int, bytes]:
    """A deferred file's (stat key, size at that stat, bytes to its end): the listing's
    key, or for a file listed without a stat (UNSTATTED) its descriptor's."""
    if f.key != UNSTATTED:
        return f.key, f.size, read_small(f.path, f.size)
    fd, st = open_listed(f)
    return stat_key(st), st.st_size, read_fd(fd, st.st_size, f.path)


def open_listed(f: LocalFile) -> tuple[int, os.stat_result]:
    """A shard file listed without a stat (key UNSTATTED), opened to be read, with its
    stat from the descriptor: a cold listing then costs no lstat a file, and the push
    one fstat. What the listing's checks would have refused is refused here, before a
    byte is read: a target gone or not a regular file; a target that is itself a link
    is followed only when it resolves inside the data source (`root`), as the listing
    follows one."""
    path, shard = f.path, f"shard file {f.rel} links to {f.path}"
    try:
        fd = os.open(path, OPEN_LISTED)
    except OSError as e:
        if e.errno != errno.ELOOP or f.root is None:
            raise listed_problem(shard, e) from None
        real = os.path.realpath(path)
        if not inside(real, f.root):
            raise DataError(f"{shard}, a symlink pointing outside the data source {f.root} "
                            f"(to {real})", hint=RESPLIT) from None
        try:
            fd = os.open(real, OPEN_LISTED)
        except OSError as e2:
            raise listed_problem(f"{shard} (a symlink to {real})", e2) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise DataError(f"{shard}, which is not a regular file", hint=RESPLIT)
    return fd, st


def listed_problem(shard: str, e: OSError) -> DataError:
    if e.errno == errno.ENOENT:
        return DataError(f"{shard}, which is missing (gone since the data was split)",
                         hint=RESPLIT)
    return DataError(f"{shard}, which cannot be read ({e.strerror})",
                     hint=read_fix(e, "leave it out of what is pushed"))


def sha256_of(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})",
                        hint=read_fix(e, "leave it out of what is pushed")) from None
    return sha256_fd(fd, path)


def sha256_fd(fd: int, path: str) -> str:
    """The sha256 of what an open descriptor reads; it is closed."""
    h = hashlib.sha256()
    try:
        for block in iter(lambda: os.read(fd, BATCH), b""):
            h.update(block)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})",
                        hint=read_fix(e, "leave it out of what is pushed")) from None
    finally:
        os.close(fd)
    return h.hexdigest()


def read_fix(e: OSError, instead: str) -> str:
    """The fix for a file that cannot be read, by its real cause."""
    if e.errno == errno.ELOOP:
        return f"it is a symlink loop (it leads back to itself): remove the link, or {instead}"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"fix its permissions, or {instead}"
    if e.errno == errno.ENOENT:
        return "it went away while orch read the folder: run again"
    return f"check the file and its disk, or {instead}"


# ---------------------------------------------------------------- the one link rule

@dataclass(frozen=True)
class Resolved:
    to: str              # a link: what it names (one hop); content: the file, fully resolved
    target: str | None   # relative link text to push; None: push the content of `to`


def inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip("/") + "/")


class Resolver:
    """realpath with the folders' answers remembered: a split is many links into few
    folders, so each file costs a readlink and an lstat, not a walk of its whole path."""

    def __init__(self) -> None:
        self.folders: dict[str, str] = {}

    def folder(self, path: str) -> str:
        hit = self.folders.get(path)
        if hit is None:
            hit = self.folders[path] = os.path.realpath(path)
        return hit

    def hop(self, path: str) -> str:
        """Where a link points, one hop: its target's folder resolved, its last name kept
        (a link to a link inside the tree stays a link to that link)."""
        hop = os.path.join(os.path.dirname(path), os.readlink(path))   # an absolute target wins
        head, tail = os.path.split(hop)
        if tail in ("", ".", ".."):
            return os.path.realpath(hop)
        return os.path.join(self.folder(head), tail)

    def real(self, path: str, hop: str) -> str:
        """The link's final target; OSError when it dangles or loops."""
        try:
            if not stat.S_ISLNK(os.lstat(hop).st_mode):
                return hop   # the usual case: one hop to a file or folder
        except OSError:
            pass
        return os.path.realpath(path, strict=True)


def resolve_link(path: str, tree: str, fix: str, content_root: str | None = None,
                 resolver: Resolver | None = None) -> Resolved:
    """What a symlink at `path` is pushed as. `tree` is the resolved folder being pushed:
    a link naming something inside it stays a link (made relative; what it names is
    pushed and judged on its own). A target resolving inside `content_root` (shards: the
    data source) is pushed as content. Anything else is refused."""
    r = resolver or Resolver()
    try:
        hop = r.hop(path)
        real = r.real(path, hop)
    except OSError as e:
        raise DataError(f"{path}: {link_problem(path, e)}", hint=fix) from None
    if inside(hop, tree):
        folder = r.folder(os.path.dirname(path))
        if inside(folder, real):
            raise DataError(f"{path}: symlink to its own folder or one above it ({real}), "
                            "a loop on the hosts", hint=fix)
        return Resolved(hop, os.path.relpath(hop, folder))
    if content_root is not None and inside(real, content_root):
        return Resolved(real, None)
    raise DataError(f"{path}: symlink pointing outside {tree} (to {real}); orch pushes a link "
                    "only when its target is pushed with it", hint=fix)


def link_problem(path: str, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "symlink loop (it leads back to itself)"
    try:
        text = os.readlink(path)
    except OSError:
        text = "?"
    if isinstance(e, FileNotFoundError):
        return f"dangling symlink (its target {text!r} does not exist)"
    return f"symlink that cannot be followed ({e.strerror})"


# ---------------------------------------------------------------- code files

def code_files(base: Path, paths: Iterable[str], exclude: Iterable[str],
               cache: DigestCache, inventory: str = "") -> list[LocalFile]:
    """code.paths keep their names under code/; .gitignore and code.exclude apply."""
    rules, files = IgnoreRules(base, exclude, inventory), {}
    for top in paths:
        for f in tree_files(base, top, rules, cache):
            files[f.rel] = f
    return [files[k] for k in sorted(files)]


def code_root(base: Path, top: str) -> str:
    """The resolved code path. A code path that is itself a link is followed: it was named
    in cluster.yaml. Links below it are what the link rule is about."""
    try:
        return os.path.realpath(base / top, strict=True)
    except OSError as e:
        raise DataError(f"{base / top}: code path {top!r} is a {link_problem(str(base / top), e)}",
                        hint="fix the link or the entry in code.paths") from None


def tree_files(base: Path, top: str, rules: IgnoreRules, cache: DigestCache) -> Iterator[LocalFile]:
    """One code path's files and links, as `<its name>/...` on the host."""
    name, root = PurePosixPath(top).name, code_root(base, top)
    if rules.why(top, os.path.isdir(root)):
        return
    if not os.path.isdir(root):
        yield regular_file(name, root, os.stat(root), cache)
        return
    fix = (f"make the link point inside {top}, replace it with a copy of what it points to, "
           "or leave it out with code.exclude or .gitignore")
    resolver = Resolver()
    for d, dirs, names in os.walk(root, onerror=unreadable):
        sub = os.path.relpath(d, root).replace(os.sep, "/")
        prefix = "" if sub == "." else sub + "/"
        kept = []
        for n in sorted(dirs):
            rel = f"{top}/{prefix}{n}"
            if rules.why(rel, is_dir=True):
                continue   # not walked: git does not look inside an ignored folder either
            if os.path.islink(os.path.join(d, n)):
                yield code_link(f"{name}/{prefix}{n}", os.path.join(d, n), root, top, rules, fix,
                                resolver)
            else:
                kept.append(n)
        dirs[:] = kept
        for n in sorted(names):
            if not rules.why(f"{top}/{prefix}{n}"):
                f = code_entry(f"{name}/{prefix}{n}", os.path.join(d, n), (root, top), rules, fix,
                               cache, resolver)
                if f is not None:
                    yield f


def code_entry(dest: str, path: str, tree: tuple[str, str], rules: IgnoreRules, fix: str,
               cache: DigestCache, resolver: Resolver) -> LocalFile | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None   # removed while we walked
    if stat.S_ISLNK(st.st_mode):
        return code_link(dest, path, *tree, rules, fix, resolver)
    if stat.S_ISREG(st.st_mode):
        return regular_file(dest, path, st, cache)
    return None   # a socket, fifo or device file is not code


def code_link(dest: str, path: str, root: str, top: str, rules: IgnoreRules, fix: str,
              resolver: Resolver) -> LocalFile:
    res = resolve_link(path, root, fix, resolver=resolver)
    assert res.target is not None   # no content_root: outside links were refused
    sub = os.path.relpath(res.to, root).replace(os.sep, "/")
    reason = rules.why_path(f"{top}/{sub}", os.path.isdir(res.to))
    if reason:
        raise DataError(f"{path}: symlink to {res.to}, which {reason} leaves out: it would "
                        "dangle on the hosts", hint=fix)
    return link_file(dest, path, res.target)


def regular_file(dest: str, path: str, st: os.stat_result, cache: DigestCache) -> LocalFile:
    digest, data = cache.hashed(path, st)
    return LocalFile(dest, path, st.st_size, st.st_mode & 0o777, digest, data=data)


def unreadable(e: OSError) -> None:
    raise DataError(f"{e.filename}: cannot be read ({e.strerror})",
                    hint=read_fix(e, "leave it out with code.exclude")) from None


# ---------------------------------------------------------------- checks before connecting

def source_rel(dest: str, paths: Iterable[str]) -> str:
    """A path under code/ on the host, as a path relative to the inventory's folder."""
    names = {PurePosixPath(top).name: top for top in paths}
    first, sep, rest = dest.partition("/")
    return names[first] + sep + rest if first in names else dest


class Pushable:
    """Filters a host's code manifest down to what the ignore rules keep: the rest (a
    __pycache__ written on the host) is never proposed for deletion. One per `orch up`,
    shared by all hosts: each path is judged once."""

    def __init__(self, base: Path, paths: Iterable[str], exclude: Iterable[str]) -> None:
        self.rules, self.paths = IgnoreRules(base, exclude), tuple(paths)
        self.seen: dict[str, bool] = {}
        self.lock = threading.Lock()

    def keeps(self, rel: object) -> bool:
        if not isinstance(rel, str):
            return True   # not ours to judge: the push refuses a malformed manifest
        with self.lock:
            hit = self.seen.get(rel)
        if hit is None:
            hit = not self.rules.why_path(source_rel(rel, self.paths))
            with self.lock:
                self.seen[rel] = hit
        return hit

    def __call__(self, remote: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not isinstance(remote, dict):
            return remote
        return {rel: v for rel, v in remote.items() if self.keeps(rel)}


def entrypoint_file(base: Path, paths: Iterable[str], entrypoint: str) -> str | None:
    """The file (relative to the inventory's folder) that the entrypoint runs, when it
    comes from code.paths; None for an installed module."""
    names = {PurePosixPath(top).name: top for top in paths}
    if entrypoint.endswith(".py"):
        first, _, rest = entrypoint.partition("/")
        return names[first] + ("/" + rest if rest else "") if first in names else None
    first, _, rest = entrypoint.partition(".")
    if not rest:
        package_main = names[first] + "/__main__.py" if first in names else None
        return names.get(first + ".py") or package_main
    if first not in names:
        return None
    module = names[first] + "/" + rest.replace(".", "/")
    return module + "/__main__.py" if (base / module).is_dir() else module + ".py"


def check_entrypoint(base: Path, paths: Iterable[str], exclude: Iterable[str], entrypoint: str,
                     inventory: str) -> None:
    """Refuse a job whose entrypoint the ignore rules would keep off the hosts."""
    paths = tuple(paths)
    rel = entrypoint_file(base, paths, entrypoint)
    if rel is None:
        return
    reason = IgnoreRules(base, exclude, inventory).why_path(rel)
    if reason:
        raise DataError(f"{inventory}: job.entrypoint {entrypoint!r} ({rel}) would not be pushed: "
                        f"{reason} leaves it out",
                        hint=f"change that rule so that it keeps {rel} (in .gitignore a later "
                             f"line `!{rel}` re-includes a file), or run another entrypoint")
