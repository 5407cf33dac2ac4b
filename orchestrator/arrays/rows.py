"""A job array's rows, as the API returns them (api/outcomes re-exports them): built
once, here, where a host's reply becomes a task's row. `metadata={"json": ...}` is the
name a field has in `--json` (api/outcomes.document)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskStatus:
    """One task of a job array. `state`: queued, running, exited 0, failed (...),
    stopped, unreachable."""

    task: int
    args: str
    host: str
    slot: int | None
    state: str
    exit_code: int | None = field(metadata={"json": "code"})
    runtime_s: float | None
    last_line: str


@dataclass(frozen=True)
class MetricStats:
    mean: float
    std: float                # sample std; 0 for one value
    n: int


@dataclass(frozen=True)
class TaskResult:
    task: int
    args: str
    params: dict[str, str]    # --model vgg --fold 1 -> {"model": "vgg", "fold": "1"}
    state: str
    metrics: dict[str, str]   # the last row of its metrics.csv, as text
    # its curve: one metric's values, epoch by epoch, from the task's files (watch/curves.py)
    curve_metric: str = ""
    curve: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ResultGroup:
    params: dict[str, str]    # every param but fold
    tasks: list[int]
    ok: int                   # tasks of the group that exited 0
    metrics: dict[str, MetricStats]
