"""`orch status`: one row per rank: host, local rank, pid, state, runtime, last line
(api.status, rendered as a table that fits the screen)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orchestrator.api import querying
from orchestrator.api.outcomes import RankStatus, Status, TaskStatus
from orchestrator.commands.common import (
    console,
    emit_json,
    emit_json_line,
    inventory,
    out,
    warn,
    warn_unreachable,
)
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_HOST, EXIT_JOB_FAILED, EXIT_OK
from orchestrator.ui.termsafe import plain, visible
from orchestrator.ui.wording import plural

WATCH_EVERY = 2.0     # seconds between two rounds of `--watch`
LAST_LINE_MAX = 200   # characters kept in a row (the table cuts it to the screen at the end)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status")
    p.add_argument("--watch", action="store_true",
                   help="refresh the ranks and the GPUs every 2 s until Ctrl-C")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 1 when a rank failed (the job failed), else 3 when a host could not be reached
    or answer (its ranks read `unreachable`), after the table is printed; the failures are
    summed up in one line on stderr, so a script sees them without reading the table."""
    cluster = inventory(args)
    if cluster.job.array is not None:
        if getattr(args, "watch", False):
            return array_watch(cluster, args)
        return array_status(cluster, args)
    if getattr(args, "watch", False):
        return watch(cluster, args)
    status = querying.status(cluster)
    if args.json:
        emit_json(status)
    else:
        warn_unreachable(status.unreached.values())
        for i, exc in status.unanswered.items():
            warn(f"{cluster.hosts[i].label}: {exc}")
        out.print(table(cluster.name, status.ranks), soft_wrap=False, crop=True)
        restart_rows(status)
        network_view(status)
        gpu_view(status)
        summarize(status.failed, len(status.ranks), "rank")
    return verdict(bool(status.failed), bool(status.unreachable))


def verdict(failed: bool, unreachable: bool) -> int:
    """A failed rank or task: the job failed (1), whatever else is known; a host that
    cannot be reached: its ranks' state is unknown, not "lost" (3)."""
    if failed:
        return EXIT_JOB_FAILED
    return EXIT_HOST if unreachable else EXIT_OK


def summarize(failed: Sequence[RankStatus | TaskStatus], total: int, unit: str) -> None:
    if failed:
        console.print(plain(failed_summary(failed, total, unit)), style="red")


SUMMARY_NAMED = 3   # failures named in the summary line; the rest counted


def failed_summary(failed: Sequence[RankStatus | TaskStatus], total: int, unit: str) -> str:
    """`1 of 4 ranks failed: rank 2 on 127.0.1.3 (exit code 1)`."""
    named = []
    for r in failed[:SUMMARY_NAMED]:
        index = r.rank if isinstance(r, RankStatus) else r.task
        why = r.state.removeprefix("failed").strip()
        named.append(f"{unit} {index} on {r.host}" + (f" {why}" if why else ""))
    more = len(failed) - SUMMARY_NAMED
    return (f"{len(failed)} of {plural(total, unit)} failed: " + ", ".join(named)
            + (f", and {more} more" if more > 0 else ""))


def network_view(status: Status) -> None:
    """MASTER_ADDR and each host's interface, as the run's `up` proved them."""
    from orchestrator.config.hostranges import fold
    doc = status.network
    if not doc:
        return
    by: dict[str, list[str]] = {}
    for h in doc["hosts"]:
        by.setdefault(h["interface"] or "left to torch", []).append(h["host"])
    ifaces = "; ".join(f"{name} on {fold(labels)}" for name, labels in by.items())
    console.print(f"network: MASTER_ADDR={doc['master_addr']}; interface {ifaces}", markup=False)


def restart_rows(status: Status) -> None:
    """One row per restart of the run: attempt k of N, when, why, on which hosts."""
    for r in status.restarts:
        when = time.strftime("%H:%M:%S", time.localtime(r.at))
        out.print(plain(f"attempt {r.attempt + 1} of {r.of + 1} (restart {r.attempt}) at "
                            f"{when} after {r.why}; hosts {', '.join(r.hosts)}"))


def gpu_view(status: Status) -> None:
    for label, why in status.gpu_errors.items():
        warn(f"{label}: no GPU view: {why}")
    if status.gpus:
        from orchestrator.commands import gpuview  # only with GPUs: a CPU job's status imports less
        out.print(gpuview.table(status.gpus), soft_wrap=False, crop=True)


def watch(cluster: Cluster, args: argparse.Namespace) -> int:
    """`--watch`: the tables redrawn in place every 2 s (`--json`: one document per
    line); Ctrl-C ends it, exit 0. One login per host for the whole watch."""
    rounds = querying.watch(cluster, every=WATCH_EVERY)
    try:
        if args.json:
            for status in rounds:
                emit_json_line(status)
            return EXIT_OK
        with Live(console=out, auto_refresh=False, transient=False) as live:
            for status in rounds:
                live.update(Group(table(cluster.name, status.ranks), *gpu_tables(status),
                                  Text(f"every {WATCH_EVERY:.0f} s; Ctrl-C to end")),
                            refresh=True)
    except KeyboardInterrupt:
        rounds.close()
    return EXIT_OK


def gpu_tables(status: Status) -> list[Any]:
    from orchestrator.commands import gpuview
    return [gpuview.table(status.gpus)] if status.gpus else []


COLUMNS = ("rank", "host", "local", "pid", "state", "runtime", "metric", "last line")
CAPS = {"host": 20}                    # wider than this: cut with an ellipsis
NARROW_CAPS = {"host": 12}
NARROW = 100                           # below this width the pid column is left out
# the state is never cut: on a screen too narrow for it, these columns are left out first
DROPPED = ("last line", "metric", "local", "runtime", "host")
# the metric shown per rank: its loss and its accuracy, the first of these it has
LOSS_KEYS = ("loss", "train_loss", "train/loss", "val_loss", "val/loss")
ACC_KEYS = ("val_acc", "val/acc", "accuracy", "acc", "train_acc", "train/acc")


