"""`orch pull`: files from one host's job output/ into a local folder, incrementally,
verified and atomically per file.

The host sends a manifest (path, size, sha256); every entry is checked here (a plain
relative path, sizes and counts capped); the plan compares it with the local files
(digests cached by size/mtime/inode) and asks only for what differs. The files come
back on the same agent channel: a `pull_file` part, its data frames, a `pull_end` with
the sha256 the host read; this side hashes what it writes, and a file is renamed into
place only when both digests agree. Only requested names are accepted, each once, with
exactly the announced bytes. Nothing local is ever deleted.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

from orchestrator.errors import HostError, UsageError
from orchestrator.files.localfiles import DigestCache
from orchestrator.files.pulldest import Dest, Refused, Writing
from orchestrator.remote.link import Link, Pending, PullEnd, PullFile, PullPart, Stream
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import protocol, timeouts

ReceiveProgress = Callable[[int], None]     # bytes just received
BATCH_NAMES = 2 << 20                # bytes of names per pull_send request (a JSON frame)
HEX = frozenset("0123456789abcdef")


class Entry(NamedTuple):
    """One file of a host's pull manifest: the wire's [size, sha256], as the host read it."""

    size: int
    sha256: str


Listing = dict[str, Entry]           # a manifest: path under the folder -> its entry


@dataclass(frozen=True)
class Skipped:
    """A file the host left out of its listing, and why (too big, a link, unreadable)."""

    path: str
    why: str


@dataclass(frozen=True)
class ManifestReply:
    """A host's `pull_manifest` reply (its files come as parts, in a Listing): its folder,
    the files it skipped (the first MAX_PULL_NOTES named), and those not yet settled."""

    root: str
    skipped: tuple[Skipped, ...]
    skipped_count: int
    fresh_paths: tuple[str, ...]

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> ManifestReply:   # checked by protocol.py
        return cls(reply["root"], tuple(Skipped(s["p"], s["why"]) for s in reply["skipped"]),
                   reply["skipped_count"], tuple(reply.get("fresh_paths", ())))


@dataclass
class PullReport:
    host: str
    source: str                      # the host's output folder
    dest: str
    listed: int = 0                  # files the host has (after skips)
    files: int = 0                   # pulled now
    bytes: int = 0
    unchanged: int = 0
    # {"p", "why"}: the host's skips and vanished files; files that could not be written here
    skipped: list[dict[str, str]] = field(default_factory=list)
    skipped_count: int = 0
    failed: list[dict[str, str]] = field(default_factory=list)

    def skip(self, rel: str, why: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < protocol.MAX_PULL_NOTES:
            self.skipped.append({"p": rel, "why": why})


# ---------------------------------------------------------------- checks

def check_paths(paths: list[str]) -> list[str]:
    """The user's PATH arguments (relative to output/); exit 2 for anything else."""
    out = []
    for raw in paths:
        rel = raw.strip("/") if raw not in ("", "/") else raw
        while rel.startswith("./"):
            rel = rel[2:]
        if rel in (".", ""):
            return []   # the whole of output/
        why = protocol.pull_path_problem(rel)
        if why or raw.startswith("/"):
            raise UsageError(f"cannot pull {raw!r}: {why or 'an absolute path'}",
                             hint="name files or folders relative to the job's output/ "
                                  f"(e.g. `{hint_cmd(None, 'pull checkpoints/last.pt')}`)")
        out.append(rel)
    return sorted(set(out))


def check_manifest(host: str, remote: Listing) -> None:
    """Every entry a plain relative path with [size, sha256] in range, within the count
    cap, and no file also used as a folder: a host that sends anything else is refused."""
    def bad(why: str) -> HostError:
        return HostError(f"{host}: the pull manifest is refused: {why}",
                         hint="the host's agent may be compromised or broken; nothing was written")
    if len(remote) > protocol.MAX_PULL_FILES:
        raise bad(f"{len(remote)} files, more than {protocol.MAX_PULL_FILES}")
    parents: set[str] = set()
    for rel, entry in remote.items():
        why = protocol.pull_path_problem(rel)
        if why:
            raise bad(f"path {rel[:200]!r}: {why}")
        size, digest = entry
        if not 0 <= size <= protocol.MAX_PULL_SIZE or len(digest) != 64 or set(digest) - HEX:
            raise bad(f"{rel}: size {size} or digest {digest[:80]!r} out of range")
        parts = rel.split("/")
        parents.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = parents & remote.keys()
    if clash:
        raise bad(f"{sorted(clash)[0]} is both a file and a folder")


# ---------------------------------------------------------------- the plan

@dataclass
class PullPlan:
    fetch: Listing
    unchanged: int
    refused: dict[str, str]                   # rel -> why (cannot be written here)


