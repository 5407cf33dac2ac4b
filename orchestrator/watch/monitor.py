"""Watching an attached job: the policy of `orch up` and `api.run`, as events.

`watch(session, state, emit)` follows every host to the job's end and decides: the first
non-zero exit or a lost host stops every rank (fail fast) and names the root cause
(rootcause.py: the earliest real failure by the hosts' measured clocks, never a rank
orch's own stop ended, or a host that went silent before any rank failed); with
`job.hang_timeout`, a hang (hang.py) takes every rank's stack, names the culprit and
stops the job; a network hang (netwatch.py) is said while the job waits; Ctrl-C stops
the job everywhere and is raised again. What happens is
emitted as events (events.py) and returned as an `Outcome`; nothing here prints."""
from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_JOB_FAILED, EXIT_OK
from orchestrator.remote.early import Begun
from orchestrator.remote.fanout import GroupResult
from orchestrator.remote.link import HostDone
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.session.stopper import StopReport
from orchestrator.watch import curves
from orchestrator.watch import events as ev
from orchestrator.watch.clock import Clocks, HostClock
from orchestrator.watch.follow import TAIL_KEEP, HostStream, LineSink, follow
from orchestrator.watch.follow import fields as follow_fields
from orchestrator.watch.hang import HangReport, HangWatch, culprits, rank_stacks, reason
from orchestrator.watch.netwatch import NetWatch, refused
from orchestrator.watch.rootcause import Exit, Failure, Verdict, verdict
from orchestrator.wire import timeouts

signal_name = ev.signal_name   # where the other layers import it from


@dataclass
class Monitor(LineSink):
    """The follow() sink: emits each line and exit, records exits, wakes the main loop
    on a failure. Called from the links' reader threads."""

    cluster: Cluster
    state: JobState
    emit: ev.Emit = field(default=lambda e: None)
    exits: dict[int, Exit] = field(default_factory=dict)
    host_codes: dict[int, int | None] = field(default_factory=dict)   # torchrun's, per host
    stopped_hosts: set[int] = field(default_factory=set)   # torchrun ended by a stop there
    lost: dict[int, str] = field(default_factory=dict)
    wake: threading.Event = field(default_factory=threading.Event)
    stop_started: float | None = None   # exits after this are our own stop's doing
    started: set[int] = field(default_factory=set)   # a pid reported, output or an exit
    tails: dict[int, deque[bytes]] = field(default_factory=dict)
    clocks: Clocks | None = None
    hang: HangWatch | None = None     # job.hang_timeout set: each rank's last progress
    last_progress: float = 0.0   # time.monotonic() of any rank's last line or heartbeat

    def label(self, host: int) -> str:
        return self.cluster.hosts[host].label

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        now, label = time.time(), self.label(host)
        self.tails.setdefault(rank, deque(maxlen=TAIL_KEEP)).extend(texts[-TAIL_KEEP:])
        self.started.add(rank)
        self.last_progress = time.monotonic()
        ev.emit_all(self.emit, [ev.RankLine(now, rank, label, "out", text) for text in texts])
        if self.hang is not None:
            self.hang.progress(rank)

    def tail(self, rank: int) -> tuple[str, ...]:
        return tuple(t.decode("utf-8", "replace") for t in self.tails.get(rank, ()))

    def rank_progress(self, host: int, ranks: list[int]) -> None:
        """The host saw these ranks touch their heartbeat files."""
        self.last_progress = time.monotonic()
        if self.hang is not None:
            for rank in ranks:
                self.hang.progress(rank, heartbeat=True)

    def rank_start(self, host: int, rank: int, pid: int) -> None:
        self.started.add(rank)   # the hang watch waits for its first progress (hang.py)
        self.emit(ev.RankStarted(time.time(), rank, self.label(host), pid))

    def rank_exit(self, host: int, rank: int, code: int, when: float,
                  after_stop: bool = False) -> None:
        self.started.add(rank)
        if self.hang is not None:
            self.hang.ended(rank)
        self.exits[rank] = Exit(host, rank, code, when, after_stop)
        if code != 0:
            self.wake.set()
        at = self.host_clock(host).ours(when) if self.state.hosts else when
        self.emit(ev.RankExited(at, rank, self.label(host), code if code >= 0 else None,
                                -code if code < 0 else None, at - self.state.started,
                                after_stop))

    def host_done(self, host: int, info: HostDone) -> None:
        self.host_codes[host] = info.code
        if info.after_stop and info.code != 0:
            self.stopped_hosts.add(host)
        self.wake.set()

    def host_lost(self, host: int, why: str) -> None:
        self.lost[host] = why
        self.wake.set()
        self.emit(ev.HostLost(time.time(), self.label(host), why))

    def user_stopped(self) -> bool:
        """The job was stopped by someone else (`orch stop`), so a restart must not undo
        it: a rank, or a host's torchrun, ended with a failure after its host received a
        stop (on a host alone, torchrun's end, killed first, may come before any rank's)."""
        return not self.lost and (any(e.after_stop for e in self.exits_now() if e.code)
                                  or bool(self.stopped_hosts))

    def failed(self) -> bool:
        return bool(self.lost) or any(e.code != 0 for e in self.exits_now()) or any(
            code != 0 for code in self.host_codes.copy().values())

    def exits_now(self) -> list[Exit]:
        """The exits so far, copied at once: the links' reader threads add to them while
        the main loop reads (a generator over the dict itself failed with "dictionary
        changed size during iteration" at 300 hosts)."""
        return list(self.exits.copy().values())

    def host_clocks(self) -> dict[int, HostClock]:
        """Each host's measured clock; the preflight offset where none was measured."""
        return {h.index: self.host_clock(h.index) for h in self.state.hosts}

    def host_clock(self, index: int) -> HostClock:
        c = self.clocks.get(index) if self.clocks else HostClock()
        if not c.samples:
            c.fallback = self.state.hosts[index].clock_offset
        return c


