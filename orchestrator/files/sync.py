"""Incremental, verified, one-stream-per-host file push (code and data shards).

Both pushes work the same way: list the local files with their sha256, ask the host
for its manifest (digests cached there by size/mtime/inode), send only what differs as
one stream of header+bytes frames, and delete what the host has but should not. The
host writes each file beside its final name, checks the digest, then renames.

A shard file the digest cache does not know is listed unhashed (LocalFile.key) and
hashed here as it is read to be sent: on a first push, reading and hashing on this
side overlap the host's writing instead of preceding the first byte.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Callable

from orchestrator.errors import DataError, HostError, OrchError
from orchestrator.files.feed import Feed
from orchestrator.files.localfiles import (  # noqa: F401 (code_files: re-exported)
    DigestCache,
    LocalFile,
    code_files,
    fill,
    read_deferred,
)
from orchestrator.remote.link import Link
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import protocol, timeouts

BATCH = 1 << 20
STALL_STEP = 1 << 18   # bytes per send between two progress stamps (13 KB/s at PUSH_IDLE)
SendProgress = Callable[[int, int], None]   # (bytes, files) just sent


@dataclass(frozen=True)
class SyncReport:
    files: int
    bytes: int
    deleted: int
    sent: tuple[str, ...]


class Same:
    """A host folder's manifest when the host answered `same`: it holds exactly `files`
    (the list whose token preflight sent). A push of that very list has nothing to send
    or delete, and skips building and comparing a manifest of every file."""

    def __init__(self, files: list[LocalFile]) -> None:
        self.files = files

    def manifest(self) -> dict[str, list[Any]]:
        return {f.rel: [f.size, f.digest] for f in self.files}


@dataclass(frozen=True)
class Received:
    """A host's reply to a stream it took (`receive`, `keep_receive`, `restore`): the
    files and bytes written, and the files deleted (none for a restore)."""

    files: int
    bytes: int
    deleted: int = 0

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> Received:   # checked by protocol.py
        return cls(reply["files"], reply["bytes"], reply.get("deleted", 0))


# ---------------------------------------------------------------- the stream

def plan(local: list[LocalFile], remote: dict[str, list[Any]]) -> tuple[list[LocalFile], list[str]]:
    """What to send (new or different digest) and what to delete on the host."""
    wanted = {f.rel for f in local}
    send = [f for f in local if remote.get(f.rel, [None, None])[1] != f.digest]
    delete = sorted(rel for rel in remote if rel not in wanted)
    return send, delete


def file_head(f: LocalFile, fresh: bool = False) -> bytes:
    """`fresh`: f.digest was taken from the very bytes sent after it (protocol.STREAM)."""
    if fresh:
        return protocol.stream_item("file", p=f.rel, s=f.size, h=f.digest, m=f.mode, fresh=True)
    return protocol.stream_item("file", p=f.rel, s=f.size, h=f.digest, m=f.mode)


def stream_files(send: Callable[[bytes | memoryview], None], files: Iterable[LocalFile],
                 progress: SendProgress | None, batch: bool = True,
                 cache: DigestCache | None = None,
                 stop: Callable[[], bool] | None = None) -> None:
    """A `file` message and data frames (at most 1 MiB each) per file. `batch`: small
    files go as `files` messages instead, each one JSON list of up to BATCH_FILES files
    and one data frame of their bytes end to end (the host's per-file cost was most of
    a first push of many small files); their bytes are those LocalFile.data kept from
    the hash, else read now. A deferred file (digest "") is hashed as it is read, its
    digest remembered in `cache` (one over BATCH is read twice: its head, which
    carries the digest, goes before its bytes). Everything goes out in writes of about
    1 MiB. `stop`: asked between two frames; true (the host answered already: it
    refused the stream) ends it there with HostRefused."""
    out = Batcher(send, progress, stop)
    try:
        stream_each(out, files, batch, cache)
    except DataError:   # a file that cannot be read: what was read before it still goes
        out.close()
        raise
    out.close()


def stream_each(out: Batcher, files: Iterable[LocalFile], batch: bool,
                cache: DigestCache | None) -> None:
    learned = Learned(cache)
    items, small = learned.items, out.small
    try:
        for f in files:
            if batch and f.key is not None and not f.digest and f.size <= SMALL:
                # a small file not hashed yet (a first push's usual file): read, hashed
                # and batched here, its digest learned in bulk (fill() and a lock a file
                # were a third of the controller's time at 100,000 files)
                key, size, data = read_deferred(f)
                digest = sha256(data).digest()
                if key is not None and len(data) == size:
                    items.append((f.path, key, digest))
                    if len(items) >= BATCH_FILES:
                        learned.flush()
                if len(data) <= SMALL:
                    small(f.rel, data, digest.hex(), f.mode, True)
                    continue
                f = f._replace(size=len(data), digest=digest.hex(), key=None, root=None)
                stream_one(out, f, batch, cache, data)
            else:
                stream_one(out, f, batch, cache, None)
    finally:
        learned.flush()


class Learned:
    """Digests of deferred files, handed to the cache a few thousand at a time."""

    def __init__(self, cache: DigestCache | None) -> None:
        self.cache = cache
        self.items: list[tuple[str, bytes, bytes]] = []
        self.since = time.time_ns()   # before any of them was read: localfiles.racy's "now"

    def flush(self) -> None:
        """The items so far to the cache; `items` is emptied in place (the loop keeps it)."""
        if self.cache is not None and self.items:
            self.cache.learn_many(self.items, self.since)
        self.items.clear()


def stream_one(out: Batcher, f: LocalFile, batch: bool, cache: DigestCache | None,
               data: bytes | None) -> None:
    """One file of the stream (`data`: its bytes, when read already and hashed then)."""
    fresh = data is not None
    if not f.digest and f.link is None:
        f, data = fill(f, cache, BATCH)
        fresh = data is not None
    if f.link is not None:   # a symlink: its message carries the target, no data frames
        out.add(protocol.stream_item("link", p=f.rel, link=f.link))
    elif batch and f.size <= SMALL:
        if data is None:
            data = f.data if f.data is not None else read_whole(f.path)
        # a file that changed since its hash goes with its new length and its old
        # digest: the host refuses it, as it refuses a changed big file
        out.small(f.rel, data, f.digest, f.mode, fresh)
    else:
        fresh = fresh and f.size <= BATCH   # a bigger one is read again to be sent: verified
        out.flush_small()
        out.add(file_head(f, fresh), 0)
        if f.size <= BATCH:
            if data is None:
                data = read_whole(f.path)
            out.add(protocol.frame(protocol.DATA, data) if data else b"")
        else:
            out.big(f)


SMALL = 64 << 10      # a file this small goes in a `files` batch
BATCH_FILES = protocol.MAX_BATCH_FILES   # files in one `files` message
BATCH_HEAD = protocol.MAX_JSON // 2      # bytes of its JSON, at most


class HostRefused(Exception):
    """The host answered the stream's request before its end (an error: it refused the
    stream and skips the rest): the controller stops sending and ends it with `abort`."""


class Batcher:
    """The stream's bytes gathered into writes of about BATCH, small files into batches."""

    def __init__(self, send: Callable[[bytes | memoryview], None],
                 progress: SendProgress | None, stop: Callable[[], bool] | None = None) -> None:
        self.send, self.progress = send, progress
        self.stop = stop or (lambda: False)   # asked only between two frames
        self.out, self.pending = bytearray(), 0     # bytes to write, files in them
        self.entries: list[list[Any]] = []          # the small files' batch
        self.chunks: list[bytes] = []
        self.nbytes = self.head = 0   # the batch's data bytes, and its head's most
        self.fresh = True             # every digest of the batch taken from its bytes

    def add(self, data: bytes, files: int = 1) -> None:
        self.out += data
        self.pending += files
        if len(self.out) >= BATCH:
            self.write()

    def small(self, rel: str, data: bytes, digest: str, mode: int, fresh: bool = False) -> None:
        """`fresh`: digest was taken from these very bytes (the batch is fresh when all are)."""
        # the head's JSON stays far below protocol.MAX_JSON: a path's character is at
        # most 6 bytes of JSON (\\uXXXX), the rest of an entry under 120
        head = 6 * len(rel) + 120
        if self.nbytes + len(data) > BATCH or len(self.entries) >= BATCH_FILES or \
                self.head + head > BATCH_HEAD:
            self.flush_small()
        self.entries.append([rel, len(data), digest, mode])
        self.fresh = self.fresh and fresh
        self.chunks.append(data)
        self.nbytes += len(data)
        self.head += head

    def flush_small(self) -> None:
        if not self.entries:
            return
        head = protocol.stream_item("files", f=self.entries, fresh=True) if self.fresh else \
            protocol.stream_item("files", f=self.entries)
        data = protocol.frame(protocol.DATA, b"".join(self.chunks)) if self.nbytes else b""
        count = len(self.entries)
        self.entries, self.chunks, self.nbytes, self.head = [], [], 0, 0
        self.fresh = True
        self.add(head + data, count)

    def big(self, f: LocalFile) -> None:
        """A file over BATCH: its frames straight from the file, 1 MiB at a time."""
        self.write()
        buf = bytearray(BATCH)
        view = memoryview(buf)
        left = f.size
        try:
            with open(f.path, "rb") as src:
                while left:
                    n = src.readinto(view[:min(left, BATCH)])
                    if not n:
                        break
                    if self.stop():
                        raise HostRefused()
                    self.send(protocol.HEADER.pack(protocol.DATA, n))
                    self.send(view[:n])
                    left -= n
        except OSError as e:   # this machine's file: the stream is aborted, the host kept
            raise DataError(f"{f.path}: cannot be read ({e.strerror or e})",
                            hint="fix or remove the file, then push again") from None
        if left:   # exactly the announced bytes (the host checks their digest), or none
            raise DataError(f"{f.path}: shrank while it was sent ({f.size} bytes listed)",
                            hint="push again once nothing writes to it")
        if self.progress:
            self.progress(f.size, 1)

    def write(self) -> None:
        if self.out:
            if self.stop():
                raise HostRefused()
            self.send(bytes(self.out))
        if self.progress and (self.out or self.pending):
            self.progress(len(self.out), self.pending)
        self.out, self.pending = bytearray(), 0

    def close(self) -> None:
        self.flush_small()
        self.write()


