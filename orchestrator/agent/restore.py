"""Checkpoints put back into a job folder before a (re)launch (session/keeper.py).

`restore_check`: of the files the controller keeps ({rel: [size, sha256]}, relative to
the job folder, under output/ or code/), which are missing here or differ. `restore`:
the receive stream of agent/files.py (a `file` item and its data frames per file, then
`end`), each file written beside its name, verified and renamed through the JobDir (no
link followed; a link at the name is replaced, never written through).

Restored files are the job's, not orch's: they are never recorded in code/'s ledger
(agent/ledger.py), so the next code sync neither reports nor deletes them. Stdlib only,
Python 3.8.
"""
from __future__ import annotations

import os

from orchestrator.agent import files, pull
from orchestrator.agent.common import AgentError
from orchestrator.agent.paths import Dirs, JobDir, UnsafePath
from orchestrator.wire import globs, protocol

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request


def run_check(req: Request) -> dict[str, Any]:
    """The paths (of those asked) whose file here is missing, not a regular file, or
    has another size or sha256 (digests cached as a pull's are)."""
    jd = JobDir(req.args["job_dir"])
    caches: dict[str, Any] = {}
    want = []
    for rel, (size, digest) in sorted(req.args["files"].items()):
        folder, sub = rel.split("/", 1)
        cache = caches.setdefault(folder, pull.load_digests(jd, folder))
        try:
            got = pull.digest_of(jd, sub, cache, folder)
        except (OSError, UnsafePath):
            got = None
        if got != (size, digest):
            want.append(rel)
    for folder, cache in caches.items():
        pull.save_digests(jd, cache, folder)
    return {"want": want}


def run_restore(req: Request) -> dict[str, Any]:
    """Receive the stream into output/ and code/, holding both folders' receive locks
    (a code push never runs beside it)."""
    jd = JobDir(req.args["job_dir"])
    locks = []
    try:
        for folder in globs.FOLDERS:
            os.close(jd.open_dir(folder, create=True))
            locks.append(files.receive_lock(jd, folder))
        return receive(req.stream, jd)   # refused: the rest is skipped (agent/streams.py)
    finally:
        for fd in locks:
            os.close(fd)


def receive(reader: Any, jd: JobDir) -> dict[str, Any]:
    dirs = Dirs(jd, create=True)
    count, nbytes = 0, 0
    try:
        while True:
            head = stream_head(reader, "restore", "restore")
            if head["t"] == "end":
                if head["delete"]:
                    raise protocol.ProtocolError("restore: a restore deletes nothing")
                return {"files": count, "bytes": nbytes}
            one(reader, dirs, head)
            count, nbytes = count + 1, nbytes + head["s"]
    finally:
        dirs.close()


def one(reader: Any, dirs: Dirs, head: dict[str, Any]) -> None:
    folder, sub = job_path(head["p"], "restore")
    files.receive_file(reader, dirs, folder, dict(head, p=sub))


def stream_head(reader: Any, stream: str, request: str) -> dict[str, Any]:
    """The next message of a checkpoint stream (this request's, or keep_receive's): a
    `file` or the `end`, checked against its schema."""
    head = reader.read_json("the end of the %s stream" % stream)
    kind = head["t"]
    if kind not in ("file", "end"):
        raise protocol.ProtocolError("%s: unexpected message %r" % (request, kind))
    protocol.check(head, protocol.STREAM[kind], "%s: %s" % (request, kind))
    return head  # type: ignore[no-any-return]


def job_path(rel: str, verb: str) -> tuple[str, str]:
    """(output or code, the rest) of a checkpoint's path in the job folder: a plain
    relative one under output/ or code/, else refused ("cannot <verb> ...")."""
    why = protocol.pull_path_problem(rel)
    folder, _, sub = rel.partition("/")
    if why or folder not in globs.FOLDERS or not sub:
        raise AgentError("cannot %s %r: %s" % (verb, rel[:200], why or "not under output/ or code/"),
                         protocol.USAGE)
    return folder, sub
