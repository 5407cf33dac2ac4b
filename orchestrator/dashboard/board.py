"""What the page shows, as plain data: the ranks, their logs, the events, the root cause,
each GPU's samples over time, the curves and a job array's tasks.

A `Board` is an event reader (`board(event)`, `board.many(events)`) fed by any thread;
the server reads `snapshot()` and `log()`. Everything kept is capped (lines per rank,
characters per line, events, samples per GPU): a run that prints for days costs a
bounded amount of memory. Text stays text here; the page inserts it with textContent."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from orchestrator.api.outcomes import Finished, GpuStatus
from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Cluster
from orchestrator.session.network import PlanDoc
from orchestrator.watch import curves
from orchestrator.watch import events as ev

MAX_LOG_LINES = 5000        # per rank, the newest kept (the full log: `orch logs`)
MAX_LINE_CHARS = 2000       # a longer line is cut, marked with an ellipsis
MAX_EVENTS = 1000
MAX_DETAIL_CHARS = 20000    # a hang's stacks, a root cause's last lines
MAX_GPU_SAMPLES = 720       # an hour at the sampler's 5 s
MAX_CURVE_POINTS = 2000     # per series, thinned evenly beyond it
MAX_SERIES = 200
MAX_NOTES = 20              # the newest kept
MAX_PLAN_HOSTS = 10000      # the network plan's hosts read


def cut(text: str, limit: int = MAX_LINE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class RankRow:
    rank: int
    host: str
    local_rank: int
    state: str = "not started"
    pid: int | None = None
    started: float | None = None
    runtime: float | None = None
    last_line: str = ""
    failed: bool = False
    hung: bool = False


@dataclass
class GpuTrack:
    host: str
    index: int
    name: str
    holder: str
    samples: deque[tuple[float, float | None, float | None, float | None]] = field(
        default_factory=lambda: deque(maxlen=MAX_GPU_SAMPLES))   # time, util %, used, total MiB


# ------------------------------------------------------------ the page's JSON documents

class EventDoc(TypedDict):
    time: float
    kind: str        # the event's class name ("Followed": a new run followed)
    text: str
    detail: str      # a hang's stacks, a root cause's last lines, ...


class RootCauseDoc(TypedDict):
    summary: str
    kind: str
    rank: int | None
    lines: list[str]


class PlanRow(TypedDict):
    """Identical hosts of the network plan, folded (hostranges.fold)."""

    interface: str
    how: str
    found: list[str]
    set: list[str]       # "NAME=value"
    hosts: str
    addresses: str


class PlanTable(TypedDict):
    master_addr: str
    how: str
    probe: str
    rows: list[PlanRow]


class CurveDoc(TypedDict):
    host: str
    rank: int | None
    task: int | None
    source: str
    name: str
    points: list[list[float | None]]   # step, epoch, value, time


class GpuDoc(TypedDict):
    host: str
    index: int
    name: str
    holder: str
    samples: list[list[float | None]]  # time, util %, used, total MiB


class RankDoc(TypedDict):
    rank: int
    host: str
    local_rank: int
    state: str
    pid: int | None
    started: float | None
    runtime: float | None
    last_line: str
    failed: bool
    hung: bool
    restarts: int


class LogPage(TypedDict):
    rank: int
    lines: list[tuple[int, str]]   # (line number, text), oldest first
    next: int                      # the page's cursor for the next ask


# an array's results as api.document gives them (or {"error": why}): passed to the page
# as they are, never read here
TasksDoc = Mapping[str, object]


class _Parts(TypedDict, total=False):
    """The big parts, only where the page's version of them is not the current one."""

    events: list[EventDoc]
    gpus: list[GpuDoc]
    curves: list[CurveDoc]
    tasks: TasksDoc


class Snapshot(_Parts):
    job: str
    mode: str
    now: float
    ended: bool
    outcome: str
    restarts: int
    root_cause: RootCauseDoc | None
    ranks: list[RankDoc]
    gpu_errors: dict[str, str]
    network: PlanTable | None
    latest: dict[str, dict[str, float]]
    notes: list[str]
    log_seq: int
    versions: dict[str, int]


