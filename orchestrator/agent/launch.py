"""Launch: start the job's supervisor fully detached; it runs torchrun and records its
exit. A dropped connection, or the agent's end, does not touch it."""
from __future__ import annotations

import contextlib
import os

from orchestrator.agent import preflight, rankexec, warm
from orchestrator.agent.common import AgentError, job_paths, write_atomic
from orchestrator.agent.procs import LOCKED, STOP_FILE, job_running
from orchestrator.wire import jsonc, protocol

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request

ALREADY_RUNNING = "already running"


def job_folders(jd: Any) -> list[str]:
    """Make the job's folders (a link at any of them is refused) and return run/'s names.
    code/ too: without `code:` in the inventory nothing was pushed, and a missing
    entrypoint should fail as the rank's own error, not as a missing folder."""
    for d in ("run", "logs", "output", "code"):
        os.close(jd.open_dir(d, create=True))
    jd.check_layout()
    with jd.dirfd("run") as fd:
        return os.listdir(fd)


def clean_run_dir(p: dict[str, Any]) -> None:
    jd = p["jd"]
    for name in job_folders(jd):
        # a former run's heartbeats, stacks and NCCL dumps (agent/stacks.py) would be
        # taken for this run's
        if name.endswith((".exit", ".pid")) or name in ("host.exit", "stop.json") or \
                name.startswith(("heartbeat-", "stack-", "nccl-trace-rank-")):
            jd.unlink("run/" + name)
    # torchrun's --log-dir: a none_<id>/ folder per run would pile up; only the new
    # run's error files are of use (links inside are removed, never followed)
    jd.rmtree("run/torchrun")


def rankexec_source() -> bytes:
    """The ranks' start, from the bundle this agent was started from (or the file)."""
    loader: Any = rankexec.__loader__   # a file or zip loader: both have get_source
    source: str = loader.get_source(rankexec.__name__)
    return source.encode()


def run(req: Request) -> dict[str, Any]:
    """Start the job: the supervisor this host's prewarm left waiting (agent/warm.py), or
    one started now, gets the spec and starts torchrun; its record is the reply. The
    spec holds the job's env (secrets): it is kept in run/launch.json, mode 0600."""
    spec = req.args["spec"]
    p = job_paths(req.args["job_dir"])
    if req.args.get("unshare"):   # every host answered its preflight: the marker is done
        preflight.unshare(p, req.args["unshare"])
    waiting = warm.take(p["job"])
    try:
        # this agent's preflight found it not running and holds its lock since: no other
        # `up` can have started it (no second scan of every process)
        if p["job"] not in LOCKED and job_running(p):
            raise AgentError(ALREADY_RUNNING, protocol.USAGE)
        clean_run_dir(p)
        jd = p["jd"]
        write_atomic(jd, "run/launch.json", jsonc.dumps(spec).encode(), 0o600)
        write_atomic(jd, "run/rankexec.py", rankexec_source(), 0o644)
        for r in spec["ranks"]:
            os.close(jd.open_for_write("logs/rank-%d.log" % r))   # emptied; a link is refused
        if waiting is None or not waiting.matches(spec):
            if waiting is not None:
                waiting.cancel()
            waiting = warm.start(p, spec["argv"][0], spec["env"])
        started = waiting.go(spec)
    except BaseException:
        if waiting is not None:
            waiting.cancel()
        raise
    # the stop's record, made now (agent/spares.py): a fail-fast comes to this agent
    with contextlib.suppress(Exception):   # (a spare only saves time)
        p["jd"].spare(STOP_FILE, 0o644)
    return started