@dataclass(frozen=True)
class Outcome:
    """How one followed run ended: `code` (EXIT_OK or EXIT_JOB_FAILED), the root cause
    (None on success), the hosts lost and gone silent (indexes), every rank's exit."""

    code: int
    cause: ev.RootCause | None
    lost: frozenset[int]
    silent: frozenset[int]
    exits: tuple[ev.RankExited, ...]


class Recorder:
    """Keeps the exits emitted (for the Outcome) and passes every event on."""

    def __init__(self, emit: ev.Emit) -> None:
        self.emit = emit
        self.exits: dict[int, ev.RankExited] = {}   # one writer per rank: its host's reader

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.RankExited):
            self.exits[event.rank] = event
        self.emit(event)

    def many(self, events: Sequence[ev.Event]) -> None:
        ev.emit_all(self.emit, events)   # lines only: nothing to record


def begun_follows(cluster: Cluster) -> Begun:
    """The follows `watch(decide=True)` asks for, to begin at each host's launch."""
    return Begun(follow_fields(len(cluster.hosts), heartbeats=bool(cluster.job.hang_timeout),
                               curves=curves.GLOBS), len(cluster.hosts))


def watch(session: Session, state: JobState, emit: ev.Emit,
          on_monitor: Callable[[Monitor], None] | None = None, decide: bool = True,
          tail: int = -1) -> Outcome:
    """Follow the job to its end over the session's agents, deciding as it goes.
    KeyboardInterrupt: the job is stopped on every host, then it is raised again.
    `decide` False: only watch (`api.follow`): nothing is stopped, no hang is looked for;
    a failure's root cause is named when the job has ended. `tail`: each rank's last
    lines only (-1: from its log's start)."""
    cluster = session.cluster
    record = Recorder(emit)
    mon = Monitor(cluster, state, record)
    if on_monitor is not None:
        on_monitor(mon)
    if cluster.job.hang_timeout and decide:
        # on timeouts.CLOCK, the watchdogs' clock: a test moves it instead of waiting
        mon.hang = HangWatch(cluster.job.hang_timeout, range(cluster.world_size),
                             timeouts.CLOCK.now)
    streams = {h.index: HostStream(session.links[h.index], h.job_dir, h.ranks)
               for h in state.hosts if h.index in session.links}
    for i, exc in sorted(session.failed.items()):   # not reached (a reattach)
        mon.host_lost(i, str(exc))
    mon.clocks = Clocks(session.links).start()
    # a network hang said while it lasts (netwatch.py); only watching: not looked for
    net = NetWatch(session, mon.started, mon.failed, record,
                   (state.master_addr, state.master_port),
                   lambda since: mon.last_progress > since) if decide else None
    try:
        # follows begun at the launch asked the same (begun_follows)
        finished = follow(streams, mon, tail, heartbeats=mon.hang is not None,
                          curves=curves.GLOBS if decide else ())
        if net is not None:
            net.start()
        if not decide:
            return watched(session, mon, finished, record)
        hang = follow_to_end(session, mon, finished)
    except KeyboardInterrupt:
        if decide:
            interrupt_stop(session, set(mon.lost), record)
        raise
    finally:
        mon.clocks.close()
        if net is not None:
            net.close()
    exits = tuple(sorted(record.exits.values(), key=lambda e: e.rank))
    if hang is not None and not mon.failed():
        cause = on_hang(session, mon, finished, investigate(session, hang))
        return Outcome(EXIT_JOB_FAILED, cause, frozenset(mon.lost), frozenset(), exits)
    if not mon.failed():
        record(ev.Succeeded(time.time(), cluster.world_size))
        return Outcome(EXIT_OK, None, frozenset(), frozenset(), exits)
    cause = fail_fast(session, mon, finished, (state.master_addr, state.master_port))
    exits = tuple(sorted(record.exits.values(), key=lambda e: e.rank))
    silent = frozenset(i for i, h in enumerate(cluster.hosts) if h.label in cause.silent)
    return Outcome(EXIT_JOB_FAILED, cause, frozenset(mon.lost), silent, exits)


