"""What more than one command shows: a pull's bar and its summary (`orch pull`, and
`orch up` when the job ended), a job array's results tables (`orch results`, and an
attached array's `orch up`). Not a command: the commands stay independent of each other."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import Progress, TaskID
from rich.table import Table

from orchestrator.api.outcomes import PullResult, Results, TaskResult
from orchestrator.api.pulling import Transfer
from orchestrator.commands.common import console, out
from orchestrator.ui.console import bytes_bar
from orchestrator.ui.termsafe import plain
from orchestrator.ui.wording import plural

# ---------------------------------------------------------------- pull


class PullBar(Transfer):
    def __init__(self, bar: Progress, task: TaskID) -> None:
        self.bar, self.task = bar, task

    def planned(self, total: int) -> None:
        self.bar.update(self.task, total=total or 1)

    def received(self, nbytes: int) -> None:
        self.bar.advance(self.task, nbytes)


@contextmanager
def pull_bar(host: str) -> Iterator[Transfer]:
    """A pull's bytes bar on stderr, gone when it ends."""
    with bytes_bar() as bar:
        yield PullBar(bar, bar.add_task(f"pull {host}", total=None))


def shown(path: str) -> str:
    """The destination as the user would type it: relative to here when below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path + "/"
    return (path if rel.startswith("..") else rel) + "/"


def earlier_outputs(destination: str, aside: str) -> None:
    """The pull's line: outputs/<name>/ held an earlier run's files, moved aside first."""
    console.print(plain(f"{shown(destination)} held an earlier run's files: moved to "
                        f"{shown(aside)} (each run keeps its own folder)"))


def pulled(result: PullResult) -> None:
    where = shown(result.destination)
    if result.earlier_run:
        earlier_outputs(result.destination, result.earlier_run)
    if result.files:
        console.print(f"pulled {plural(result.files, 'file')} ({result.bytes / 1e6:.1f} MB) to {where}"
                      + (f"; {result.unchanged} unchanged" if result.unchanged else ""))
    elif result.listed:
        console.print(f"{where} is up to date ({plural(result.unchanged, 'file')})")
    else:
        console.print(plain(f"nothing to pull: {result.host}:{result.source} has no files"))
    for note in result.skipped:
        console.print(plain(f"  skipped {note['p']}: {note['why']}"))
    if result.skipped_count > len(result.skipped):
        console.print(f"  ... and {result.skipped_count - len(result.skipped)} more skipped")


# ---------------------------------------------------------------- results

SHOWN = ("val_acc", "val_loss", "train_acc", "train_loss", "time_s", "epoch")  # first, when present
MAX_COLS = 6


def shown_columns(tasks: list[TaskResult]) -> list[str]:
    cols = list(dict.fromkeys(c for t in tasks for c in t.metrics))
    first = [c for c in SHOWN if c in cols]
    return (first + [c for c in cols if c not in first])[:MAX_COLS]


BARS = "▁▂▃▄▅▆▇█"                              # a sparkline's eight heights
SPARK_WIDTH = 24                                 # characters of a task's curve at most


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """`▁▃▅█`: the values scaled to eight heights between their min and max, the last
    `width` of them."""
    tail = values[-width:]
    if not tail:
        return ""
    low, high = min(tail), max(tail)
    span = high - low
    return "".join(BARS[int((v - low) / span * 7.999) if span else 3] for v in tail)


def can_draw() -> bool:
    """The terminal's encoding holds the bars (not an ASCII locale or a pipe to one)."""
    try:
        BARS.encode(out.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def results(res: Results) -> None:
    """The tasks' table (with each task's curve where the terminal can draw it), the
    groups' table, and where results.csv is."""
    if res.earlier_run:
        earlier_outputs(*res.earlier_run)
    cols = shown_columns(res.tasks)
    curve = can_draw() and any(r.curve for r in res.tasks)
    t = Table(title=f"job array {res.job}: {len(res.tasks)} tasks")
    for c in ("task", "args", "state", *cols, *(["curve"] if curve else [])):
        t.add_column(c)
    for r in res.tasks:
        drawn = [f"{sparkline(r.curve)} {plain(r.curve_metric)}" if r.curve else ""] if curve else []
        t.add_row(str(r.task), plain(r.args), r.state, *(plain(r.metrics.get(c, "")) for c in cols),
                  *drawn)
    out.print(t, soft_wrap=False)
    g = Table(title="grouped over folds (mean ± std)")
    for c in ("group", "tasks", "ok", *cols):
        g.add_column(c)
    for grp in res.groups:
        name = " ".join(f"{k}={v}" for k, v in grp.params.items()) or "all"
        cells = []
        for c in cols:
            m = grp.metrics.get(c)
            cells.append(f"{m.mean:.4g} ± {m.std:.2g}" if m else "-")
        g.add_row(plain(name), str(len(grp.tasks)), str(grp.ok), *cells)
    out.print(g, soft_wrap=False)
    console.print(f"results: {res.csv}")
