"""What happens to a running job, as values: one stream of typed, immutable events.

The policy loop (watch/monitor.py: follow, fail fast, the hang watch; api/running.py:
restarts) emits them and prints nothing; `orch up`'s lines (commands/uprender.py),
`api.follow`'s iterator and a user's `on_event` are readers of the same stream. Every
`time` is on the controller's clock (`time.time()`): a host's exit times are corrected
by its measured clock offset (watch/clock.py). Hosts are named by label, ranks by their
global number. docs/reference/events.md lists every type with its fields."""
from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.session.stopper import StopReport
from orchestrator.watch.hang import Hang as Idle
from orchestrator.watch.hang import HangReport


@dataclass(frozen=True)
class Event:
    """The base of every event: `time` on the controller's clock."""

    time: float


Emit = Callable[[Event], None]


def emit_all(emit: Emit, events: Sequence[Event]) -> None:
    """Several events at once (a frame's lines): to a reader's `many` where it has one
    (orch up writes a frame's lines in one write), else one by one."""
    many = getattr(emit, "many", None)
    if many is not None:
        many(events)
        return
    for event in events:
        emit(event)


def signal_name(code: int) -> str:
    """A rank's end in words: `exit code 3`, `killed by SIGKILL`."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def state_text(state: str, code: int | None) -> str:
    """A rank's or task's state as status shows it: `exited 0`, `failed (exit code 3)`,
    `failed (killed by SIGTERM)`, else the host's word (running, queued, stopped, ...)."""
    if state != "exited":
        return state
    return "exited 0" if code == 0 else f"failed ({signal_name(code if code is not None else -1)})"


def runtime_of(started: float | None, ended: float | None, offset: float) -> float | None:
    """Seconds a rank (or task) ran, on its host's clock: until it ended, else until now
    (`offset`: the host's clock minus ours)."""
    if not started:
        return None
    end = ended or (time.time() + offset)
    return round(end - started, 1)


@dataclass(frozen=True)
class StartedHost:
    label: str
    job_dir: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Started(Event):
    """Every host runs its part of the job (attempt 0, or a restart's number)."""

    job: str
    run_id: str
    hosts: tuple[StartedHost, ...]
    world_size: int
    master_addr: str
    master_port: int
    attempt: int = 0
    attempts: int = 1      # restarts allowed + 1


@dataclass(frozen=True)
class Synced(Event):
    """One job folder received what it lacked (before the launch)."""

    host: str
    files: int
    bytes: int
    deleted: int


@dataclass(frozen=True)
class RankStarted(Event):
    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class RankLine(Event):
    """One line a rank printed (`data`: its bytes, without the newline; `text` decodes).
    `stream`: "out" (a rank's stdout and stderr share its log file)."""

    rank: int
    host: str
    stream: str
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass(frozen=True)
class RankExited(Event):
    """`code`: the exit code, or None when a signal ended it (`signal`: its number).
    `runtime`: seconds since the job started; `after_stop`: it ended after its host
    was told to stop (an `orch stop`, or orch's own fail-fast)."""

    rank: int
    host: str
    code: int | None
    signal: int | None
    runtime: float
    after_stop: bool = False

    @property
    def failed(self) -> bool:
        return self.code != 0

    def describe(self) -> str:
        return signal_name(self.code if self.code is not None else -(self.signal or 0))


@dataclass(frozen=True)
class HostLost(Event):
    host: str
    why: str


@dataclass(frozen=True)
class HangSuspected(Event):
    """These ranks made no progress for `seconds`: their stacks are being taken."""

    ranks: tuple[int, ...]
    seconds: float
    reason: str
    found: Idle


@dataclass(frozen=True)
class NetWait:
    """A connection of the job that failed: from `host` (its rank `rank`, None for its
    torchrun) to `peer` (the host that holds `addr`; None when several do). `cause`:
    "no answer" (waiting, or timed out), "refused" or "unreachable"."""

    host: str
    rank: int | None
    peer: str | None
    addr: str
    port: int
    tries: int                           # SYNs sent again without an answer (or tries)
    cause: str = "no answer"


@dataclass(frozen=True)
class NetworkStall(Event):
    """Said once while it lasts (watch/netwatch.py): hosts that have not joined torchrun's
    rendezvous (`late`), connections between the hosts that get no answer (`waits`), in
    words (`text`); the job goes on. Also right after a RootCause whose rank failed to
    connect to another host (refused, unreachable): then `waits` holds that one."""

    late: tuple[str, ...]
    waits: tuple[NetWait, ...]
    text: str


@dataclass(frozen=True)
class Culprit:
    rank: int
    host: str
    local_rank: int
    why: str


@dataclass(frozen=True)
class Hang(Event):
    """The hang, with every rank's stack and the ranks not where the others are."""

    reason: str
    culprits: tuple[Culprit, ...]
    report: HangReport
    first_idle: int                     # the rank whose log the hint names