def watched(session: Session, mon: Monitor, finished: Callable[[], bool],
            record: Recorder) -> Outcome:
    """Only watching: until every host is done or lost; then its outcome."""
    while not finished():
        mon.wake.wait(0.2)
        mon.wake.clear()
    exits = tuple(sorted(record.exits.values(), key=lambda e: e.rank))
    if not mon.failed():
        record(ev.Succeeded(time.time(), session.cluster.world_size))
        return Outcome(EXIT_OK, None, frozenset(), frozenset(), exits)
    lost_at = {i: session.links[i].last_heard for i in mon.lost if i in session.links}
    found = verdict(list(mon.exits.values()), mon.host_clocks(), None, lost_at,
                    timeouts.heartbeat(len(session.cluster.hosts)))
    cause = root_cause(session, mon, found, user_stop=False)
    record(cause)
    silent = frozenset(i for i, h in enumerate(session.cluster.hosts) if h.label in cause.silent)
    return Outcome(EXIT_JOB_FAILED, cause, frozenset(mon.lost), silent, exits)


def follow_to_end(session: Session, mon: Monitor, finished: Callable[[], bool]
                  ) -> ev.HangSuspected | None:
    """Until every host is done, a failure, or a hang: a host whose ranks all ended well
    is let go at once (rank 0's is kept: its output/ is pulled afterwards)."""
    keep = session.cluster.host_of(0).index
    released = {keep}
    while not finished() and not mon.failed():
        mon.wake.wait(0.2)
        mon.wake.clear()
        # failed() once a wake, not once a host (it reads every exit: at 1,000 hosts that
        # was a million reads a wake as the hosts ended)
        ended = [i for i, code in list(mon.host_codes.items()) if code == 0 and i not in released]
        if ended and not mon.failed():
            for i in ended:
                session.release(i)
            released.update(ended)
        hang = mon.hang.check() if mon.hang is not None else None
        if hang is not None:
            found = ev.HangSuspected(time.time(), hang.idle, hang.seconds, reason(hang), hang)
            mon.emit(found)
            return found
    return None


