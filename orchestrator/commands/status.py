"""`orch status`: one row per rank: host, local rank, pid, state, runtime, last line
(api.status, rendered as a table that fits the screen)."""
from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table
from rich.text import Text

from orchestrator.api import querying
from orchestrator.api.outcomes import RankStatus
from orchestrator.commands.common import console, emit_json, inventory, out, warn_unreachable
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_HOST, EXIT_OK
from orchestrator.ui.termsafe import plain, visible

LAST_LINE_MAX = 200   # characters kept in a row (the table cuts it to the screen at the end)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 3 when a host could not be reached or answer (its ranks read `unreachable`),
    after the table is printed."""
    cluster = inventory(args)
    if cluster.job.array is not None:
        return array_status(cluster, args)
    status = querying.status(cluster)
    if args.json:
        emit_json(status)
    else:
        warn_unreachable(status.unreached.values())
        for i, exc in status.unanswered.items():
            console.print("[yellow]warning:[/]", plain(f"{cluster.hosts[i].label}: {exc}"))
        out.print(table(cluster.name, status.ranks), soft_wrap=False, crop=True)
    # a host that cannot be reached: its ranks' state is unknown, not "lost"
    return EXIT_HOST if status.unreachable else EXIT_OK


COLUMNS = ("rank", "host", "local", "pid", "state", "runtime", "last line")
CAPS = {"host": 20, "state": 26}       # wider than this: cut with an ellipsis
NARROW_CAPS = {"host": 12, "state": 16}
NARROW = 100                           # below this width the pid column is left out


def cells(r: RankStatus) -> dict[str, str]:
    runtime = "-" if r.runtime_s is None else f"{r.runtime_s:.1f}s"
    shown = {"rank": str(r.rank), "host": r.host, "local": str(r.local_rank),
             "pid": str(r.pid or "-"), "state": r.state, "runtime": runtime,
             "last line": r.last_line[:LAST_LINE_MAX]}
    # measured and shown as the terminal will see them: control characters escaped
    return {k: visible(v, keep_sgr=False) for k, v in shown.items()}


def widths(rows: list[dict[str, str]], cols: list[str], total: int) -> dict[str, int]:
    """Every column as wide as its content (host and state capped), the last line the
    rest: one screen row per rank at any width."""
    w = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in cols}
    for c, cap in (CAPS if total >= NARROW else NARROW_CAPS).items():
        w[c] = min(w[c], cap)
    frame = 3 * len(cols) + 1          # borders and one space of padding each side
    spare = total - frame - sum(v for c, v in w.items() if c != "last line")
    if spare < 12:                     # a very narrow screen: host and state give way
        for c in ("state", "host"):
            give = min(w[c] - 6, 12 - spare)
            if give > 0:
                w[c] -= give
                spare += give
    w["last line"] = max(8, min(w["last line"], spare))
    return w


def table(name: str, rows: list[RankStatus], width: int | None = None) -> Table:
    """One row per rank at any width: the last line is cut at its end (its start is what
    tells lines apart); host text is shown escaped, never read as markup."""
    width = width or out.width
    cols = [c for c in COLUMNS if c != "pid" or width >= NARROW]
    texts = [cells(r) for r in rows]
    w = widths(texts, cols, width)
    t = Table(title=plain(f"job {name}"))
    for c in cols:
        t.add_column(c, no_wrap=True, overflow="ellipsis", width=w[c])
    for r in texts:
        t.add_row(*(Text(r[c]) for c in cols))   # Text: never read as markup
    return t


def array_status(cluster: Cluster, args: argparse.Namespace) -> int:
    """One row per task of a job array: index, args, host/slot, state, runtime, last line."""
    status = querying.array_status(cluster)
    if args.json:
        emit_json(status)
        return EXIT_HOST if status.unreachable else EXIT_OK
    warn_unreachable(status.unreached.values())
    t = Table(title=f"job array {cluster.name}")
    for col in ("task", "args", "host", "slot", "state", "runtime", "last line"):
        t.add_column(col, overflow="fold" if col in ("last line", "args") else "ellipsis")
    for r in status.tasks:
        runtime = "-" if r.runtime_s is None else f"{r.runtime_s:.1f}s"
        slot = "-" if r.slot is None else str(r.slot)
        t.add_row(str(r.task), plain(r.args), r.host, slot, r.state, runtime,
                  plain(r.last_line[-80:]))
    out.print(t, soft_wrap=False)
    return EXIT_HOST if status.unreachable else EXIT_OK
