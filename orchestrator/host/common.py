"""Small helpers every host module uses: the job's folders, JSON files, atomic writes."""
from __future__ import annotations

import json
import os

from orchestrator import protocol


class AgentError(Exception):
    """A failure the controller reports as it is, with its category (protocol.USAGE,
    HOST, JOB), which decides the exit code."""

    def __init__(self, message: str, category: str = protocol.HOST) -> None:
        super().__init__(message)
        self.category = category


def job_paths(job_dir: str) -> dict:
    job = os.path.abspath(os.path.expanduser(job_dir))
    names = ("code", "data", "logs", "run", "output")
    return dict({"job": job}, **{n: os.path.join(job, n) for n in names})


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    tmp = "%s.tmp-%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
