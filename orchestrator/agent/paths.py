"""Every path orch writes, deletes or reads inside a job folder on a host: one module, no link followed.

A job folder is ``<remote_dir>/<name>``. remote_dir may be a link (``~/orch ->
/scratch/orch``) and is resolved once; the job folder and everything under it is reached
through folder descriptors: each part opened with O_NOFOLLOW relative to its parent,
files created with O_CREAT|O_EXCL|O_NOFOLLOW beside their final name and renamed into
place relative to the folder's descriptor, names removed with unlink(dir_fd=) after a
stat that does not follow links. A link where orch expects its own folder or file is
refused (UnsafePath, with the command that fixes it); a link orch meets anywhere else
(something the job made) is neither followed nor touched.

Stdlib only, Python 3.8 (the agent's bundle carries it, see bundle.py).
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager

from orchestrator.agent import spares

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Callable, Iterator

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# O_NONBLOCK: a FIFO planted where orch expects a file must not hang the agent
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
EXCL_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
PART = ".orch-part-"          # a file being written beside its final name (part_name)
ORCH_FOLDERS = ("code", "data", "logs", "run", "output")
# This host's part of the job folder: run/<HOST_PART>/ holds its lock, records and state, so
# that hosts sharing one job folder (NFS, a bind mount) never take each other's. Set from
# the agent's argv (`part=host-<label>`); "" (agent unit tests): run/ itself.
HOST_PART = ""
PART_PREFIX = "host-"
# run/ entries of the filesystem, not of one host: what orch pushed into code/ and data/
# (their ledgers and receive locks), the keeper host's checkpoints/ (its ledger, lock and
# digests) and a setup run once per filesystem
SHARED_RUN = ("code-", "data-", "checkpoints-", "shared-", PART_PREFIX)
OWN_FILES_IN = ("logs", "run")  # folders that hold orch's files only: no link belongs there


def part_name(name: str) -> str:
    """Where a file is written before it is renamed over `name`, in the same folder:
    `<name>.orch-part-<pid>`, which every sweep finds. A name too long to take that
    suffix (a file system allows 255 bytes) gets a short one of its own, found the same
    way: `.orch-part-<pid>-<digest of the name>`."""
    tmp = "%s%s%d" % (name, PART, os.getpid())
    if len(os.fsencode(tmp)) <= 255:
        return tmp
    import hashlib  # here: its OpenSSL costs ~5 ms at every agent start, for names this long
    return "%s%d-%s" % (PART, os.getpid(), hashlib.sha256(os.fsencode(name)).hexdigest()[:16])


class UnsafePath(OSError):
    """A path orch will not use. The message names the path; `fix` says what to do."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message, self.fix = message, fix

    def __str__(self) -> str:
        return self.message


def quoted(path: str) -> str:
    """shlex.quote, imported for a message only: shlex loads `re` (and `enum`), about a
    megabyte and 8 ms of every agent's start otherwise."""
    import shlex
    return shlex.quote(path)


def link_refused(path: str) -> UnsafePath:
    return UnsafePath("%s is a symbolic link; orch never writes through links inside the job "
                      "folder" % path, "remove it (rm %s) and run again" % quoted(path))


def not_a(kind: str, path: str) -> UnsafePath:
    q = quoted(path)
    return UnsafePath("%s is not a %s, but orch keeps a %s there" % (path, kind, kind),
                      "move it away (mv %s %s.old) and run again" % (q, q))


def split_rel(rel: str) -> list[Any]:
    """The parts of a path relative to the job folder. Anything that could leave it
    (absolute, .., an empty or . part, NUL) is refused. A backslash is an ordinary
    character of a POSIX name: it cannot leave the folder."""
    if rel == "":
        return []
    parts = rel.split("/")
    if "\0" in rel or "" in parts or "." in parts or ".." in parts:
        raise UnsafePath("unsafe path %r: only plain relative paths are accepted" % rel)
    return parts