def read_whole(path: str) -> bytes:
    """A small file's bytes, to its end (a file grown since it was listed sends more than
    its head says, and the host refuses it): os.read, no buffered file object, which
    was a third of the controller's time for tiny files."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, BATCH)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


class Stall:
    """A push's watchdog: when the host takes no byte and sends no frame for `idle`
    seconds (sshd frozen, link cut: TCP itself may wait a quarter of an hour), the
    host's connection is closed, which ends a send blocked on the SSH window and the
    wait for the reply. progress: a send returned, or any frame from the host. Every
    push's Stall is looked at by one thread (StallWatch)."""

    thread: threading.Thread   # the watch's, from __enter__ on (a test waits on it)

    def __init__(self, link: Link, idle: float | None = None) -> None:
        self.link, self.idle = link, timeouts.PUSH_IDLE if idle is None else idle
        self.clock = timeouts.CLOCK
        self.sent = self.clock.now()
        self.fired = False            # set under WATCH.lock, before the close
        self.closed = threading.Event()   # the fired close has returned

    def __enter__(self) -> Stall:
        self.thread = WATCH.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if WATCH.remove(self):   # fired: its close has begun; it ends before the push does
            self.closed.wait()

    def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for i in range(0, len(view), STALL_STEP):   # progress on a slow link too
            self.link.send(view[i:i + STALL_STEP])
            self.sent = self.clock.now()

    def quiet(self) -> float:
        return self.clock.now() - max(self.sent, self.link.last_seen)

    def fire(self) -> None:
        try:
            self.link.transport.close()   # unblocks the sender and the reader
        except Exception:  # closing is best effort; the host is gone either way
            pass
        finally:
            self.closed.set()

    def error(self, dest: str) -> HostError:
        return HostError(f"{self.link.name}: the push to {dest} stalled: the host took no "
                         f"data and sent nothing for {self.idle:g} s (frozen, or its network "
                         "is down); nothing was started on any host",
                         hint=f"once the host answers again, run `{hint_cmd(None, 'up')}`: the "
                              "files that landed are kept, only the rest is sent")


