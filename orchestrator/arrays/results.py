"""A job array's results: one row per task (its args, its state, the last row of the
metrics.csv it wrote), the rows grouped over folds (mean and sample std), and
`.orch/<name>/results.csv`."""
from __future__ import annotations

import csv
import io
import math
import statistics
import time
from pathlib import Path

from orchestrator.arrays.plan import ArrayRecord, ArrayStatus, TaskMetrics, TaskReply
from orchestrator.arrays.rows import MetricStats, ResultGroup, TaskResult, TaskStatus
from orchestrator.config.arrayspec import task_params
from orchestrator.config.inventory import Cluster
from orchestrator.config.safefile import write_whole
from orchestrator.remote.fanout import GroupResult
from orchestrator.watch import events

FOLD = "fold"


def status_rows(cluster: Cluster, rec: ArrayRecord,
                status: GroupResult[ArrayStatus]) -> list[TaskStatus]:
    """One row per task: index, args, host/slot, state (exited 0, failed (exit code 3 /
    killed by SIGTERM), running, queued, stopped, unreachable: the host did not answer),
    runtime, last line."""
    infos: dict[int, tuple[TaskReply, float]] = {}
    for reply in status.ok.values():
        offset = reply.time - time.time()
        for info in reply.tasks:
            infos[info.task] = (info, offset)
    rows = []
    for i, host in enumerate(rec.host):
        info, offset = infos.get(i, (TaskReply(i, "unreachable"), 0.0))
        runtime = events.runtime_of(info.started, info.ended, offset)
        rows.append(TaskStatus(task=i, args=" ".join(rec.args[i]),
                               host=cluster.hosts[host].label, slot=info.slot,
                               state=events.state_text(info.state, info.code),
                               exit_code=info.code, runtime_s=runtime, last_line=info.last_line))
    return rows


def parse_metrics(header: str | None, last: str | None) -> dict[str, str]:
    """The last row of a metrics.csv as {column: text}; {} when there is none."""
    if not header or not last or last == header:
        return {}
    try:
        cols = next(csv.reader(io.StringIO(header)))
        vals = next(csv.reader(io.StringIO(last)))
    except (csv.Error, StopIteration):
        return {}
    return {c: v for c, v in zip(cols, vals)}


def result_rows(rec: ArrayRecord, statuses: list[TaskStatus],
                results: GroupResult[tuple[TaskMetrics, ...]]) -> list[TaskResult]:
    metrics: dict[int, dict[str, str]] = {}
    for tasks in results.ok.values():
        for item in tasks:
            metrics[item.task] = parse_metrics(item.header, item.last)
    return [TaskResult(task=r.task, args=r.args, params=task_params(rec.args[r.task]),
                       state=r.state, metrics=metrics.get(r.task, {})) for r in statuses]


def number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def group(rows: list[TaskResult]) -> list[ResultGroup]:
    """Rows with the same params other than `fold`: per numeric metric, mean and sample std
    (0 for one row) over the rows that have it; groups in the order they first appear."""
    groups: dict[tuple[tuple[str, str], ...], list[TaskResult]] = {}
    for r in rows:
        key = tuple((k, v) for k, v in r.params.items() if k != FOLD)
        groups.setdefault(key, []).append(r)
    return [group_of(dict(key), members) for key, members in groups.items()]


def group_of(params: dict[str, str], members: list[TaskResult]) -> ResultGroup:
    cols: dict[str, list[float]] = {}
    for r in members:
        for c, v in r.metrics.items():
            x = number(v)
            if x is not None:
                cols.setdefault(c, []).append(x)
    stats = {c: MetricStats(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0,
                            len(xs)) for c, xs in cols.items()}
    return ResultGroup(params=params, tasks=[r.task for r in members],
                       ok=sum(r.state == "exited 0" for r in members), metrics=stats)


def columns(rows: list[TaskResult]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for c in r.metrics:
            seen.setdefault(c, None)
    return list(seen)


def write_csv(path: Path, rows: list[TaskResult]) -> None:
    """results.csv: task, each param, state, each metric column of the last rows;
    replaced whole (two `orch results` at once each through a .tmp of their own)."""
    params = list(dict.fromkeys(k for r in rows for k in r.params))
    cols = columns(rows)
    out = io.StringIO(newline="")
    w = csv.writer(out)
    w.writerow(["task", *params, "state", *cols])
    for r in rows:
        w.writerow([r.task, *(r.params.get(k, "") for k in params), r.state,
                    *(r.metrics.get(c, "") for c in cols)])
    write_whole(path, out.getvalue().encode(), 0o644)