class Board:
    """The job's page as data, updated by events from any thread."""

    def __init__(self, cluster: Cluster, mode: str = "job") -> None:
        self.lock = threading.Lock()
        self.job, self.mode = cluster.name, mode
        self.ranks: dict[int, RankRow] = {}
        self.logs: dict[int, deque[tuple[int, str]]] = {}
        self.seq = 0                       # every log line's number, across ranks
        self.events: deque[EventDoc] = deque(maxlen=MAX_EVENTS)
        self.root_cause: RootCauseDoc | None = None
        self.restarts = 0
        self.ended = False
        self.outcome = ""
        self.gpus: dict[tuple[str, int], GpuTrack] = {}
        self.gpu_errors: dict[str, str] = {}
        self.network: PlanTable | None = None
        self.curves: list[CurveDoc] = []
        self.latest: dict[str, dict[str, float]] = {}   # "host/rank" -> metric -> value
        self.tasks: TasksDoc = {}
        self.notes: list[str] = []
        self.started = threading.Event()   # an attempt's Started was seen
        self.versions = {"events": 0, "gpus": 0, "curves": 0, "tasks": 0}
        if cluster.job.array is None:   # an array's tasks are rows of their own (`tasks`)
            self.place([(h.label, list(h.ranks)) for h in cluster.hosts])

    def place(self, hosts: Sequence[tuple[str, Sequence[int]]]) -> None:
        """The ranks as the hosts hold them (the inventory's, then each Started's)."""
        for label, ranks in hosts:
            for local, rank in enumerate(ranks):
                row = self.ranks.get(rank)
                if row is None or row.host != label:
                    self.ranks[rank] = RankRow(rank, label, local)

    # ------------------------------------------------------------------ the events

    def __call__(self, event: ev.Event) -> None:
        with self.lock:
            self.apply(event)

    def many(self, events: Sequence[ev.Event]) -> None:
        with self.lock:
            for event in events:
                self.apply(event)

    def apply(self, event: ev.Event) -> None:
        handler = getattr(self, "on_" + type(event).__name__, None)
        if handler is not None:
            handler(event)
        if not isinstance(event, (ev.RankLine, ev.RankStarted)):
            text, detail = describe(event)
            self.events.append({"time": event.time, "kind": type(event).__name__,
                                "text": cut(text), "detail": cut(detail, MAX_DETAIL_CHARS)})
            self.changed("events")

    def row(self, rank: int, host: str) -> RankRow:
        if rank not in self.ranks:
            self.ranks[rank] = RankRow(rank, host, 0)
        return self.ranks[rank]

    def on_Started(self, e: ev.Started) -> None:
        self.place([(h.label, h.ranks) for h in e.hosts])
        for row in self.ranks.values():
            row.state, row.failed, row.hung, row.runtime = "starting", False, False, None
            row.started = e.time
        self.ended, self.outcome = False, ""
        self.started.set()

    def on_RankStarted(self, e: ev.RankStarted) -> None:
        row = self.row(e.rank, e.host)
        row.state, row.pid, row.started = "running", e.pid, e.time

    def on_RankLine(self, e: ev.RankLine) -> None:
        row = self.row(e.rank, e.host)
        text = cut(e.text)
        if row.state in ("not started", "starting"):
            row.state = "running"
            row.started = row.started or e.time
        row.last_line = text
        self.seq += 1
        self.logs.setdefault(e.rank, deque(maxlen=MAX_LOG_LINES)).append((self.seq, text))

    def on_RankExited(self, e: ev.RankExited) -> None:
        row = self.row(e.rank, e.host)
        code = e.code if e.code is not None else -(e.signal or 0)
        row.state = "stopped" if e.after_stop and code != 0 else ev.state_text("exited", code)
        row.failed, row.runtime = e.failed and not e.after_stop, e.runtime

    def on_HostLost(self, e: ev.HostLost) -> None:
        for row in self.ranks.values():
            if row.host == e.host and row.state in ("running", "starting", "not started"):
                row.state, row.failed = "lost", True

    def on_Hang(self, e: ev.Hang) -> None:
        for c in e.culprits:
            self.row(c.rank, c.host).hung = True

    def on_RootCause(self, e: ev.RootCause) -> None:
        first = e.rank
        self.root_cause = {"summary": e.summary(), "kind": e.kind,
                           "rank": first.rank if first else None,
                           "lines": [cut(t) for t in (first.last_lines if first else ())][-20:]}
        for f in e.failures:
            self.row(f.rank, f.host).failed = True
        self.ended, self.outcome = True, "failed"

    def on_Restarting(self, e: ev.Restarting) -> None:
        self.restarts = e.attempt

    def on_Succeeded(self, e: ev.Succeeded) -> None:
        self.ended, self.outcome = True, "succeeded"

    def on_Finished(self, e: Finished) -> None:
        self.ended = True
        self.outcome = self.outcome or ("succeeded" if e.result.code == 0 else "failed")

    def on_NoRestart(self, e: ev.NoRestart) -> None:
        self.ended = True

    def reattached(self, cluster: Cluster, run_id: str, restarts: int) -> None:
        """A new run of the job is followed (`orch dashboard`): its ranks start again."""
        with self.lock:
            self.place([(h.label, list(h.ranks)) for h in cluster.hosts])
            for row in self.ranks.values():
                row.state, row.failed, row.hung, row.runtime, row.started = "starting", False, False, None, None
            self.ended, self.outcome, self.root_cause, self.restarts = False, "", None, restarts
            what = f"restart {restarts}" if restarts else f"run {run_id}"
            self.events.append({"time": time.time(), "kind": "Followed",
                                "text": cut(f"following the job's {what}"), "detail": ""})
            self.changed("events")

    def note(self, text: str) -> None:
        """A line for the page's notes (a feed's failure, an earlier run's files moved)."""
        with self.lock:
            self.notes = [*self.notes, cut(text)][-MAX_NOTES:]

    def end(self, why: str = "") -> None:
        """The feed is over (the follow ended): nothing more will come."""
        with self.lock:
            self.ended = True
            if why:
                self.notes.append(cut(why))

    # ------------------------------------------------------------------ samples

    def gpu_sample(self, when: float, gpus: Sequence[GpuStatus],
                   errors: dict[str, str] | None = None) -> None:
        with self.lock:
            for g in gpus:
                track = self.gpus.get((g.host, g.index))
                if track is None:
                    track = self.gpus[(g.host, g.index)] = GpuTrack(g.host, g.index, cut(g.name, 80), "")
                track.holder = cut(holder(g), 200)
                track.samples.append((when, g.util, g.mem_used, g.mem_total))
            self.changed("gpus")
            self.gpu_errors = {k: cut(v, 500) for k, v in (errors or {}).items()}

    def set_curves(self, series: Sequence[curves.Series],
                   latest: dict[tuple[str, int | None], dict[str, float]]) -> None:
        """The curves as read from the job's files (watch/curves.Series), thinned."""
        shown = [curve(s) for s in series[:MAX_SERIES]]
        with self.lock:
            if shown != self.curves:
                self.curves = shown
                self.changed("curves")
            self.latest = {f"{h}/{'' if r is None else r}": dict(m) for (h, r), m in latest.items()}

    def set_tasks(self, tasks: TasksDoc) -> None:
        with self.lock:
            if tasks != self.tasks:
                self.tasks = tasks
                self.changed("tasks")

    def set_network(self, plan: PlanDoc | None) -> None:
        """The plan `up` saved (session/network.load), as the page's table."""
        table = plan_table(plan) if plan else None
        with self.lock:
            self.network = table

    # ------------------------------------------------------------------ reading

    def snapshot(self, have: dict[str, int] | None = None) -> Snapshot:
        """Everything but the logs, as JSON-ready data. The big parts (events, GPU
        samples, curves, tasks) only where `have` (the page's versions of them, as
        `versions` gave them) is not the current one: the page polls every second."""
        now = time.time()
        with self.lock:
            doc: Snapshot = {"job": self.job, "mode": self.mode, "now": now, "ended": self.ended,
                   "outcome": self.outcome, "restarts": self.restarts,
                   "root_cause": self.root_cause, "ranks": [self.rank_json(r, now) for r in
                                                            sorted(self.ranks.values(), key=lambda r: r.rank)],
                   "gpu_errors": dict(self.gpu_errors), "network": self.network,
                   "latest": dict(self.latest), "notes": list(self.notes), "log_seq": self.seq,
                   "versions": dict(self.versions)}
            old = {part for part, v in self.versions.items() if have is None or have.get(part) != v}
            if "events" in old:
                doc["events"] = list(self.events)
            if "gpus" in old:
                doc["gpus"] = [gpu_json(t) for t in self.gpus.values()]
            if "curves" in old:
                doc["curves"] = list(self.curves)
            if "tasks" in old:
                doc["tasks"] = self.tasks
            return doc

    def changed(self, part: str) -> None:
        self.versions[part] += 1

    def rank_json(self, row: RankRow, now: float) -> RankDoc:
        runtime = row.runtime
        if runtime is None and row.started and row.state == "running":
            runtime = round(now - row.started, 1)
        return {"rank": row.rank, "host": row.host, "local_rank": row.local_rank,
                "state": row.state, "pid": row.pid, "started": row.started, "runtime": runtime,
                "last_line": row.last_line, "failed": row.failed, "hung": row.hung,
                "restarts": self.restarts}

    def log(self, rank: int, after: int = 0, limit: int = MAX_LOG_LINES) -> LogPage:
        """Rank `rank`'s lines numbered above `after` (the page's cursor), oldest first."""
        with self.lock:
            lines = [(n, t) for n, t in self.logs.get(rank, ()) if n > after][-limit:]
            return {"rank": rank, "lines": lines, "next": lines[-1][0] if lines else after}

    def log_text(self, rank: int) -> str:
        with self.lock:
            return "".join(t + "\n" for _, t in self.logs.get(rank, ()))

    def all_logs(self) -> dict[str, list[tuple[int, str]]]:
        with self.lock:
            return {str(r): list(lines) for r, lines in self.logs.items()}


