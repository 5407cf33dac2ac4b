"""Where messages and progress go: stderr (stdout carries only the job's output, so it pipes)."""
from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

console = Console(stderr=True, highlight=False, soft_wrap=True)


def hosts_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("hosts"), console=console, transient=True)


def bytes_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)