def plan(remote: Listing, dest: Dest, cache: DigestCache) -> PullPlan:
    """What to ask for: every file whose local copy is missing or differs by content."""
    out = PullPlan({}, 0, {})
    for rel, (size, digest) in sorted(remote.items()):
        try:
            st = dest.lstat(rel)
        except Refused as e:
            out.refused[rel] = str(e)
            continue
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == size \
                and local_digest(dest, rel, st, cache) == digest:
            out.unchanged += 1
        else:
            out.fetch[rel] = Entry(size, digest)
    return out


def local_digest(dest: Dest, rel: str, st: os.stat_result, cache: DigestCache) -> str:
    key = dest.show(rel)
    known = cache.known(key, st)
    if known is None:
        try:
            known = dest.digest(rel)
        except OSError:
            return ""   # unreadable or swapped meanwhile: fetch it again
        cache.remember(key, st, known)
    return known


def check_space(dest: Dest, fetch: Listing) -> None:
    need = sum(size for size, _ in fetch.values())
    free = shutil.disk_usage(dest.root).free
    if need > free:
        raise UsageError(f"{dest.root}: {need / 1e6:.1f} MB to pull but only "
                         f"{free / 1e6:.1f} MB free",
                         hint="free some space, or pull into another folder with -o DIR")


# ---------------------------------------------------------------- the stream

class Receiver(Stream):
    """The pull stream's sink, called in the link's reader thread. A breach of the
    stream (a name not asked for, more bytes than announced) raises ProtocolError,
    which ends the link; a file that cannot be written here is noted and its bytes
    dropped, and the stream goes on."""

    takes_data = True
    # exact: a file is kept only when the bytes sent are the ones the manifest listed
    # (the checkpoint keeper: a file rewritten in place between listing and sending,
    # even to the same size, is left for the next round); `orch pull` keeps the newer
    exact = False

    def __init__(self, dest: Dest, wanted: Listing, cache: DigestCache, report: PullReport,
                 progress: ReceiveProgress | None) -> None:
        self.dest, self.wanted, self.cache, self.report = dest, wanted, cache, report
        self.progress, self.lock = progress, threading.Lock()
        self.seen: set[str] = set()
        self.rel: str | None = None
        self.left = 0
        self.hash = hashlib.sha256()
        self.out: Writing | None = None
        self.closed = False

    def _claim(self, rel: str) -> None:
        if self.rel is not None:
            raise protocol.ProtocolError(f"pull: {rel!r} before the end of {self.rel!r}")
        if rel not in self.wanted or rel in self.seen:
            raise protocol.ProtocolError(f"pull: {rel[:200]!r} was not asked for (or twice)")
        self.seen.add(rel)

    def part(self, part: PullPart) -> None:
        with self.lock:
            if isinstance(part, PullFile):
                self._begin(part)
            elif isinstance(part, PullEnd):
                self._end(part)
            else:
                self._claim(part.path)
                self.report.skip(part.path, part.why[:300])

    def _begin(self, part: PullFile) -> None:
        rel, size = part.path, part.size
        self._claim(rel)
        if not 0 <= size <= protocol.MAX_PULL_SIZE:
            raise protocol.ProtocolError(f"pull: {rel}: size {size} out of range")
        self.rel, self.left, self.hash = rel, size, hashlib.sha256()
        if self.closed:
            return
        try:
            self.out = self.dest.create(rel, part.mode)
        except (Refused, OSError) as e:
            self._failed(rel, e)

    def _failed(self, rel: str, e: BaseException) -> None:
        why = str(e) if isinstance(e, Refused) else \
            f"{self.dest.show(rel)}: {getattr(e, 'strerror', None) or e}"
        self.report.failed.append({"p": rel, "why": why})
        if self.out is not None:
            self.out.abandon()
            self.out = None

    def data(self, payload: bytes | bytearray) -> None:
        with self.lock:
            if self.rel is None or len(payload) > self.left:
                raise protocol.ProtocolError("pull: file data beyond the announced size")
            self.left -= len(payload)
            self.hash.update(payload)
            if self.out is not None:
                try:
                    self.out.write(payload)
                except OSError as e:   # disk full: this file fails, the stream goes on
                    self._failed(self.rel, e)
            if self.progress:
                self.progress(len(payload))

    def _end(self, part: PullEnd) -> None:
        rel, sent = self.rel, part.sha256
        if rel is None or part.path != rel or self.left:
            raise protocol.ProtocolError(f"pull: end of {part.path[:200]!r} out of place")
        self.rel, out, self.out = None, self.out, None
        if out is None:
            return
        changed = self.exact and sent != self.wanted[rel].sha256
        if not sent or sent != self.hash.hexdigest() or changed:
            out.abandon()
            if sent and not changed:
                self.report.failed.append({"p": rel, "why": "sha256 mismatch after transfer"})
            else:
                self.report.skip(rel, "changed on the host while it was sent; pull again")
            return
        try:
            st = out.commit()
        except (Refused, OSError) as e:
            self._failed(rel, e)
            return
        self.cache.remember(self.dest.show(rel), st, sent)
        self.report.files += 1
        self.report.bytes += st.st_size

    def abort(self) -> None:
        """The stream ended early (host lost, Ctrl-C): drop the file being written."""
        with self.lock:
            self.closed = True
            if self.out is not None:
                self.out.abandon()
                self.out = None