def holder(g: GpuStatus) -> str:
    """Whose the GPU is, in the words of `orch status`'s GPU view."""
    if g.holder == "this job":
        return f"this job, rank {','.join(map(str, g.ranks))}" if g.ranks else "this job"
    if g.holder == "job":
        return f"job {g.job} (user {g.user})"
    if g.holder == "process":
        return f"pid {','.join(map(str, g.pids[:3]))} (user {g.user}), not an orch job"
    return "free"


def gpu_json(t: GpuTrack) -> GpuDoc:
    return {"host": t.host, "index": t.index, "name": t.name, "holder": t.holder,
            "samples": [list(s) for s in t.samples]}


def curve(s: curves.Series) -> CurveDoc:
    points = list(s.points)
    if len(points) > MAX_CURVE_POINTS:
        step = len(points) / MAX_CURVE_POINTS
        points = [points[int(i * step)] for i in range(MAX_CURVE_POINTS)] + [points[-1]]
    return {"host": s.host, "rank": s.rank, "task": curves.task_of(str(s.source)),
            "source": cut(str(s.source), 300),
            "name": cut(str(s.name), 200),
            "points": [[p.step, p.epoch, p.value, p.time] for p in points]}


def plan_table(doc: PlanDoc) -> PlanTable | None:
    """The network plan as rows, identical hosts folded into one as `orch up`'s plan
    lines fold them (same interface, reason, findings and variables set). The file holds
    what the hosts said and network.load passes it on unchecked: each value is read as
    an object here, checked, and made a capped string."""
    raw: Mapping[str, object] = doc
    groups: dict[tuple[str, ...], HostGroup] = {}
    for h in listed(raw.get("hosts"))[:MAX_PLAN_HOSTS]:
        if isinstance(h, dict):
            group_host(groups, h)
    if not groups and not raw.get("master_addr"):
        return None
    return {"master_addr": cut(str(raw.get("master_addr", "")), 200),
            "how": cut(str(raw.get("how", "")), 500), "probe": cut(str(raw.get("probe", "")), 500),
            "rows": [g.row() for g in groups.values()]}


