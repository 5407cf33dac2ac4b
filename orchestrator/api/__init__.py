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
both). `up` is always detached: following a job's output is the CLI's (`orch up`,
`orch logs -f`). The results are frozen dataclasses (api/outcomes.py).

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
  `Status.raise_for_failures()` turns it into a `JobError` carrying every failed rank.

Nothing is printed, on stdout or stderr, except `exec(echo=True)`'s output; warnings (a
damaged state file, a host key recorded under accept-new) go to the `orchestrator`
logger unless a `warn` callable is given.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the names as the type checker sees them; at run time: __getattr__
    from orchestrator.api.executing import exec
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
        ExecResult,
        GpuStatus,
        HostExec,
        LogEntry,
        LogLines,
        LogList,
        MetricStats,
        Plan,
        PullResult,
        RankLines,
        RankStatus,
        Restart,
        ResultGroup,
        Results,
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
    from orchestrator.api.stopping import stop
    from orchestrator.errors import GroupError, HostError, JobError, OrchError, UsageError
    from orchestrator.session.stopper import StopReport

# Each name is imported the first time it is used (PEP 562): `orch up` imports
# orchestrator.api.launching, which makes Python import this package first, and should
# not pay for status, logs, exec and pull (their modules, the watch, the rendering of
# results) before its first login.
_MODULES = (
    ("orchestrator.api.executing", "exec"),
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
    ("orchestrator.api.stopping", "stop"),
    ("orchestrator.errors", "GroupError HostError JobError OrchError UsageError"),
    ("orchestrator.session.stopper", "StopReport"),
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
    "ExecResult",
    "Forwarding",
    "GpuStatus",
    "GroupError",
    "HostError",
    "HostExec",
    "Inventory",
    "JobError",
    "LogEntry",
    "LogLines",
    "LogList",
    "MetricStats",
    "OrchError",
    "Plan",
    "PullResult",
    "RankLines",
    "RankStatus",
    "Restart",
    "ResultGroup",
    "Results",
    "Status",
    "StopReport",
    "StopResult",
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
    "forward",
    "logs",
    "plan",
    "pull",
    "results",
    "status",
    "stop",
    "up",
    "watch",
]