def stop_job(session: Session, mon: Monitor, finished: Callable[[], bool], why: str
             ) -> GroupResult[StopReport]:
    """Stop every rank on every host at once; wait for the last lines and exits."""
    mon.emit(ev.Stopping(time.time(), why))
    mon.stop_started = time.time()
    result = session.stop(timeouts.FAILFAST_GRACE, skip=set(mon.lost))
    deadline = time.monotonic() + timeouts.DRAIN
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.05)  # let the last lines and exit codes arrive
    for i, exc in result.failed.items():   # lost while we stopped (a frozen host)
        mon.lost.setdefault(i, f"no answer to the stop: {exc}")
    return result


def stopped(session: Session, mon: Monitor, result: GroupResult[StopReport], why: str,
            seconds: float) -> ev.Stopped:
    """What was stopped and what was not: a lost host's ranks may run on."""
    hosts = session.cluster.hosts
    return ev.Stopped(time.time(), why,
                      tuple((hosts[i].label, r) for i, r in sorted(result.ok.items())),
                      tuple((hosts[i].label, w) for i, w in sorted(mon.lost.items())
                            if i not in result.ok), len(hosts), seconds)


def fail_fast(session: Session, mon: Monitor, finished: Callable[[], bool],
              master: tuple[str, int]) -> ev.RootCause:
    """Stop every other rank on every host at once, then name the earliest failure (and
    the network, where it failed to connect to another host: netwatch.refused)."""
    # before our own stop: a rank that ended after its host got a stop was stopped by
    # someone else (`orch stop`), and a restart must not undo that
    user_stop = mon.user_stopped()
    started = time.monotonic()
    result = stop_job(session, mon, finished, "failure")
    lost_at = {i: session.links[i].last_heard for i in mon.lost if i in session.links}
    if mon.clocks is not None:   # fresh samples: the failure may come before the first ones
        for _ in range(2):
            mon.clocks.measure(timeouts.CLOCK_REPLY / 2, skip=not_compared(session, mon))
    found = verdict(list(mon.exits.values()), mon.host_clocks(), mon.stop_started, lost_at,
                    timeouts.heartbeat(len(session.cluster.hosts)))
    cause = root_cause(session, mon, found, user_stop)
    mon.emit(cause)
    network = refused(session, cause, master)
    if network is not None:
        mon.emit(network)
    mon.emit(stopped(session, mon, result, "failure", time.monotonic() - started))
    return cause


def not_compared(session: Session, mon: Monitor) -> set[int]:
    """The hosts whose clocks the verdict does not read: lost, or no failed rank of their
    own (rootcause.candidates compares only those exits). Two rounds to every host were
    seconds at 300 hosts, after the stop and before the stop was said."""
    failed = {e.host for e in mon.exits_now() if e.code != 0 and not e.after_stop}
    return set(mon.lost) | (set(session.links) - failed)


def failure(cluster: Cluster, f: Failure, **known: object) -> ev.RankFailure:
    host = cluster.hosts[f.host]
    return ev.RankFailure(f.rank, host.label, f.rank - host.first_rank, f.code, f.at,
                          f.uncertainty, **known)  # type: ignore[arg-type]


