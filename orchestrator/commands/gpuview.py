"""The GPU view of `orch status`: one row per GPU of the job's hosts, with whose it is.
Host text (names, users, job names) is shown escaped, never read as markup."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text

from orchestrator.api.outcomes import GpuStatus
from orchestrator.ui.termsafe import visible

COLUMNS = ("host", "gpu", "name", "util", "memory", "holder")


def holder(g: GpuStatus) -> str:
    if g.holder == "this job":
        ranks = ",".join(map(str, g.ranks))
        return f"this job, rank {ranks}" if ranks else "this job"
    if g.holder == "job":
        return f"job {g.job!r} (user {g.user})"
    if g.holder == "process":
        shown = ",".join(map(str, g.pids[:3])) + (" ..." if len(g.pids) > 3 else "")
        return f"pid {shown} (user {g.user}), not an orch job"
    return "free"


def memory(g: GpuStatus) -> str:
    if g.mem_used is None or g.mem_total is None:
        return "-"
    return f"{g.mem_used / 1024:.1f}/{g.mem_total / 1024:.0f} GiB"


def cells(g: GpuStatus) -> list[str]:
    util = "-" if g.util is None else f"{g.util:.0f}%"
    shown = [g.host, str(g.index), g.name, util, memory(g), holder(g)]
    return [visible(c, keep_sgr=False) for c in shown]


def table(gpus: list[GpuStatus]) -> Table:
    """The holder column is never cut: it is what the view is for."""
    t = Table(title="GPUs")
    for c in COLUMNS:
        t.add_column(c, no_wrap=c != "holder", overflow="fold" if c == "holder" else "ellipsis",
                     max_width=24 if c in ("host", "name") else None)
    for g in gpus:
        t.add_row(*(Text(c) for c in cells(g)))
    return t
