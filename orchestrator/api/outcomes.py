"""What each call of the Python API returns: frozen dataclasses, one per result, and the
`--json` document of each (`document`), which is the same data with `"version": 1`.

A field's JSON name is its own unless its metadata says otherwise (`json="code"`); a
field marked `NOT_IN_JSON` (the exceptions behind a message, a local path the CLI
prints) is data for Python callers only. docs/reference/json.md lists every document.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from orchestrator.arrays.rows import MetricStats as MetricStats  # built once where a row is made
from orchestrator.arrays.rows import ResultGroup as ResultGroup
from orchestrator.arrays.rows import TaskResult as TaskResult
from orchestrator.arrays.rows import TaskStatus as TaskStatus
from orchestrator.errors import JobError
from orchestrator.session.network import PlanDoc
from orchestrator.session.stopper import StopReport
from orchestrator.watch.events import Event, RootCause

JSON_VERSION = 1   # raised when a field changes meaning or goes away; new fields keep it

NOT_IN_JSON = {"json": None}

# host index -> that host's exception: data for Python callers, not for --json
HostErrors = dict[int, BaseException]
OMIT_NONE = {"omit_none": True}


def _renamed(name: str) -> dict[str, str]:
    return {"json": name}


# ---------------------------------------------------------------- up

@dataclass(frozen=True)
class Plan:
    """`up --dry-run`: the plan and each host's command, as printed; no host touched."""

    job: str
    plan: str


@dataclass(frozen=True)
class UpHost:
    host: str                 # the host's label
    job_dir: str              # <remote_dir>/<name>, absolute on that host
    ranks: list[int]          # its global ranks


@dataclass(frozen=True)
class UpResult:
    """A distributed job started on every host (`up --detach`)."""

    job: str
    run_id: str
    world_size: int
    master_addr: str
    master_port: int
    hosts: list[UpHost]
    # the network plan: MASTER_ADDR and each host's interface, what was found and set
    network: PlanDoc | None = None


@dataclass(frozen=True)
class ArrayHost:
    host: str
    job_dir: str
    tasks: list[int]          # the tasks dealt to this host, in its queue's order


@dataclass(frozen=True)
class ArrayUpResult:
    """A job array started: every host's runner works through its own tasks."""

    job: str
    run_id: str
    tasks: int
    hosts: list[ArrayHost]


# ---------------------------------------------------------------- status

@dataclass(frozen=True)
class RankStatus:
    """One global rank. `state`: not started, starting, running, exited 0, failed (exit
    code N / killed by SIGNAL), stopped, lost, or unreachable (its host did not answer)."""

    rank: int
    host: str
    local_rank: int
    pid: int | None
    state: str
    exit_code: int | None = field(metadata=_renamed("code"))
    runtime_s: float | None   # measured on the host's clock; None before it started
    last_line: str
    log_bytes: int | None = field(default=None, metadata=NOT_IN_JSON)   # `logs --list`
    # the latest value of each metric the job's files hold for this rank (watch/curves.py)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.state.startswith("failed")


@dataclass(frozen=True)
class GpuStatus:
    """One GPU of a host of the job (`orch status`'s GPU view): its facts as nvidia-smi
    gives them and whose it is. `holder`: "this job", "job" (another orch job: `job`,
    `user`), "process" (compute processes no orch claim covers: `pids`) or "free"."""

    host: str
    index: int
    name: str
    util: float | None           # percent
    mem_used: float | None       # MiB
    mem_total: float | None      # MiB
    holder: str
    job: str | None = None       # the holding orch job's name ("this job": this one's)
    user: str | None = None      # its user, or the first process's
    ranks: list[int] = field(default_factory=list)   # this job's ranks on it
    pids: list[int] = field(default_factory=list)    # compute processes on it


@dataclass(frozen=True)
class Restart:
    """One restart of the run (`job.restarts`): attempt k of `of`+1 began at `at` (epoch
    seconds) on `hosts`, after `why`."""

    attempt: int
    of: int
    why: str
    at: float
    hosts: list[str]


