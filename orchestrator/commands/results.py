"""`orch results`: a job array's tasks with the last row of each one's metrics.csv, then
grouped over folds (mean ± std); also written to `.orch/<name>/results.csv`."""
from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from orchestrator.arrays import plan
from orchestrator.arrays import results as res
from orchestrator.commands.common import (
    console,
    emit_json,
    inventory,
    open_session,
    require_state,
    warn_unreachable,
)
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_OK, UsageError
from orchestrator.session.session import Session
from orchestrator.ui.termsafe import plain

SHOWN = ("val_acc", "val_loss", "train_acc", "train_loss", "time_s", "epoch")  # first, when present
MAX_COLS = 6


def add_parser(sub: Any) -> None:
    p = sub.add_parser("results")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    if cluster.job.array is None:
        raise UsageError(f"{cluster.path.name}: job '{cluster.name}' is not a job array",
                         hint="add `array:` under `job:` (see the README's Job arrays), "
                              f"or use `orch status -c {cluster.path.name}`")
    rec = plan.load(cluster)
    session = open_session(cluster, require_state(cluster))
    try:
        if not args.json:
            warn_unreachable(session)
        return show(session, rec, args.json)
    finally:
        session.close()


def collect(session: Session, rec: plan.ArrayRecord) -> list[dict[str, Any]]:
    status = plan.host_request(session, "array_status", rec)
    fetched = plan.host_request(session, "array_results", rec)
    return res.result_rows(rec, res.status_rows(session.cluster, rec, status), fetched)


def show(session: Session, rec: plan.ArrayRecord, as_json: bool) -> int:
    cluster = session.cluster
    rows = collect(session, rec)
    groups = res.group(rows)
    path = cluster.state_dir / "results.csv"
    res.write_csv(path, rows)
    if as_json:
        emit_json({"job": cluster.name, "tasks": rows, "groups": groups})
    else:
        render(cluster, rows, groups)
        console.print(f"results: {path}")
    return EXIT_OK


def shown_columns(rows: list[dict[str, Any]]) -> list[str]:
    cols = res.columns(rows)
    first = [c for c in SHOWN if c in cols]
    return (first + [c for c in cols if c not in first])[:MAX_COLS]


def render(cluster: Cluster, rows: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    cols = shown_columns(rows)
    t = Table(title=f"job array {cluster.name}: {len(rows)} tasks")
    for c in ("task", "args", "state", *cols):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["task"]), plain(r["args"]), r["state"],
                  *(plain(r["metrics"].get(c, "")) for c in cols))
    console.print(t, soft_wrap=False)
    g = Table(title="grouped over folds (mean ± std)")
    for c in ("group", "tasks", "ok", *cols):
        g.add_column(c)
    for grp in groups:
        name = " ".join(f"{k}={v}" for k, v in grp["params"].items()) or "all"
        cells = []
        for c in cols:
            m = grp["metrics"].get(c)
            cells.append(f"{m['mean']:.4g} ± {m['std']:.2g}" if m else "-")
        g.add_row(plain(name), str(len(grp["tasks"])), str(grp["ok"]), *cells)
    console.print(g, soft_wrap=False)
