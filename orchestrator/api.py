"""A small Python API over the same verbs as the command line: up, status, stop, logs.

Each call runs the command exactly as `orch` does (the same Session verbs, checks and
exit codes) and hands back what the command's `--json` document says, instead of
printing it. A mistake (bad inventory, unreachable host, ...) raises the command's
OrchError, whose `exit_code` is the CLI's; messages and progress still go to stderr.

    from orchestrator import api
    job = api.up("cluster.yaml")            # detached: returns once every host started
    print(api.status("cluster.yaml").doc["ranks"])
    print(api.logs("cluster.yaml", rank=0).decode())
    api.stop("cluster.yaml")
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import cli


@dataclass(frozen=True)
class Result:
    code: int                  # the command's exit code (0 ok, 1 job failed, 3 host, ...)
    doc: dict[str, Any]        # its --json document


def _run(words: list[str]) -> tuple[int, bytes]:
    """Run one orch command in this process; (exit code, what it wrote to stdout)."""
    args = cli.parse(words)
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    with contextlib.redirect_stdout(out):
        code = int(args.func(args))
        out.flush()
    return code, raw.getvalue()


def _json(words: list[str]) -> Result:
    import json
    code, data = _run([*words, "--json"])
    return Result(code, json.loads(data) if data.strip() else {})


def up(inventory: str | Path, setup: bool = False) -> Result:
    """`orch up --detach`: preflight, sync, setup, launch; returns once every host started."""
    return _json(["up", "-c", str(inventory), "--detach", *(["--setup"] if setup else [])])


def status(inventory: str | Path) -> Result:
    """`orch status`: per rank host, state, runtime, last line (`doc["ranks"]`)."""
    return _json(["status", "-c", str(inventory)])


def stop(inventory: str | Path, grace: float = 10.0) -> Result:
    """`orch stop`: every process of the job on every host, verified gone."""
    return _json(["stop", "-c", str(inventory), "--grace", str(grace)])


def logs(inventory: str | Path, rank: int, tail: int = -1) -> bytes:
    """`orch logs --rank R`: the rank's log, its bytes exactly."""
    return _run(["logs", "-c", str(inventory), "--rank", str(rank), "--tail", str(tail)])[1]