@dataclass(frozen=True)
class Status:
    """`orch status`: every rank. A host that could not be reached, or did not answer,
    is named in `unreachable` (its ranks read `unreachable`); nothing is raised for it.
    A failed rank is a state here, not an exception: see `raise_for_failures`."""

    job: str
    ranks: list[RankStatus]
    unreachable: dict[str, str]      # host label -> why
    gpus: list[GpuStatus] = field(default_factory=list)   # hosts with `gpus:` only
    gpu_errors: dict[str, str] = field(default_factory=dict)   # host label -> nvidia-smi's failure
    restarts: list[Restart] = field(default_factory=list)     # this run's, oldest first
    # the run's network plan, as `up --json` gave it (None: nothing proven, or no run)
    network: PlanDoc | None = None
    # by host index: the connection's failure; reached, but no answer to `status`
    unreached: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                  metadata=NOT_IN_JSON)
    unanswered: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                   metadata=NOT_IN_JSON)

    @property
    def failed(self) -> list[RankStatus]:
        return [r for r in self.ranks if r.failed]

    @property
    def running(self) -> bool:
        return any(r.state == "running" for r in self.ranks)

    def raise_for_failures(self) -> None:
        """JobError (exit code 1) carrying every failed rank's status, when one failed."""
        failed = self.failed
        if failed:
            first = failed[0]
            raise JobError(f"job '{self.job}': {len(failed)} of {len(self.ranks)} ranks failed; "
                           f"rank {first.rank} on {first.host}: {first.state}",
                           failures={r.rank: r for r in failed})


@dataclass(frozen=True)
class ArrayStatus:
    job: str
    tasks: list[TaskStatus]
    unreachable: dict[str, str]
    unreached: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                  metadata=NOT_IN_JSON)
    unanswered: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                   metadata=NOT_IN_JSON)


# ---------------------------------------------------------------- logs

@dataclass(frozen=True)
class LogLines:
    """One rank's (or task's) log as lines (`logs --rank R --json`)."""

    job: str
    host: str
    lines: list[str]
    rank: int | None = field(default=None, metadata=OMIT_NONE)
    task: int | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class RankLines:
    rank: int
    lines: list[str]


@dataclass(frozen=True)
class TaskLines:
    task: int
    lines: list[str]


@dataclass(frozen=True)
class AllLogs:
    """Every rank's lines (`logs --json`); `lost`: hosts lost while reading (label -> why)."""

    job: str
    ranks: list[RankLines]
    lost: dict[str, str]


@dataclass(frozen=True)
class ArrayLogs:
    job: str
    tasks: list[TaskLines]
    lost: dict[str, str]


@dataclass(frozen=True)
class LogEntry:
    rank: int
    host: str
    state: str
    log_bytes: int | None


@dataclass(frozen=True)
class LogList:
    """`logs --list`: where each rank's log is and how long it is."""

    job: str
    ranks: list[LogEntry]
    unreachable: dict[str, str]


# ---------------------------------------------------------------- stop, pull, exec

@dataclass(frozen=True)
class StopResult:
    """`orch stop`: what each reached host's stop did (`StopReport`: found, killed, left,
    seconds), and the hosts that could not be stopped (label -> why)."""

    job: str
    hosts: dict[str, StopReport]
    failed: dict[str, str]
    failures: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                 metadata=NOT_IN_JSON)


@dataclass(frozen=True)
class PortForward:
    """One forward: 127.0.0.1:local_port here to localhost:remote_port on the host."""

    remote_port: int
    local_port: int
    url: str


@dataclass(frozen=True)
class ForwardResult:
    """`orch forward`: the host and its forwards, as they listen."""

    host: str
    forwards: list[PortForward]


