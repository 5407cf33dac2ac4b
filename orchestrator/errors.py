"""One error base class; `cli()` turns any of them into one message and an exit code.

An error raised after part of the work was done keeps that part as data in `result`
(as fabric's GroupException does): `orch stop` that reached two hosts of three raises
with the two hosts' reports there, and the CLI prints them before the message."""
from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_HOST = 3
EXIT_INTERRUPTED = 130


class OrchError(Exception):
    """A problem the user can act on: printed as one message, never as a traceback."""

    exit_code = EXIT_USAGE
    result: Any = None      # what was done before the failure (an api result), when any

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.hint}" if self.hint else self.message


class UsageError(OrchError):
    exit_code = EXIT_USAGE


class InventoryError(OrchError):
    """A mistake in cluster.yaml, always with file and line."""

    exit_code = EXIT_USAGE

    def __init__(self, path: str, line: int | None, message: str, hint: str = "") -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}", hint=hint)
        self.path = path
        self.line = line


class DataError(OrchError):
    exit_code = EXIT_USAGE


class HostError(OrchError):
    """One or more hosts failed preflight or could not be reached."""

    exit_code = EXIT_HOST


class GroupError(HostError):
    """Some hosts failed one step. Every host's outcome stays data, as in fabric's
    GroupException: `failures` maps each failed host's index to its exception (explained:
    a lost connection says so), `hosts` each index to the host's label. The message is
    what the CLI prints: one line per host, each with its fix."""

    def __init__(self, message: str, failures: dict[int, BaseException],
                 hosts: dict[int, str], *, hint: str = "", result: Any = None) -> None:
        super().__init__(message, hint=hint)
        self.failures = failures
        self.hosts = hosts
        self.result = result
        self.reached = False   # True: the hosts answered preflight; a later step failed


class JobError(OrchError):
    """The job failed (a rank exited non-zero). `failures`: each failed rank (or task)
    and what is known of it (`api.Status.raise_for_failures` gives its RankStatus,
    `api.run` its RankEnd). From `api.run`: `cause`, the root cause as a value (a
    RootCause event: the rank, host, exit code or signal, last lines, error file, or
    the hang's stacks and culprits), and `result`, the RunResult so far."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, message: str, *, hint: str = "",
                 failures: dict[int, Any] | None = None, cause: Any = None,
                 result: Any = None) -> None:
        super().__init__(message, hint=hint)
        self.failures = dict(failures or {})
        self.cause = cause
        self.result = result


def for_category(category: str) -> type[OrchError]:
    """The error class of an agent's error reply category (protocol.USAGE, HOST, JOB)."""
    return {"usage": UsageError, "inventory": UsageError, "job": JobError}.get(category, HostError)
