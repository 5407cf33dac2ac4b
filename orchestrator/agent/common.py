"""Small helpers every host module uses: the job's folder (through its JobDir: no link
followed inside it, agent/paths.py), its JSON state files, atomic writes, AgentError."""
from __future__ import annotations

import os

from orchestrator.agent.paths import JobDir
from orchestrator.wire import jsonc, protocol

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

STATE_CAP = 1 << 20   # supervisor.json, host.exit, rank-<r>.exit/.pid: tiny when orch wrote them


class AgentError(Exception):
    """A failure the controller reports as it is, with its category (protocol.USAGE,
    HOST, JOB), which decides the exit code."""

    def __init__(self, message: str, category: str = protocol.HOST) -> None:
        super().__init__(message)
        self.category = category


def job_paths(job_dir: str) -> dict[str, Any]:
    """The job folder (remote_dir resolved once: it may be a link) and its JobDir ("jd"),
    through which every read, write and delete inside it goes."""
    jd = JobDir(job_dir)
    names = ("code", "data", "logs", "run", "output")
    return dict({"job": jd.path, "jd": jd}, **{n: os.path.join(jd.path, n) for n in names})


def folder_of(root: str) -> tuple[Any, ...]:
    """(JobDir, folder name) of a pushed folder given as <job dir>/<folder>."""
    root = os.path.abspath(os.path.expanduser(root)).rstrip("/")
    return JobDir(os.path.dirname(root)), os.path.basename(root)


def read_json(jd: JobDir, rel: str) -> Any:
    """A JSON state file of the job, None when missing, unreadable, a link or too big."""
    try:
        data = jd.read(rel, STATE_CAP)
        return jsonc.loads(data.decode()) if data is not None else None
    except (OSError, ValueError):
        return None


def write_atomic(jd: JobDir, rel: str, data: bytes, mode: int = 0o600) -> None:
    jd.write_file(rel, data, mode)


class StreamIdle(EOFError):
    """No byte of a receive stream for RECEIVE_IDLE seconds: the controller is gone (a
    frozen or cut connection that sshd has not noticed). An EOFError: the agent ends.
    (Here, not in files.py where it is raised: the agent's main catches it without
    importing files.py before a push needs it.)"""