class StallWatch:
    """One thread for every push's Stall: a thread each was 1,000 threads at 1,000 hosts,
    each waking twice a second for the whole push. The thread runs while a push does and
    ends with the last one; it waits on a push's own clock (timeouts.CLOCK as the Stall
    began: a test's fake one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stalls: set[Stall] = set()
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()   # the last push ended: the thread ends now

    def add(self, stall: Stall) -> threading.Thread:
        with self.lock:
            self.stalls.add(stall)
            if self.thread is None:
                self.wake.clear()
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="push-stall")
                self.thread.start()
            return self.thread

    def remove(self, stall: Stall) -> bool:
        """Watched no more; True when it fired (its close may still be running)."""
        with self.lock:
            self.stalls.discard(stall)
            if not self.stalls:
                self.wake.set()
            return stall.fired

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.stalls:
                    self.thread = None
                    return
                self.wake.clear()   # set by a push that ended while another began
                clock = next(iter(self.stalls)).clock
                step = min(min(0.5, s.idle / 4) for s in self.stalls)
            clock.wait(self.wake, step)
            with self.lock:
                due = [s for s in self.stalls if s.quiet() > s.idle]
                for s in due:
                    s.fired = True
                    self.stalls.discard(s)
            for s in due:
                s.fire()


WATCH = StallWatch()


def push(link: Link, dest: str, local: list[LocalFile] | Feed,
         progress: SendProgress | None = None, remote: dict[str, list[Any]] | Same | None = None,
         cache: DigestCache | None = None) -> SyncReport:
    """Make `dest` on the host hold exactly `local` (by content); send only differences.
    `remote` is the host's manifest of dest when the caller has it already; `cache`
    learns the digests of deferred files (LocalFile.key) hashed on the way. `local` as a
    Feed (still being listed) into a folder that holds nothing: sent as it comes."""
    if isinstance(local, Feed):
        if isinstance(remote, dict) and not remote:
            return push_fed(link, dest, local, progress, cache)
        local = local.whole()
    if isinstance(remote, Same):
        if remote.files is local:
            return SyncReport(0, 0, 0, ())
        remote = remote.manifest()   # another list (hosts sharing a folder): compared
    if remote is None:
        _, asked = link.submit("manifest", root=dest)
        link.wait(asked, timeouts.SYNC)
        remote = {rel: entry for part in asked.parts for rel, entry in part["files"].items()}
    send, delete = plan(settle(local, remote, cache), remote)
    if not send and not delete:
        return SyncReport(0, 0, 0, ())
    with Stall(link) as stall:
        try:
            reply = stream_and_wait(link, stall, dest, send, delete, progress, cache=cache)
        except Exception:
            if stall.fired:
                raise stall.error(dest) from None
            raise
    return SyncReport(reply.files, reply.bytes, reply.deleted, tuple(f.rel for f in send))


def push_fed(link: Link, dest: str, feed: Feed, progress: SendProgress | None,
             cache: DigestCache | None) -> SyncReport:
    """A first push into a folder that holds nothing: every file is sent and none
    deleted, so the stream starts with the listing's first chunk. The request waits for
    that chunk (the host's receive gives up on a stream silent for RECEIVE_IDLE)."""
    if feed.empty():
        return SyncReport(0, 0, 0, ())
    with Stall(link) as stall:
        def arrived() -> None:   # waiting for the listing is not the host's stall
            stall.sent = stall.clock.now()
        try:
            reply = stream_and_wait(link, stall, dest, feed.each(arrived), [], progress,
                                    cache=cache)
        except Exception:
            if stall.fired:
                raise stall.error(dest) from None
            raise
    return SyncReport(reply.files, reply.bytes, reply.deleted,
                      tuple(f.rel for f in feed.whole()))


def settle(local: list[LocalFile], remote: dict[str, list[Any]],
           cache: DigestCache | None) -> list[LocalFile]:
    """Deferred files that the host holds at the same size, hashed now: sent only when
    their digest differs (a cold cache here, the files there). The rest stay deferred:
    the host has none of them, or another size, so they are sent in any case."""
    if not remote:
        return local
    out = []
    for f in local:
        if not f.digest and f.link is None and remote.get(f.rel, [None])[0] == f.size:
            f = fill(f, cache, 0)[0]
        out.append(f)
    return out


def stream_and_wait(link: Link, stall: Stall, dest: str, send: Iterable[LocalFile],
                    delete: list[str], progress: SendProgress | None,
                    command: str = "receive", cache: DigestCache | None = None,
                    **fields: Any) -> Received:
    """The stream after its request (`receive` into dest, or another that takes the same
    stream with `fields`: a checkpoint `restore`, which takes no `files` batches), then
    the reply. Once the request is sent the stream always ends, so the host reads the
    next request as one: with `end`, or with `abort` when this side gives up half way (a
    local file that cannot be read: the host keeps and records what landed, the
    DataError names the file) or the host answered before the end (it refused the
    stream: its error is raised)."""
    local: BaseException | None = None
    try:
        with link.wlock:   # the stream follows its request with nothing in between
            _, pending = link.submit(command, **(fields or {"root": dest}))
            try:
                stream_files(sent(stall), send, progress, batch=command == "receive",
                             cache=cache, stop=pending.done.is_set)
                link.send(protocol.stream_item("end", delete=delete))
            except LinkBroke:
                raise
            except BaseException as e:   # this side's failure, or the host's early answer
                local = unreadable(e)
                link.send(protocol.stream_item("abort", why=abort_reason(e)))
    except LinkBroke as e:
        if isinstance(e.cause, OrchError):   # the host was found lost: its own words
            raise e.cause from None
        raise HostError(f"{link.name}: push to {dest} broke off: {e.cause}",
                        hint=f"run `{hint_cmd(None, 'up')}` again: only what is missing "
                             "will be sent") from None
    except (OSError, EOFError) as e:   # the abort itself could not be sent
        raise HostError(f"{link.name}: push to {dest} broke off: {e}",
                        hint=f"run `{hint_cmd(None, 'up')}` again: only what is missing "
                             "will be sent") from None
    if local is not None and not isinstance(local, Exception):
        raise local   # Ctrl-C: the stream is ended, its answer not waited for
    stall.sent = stall.clock.now()
    deadline = time.monotonic() + timeouts.SYNC
    # the stall watchdog ends a silent host sooner (its reader then fails the wait, which
    # sets done): one wait, not a wake-up every half second per host
    pending.done.wait(timeouts.SYNC)
    if local is not None and not isinstance(local, HostRefused):
        raise local   # (the host's answer to the abort says only that it was aborted)
    return Received.of(link.wait(pending, max(0.0, deadline - time.monotonic())))


class LinkBroke(Exception):
    """A send of the stream failed: the connection, not this side's files."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def sent(stall: Stall) -> Callable[[bytes | memoryview], None]:
    """stall.send, its failures told apart from this side's (LinkBroke)."""
    def send(data: bytes | memoryview) -> None:
        try:
            stall.send(data)
        except Exception as e:
            raise LinkBroke(e) from e
    return send


def unreadable(e: BaseException) -> BaseException:
    """A local file's OSError (gone or unreadable since it was listed) as the DataError
    that names it; anything else as it is."""
    if isinstance(e, OSError):
        return DataError(f"{e.filename or 'a file to push'}: cannot be read "
                         f"({e.strerror or e})", hint="fix or remove the file, then push again")
    return e


def abort_reason(e: BaseException) -> str:
    if isinstance(e, HostRefused):
        return "the host refused the stream"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return (getattr(e, "message", None) or str(e) or type(e).__name__)[:500]
