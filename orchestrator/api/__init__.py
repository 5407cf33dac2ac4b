"""orch as a library: the verbs of the command line as plain functions over the same
session, returning typed results. The CLI (orchestrator/commands/) calls these and
renders what they return; its --json documents are these results (`document`).

    from orchestrator import api

    job = api.up("cluster.yaml")                  # returns once every host started
    ranks = api.status("cluster.yaml").ranks      # RankStatus: rank, host, state, ...
    print(api.logs("cluster.yaml", rank=0).decode())   # what rank 0 printed so far
    api.stop("cluster.yaml", grace=2)

(`up` returns before the ranks print anything: the README's example waits for rank 0's
first line.)

Every call takes the inventory's path (or a loaded `Cluster`) and keyword options that
mirror the CLI's flags. `up` and `status` are a distributed job's; a job array has
`array_up`, `array_status` and `results` (`logs(task=I)`, `stop`, `pull`, `exec` serve
both). `up` is detached; `run` is an attached `orch up` (the job to its end, fail-fast,
the hang watch, restarts, the pull: a RunResult or JobError), and `run(on_event=...)`
and `follow` give its events (watch/events.py, docs/reference/events.md). The results
are frozen dataclasses (api/outcomes.py).

How failures come back:

- a mistake (bad inventory, unknown rank, a job not started) raises the OrchError the
  CLI prints; its `exit_code` is the CLI's;
- a call that acts on every host (`up`, `stop`, `exec`, `pull`) raises `GroupError` when
  some hosts could not do their part: `failures` holds each failed host's exception by
  index, `hosts` its label, and `result` what the other hosts did (`up` is all or
  nothing: it starts nothing, so it has no result); `pull` raises UsageError, with the
  PullResult in `result`, for files it could not write here;
- a call that reports (`status`, `array_status`, `results`) returns: the hosts that did
  not answer are named (`unreachable`, `unreached`) and their ranks or tasks read
  `unreachable`;
- a failed job is data: a rank's `state` reads `failed (exit code N)` and
  `Status.raise_for_failures()` turns it into a `JobError` carrying every failed rank;
  `run` raises a `JobError` with the root cause (`cause`) and its RunResult (`result`).

Nothing is printed, on stdout or stderr, except `exec(echo=True)`'s output; warnings (a
damaged state file, a host key recorded under accept-new) go to the `orchestrator`
logger unless a `warn` callable is given.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the names as the type checker sees them; at run time: __getattr__
    from orchestrator.api.executing import exec
    from orchestrator.api.following import follow
    from orchestrator.api.forwarding import Forwarding, forward
    from orchestrator.api.jobs import Inventory
    from orchestrator.api.launching import UpProgress, array_up, plan, up
    from orchestrator.api.outcomes import (
        JSON_VERSION,
        AllLogs,
        ArrayHost,
        ArrayLogs,
        ArrayStatus,
        ArrayUpResult,
        AttemptResult,
        ExecResult,
        Finished,
        GpuStatus,
        HostExec,
        LogEntry,
        LogLines,
        LogList,
        MetricStats,
        Plan,
        Pulled,
        PullResult,
        RankEnd,
        RankLines,
        RankStatus,
        Restart,
        ResultGroup,
        Results,
        RunResult,
        Status,
        StopResult,
        TaskLines,
        TaskResult,
        TaskStatus,
        UpHost,
        UpResult,
        document,
    )
    from orchestrator.api.pulling import Transfer, pull
    from orchestrator.api.querying import array_status, results, status, watch
    from orchestrator.api.reading import logs
    from orchestrator.api.running import run
    from orchestrator.api.stopping import stop
    from orchestrator.errors import GroupError, HostError, JobError, OrchError, UsageError
    from orchestrator.session.stopper import StopReport
    from orchestrator.watch.events import (
        CheckpointKept,
        CheckpointRestored,
        Culprit,
        Event,
        Hang,
        HangSuspected,
        HostLost,
        KeeperChosen,
        NoRestart,
        RankExited,
        RankFailure,
        RankLine,
        RankStarted,
        Restarting,
        RootCause,
        Spares,
        Started,
        StartFailed,
        Stopped,
        Stopping,
        Succeeded,
        Synced,
    )

# Each name is imported the first time it is used (PEP 562): `orch up` imports
# orchestrator.api.launching, which makes Python import this package first, and should
# not pay for status, logs, exec and pull (their modules, the watch, the rendering of
# results) before its first login.
_MODULES = (
    ("orchestrator.api.executing", "exec"),
    ("orchestrator.api.following", "follow"),
    ("orchestrator.api.forwarding", "Forwarding forward"),
    ("orchestrator.api.jobs", "Inventory"),
    ("orchestrator.api.launching", "UpProgress array_up plan up"),
    ("orchestrator.api.outcomes", "JSON_VERSION AllLogs ArrayHost ArrayLogs ArrayStatus "
     "ArrayUpResult ExecResult GpuStatus HostExec LogEntry LogLines LogList MetricStats Plan "
     "PullResult RankLines RankStatus Restart ResultGroup Results Status StopResult TaskLines "
     "TaskResult TaskStatus UpHost UpResult document"),
    ("orchestrator.api.pulling", "Transfer pull"),
    ("orchestrator.api.querying", "array_status results status watch"),
    ("orchestrator.api.reading", "logs"),
    ("orchestrator.api.running", "run"),
    ("orchestrator.api.outcomes", "AttemptResult Finished Pulled RankEnd RunResult"),
    ("orchestrator.api.stopping", "stop"),
    ("orchestrator.errors", "GroupError HostError JobError OrchError UsageError"),
    ("orchestrator.session.stopper", "StopReport"),
    ("orchestrator.watch.events", "Culprit CheckpointKept CheckpointRestored Event Hang "
     "HangSuspected HostLost KeeperChosen NoRestart RankExited RankFailure RankLine RankStarted "
     "Restarting RootCause Spares StartFailed Started Stopped Stopping Succeeded Synced"),
)
WHERE = {name: module for module, names in _MODULES for name in names.split()}


def __getattr__(name: str) -> object:
    module = WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(WHERE))


__all__ = [
    "JSON_VERSION",
    "AllLogs",
    "ArrayHost",
    "ArrayLogs",
    "ArrayStatus",
    "ArrayUpResult",
    "AttemptResult",
    "CheckpointKept",
    "CheckpointRestored",
    "Culprit",
    "Event",
    "ExecResult",
    "Finished",
    "Forwarding",
    "GpuStatus",
    "GroupError",
    "Hang",
    "HangSuspected",
    "HostError",
    "HostExec",
    "HostLost",
    "Inventory",
    "JobError",
    "KeeperChosen",
    "LogEntry",
    "LogLines",
    "LogList",
    "MetricStats",
    "NoRestart",
    "OrchError",
    "Plan",
    "PullResult",
    "Pulled",
    "RankEnd",
    "RankExited",
    "RankFailure",
    "RankLine",
    "RankLines",
    "RankStarted",
    "RankStatus",
    "Restart",
    "Restarting",
    "ResultGroup",
    "Results",
    "RootCause",
    "RunResult",
    "Spares",
    "StartFailed",
    "Started",
    "Status",
    "StopReport",
    "StopResult",
    "Stopped",
    "Stopping",
    "Succeeded",
    "Synced",
    "TaskLines",
    "TaskResult",
    "TaskStatus",
    "Transfer",
    "UpHost",
    "UpProgress",
    "UpResult",
    "UsageError",
    "array_status",
    "array_up",
    "document",
    "exec",
    "follow",
    "forward",
    "logs",
    "plan",
    "pull",
    "results",
    "run",
    "status",
    "stop",
    "up",
    "watch",
]