@dataclass(frozen=True)
class RankFailure:
    """A failed rank, on our clock (`at`, give or take `uncertainty` seconds), with what
    it left behind where known (the root cause's: its last lines and error file)."""

    rank: int
    host: str
    local_rank: int
    code: int                      # negative: the signal's number
    at: float = 0.0
    uncertainty: float = 0.0
    last_lines: tuple[str, ...] = ()
    error_file: str = ""
    nccl_dumps: tuple[str, ...] = ()   # paths on its host

    def describe(self) -> str:
        return f"rank {self.rank} on {self.host} ({signal_name(self.code)})"


@dataclass(frozen=True)
class RootCause(Event):
    """Why the job failed. `kind`: "rank" (`failures[0]`, with any that failed within
    the clocks' uncertainty of it), "silent" (hosts that went quiet before any rank
    failed), "host" (torchrun on `host` ended with `host_code` before its ranks
    reported), "hang" (`hang`), or "unknown". `later`: ranks that failed after it;
    `lost`: hosts lost (label -> why); `user_stop`: an `orch stop` from elsewhere."""

    kind: str
    failures: tuple[RankFailure, ...] = ()
    later: tuple[RankFailure, ...] = ()
    silent: tuple[str, ...] = ()
    lost: tuple[tuple[str, str], ...] = ()
    host: str = ""
    host_code: int | None = None
    host_log: str = ""              # torchrun's log in that host's job folder
    hang: Hang | None = None
    user_stop: bool = False

    @property
    def rank(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    def summary(self) -> str:
        """The cause in a line (a restart's reason, JobError's message)."""
        if self.hang is not None:
            ranks = [c.rank for c in self.hang.culprits] or list(self.hang.report.hang.idle)
            return f"a hang ({self.hang.reason}; rank {', '.join(map(str, ranks[:8]))})"
        if self.failures:
            f = self.failures[0]
            return f"rank {f.rank} on {f.host} failed ({signal_name(f.code)})"
        if self.user_stop:   # no rank failed on its own: each ended under the stop
            return "it was stopped by `orch stop`"
        if self.silent:
            return f"host {', '.join(sorted(self.silent))} went silent"
        if self.lost:
            return f"host {', '.join(sorted(label for label, _ in self.lost))} was lost"
        return "the job failed"


@dataclass(frozen=True)
class Stopping(Event):
    """orch stops the job on every host: "failure" (fail fast), "hang", "interrupt"
    (Ctrl-C), "kill" (a second Ctrl-C: SIGKILL at once)."""

    why: str


@dataclass(frozen=True)
class Stopped(Event):
    """The stop's outcome: each host's report, the hosts not reached (label -> why)."""

    why: str
    reports: tuple[tuple[str, StopReport], ...]
    not_stopped: tuple[tuple[str, str], ...]
    hosts: int
    seconds: float


@dataclass(frozen=True)
class Succeeded(Event):
    """Every rank exited 0."""

    world_size: int


@dataclass(frozen=True)
class Spares(Event):
    """The spares made ready beside the first attempt: `ready`, `refused` (label -> why),
    or `error` when none could be prepared."""

    ready: tuple[str, ...]
    refused: tuple[tuple[str, str], ...] = ()
    error: str = ""


@dataclass(frozen=True)
class KeeperChosen(Event):
    """`job.checkpoint_to: host`: where this attempt's checkpoints are kept (`host`
    empty: on the controller), said in `line`."""

    host: str
    line: str


@dataclass(frozen=True)
class CheckpointKept(Event):
    """The checkpoint files kept off rank 0's host during the attempt."""

    files: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointRestored(Event):
    """Kept checkpoints put back before a restart's launch (`source`: the keeper host,
    or empty for the controller); `nothing`: why there was nothing to put back."""

    hosts: tuple[str, ...]
    files: tuple[str, ...]
    source: str = ""
    nothing: str = ""


@dataclass(frozen=True)
class Restarting(Event):
    """The whole job starts again after `delay` seconds: restart `attempt` of
    `restarts`, after `cause`, on `hosts`; `no_checkpoint`: why it resumes from nothing."""

    attempt: int
    restarts: int
    cause: str
    hosts: tuple[str, ...]
    delay: float
    no_checkpoint: str = ""


@dataclass(frozen=True)
class StartFailed(Event):
    """A restart that could not start (it counts as a failed attempt)."""

    attempt: int
    message: str


@dataclass(frozen=True)
class NoRestart(Event):
    """The run ends with its failure: "user_stop" (an `orch stop` from elsewhere),
    "none_left" (`restarts` made), "cannot" (`why`)."""

    kind: str
    restarts: int = 0
    why: str = ""