def metric_text(m: dict[str, float]) -> str:
    """`train_loss 0.231  val_acc 0.912`: a loss and an accuracy (any name holding the
    word, else); empty when the rank's files hold neither."""
    parts = []
    for keys, word in ((LOSS_KEYS, "loss"), (ACC_KEYS, "acc")):
        key = next((k for k in keys if k in m), None) or \
            next((k for k in sorted(m) if word in k.lower()), None)
        if key is not None:
            parts.append(f"{key[:24]} {m[key]:.4g}")
    return "  ".join(parts)


def cells(r: RankStatus) -> dict[str, str]:
    runtime = "-" if r.runtime_s is None else f"{r.runtime_s:.1f}s"
    shown = {"rank": str(r.rank), "host": r.host, "local": str(r.local_rank),
             "pid": str(r.pid or "-"), "state": r.state, "runtime": runtime,
             "metric": metric_text(r.metrics), "last line": r.last_line[:LAST_LINE_MAX]}
    # measured and shown as the terminal will see them: control characters escaped
    return {k: visible(v, keep_sgr=False) for k, v in shown.items()}


def widths(rows: list[dict[str, str]], cols: list[str], total: int) -> dict[str, int]:
    """Every column as wide as its content (host capped; the state never: it is what
    the table is read for), the last line the rest: one screen row per rank."""
    w = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in cols}
    for c, cap in (CAPS if total >= NARROW else NARROW_CAPS).items():
        if c in w:
            w[c] = min(w[c], cap)
    frame = 3 * len(cols) + 1          # borders and one space of padding each side
    spare = total - frame - sum(v for c, v in w.items() if c != "last line")
    if spare < 12 and "host" in w:     # a narrow screen: the host gives way
        give = min(w["host"] - 6, 12 - spare)
        if give > 0:
            w["host"] -= give
            spare += give
    if "last line" in w:
        w["last line"] = max(8, min(w["last line"], spare))
    return w


def fitted(rows: list[dict[str, str]], cols: list[str], total: int) -> tuple[list[str], dict[str, int]]:
    """The columns that fit `total` with the state whole, and their widths: rich would
    shrink every column, the state too, so columns are left out (DROPPED) instead."""
    w = widths(rows, cols, total)
    for c in DROPPED:
        if 3 * len(cols) + 1 + sum(w.values()) <= total:
            break
        cols = [k for k in cols if k != c]
        w = widths(rows, cols, total)
    return cols, w


def table(name: str, rows: list[RankStatus], width: int | None = None) -> Table:
    """One row per rank at any width: the last line is cut at its end (its start is what
    tells lines apart); host text is shown escaped, never read as markup."""
    width = width or out.width
    texts = [cells(r) for r in rows]
    metric = any(r["metric"] for r in texts)   # a job that writes no metrics: no column
    cols, w = fitted(texts, [c for c in COLUMNS if (c != "pid" or width >= NARROW)
                             and (c != "metric" or metric)], width)
    t = Table(title=plain(f"job {name}"))
    for c in cols:
        # the state folds onto a second line on a screen too narrow even for it alone
        t.add_column(c, no_wrap=c != "state", overflow="fold" if c == "state" else "ellipsis",
                     width=w[c], min_width=w[c] if c == "state" else None)
    for r in texts:
        t.add_row(*(Text(r[c]) for c in cols))   # Text: never read as markup
    return t


def array_status(cluster: Cluster, args: argparse.Namespace) -> int:
    """One row per task of a job array: index, args, host/slot, state, runtime, last line."""
    status = querying.array_status(cluster)
    failed = [r for r in status.tasks if r.state.startswith("failed")]
    if args.json:
        emit_json(status)
        return verdict(bool(failed), bool(status.unreachable))
    warn_unreachable(status.unreached.values())
    out.print(array_table(cluster.name, status.tasks), soft_wrap=False)
    summarize(failed, len(status.tasks), "task")
    return verdict(bool(failed), bool(status.unreachable))


def array_watch(cluster: Cluster, args: argparse.Namespace) -> int:
    """`--watch` of a job array: its table redrawn every 2 s (`--json`: one document per
    line) until Ctrl-C, exit 0."""
    try:
        if args.json:
            while True:
                emit_json_line(querying.array_status(cluster))
                time.sleep(WATCH_EVERY)
        with Live(console=out, auto_refresh=False, transient=False) as live:
            while True:
                tasks = querying.array_status(cluster).tasks
                live.update(Group(array_table(cluster.name, tasks),
                                  Text(f"every {WATCH_EVERY:.0f} s; Ctrl-C to end")), refresh=True)
                time.sleep(WATCH_EVERY)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def array_table(name: str, tasks: Sequence[TaskStatus]) -> Table:
    t = Table(title=f"job array {name}")
    state_w = max([5] + [len(r.state) for r in tasks])
    for col in ("task", "args", "host", "slot", "state", "runtime", "last line"):
        if col == "state":   # never cut: the other columns give way
            t.add_column(col, no_wrap=True, min_width=state_w)
        else:
            t.add_column(col, overflow="fold" if col in ("last line", "args") else "ellipsis")
    for r in tasks:
        runtime = "-" if r.runtime_s is None else f"{r.runtime_s:.1f}s"
        slot = "-" if r.slot is None else str(r.slot)
        t.add_row(str(r.task), plain(r.args), r.host, slot, r.state, runtime,
                  plain(r.last_line[-80:]))
    return t
