"""`orch status`: one row per rank: host, local rank, pid, state, runtime, last line."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.table import Table

from orchestrator import arrays
from orchestrator.commands.common import console, inventory, open_session, require_state, warn_unreachable
from orchestrator.errors import EXIT_OK
from orchestrator.inventory import Cluster
from orchestrator.results import status_rows
from orchestrator.termsafe import plain
from orchestrator.watch import signal_name


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="per-rank state of the job")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    if cluster.job.array is not None:
        return array_status(cluster, args)
    session = open_session(cluster, require_state(cluster))
    try:
        warn_unreachable(session)
        result = session.status()
    finally:
        session.close()
    rows = []
    for h in cluster.hosts:
        reply = result.ok.get(h.index)
        for local, rank in enumerate(h.ranks):
            info = reply["ranks"][local] if reply else {"state": "lost", "last_line": ""}
            offset = reply["time"] - time.time() if reply else 0.0
            rows.append(row(rank, h.label, local, info, offset))
    if args.json:
        print(json.dumps({"job": cluster.name, "ranks": rows}, indent=1))
    else:
        console.print(table(cluster.name, rows), soft_wrap=False)
    return EXIT_OK


def row(rank: int, host: str, local: int, info: dict, offset: float) -> dict:
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


def table(name: str, rows: list[dict]) -> Table:
    t = Table(title=f"job {name}")
    for col in ("rank", "host", "local", "pid", "state", "runtime", "last line"):
        t.add_column(col, overflow="fold" if col == "last line" else "ellipsis")
    for r in rows:
        runtime = "-" if r["runtime_s"] is None else f"{r['runtime_s']:.1f}s"
        t.add_row(str(r["rank"]), r["host"], str(r["local_rank"]), str(r["pid"] or "-"),
                  r["state"], runtime, r["last_line"][-80:])
    return t


def array_status(cluster: Cluster, args: argparse.Namespace) -> int:
    """One row per task of a job array: index, args, host/slot, state, runtime, last line."""
    rec = arrays.load(cluster)
    session = open_session(cluster, require_state(cluster))
    try:
        warn_unreachable(session)
        rows = status_rows(cluster, rec, session.array_request("array_status", rec))
    finally:
        session.close()
    if args.json:
        print(json.dumps({"job": cluster.name, "tasks": rows}, indent=1))
        return EXIT_OK
    t = Table(title=f"job array {cluster.name}")
    for col in ("task", "args", "host", "slot", "state", "runtime", "last line"):
        t.add_column(col, overflow="fold" if col in ("last line", "args") else "ellipsis")
    for r in rows:
        runtime = "-" if r["runtime_s"] is None else f"{r['runtime_s']:.1f}s"
        slot = "-" if r["slot"] is None else str(r["slot"])
        t.add_row(str(r["task"]), plain(r["args"]), r["host"], slot, r["state"], runtime,
                  plain(r["last_line"][-80:]))
    console.print(t, soft_wrap=False)
    return EXIT_OK
