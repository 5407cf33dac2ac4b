"""The keeper host's copy of the checkpoints (`job.checkpoint_to: host`,
session/hostkeep.py): `<job dir>/checkpoints/<output|code>/...`, the files the
controller relays from rank 0's host, under their path in the job folder.

`keep_receive` takes the receive stream of agent/files.py (a `file` item and its data
frames per file, then `end` with the files to delete): each file written beside its
name, verified and renamed through the JobDir (no link followed), and recorded in the
folder's own ledger (run/checkpoints-pushed.json, one per filesystem). `end` deletes
only what that ledger holds: a file orch did not put there stays. The copy is listed
and read back with `pull_manifest`/`pull_send` (folder "checkpoints"). Stdlib only,
Python 3.8.
"""
from __future__ import annotations

import os

from orchestrator.agent import files
from orchestrator.agent.ledger import Ledger
from orchestrator.agent.paths import Dirs, JobDir
from orchestrator.agent.restore import job_path, stream_head
from orchestrator.wire import globs

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request

KEEP = globs.KEEP


def run_receive(req: Request) -> dict[str, Any]:
    """Receive the stream into checkpoints/, holding its receive lock (one relay at a
    time, whatever the controller). Refused before or during the stream (a link at
    checkpoints/, a full disk): the error is answered and the rest skipped
    (agent/streams.py)."""
    jd = JobDir(req.args["job_dir"])
    os.close(jd.open_dir(KEEP, create=True))
    lock = files.receive_lock(jd, KEEP)
    try:
        return receive(req.stream, jd)
    finally:
        os.close(lock)


def receive(reader: Any, jd: JobDir) -> dict[str, Any]:
    ledger, dirs = Ledger(jd, KEEP), Dirs(jd, create=True)
    ledger.begin()
    count, nbytes = 0, 0
    try:
        while True:
            head = stream_head(reader, "keep", "keep_receive")
            if head["t"] == "end":
                break
            # a refused file (a link, a full disk) ends the request: its error is
            # answered, the rest of the stream skipped (agent/streams.py)
            st, digest = files.receive_file(reader, dirs, KEEP, checked(head))
            ledger.record(head["p"], st, digest)
            count, nbytes = count + 1, nbytes + head["s"]
    except BaseException:
        files.after_failure(reader, lambda: None, dirs, ledger)
        raise
    try:
        for rel in head["delete"]:
            checked({"p": rel})
        deleted = files.apply_deletes(jd, KEEP, ledger, head["delete"])
    finally:
        dirs.close()
        ledger.save()
    return {"files": count, "bytes": nbytes, "deleted": deleted}


def checked(head: dict[str, Any]) -> dict[str, Any]:
    """A path of the copy: a plain relative one under output/ or code/."""
    job_path(head["p"], "keep")
    return head
