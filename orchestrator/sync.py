"""Incremental, verified, one-stream-per-host file push (code and data shards).

Both pushes work the same way: list the local files with their sha256, ask the host
for its manifest (digests cached there by size/mtime/inode), send only what differs as
one stream of header+bytes frames, and delete what the host has but should not. The
host writes each file beside its final name, checks the digest, then renames.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pathspec

from orchestrator import protocol, timeouts
from orchestrator.errors import HostError
from orchestrator.link import Link

BATCH = 1 << 20
Progress = Callable[[int, int], None]   # (bytes, files) just sent


@dataclass(frozen=True)
class LocalFile:
    rel: str        # path on the host, relative to the destination folder
    path: str       # where the bytes are here (links already resolved)
    size: int
    mode: int
    digest: str


@dataclass(frozen=True)
class SyncReport:
    files: int
    bytes: int
    deleted: int
    sent: tuple[str, ...]


class DigestCache:
    """sha256 of local files, remembered by (size, mtime, inode) across runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        try:
            self.entries: dict = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    def digest(self, path: str, st: os.stat_result) -> str:
        key = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        with self.lock:
            hit = self.entries.get(path)
        if hit and hit[0] == key:
            return hit[1]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(BATCH), b""):
                h.update(block)
        with self.lock:
            self.entries[path] = [key, h.hexdigest()]
            self.dirty = True
        return h.hexdigest()

    def save(self) -> None:
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.entries))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------- code files

def ignore_spec(base: Path, exclude: Iterable[str]) -> pathspec.PathSpec:
    lines = list(exclude)
    gitignore = base / ".gitignore"
    if gitignore.is_file():
        lines += gitignore.read_text().splitlines()
    return pathspec.PathSpec.from_lines("gitwildmatch", lines)


def code_files(base: Path, paths: Iterable[str], exclude: Iterable[str],
               cache: DigestCache) -> list[LocalFile]:
    """code.paths keep their names under code/; .gitignore and code.exclude apply."""
    spec, files = ignore_spec(base, exclude), {}
    for top in paths:
        name = Path(top).name   # src/job lands as code/job
        for rel in walk(base, top):
            if spec.match_file(rel) or any(fnmatch.fnmatch(part, pat) for part in rel.split("/")
                                           for pat in exclude):
                continue
            full = str(base / rel)
            st = os.stat(full)
            dest = name + rel[len(top):]
            files[dest] = LocalFile(dest, full, st.st_size, st.st_mode & 0o777,
                                    cache.digest(full, st))
    return [files[k] for k in sorted(files)]


def walk(base: Path, top: str) -> Iterable[str]:
    root = base / top
    if root.is_file():
        yield top
        return
    for d, dirs, names in os.walk(root):
        dirs.sort()
        rel_dir = os.path.relpath(d, base).replace(os.sep, "/")
        for n in sorted(names):
            if os.path.isfile(os.path.join(d, n)):
                yield f"{rel_dir}/{n}"


# ---------------------------------------------------------------- the stream

def plan(local: list[LocalFile], remote: dict[str, list]) -> tuple[list[LocalFile], list[str]]:
    """What to send (new or different digest) and what to delete on the host."""
    wanted = {f.rel for f in local}
    send = [f for f in local if remote.get(f.rel, [None, None])[1] != f.digest]
    delete = sorted(rel for rel in remote if rel not in wanted)
    return send, delete


def file_head(f: LocalFile) -> bytes:
    return protocol.stream_item("file", p=f.rel, s=f.size, h=f.digest, m=f.mode)


def stream_files(send: Callable[[bytes], None], files: list[LocalFile],
                 progress: Progress | None) -> None:
    """A `file` message and data frames (at most 1 MiB each) per file; small files are
    batched into 1 MiB writes."""
    batch, pending, buf = bytearray(), 0, bytearray(BATCH)
    view = memoryview(buf)
    for f in files:
        batch += file_head(f)
        with open(f.path, "rb") as src:
            if f.size <= BATCH:
                data = src.read()
                batch += protocol.frame(protocol.DATA, data) if data else b""
            else:
                send(bytes(batch))
                batch = bytearray()
                for n in iter(lambda: src.readinto(buf), 0):
                    send(protocol.HEADER.pack(protocol.DATA, n))
                    send(view[:n])
        pending += 1
        if len(batch) >= BATCH:
            send(bytes(batch))
            if progress:
                progress(len(batch), pending)
            batch, pending = bytearray(), 0
        elif f.size > BATCH and progress:
            progress(f.size, pending)
            pending = 0
    if batch:
        send(bytes(batch))
    if progress:
        progress(len(batch), pending)


def push(link: Link, dest: str, local: list[LocalFile], progress: Progress | None = None,
         remote: dict[str, list] | None = None) -> SyncReport:
    """Make `dest` on the host hold exactly `local` (by content); send only differences.
    `remote` is the host's manifest of dest when the caller has it already."""
    if remote is None:
        _, asked = link.submit("manifest", root=dest)
        link.wait(asked, timeouts.SYNC)
        remote = {rel: entry for part in asked.parts for rel, entry in part["files"].items()}
    send, delete = plan(local, remote)
    if not send and not delete:
        return SyncReport(0, 0, 0, ())
    try:
        with link.wlock:   # the stream follows its request with nothing in between
            _, pending = link.submit("receive", root=dest)
            stream_files(link.send, send, progress)
            link.send(protocol.stream_item("end", delete=delete))
    except (OSError, EOFError) as e:
        raise HostError(f"{link.name}: push to {dest} broke off: {e}",
                        hint="run `orch up` again: only what is missing will be sent") from None
    reply = link.wait(pending, timeouts.SYNC)
    return SyncReport(reply["files"], reply["bytes"], reply["deleted"],
                      tuple(f.rel for f in send))
