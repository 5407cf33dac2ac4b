"""`orch status`: one row per rank: host, local rank, pid, state, runtime, last line."""
from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table
from rich.text import Text

from orchestrator.arrays import plan
from orchestrator.arrays.results import status_rows
from orchestrator.commands.common import (
    console,
    emit_json,
    inventory,
    open_session,
    require_a_run,
    require_state,
    saved_state,
    unreachable,
    warn_unreachable,
)
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_HOST, EXIT_OK
from orchestrator.remote.fanout import GroupResult
from orchestrator.ui.termsafe import plain, visible
from orchestrator.watch.monitor import signal_name

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
    st = saved_state(cluster)
    session = open_session(cluster, st)
    try:
        if not args.json:
            warn_unreachable(session)
        result = session.status()
    finally:
        session.close()
    if st is None:
        require_a_run(session, result)
    failed = dict(session.failed)
    failed.update(result.failed)
    rows = [r for r, _ in rank_rows(cluster, result)]
    if args.json:
        emit_json({"job": cluster.name, "ranks": rows,
                   "unreachable": unreachable(cluster, failed)})
    else:
        for i, exc in sorted(result.failed.items()):
            console.print("[yellow]warning:[/]", plain(f"{cluster.hosts[i].label}: {exc}"))
        console.print(table(cluster.name, rows), soft_wrap=False, crop=True)
    # a host that cannot be reached: its ranks' state is unknown, not "lost"
    missing = failed or session.failed or len(result.ok) < len(session.links)
    return EXIT_HOST if missing else EXIT_OK


def rank_rows(cluster: Cluster, result: GroupResult[dict[str, Any]]
              ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every rank's row, with what its host said of it (`unreachable`: the host did not
    answer); a runtime is measured on the host's clock (its offset from ours)."""
    out = []
    for h in cluster.hosts:
        reply = result.ok.get(h.index)
        for local, rank in enumerate(h.ranks):
            info = reply["ranks"][local] if reply else {"state": "unreachable", "last_line": ""}
            offset = reply["time"] - time.time() if reply else 0.0
            out.append((row(rank, h.label, local, info, offset), info))
    return out


def row(rank: int, host: str, local: int, info: dict[str, Any], offset: float) -> dict[str, Any]:
    state = info["state"]
    if state == "exited":
        state = "exited 0" if info["code"] == 0 else f"failed ({signal_name(info['code'])})"
    runtime = None
    if info.get("started"):
        end = info.get("ended") or (time.time() + offset)
        runtime = round(end - info["started"], 1)
    return {"rank": rank, "host": host, "local_rank": local, "pid": info.get("pid"),
            "state": state, "code": info.get("code"), "runtime_s": runtime,
            "last_line": info.get("last_line", "")}


COLUMNS = ("rank", "host", "local", "pid", "state", "runtime", "last line")
CAPS = {"host": 20, "state": 26}       # wider than this: cut with an ellipsis
NARROW_CAPS = {"host": 12, "state": 16}
NARROW = 100                           # below this width the pid column is left out


def cells(r: dict[str, Any]) -> dict[str, str]:
    runtime = "-" if r["runtime_s"] is None else f"{r['runtime_s']:.1f}s"
    shown = {"rank": str(r["rank"]), "host": r["host"], "local": str(r["local_rank"]),
             "pid": str(r["pid"] or "-"), "state": r["state"], "runtime": runtime,
             "last line": r["last_line"][:LAST_LINE_MAX]}
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


def table(name: str, rows: list[dict[str, Any]], width: int | None = None) -> Table:
    """One row per rank at any width: the last line is cut at its end (its start is what
    tells lines apart); host text is shown escaped, never read as markup."""
    width = width or console.width
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
    rec = plan.load(cluster)
    session = open_session(cluster, require_state(cluster))
    try:
        if not args.json:
            warn_unreachable(session)
        result = plan.host_request(session, "array_status", rec)
        rows = status_rows(cluster, rec, result)
    finally:
        session.close()
    failed = dict(session.failed)
    failed.update(result.failed)
    if args.json:
        emit_json({"job": cluster.name, "tasks": rows, "unreachable": unreachable(cluster, failed)})
        return EXIT_HOST if failed else EXIT_OK
    t = Table(title=f"job array {cluster.name}")
    for col in ("task", "args", "host", "slot", "state", "runtime", "last line"):
        t.add_column(col, overflow="fold" if col in ("last line", "args") else "ellipsis")
    for r in rows:
        runtime = "-" if r["runtime_s"] is None else f"{r['runtime_s']:.1f}s"
        slot = "-" if r["slot"] is None else str(r["slot"])
        t.add_row(str(r["task"]), plain(r["args"]), r["host"], slot, r["state"], runtime,
                  plain(r["last_line"][-80:]))
    console.print(t, soft_wrap=False)
    return EXIT_HOST if failed else EXIT_OK
