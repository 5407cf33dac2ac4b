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

from orchestrator.errors import HostError
from orchestrator.remote import call, open_agent, parse_reply
from orchestrator.transport import Transport

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


def stream_files(chan, files: list[LocalFile], progress: Progress | None) -> None:
    """Small files are batched into 1 MiB writes; large ones go in 1 MiB slices."""
    batch, pending, buf = bytearray(), 0, bytearray(BATCH)
    view = memoryview(buf)
    for f in files:
        head = {"p": f.rel, "s": f.size, "h": f.digest, "m": f.mode}
        batch += json.dumps(head).encode() + b"\n"
        with open(f.path, "rb") as src:
            if f.size <= BATCH:
                batch += src.read()
            else:
                chan.write(batch)
                batch = bytearray()
                for n in iter(lambda: src.readinto(buf), 0):
                    chan.write(view[:n])
        pending += 1
        if len(batch) >= BATCH:
            chan.write(batch)
            if progress:
                progress(len(batch), pending)
            batch, pending = bytearray(), 0
        elif f.size > BATCH and progress:
            progress(f.size, pending)
            pending = 0
    if batch:
        chan.write(batch)
    if progress:
        progress(len(batch), pending)


def push(t: Transport, dest: str, local: list[LocalFile], progress: Progress | None = None,
         remote: dict[str, list] | None = None) -> SyncReport:
    """Make `dest` on the host hold exactly `local` (by content); send only differences.
    `remote` is the host's manifest of dest when the caller has it already."""
    if remote is None:
        remote = call(t, "manifest", dest, timeout=600)["files"]
    send, delete = plan(local, remote)
    if not send and not delete:
        return SyncReport(0, 0, 0, ())
    chan = open_agent(t, "receive", dest, timeout=600)
    try:
        stream_files(chan, send, progress)
        chan.write(json.dumps({"end": True, "delete": delete}).encode() + b"\n")
        chan.close_stdin()
        res = chan.finish()
    except (OSError, EOFError, TimeoutError) as e:
        raise HostError(f"{t.host.label}: push to {dest} broke off: {e}",
                        hint="run `orch up` again: only what is missing will be sent") from None
    finally:
        chan.close()
    reply = parse_reply(t, "receive", res.code, res.stdout, res.stderr)
    return SyncReport(reply["files"], reply["bytes"], reply["deleted"],
                      tuple(f.rel for f in send))