def wait_stream(link: Link, p: Pending) -> None:
    """Until a streaming request's reply (not used): any wait is fine while frames keep
    coming."""
    clock = timeouts.CLOCK
    while not clock.wait(p.done, 0.5):
        if clock.now() - link.last_seen > timeouts.PULL_IDLE:
            raise HostError(f"{link.name}: the pull stalled: nothing came for "
                            f"{timeouts.PULL_IDLE:g} s", hint=f"run `{hint_cmd(None, 'pull')}` again: "
                            "only what is missing will be sent")
    link.wait(p, 0)


def batches(names: list[str]) -> list[list[str]]:
    """Names in requests of at most BATCH_NAMES bytes (a JSON frame is capped)."""
    out: list[list[str]] = [[]]
    size = 0
    for rel in names:
        if size > BATCH_NAMES:
            out.append([])
            size = 0
        out[-1].append(rel)
        size += len(rel) + 4
    return out


def receive(link: Link, job_dir: str, rx: Receiver, **fields: Any) -> None:
    """The wanted files; `fields` go with each request (`folder`: code/ not output/)."""
    for names in batches(sorted(rx.wanted)):
        with link.pull_lock:   # another pull on this link (a keeper) ends its batch first
            link.last_seen = timeouts.CLOCK.now()
            _, p = link.submit("pull_send", stream=rx, job_dir=job_dir, files=names, **fields)
            try:
                wait_stream(link, p)
            except BaseException:   # host lost, an error reply, Ctrl-C: no half file stays
                rx.abort()
                raise
        if rx.rel is not None:
            raise HostError(f"{link.name}: the pull stream ended inside {rx.rel}")


# ---------------------------------------------------------------- the whole pull

def manifest(link: Link, job_dir: str, paths: list[str],
             **fields: Any) -> tuple[ManifestReply, Listing]:
    """The host's listing, checked; `fields`: the request's optional ones (folder, globs,
    settle)."""
    return manifest_of(link, ask_manifest(link, job_dir, paths, **fields))


def ask_manifest(link: Link, job_dir: str, paths: list[str], **fields: Any) -> Pending:
    """The listing asked for; `manifest_of` reads it (many hosts asked before any is read)."""
    return link.submit("pull_manifest", job_dir=job_dir, paths=paths, **fields)[1]


def manifest_of(link: Link, asked: Pending, timeout: float = timeouts.PULL_MANIFEST,
                bound: float | None = None) -> tuple[ManifestReply, Listing]:
    """The listing `asked` of the host, checked, within `timeout` (said as `bound`)."""
    reply = ManifestReply.of(link.wait(asked, timeout, bound))
    remote: Listing = {}
    for part in asked.parts:   # each checked by protocol.manifest_files: [int, str]
        remote.update((rel, Entry(size, digest)) for rel, (size, digest) in part["files"].items())
    check_manifest(link.name, remote)
    return reply, remote


def pull(link: Link, job_dir: str, paths: list[str], root: Path, cache: DigestCache,
         progress: ReceiveProgress | None = None,
         planned: Callable[[int], None] | None = None) -> PullReport:
    """Bring output/ (or `paths` under it) of one host's job into root. `planned` is
    told how many bytes will come, before they do."""
    reply, remote = manifest(link, job_dir, paths)
    report = PullReport(link.name, reply.root, str(root), listed=len(remote))
    for note in reply.skipped:
        report.skip(note.path[:300], note.why[:300])
    report.skipped_count = max(report.skipped_count, reply.skipped_count)
    if not remote and not os.path.lexists(root):   # nothing to write: no empty folder made
        return report
    with Dest(root) as dest:
        dest.sweep()
        todo = plan(remote, dest, cache)
        report.unchanged = todo.unchanged
        report.failed += [{"p": rel, "why": why} for rel, why in todo.refused.items()]
        if todo.fetch:
            check_space(dest, todo.fetch)
            if planned:
                planned(sum(size for size, _ in todo.fetch.values()))
            try:
                receive(link, job_dir, Receiver(dest, todo.fetch, cache, report, progress))
            finally:
                cache.save()
    cache.save()
    return report


def raise_failed(report: PullReport) -> None:
    """Files that could not be written here: exit 2 with the first one's reason."""
    if report.failed:
        first = report.failed[0]
        more = f" (and {len(report.failed) - 1} more)" if len(report.failed) > 1 else ""
        raise UsageError(f"could not write {first['p']}{more}: {first['why']}",
                         hint="fix the destination as the message says and run "
                         f"`{hint_cmd(None, 'pull')}` again: "
                              "only what is missing will be sent")