def root_cause(session: Session, mon: Monitor, v: Verdict, user_stop: bool) -> ev.RootCause:
    cluster = session.cluster
    lost = tuple((cluster.hosts[i].label, why) for i, why in sorted(mon.lost.items()))
    later = tuple(failure(cluster, f) for f in v.later)
    if v.silent:
        return ev.RootCause(time.time(), "silent", later=later, lost=lost, user_stop=user_stop,
                            silent=tuple(cluster.hosts[i].label for i in v.silent))
    if v.failures:
        first = v.failures[0]
        error_file, dumps = session.failure_files(first.rank)
        cause = failure(cluster, first, last_lines=mon.tail(first.rank)[-10:],
                        error_file=error_file, nccl_dumps=dumps)
        fails = (cause,) + tuple(failure(cluster, f) for f in v.failures[1:])
        return ev.RootCause(time.time(), "rank", fails, later, lost=lost, user_stop=user_stop)
    for i, code in sorted(mon.host_codes.items()):
        if code != 0:
            host = cluster.hosts[i]
            return ev.RootCause(time.time(), "host", later=later, lost=lost, host=host.label,
                                host_code=code, host_log=f"run/{host.part}/torchrun.log",
                                user_stop=user_stop)
    return ev.RootCause(time.time(), "unknown", later=later, lost=lost, user_stop=user_stop)


def investigate(session: Session, hang: ev.HangSuspected) -> ev.Hang:
    """Every rank's stack (also appended to its log by its host), and the culprits."""
    cluster = session.cluster
    result = session.stacks(hang.reason)
    stacks = rank_stacks(result.ok)
    dumps = tuple(f"{cluster.hosts[i].label}: {session.run_dir(i)}/{name}"
                  for i, reply in sorted(result.ok.items()) for name in reply.nccl_dumps)
    unreachable = tuple(f"{cluster.hosts[i].label}: {exc}"
                        for i, exc in sorted(result.failed.items()))
    found = culprits(hang.found, stacks)
    return hang_event(cluster, HangReport(hang.found, stacks, found, dumps, unreachable))


def hang_event(cluster: Cluster, report: HangReport) -> ev.Hang:
    """The report as an event: each culprit with its host and local rank."""
    named = tuple(ev.Culprit(rank, cluster.host_of(rank).label,
                             rank - cluster.host_of(rank).first_rank, why)
                  for rank, why in sorted(report.found.why.items()))
    first = min(report.found.why or report.hang.idle or (0,))
    return ev.Hang(time.time(), reason(report.hang), named, report, first)


def on_hang(session: Session, mon: Monitor, finished: Callable[[], bool],
            hang: ev.Hang) -> ev.RootCause:
    """A hang fails the job: the report, then every rank stopped (a restart starts the
    job again after this)."""
    cluster = session.cluster
    lost = tuple((cluster.hosts[i].label, why) for i, why in sorted(mon.lost.items()))
    cause = ev.RootCause(time.time(), "hang", lost=lost, hang=hang)
    mon.emit(hang)
    started = time.monotonic()
    result = stop_job(session, mon, finished, "hang")
    mon.emit(stopped(session, mon, result, "hang", time.monotonic() - started))
    mon.emit(cause)
    return cause


def interrupt_stop(session: Session, lost: set[int], emit: ev.Emit) -> None:
    """First Ctrl-C: graceful stop everywhere. Another Ctrl-C: SIGKILL at once.
    Either way the stop runs to the end and is verified on every host."""
    emit(ev.Stopping(time.time(), "interrupt"))
    results: list[GroupResult[StopReport]] = []
    started = time.monotonic()
    stops = [threading.Thread(target=lambda: results.append(
        session.stop(timeouts.INTERRUPT_GRACE, lost)), daemon=True)]

    def force(signum: int, frame: FrameType | None) -> None:
        emit(ev.Stopping(time.time(), "kill"))
        th = threading.Thread(target=lambda: results.append(session.stop(0, lost)), daemon=True)
        stops.append(th)
        th.start()
    previous = {sig: signal.signal(sig, force) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stops[0].start()
        while any(th.is_alive() for th in stops):
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if results:
        hosts = session.cluster.hosts
        last = results[-1]
        emit(ev.Stopped(time.time(), "interrupt",
                        tuple((hosts[i].label, r) for i, r in sorted(last.ok.items())),
                        tuple((hosts[i].label, str(e)) for i, e in sorted(last.failed.items())),
                        len(hosts), time.monotonic() - started))
