"""Where things go: messages and progress on stderr (`console`); what a command answers
(its table, the job's output) on stdout (`out`), so `orch status > f` and
`orch status | grep running` work as with any CLI."""
from __future__ import annotations

import logging

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from orchestrator.ui.termsafe import plain_lines

console = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)   # tables: the answer, on stdout


def hosts_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("hosts"), console=console, transient=True)


def bytes_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)


class _Warnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        console.print("[yellow]warning:[/]", plain_lines(record.getMessage()))


def warnings_to_console() -> None:
    """The library's warnings (the `orchestrator` logger: a damaged state file, a host key
    recorded under accept-new) printed as the CLI's own `warning:` lines on stderr."""
    log = logging.getLogger("orchestrator")
    if not any(isinstance(h, _Warnings) for h in log.handlers):
        log.addHandler(_Warnings(logging.WARNING))