def split_parent(rel: str) -> tuple[Any, ...]:
    """(parent, name) of a file's path; the name must be a plain name."""
    parts = split_rel(rel)
    if not parts:
        raise UnsafePath("unsafe path %r: a file needs a name" % rel)
    return "/".join(parts[:-1]), parts[-1]


def check_link_target(rel: str, target: str) -> None:
    """A link orch makes at `rel` must point inside the folder it is pushed to: relative,
    resolved from rel's folder without leaving it, and `..` only at the start (after a
    name, `..` would be resolved from wherever a link in between points)."""
    parts = target.split("/")
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    rest = parts[ups:]
    bad = (not target or target[0] == "/" or "\0" in target or "\\" in target or not rest
           or any(p in ("", ".", "..") for p in rest) or ups > len(split_rel(rel)) - 1)
    if bad:
        raise UnsafePath("unsafe link %s -> %r: a link must point inside the folder it is "
                         "pushed to (relative, no absolute path, no escape by ..)" % (rel, target),
                         "make the link relative and inside the pushed folder, or push the "
                         "file it points to instead")


def open_child_dir(pfd: int, name: str, shown: str, create: bool) -> int:
    """A descriptor of folder `name` in folder pfd, made if asked; never through a link."""
    for attempt in (0, 1):
        try:
            return os.open(name, DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            if not create or attempt:
                raise
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise why_not(pfd, name, shown, "folder") from None
            raise
        try:
            os.mkdir(name, 0o777, dir_fd=pfd)
        except FileExistsError:
            pass   # made meanwhile, or a link: the second open tells
    raise AssertionError("unreachable")


def why_not(pfd: int, name: str, shown: str, kind: str) -> UnsafePath:
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except OSError:
        return not_a(kind, shown)
    return link_refused(shown) if stat.S_ISLNK(st.st_mode) else not_a(kind, shown)


def open_file_at(pfd: int, name: str, shown: str, flags: int, mode: int = 0o644) -> int:
    """Open a regular file in folder pfd without following a link; a FIFO, device or
    folder at that name is refused."""
    try:
        fd = os.open(name, flags, mode, dir_fd=pfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise why_not(pfd, name, shown, "file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_a("file", shown)
    return fd


def create_excl(pfd: int, name: str, mode: int) -> int:
    """A new file `name` (O_EXCL: never an existing file or link). One left by a killed
    writer under the same name (a recycled pid) is removed first."""
    try:
        return os.open(name, EXCL_FLAGS, mode, dir_fd=pfd)
    except FileExistsError:
        os.unlink(name, dir_fd=pfd)   # unlink never follows a link
        return os.open(name, EXCL_FLAGS, mode, dir_fd=pfd)


def lstat_at(pfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def rmtree_at(pfd: int, name: str) -> None:
    """Remove name (a folder with everything in it, or a file, or a link itself)."""
    st = lstat_at(pfd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=pfd)
        return
    fd = os.open(name, DIR_FLAGS, dir_fd=pfd)   # replaced by a link meanwhile: ELOOP
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                rmtree_at(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=pfd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class JobDir:
    """One job folder on this host. Paths given to its methods are relative to it
    ("run/launch.json", "code/pkg/a.py") and checked by split_rel."""

    def __init__(self, path: str) -> None:
        path = os.path.abspath(os.path.expanduser(path)).rstrip("/")
        parent, name = os.path.split(path)
        if name in ("", ".", ".."):
            raise UnsafePath("%r cannot be a job folder" % path,
                             "set remote_dir to a folder (e.g. ~/orch)")
        self.parent = os.path.realpath(parent)   # remote_dir may be a link: resolved once
        self.name = name
        self.part = HOST_PART
        self.path = os.path.join(self.parent, name)
        self._fd: int | None = None
        self._held = {}   # type: dict[str, int]   # (hold) mapped folder -> its descriptor

    def map(self, rel: str) -> str:
        """rel with run/ turned into this host's part, run/<part>/ (shared names and the
        parts themselves are left as they are: mapping twice changes nothing)."""
        if not self.part or not (rel == "run" or rel.startswith("run/")):
            return rel
        rest = rel[4:]
        if rest.startswith(SHARED_RUN):
            return rel
        return "run/" + self.part + ("/" + rest if rest else "")

    def show(self, rel: str) -> str:
        rel = self.map(rel)
        return self.path + "/" + rel if rel else self.path

    def fd(self, create: bool = False) -> int:
        """The job folder's own descriptor (kept open); made with remote_dir if asked."""
        if self._fd is None:
            if create:
                os.makedirs(self.parent, exist_ok=True)
            pfd = os.open(self.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._fd = open_child_dir(pfd, self.name, self.path, create)
            finally:
                os.close(pfd)
        return self._fd

    def close(self) -> None:
        held, self._held = getattr(self, "_held", {}), {}
        fd, self._fd = getattr(self, "_fd", None), None
        for f in [*held.values(), fd]:
            if f is not None:
                os.close(f)

    def hold(self, rel: str) -> int:
        """Keep folder rel's descriptor open for this JobDir's life (until close) and go
        through it for every path inside rel: no walk from the job folder for each
        record. For a reader of many records in one folder (a follow's run/, a stop);
        a folder replaced meanwhile is not followed to its new self. FileNotFoundError
        if it is missing."""
        rel = self.map(rel)
        if rel not in self._held:
            self._held[rel] = self.open_dir(rel, mapped=True)
        return self._held[rel]

    def release(self, rel: str) -> None:
        """Close what hold(rel) kept open; paths inside rel are walked to again."""
        fd = self._held.pop(self.map(rel), None)
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        # A request's JobDir ends with the request, and its descriptor with it: the agent
        # of an attached `up` serves a listing every half second for the job's whole
        # life (the checkpoint keeper), and one descriptor left per request ran it out
        # of them (a login's 1,024) within minutes; every record read failed after.
        self.close()

    # ------------------------------------------------------------ folders

    def open_dir(self, rel: str = "", create: bool = False, mapped: bool = False) -> int:
        """A new descriptor (the caller closes it) of folder rel, each part opened
        without following a link and made if `create`. FileNotFoundError if missing.
        `mapped`: rel is already this host's (the parent of a mapped path: the parent of
        run/<part> is run/ itself)."""
        rel = rel if mapped else self.map(rel)
        parts = split_rel(rel)
        fd = os.dup(self.fd(create))
        shown = self.path
        try:
            for part in parts:
                shown += "/" + part
                child = open_child_dir(fd, part, shown, create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def dirfd(self, rel: str = "", create: bool = False, mapped: bool = False) -> Iterator[int]:
        held = self._held.get(rel if mapped else self.map(rel))
        if held is not None:   # (hold): the caller must not close it
            yield held
            return
        fd = self.open_dir(rel, create, mapped)
        try:
            yield fd
        finally:
            os.close(fd)

    def check_layout(self) -> None:
        """Refuse a link (or a file) at code, data, logs, run or output, and a link
        directly inside logs/ or run/ (orch's files only), before anything is written."""
        try:
            self.fd()
        except FileNotFoundError:
            return
        for folder in ORCH_FOLDERS:
            try:
                fd = self.open_dir(folder)
            except FileNotFoundError:
                continue
            try:
                if folder in OWN_FILES_IN:
                    with os.scandir(fd) as it:
                        links = sorted(e.name for e in it if e.is_symlink())
                    if links:
                        raise link_refused(self.show(folder + "/" + links[0]))
            finally:
                os.close(fd)

    # ------------------------------------------------------------ files

    def lstat(self, rel: str) -> os.stat_result | None:
        """The entry at rel itself (a link is not followed); None when missing."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        try:
            with self.dirfd(parent, mapped=True) as pfd:
                return lstat_at(pfd, name)
        except FileNotFoundError:
            return None

    def write_file(self, rel: str, data: bytes, mode: int = 0o600) -> None:
        """Atomically: written beside (O_EXCL), then renamed over rel. A link at rel is
        refused, not replaced: rel is one of orch's own files."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        with self.dirfd(parent, create=True, mapped=True) as pfd:
            st = lstat_at(pfd, name)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise link_refused(self.show(rel))
            tmp = part_name(name)
            if spares.write(pfd, name, tmp, mode, lambda fd: write_all(fd, data)):   # spare
                return
            fd = create_excl(pfd, tmp, mode)
            try:
                write_all(fd, data)
            except BaseException:
                os.close(fd)
                os.unlink(tmp, dir_fd=pfd)
                raise
            os.close(fd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)

    def spare(self, rel: str, mode: int = 0o600) -> None:
        """Make rel's next write_file cheap in this process (agent/spares.py)."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        with self.dirfd(parent, create=True, mapped=True) as pfd:
            spares.make(pfd, name, mode)

    def create_once(self, rel: str, data: bytes) -> bytes:
        """Make rel hold `data` unless it exists; either way return what rel holds. The
        file is written beside and hard-linked to its name, which fails when the name is
        taken: of agents racing on one (shared, NFS too) folder exactly one wins, and
        nobody reads a half-written file."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        with self.dirfd(parent, create=True, mapped=True) as pfd:
            tmp = part_name(name)
            fd = create_excl(pfd, tmp, 0o644)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            try:
                os.link(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp, dir_fd=pfd)
            fd = open_file_at(pfd, name, self.show(rel), READ_FLAGS)
            try:
                return os.read(fd, 4096)
            finally:
                os.close(fd)

    def open_for_write(self, rel: str, mode: int = 0o644, append: bool = False) -> int:
        """A descriptor to write rel (emptied unless `append`), made if missing. A link,
        a FIFO or a file with a second (hard) link there is refused: orch would write
        into something that is not its own file."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        with self.dirfd(parent, create=True, mapped=True) as pfd:
            fd = open_file_at(pfd, name, self.show(rel),
                              WRITE_FLAGS | (os.O_APPEND if append else 0), mode)
        if os.fstat(fd).st_nlink > 1:
            os.close(fd)
            raise UnsafePath("%s has another hard link; orch writes only its own files"
                             % self.show(rel), "remove it (rm %s) and run again"
                             % quoted(self.show(rel)))
        if not append:
            os.ftruncate(fd, 0)
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd

    def open_for_read(self, rel: str) -> int:
        """A descriptor to read regular file rel; FileNotFoundError if missing, a link
        or anything but a regular file refused."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        with self.dirfd(parent, mapped=True) as pfd:
            return open_file_at(pfd, name, self.show(rel), READ_FLAGS)

    def read(self, rel: str, cap: int) -> bytes | None:
        """rel's bytes, None when it is missing; more than `cap` bytes is refused
        (nothing on a host is trusted to be small)."""
        try:
            fd = self.open_for_read(rel)
        except FileNotFoundError:
            return None
        try:
            chunks, left = [], cap + 1
            while left > 0:
                block = os.read(fd, min(left, 1 << 20))
                if not block:
                    break
                chunks.append(block)
                left -= len(block)
        finally:
            os.close(fd)
        if left <= 0:
            raise UnsafePath("%s is larger than %d bytes" % (self.show(rel), cap),
                             "remove it (rm %s) and run again" % quoted(self.show(rel)))
        return b"".join(chunks)

    def unlink(self, rel: str) -> bool:
        """Remove the file or link at rel (a link itself, never what it points to).
        False when there is nothing, or a folder, there."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        try:
            with self.dirfd(parent, mapped=True) as pfd:
                st = lstat_at(pfd, name)
                if st is None or stat.S_ISDIR(st.st_mode):
                    return False
                os.unlink(name, dir_fd=pfd)
                return True
        except FileNotFoundError:
            return False

    def rmdir(self, rel: str) -> bool:
        """Remove folder rel if it is empty (never a link); True when it was removed."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        try:
            with self.dirfd(parent, mapped=True) as pfd:
                os.rmdir(name, dir_fd=pfd)
                return True
        except OSError:
            return False

    def rmdir_top(self, name: str) -> bool:
        """Remove folder `name` of the job folder itself if it is empty (run/ itself,
        not this host's part of it)."""
        try:
            os.rmdir(name, dir_fd=self.fd())
            return True
        except OSError:
            return False

    def replace(self, src_rel: str, dst_rel: str) -> None:
        """Rename src over dst (a folder onto a missing name, a file over a file); the
        rename moves names, so no link in either place is followed."""
        src_rel, dst_rel = self.map(src_rel), self.map(dst_rel)
        src_parent, src = split_parent(src_rel)
        dst_parent, dst = split_parent(dst_rel)
        with self.dirfd(src_parent, mapped=True) as sfd, \
                self.dirfd(dst_parent, create=True, mapped=True) as dfd:
            os.rename(src, dst, src_dir_fd=sfd, dst_dir_fd=dfd)

    def symlink(self, rel: str, target: str) -> os.stat_result:
        """Make rel a link to target (checked by check_link_target): made beside, then
        renamed over whatever file or link was at rel. Returns the link's own stat."""
        rel = self.map(rel)
        check_link_target(rel, target)
        parent, name = split_parent(rel)
        with self.dirfd(parent, create=True, mapped=True) as pfd:
            tmp = part_name(name)
            if lstat_at(pfd, tmp) is not None:
                os.unlink(tmp, dir_fd=pfd)
            os.symlink(target, tmp, dir_fd=pfd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)

    def rmtree(self, rel: str) -> None:
        """Remove rel and everything under it; links inside are removed, never followed."""
        rel = self.map(rel)
        parent, name = split_parent(rel)
        try:
            with self.dirfd(parent, mapped=True) as pfd:
                rmtree_at(pfd, name)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ walking

    def walk(self, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
        """(path relative to the job folder, stat) of every regular file under rel; a
        link is neither reported nor entered."""
        rel = self.map(rel)
        try:
            fd = self.open_dir(rel, mapped=True)
        except FileNotFoundError:
            return
        yield from walk_fd(fd, rel)

    def sweep(self, rel: str, is_leftover: Callable[[str], bool]) -> int:
        """Remove every entry under rel whose name is_leftover(name) says orch left
        there (a folder with its content); nothing else is touched. Returns the count."""
        rel = self.map(rel)
        try:
            fd = self.open_dir(rel, mapped=True)
        except FileNotFoundError:
            return 0
        return sweep_fd(fd, is_leftover)


def walk_fd(fd: int, rel: str) -> Iterator[tuple[str, os.stat_result]]:
    """Closes fd when done."""
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            path = rel + "/" + e.name if rel else e.name
            if e.is_dir(follow_symlinks=False):
                try:
                    child = os.open(e.name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue   # replaced or removed meanwhile
                yield from walk_fd(child, path)
            elif e.is_file(follow_symlinks=False):
                yield path, e.stat(follow_symlinks=False)
    finally:
        os.close(fd)


def sweep_fd(fd: int, is_leftover: Callable[[str], bool]) -> int:
    """Closes fd when done."""
    count = 0
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for name, is_dir in entries:
            if is_leftover(name):
                rmtree_at(fd, name)
                count += 1
            elif is_dir:
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                count += sweep_fd(child, is_leftover)
    finally:
        os.close(fd)
    return count


class Dirs:
    """Descriptors of folders of a JobDir, each opened (and made) once: a stream of many
    files in few folders walks each folder once."""

    def __init__(self, jd: JobDir, create: bool = True) -> None:
        self.jd, self.create = jd, create
        self.fds: dict[str, int] = {}

    def fd(self, rel: str) -> int:
        fd = self.fds.get(rel)
        if fd is None:
            if len(self.fds) >= 64:
                self.close()
            fd = self.fds[rel] = self.jd.open_dir(rel, self.create)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