@dataclass
class HostGroup:
    """Hosts of the network plan alike in all but their name and address."""

    interface: str
    how: str
    found: list[str]
    set: list[str]
    hosts: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def row(self) -> PlanRow:
        return {"interface": self.interface or "left to torch", "how": self.how,
                "found": self.found, "set": self.set, "hosts": fold(self.hosts),
                "addresses": cut(fold([a for a in self.addresses if a]), 500)}


def group_host(groups: dict[tuple[str, ...], HostGroup], h: Mapping[str, object]) -> None:
    found = [cut(str(f), 300) for f in listed(h.get("found"))[:10]]
    env = h.get("set")
    env = env if isinstance(env, dict) else {}
    set_ = [cut(f"{k}={v}", 200) for k, v in sorted(env.items())[:10]]
    iface = cut(str(h.get("interface") or ""), 100)
    key = (iface, cut(str(h.get("how", "")), 300), *found, "\0", *set_)
    group = groups.setdefault(key, HostGroup(iface, key[1], found, set_))
    group.hosts.append(cut(str(h.get("host", "")), 200))
    group.addresses.append(cut(str(h.get("address") or ""), 100))


def listed(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def describe(e: ev.Event) -> tuple[str, str]:
    """An event in a line for the timeline, and its detail (stacks, last lines)."""
    fn = DESCRIBE.get(type(e).__name__)
    return fn(e) if fn is not None else (type(e).__name__, "")


def _started(e: Any) -> tuple[str, str]:
    attempt = f" (restart {e.attempt} of {e.attempts - 1})" if e.attempt else ""
    return f"started {e.world_size} ranks on {len(e.hosts)} hosts{attempt}", ""


def _exited(e: Any) -> tuple[str, str]:
    return f"rank {e.rank} on {e.host}: {e.describe()}", ""


def _hang(e: Any) -> tuple[str, str]:
    who = ", ".join(f"rank {c.rank} on {c.host}: {c.why}" for c in e.culprits)
    stacks = "\n\n".join(f"rank {r}:\n{s.text}" for r, s in sorted(e.report.stacks.items()))
    return f"hang: {e.reason}" + (f" ({who})" if who else ""), stacks


def _root(e: Any) -> tuple[str, str]:
    first = e.rank
    return f"root cause: {e.summary()}", "\n".join(first.last_lines) if first else ""


def _restarting(e: Any) -> tuple[str, str]:
    hosts = ", ".join(e.hosts)
    return (f"restart {e.attempt} of {e.restarts} in {e.delay:.0f} s after {e.cause}"
            f" on {hosts}"), e.no_checkpoint


# each takes the event class it is named by (Any: one table for all of them)
Describe = Callable[[Any], tuple[str, str]]

DESCRIBE: dict[str, Describe] = {
    "Started": _started,
    "Synced": lambda e: (f"{e.host}: synced {e.files} files ({e.bytes} bytes), {e.deleted} deleted", ""),
    "RankExited": _exited,
    "HostLost": lambda e: (f"host {e.host} lost: {e.why}", ""),
    "HangSuspected": lambda e: (f"no progress for {e.seconds:.0f} s: taking the stacks ({e.reason})", ""),
    "Hang": _hang,
    "Stopping": lambda e: (f"stopping every rank ({e.why})", ""),
    "Stopped": lambda e: (f"stopped on {e.hosts} hosts in {e.seconds:.1f} s", ""),
    "RootCause": _root,
    "Succeeded": lambda e: (f"succeeded: every one of {e.world_size} ranks exited 0", ""),
    "Spares": lambda e: (f"spares ready: {', '.join(e.ready) or 'none'}", e.error),
    "KeeperChosen": lambda e: (e.line, ""),
    "CheckpointKept": lambda e: (f"checkpoint kept: {len(e.files)} files", "\n".join(e.files[:50])),
    "CheckpointRestored": lambda e: (f"checkpoint restored on {', '.join(e.hosts)}"
                                     if not e.nothing else f"no checkpoint restored: {e.nothing}", ""),
    "Restarting": _restarting,
    "StartFailed": lambda e: (f"restart {e.attempt} could not start: {e.message}", ""),
    "NoRestart": lambda e: (f"no restart: {e.why or e.kind}", ""),
    "Pulled": lambda e: ("output pulled" if not e.error else f"pull failed: {e.error}", ""),
    "Finished": lambda e: (f"finished (exit code {e.result.code})", ""),
}