@dataclass(frozen=True)
class PullResult:
    """`orch pull`: files from one host's output/ into `destination`."""

    host: str
    source: str               # the host's folder
    destination: str
    files: int                # pulled now
    bytes: int
    unchanged: int
    listed: int               # files the host has (after its skips)
    skipped: list[dict[str, str]]   # {"p": path, "why": reason}, the first ones
    skipped_count: int
    failed: list[dict[str, str]]    # files that could not be written here
    # outputs/<name>/ held an earlier run's files: the folder they were moved to first
    earlier_run: str | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class HostExec:
    host: str
    index: int
    exit_code: int | None     # None: the host could not run it (see `error`)
    output: str               # its last MiB of output
    output_truncated: bool
    error: str | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class ExecResult:
    """`orch exec`: each host's exit code. A non-zero exit is data; `exit_code` is the
    CLI's (0 all ok, 1 a command failed, 3 a host could not run it, 130 interrupted)."""

    command: list[str]
    hosts: list[HostExec]
    interrupted: bool
    exit_code: int
    failures: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                 metadata=NOT_IN_JSON)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


# ---------------------------------------------------------------- results

@dataclass(frozen=True)
class Results:
    """`orch results`: a job array's tasks and their groups over folds."""

    job: str
    tasks: list[TaskResult]
    groups: list[ResultGroup]
    csv: Path = field(metadata=NOT_IN_JSON)   # .orch/<name>/results.csv, written now
    unreached: HostErrors = field(default_factory=dict, repr=False, compare=False,
                                  metadata=NOT_IN_JSON)
    # outputs/<name>/ held an earlier run's files: (that folder, where they were moved first)
    earlier_run: tuple[str, str] | None = field(default=None, metadata=NOT_IN_JSON)


# ---------------------------------------------------------------- run


@dataclass(frozen=True)
class RankEnd:
    """How a rank ended in the run's last attempt: `code`, or the `signal` that ended it;
    `runtime`: seconds from the job's start to its exit, on the controller's clock."""

    rank: int
    host: str
    code: int | None
    signal: int | None
    runtime: float
    after_stop: bool = False   # ended by a stop (orch's fail-fast, or an `orch stop`)

    @property
    def failed(self) -> bool:
        return self.code != 0


@dataclass(frozen=True)
class AttemptResult:
    """One attempt of a run: its hosts, its root cause (None: it succeeded) and `why` in
    a line, and how long it took to start (preflight, sync, setup, launch) and to run."""

    attempt: int
    hosts: tuple[str, ...]
    cause: RootCause | None = field(metadata=NOT_IN_JSON)
    why: str
    start_seconds: float
    run_seconds: float


@dataclass(frozen=True)
class RunResult:
    """`api.run`: the run to its end. `code`: the CLI's exit code (0: every rank exited 0
    and the pull worked); `ranks`: the last attempt's ranks; `pulled`: rank 0's output/
    (None: not pulled), `pull_error` when its pull failed."""

    job: str
    code: int
    ranks: tuple[RankEnd, ...]
    attempts: tuple[AttemptResult, ...]
    pulled: PullResult | None
    pull_error: str = ""
    pull_seconds: float = 0.0


@dataclass(frozen=True)
class Pulled(Event):
    """The pull of rank 0's output/ at the run's end: what came (`result`, which may be
    partial), or `error`."""

    result: PullResult | None
    error: str = ""


@dataclass(frozen=True)
class Finished(Event):
    """The run ended (the last event of `api.run`): its RunResult."""

    result: RunResult


# ---------------------------------------------------------------- --json

def to_json(value: Any) -> Any:
    """A result as JSON data: dataclasses by their fields (renamed, left out as their
    metadata says), tuples as lists, paths as text."""
    if is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in fields(value):
            name = f.metadata.get("json", f.name)
            item = getattr(value, f.name)
            if name is None or (item is None and f.metadata.get("omit_none")):
                continue
            out[name] = to_json(item)
        return out
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def document(result: Any) -> dict[str, Any]:   # free-form JSON, as json.loads gives it
    """The --json document of a result: `version` first, then its fields (api.document:
    a user's code reads it as it would read the JSON)."""
    data = to_json(result)
    if not isinstance(data, dict):
        raise TypeError(f"{type(result).__name__} is not a result")
    return {"version": JSON_VERSION, **data}
