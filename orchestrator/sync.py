"""Incremental, verified, one-stream-per-host file push (code and data shards).

Both pushes work the same way: list the local files with their sha256, ask the host
for its manifest (digests cached there by size/mtime/inode), send only what differs as
one stream of header+bytes frames, and delete what the host has but should not. The
host writes each file beside its final name, checks the digest, then renames.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from orchestrator.errors import HostError
from orchestrator.localfiles import DigestCache, LocalFile, code_files  # noqa: F401 (re-exported)
from orchestrator.remote import call, open_agent, parse_reply
from orchestrator.transport import Transport

BATCH = 1 << 20
Progress = Callable[[int, int], None]   # (bytes, files) just sent


@dataclass(frozen=True)
class SyncReport:
    files: int
    bytes: int
    deleted: int
    sent: tuple[str, ...]


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
        if f.link is not None:   # a symlink: its header carries the target, no bytes follow
            batch += json.dumps({"p": f.rel, "link": f.link}).encode() + b"\n"
            pending += 1
            continue
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
