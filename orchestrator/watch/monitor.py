"""Watching an attached job: print every rank, fail fast, stop on Ctrl-C, name the root cause.

`attach(session, state)` returns the exit code; the root cause (rootcause.py) is the
earliest real failure by the hosts' measured clocks, never a rank orch's stop ended, or
a host that went silent before any rank failed. With `job.hang_timeout`, a hang
(hang.py) is a failure too: every rank's stack is taken, the culprit named, the job
stopped (`on_hang`: where a restart would go instead)."""
from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK
from orchestrator.remote.fanout import GroupResult
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.session.stopper import StopReport
from orchestrator.ui.console import console
from orchestrator.ui.liveline import LiveLine, started_text
from orchestrator.ui.termsafe import markup_safe as escape
from orchestrator.ui.wording import hint_cmd, plural
from orchestrator.watch.clock import Clocks, HostClock
from orchestrator.watch.follow import HostStream, LineSink, PrefixPrinter, follow
from orchestrator.watch.hang import (
    Hang,
    HangReport,
    HangWatch,
    culprits,
    places,
    rank_stacks,
    reason,
    stack_lines,
)
from orchestrator.watch.rootcause import Exit, Failure, Verdict, verdict
from orchestrator.wire import timeouts


@dataclass(frozen=True)
class RankFailure:
    """A failed rank named in the report, with what it left behind."""

    host: str
    rank: int
    local_rank: int
    code: int
    error_file: str
    last_lines: tuple[str, ...]
    nccl_dumps: tuple[str, ...] = ()   # paths on its host


@dataclass
class Monitor(LineSink):
    """The follow() sink of `orch up`: records exits, wakes the main loop on failure."""

    cluster: Cluster
    state: JobState
    printer: PrefixPrinter
    exits: dict[int, Exit] = field(default_factory=dict)
    host_exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    wake: threading.Event = field(default_factory=threading.Event)
    stop_started: float | None = None   # exits after this are our own stop's doing
    live: LiveLine = field(default_factory=lambda: LiveLine(enabled=False))
    started: set[int] = field(default_factory=set)   # a pid reported, output or an exit
    printed: set[int] = field(default_factory=set)   # output or an exit
    clocks: Clocks | None = None
    hang: HangWatch | None = None     # job.hang_timeout set: each rank's last progress
    user_stop: bool = False             # the failure was an `orch stop` from elsewhere
    cause: Verdict | None = None        # the root cause, once the job failed
    hang_report: HangReport | None = None   # the hang found, with its culprits

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.printer.lines(host, rank, texts)
        self.seen(rank, printed=True)
        if self.hang is not None:
            self.hang.progress(rank)

    def rank_progress(self, host: int, ranks: list[int]) -> None:
        """The host saw these ranks touch their heartbeat files."""
        if self.hang is not None:
            for rank in ranks:
                self.hang.progress(rank, heartbeat=True)

    def rank_start(self, host: int, rank: int, pid: int) -> None:
        self.seen(rank, printed=False)

    def seen(self, rank: int, printed: bool) -> None:
        """Until every rank has printed, the live line says which hosts are still quiet."""
        if rank in self.printed or (not printed and rank in self.started):
            return
        self.started.add(rank)
        if printed:
            self.printed.add(rank)
        if not self.live.enabled:
            return
        if len(self.printed) == self.cluster.world_size:
            self.live.close()
        else:
            self.live.update(self.started_line())

    def started_line(self) -> str:
        hosts = [(h.label, sum(r in self.started for r in h.ranks), len(h.ranks))
                 for h in self.cluster.hosts]
        return started_text(hosts, len(self.printed))

    def rank_exit(self, host: int, rank: int, code: int, when: float,
                  after_stop: bool = False) -> None:
        self.seen(rank, printed=True)
        if self.hang is not None:
            self.hang.ended(rank)
        self.exits[rank] = Exit(host, rank, code, when, after_stop)
        if code != 0:
            self.wake.set()

    def host_done(self, host: int, info: dict[str, Any]) -> None:
        self.host_exits[host] = info
        self.wake.set()

    def host_lost(self, host: int, why: str) -> None:
        self.lost[host] = why
        self.wake.set()

    def failed(self) -> bool:
        return bool(self.lost) or any(e.code != 0 for e in self.exits.values()) or any(
            i.get("code") != 0 for i in self.host_exits.values())

    def host_clocks(self) -> dict[int, HostClock]:
        """Each host's measured clock; the preflight offset where none was measured."""
        out = {}
        for h in self.state.hosts:
            c = self.clocks.get(h.index) if self.clocks else HostClock()
            if not c.samples:
                c.fallback = h.clock_offset
            out[h.index] = c
        return out


def attach(session: Session, state: JobState, seen: list[Monitor] | None = None) -> int:
    """Follow the job to its end over the session's agents. `seen` gets the Monitor:
    what failed, where, and whether it was an `orch stop` (a restart's decision)."""
    cluster = session.cluster
    printer = PrefixPrinter({h.index: h.label for h in cluster.hosts})
    live = LiveLine(sys.stderr)   # the console's file: stderr
    mon = Monitor(cluster, state, printer, live=live)
    if seen is not None:
        seen.append(mon)
    if cluster.job.hang_timeout:
        mon.hang = HangWatch(cluster.job.hang_timeout, range(cluster.world_size))
    printer.above = live.above
    live.update(mon.started_line())
    links = session.links
    streams = {h.index: HostStream(links[h.index], h.job_dir, h.ranks) for h in state.hosts}
    mon.clocks = Clocks(links).start()
    keep = cluster.host_of(0).index   # `up` pulls rank 0's output/ from it afterwards
    hang = None
    try:
        finished = follow(streams, mon, heartbeats=mon.hang is not None)
        while not finished() and not mon.failed():
            mon.wake.wait(0.2)
            mon.wake.clear()
            for i, info in list(mon.host_exits.items()):
                if info.get("code") == 0 and i != keep and not mon.failed():
                    session.release(i)
            hang = mon.hang.check() if mon.hang is not None else None
            if hang is not None:
                break
    except KeyboardInterrupt:
        live.close()
        interrupt_stop(session, mon)
        return EXIT_INTERRUPTED
    finally:
        live.close()
        mon.clocks.close()
    if hang is not None and not mon.failed():
        mon.hang_report = investigate(session, hang)
        return on_hang(session, mon, finished, mon.hang_report)
    if not mon.failed():
        console.print(f"job '{cluster.name}' finished: "
                      f"{'all ' if cluster.world_size > 1 else ''}"
                      f"{plural(cluster.world_size, 'rank')} "
                      f"exited 0")
        return EXIT_OK
    # before our own stop: a rank that ended after its host got a stop was stopped by
    # someone else (`orch stop`), and a restart must not undo that
    mon.user_stop = not mon.lost and any(e.after_stop for e in mon.exits.values() if e.code)
    mon.cause = fail_fast(session, mon, finished)
    return EXIT_JOB_FAILED


def stop_job(session: Session, mon: Monitor, finished: Callable[[], bool]
             ) -> GroupResult[StopReport]:
    """Stop every rank on every host at once; wait for the last lines and exits."""
    mon.stop_started = time.time()
    result = session.stop(timeouts.FAILFAST_GRACE, skip=set(mon.lost))
    deadline = time.monotonic() + timeouts.DRAIN
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.05)  # let the last lines and exit codes arrive
    for i, exc in result.failed.items():   # lost while we stopped (a frozen host)
        mon.lost.setdefault(i, f"no answer to the stop: {exc}")
    return result


def fail_fast(session: Session, mon: Monitor, finished: Callable[[], bool]) -> Verdict:
    """Stop every other rank on every host at once, then report the earliest failure."""
    cluster = session.cluster
    started = time.monotonic()
    result = stop_job(session, mon, finished)
    lost_at = {i: session.links[i].last_heard for i in mon.lost if i in session.links}
    if mon.clocks is not None:   # fresh samples: the failure may come before the first ones
        for _ in range(2):
            mon.clocks.measure(timeouts.CLOCK_REPLY / 2, skip=set(mon.lost))
    found = verdict(list(mon.exits.values()), mon.host_clocks(), mon.stop_started, lost_at)
    console.print(render_verdict(session, mon, found))
    console.print(stop_summary(cluster, mon, result, time.monotonic() - started))
    return found


def investigate(session: Session, hang: Hang) -> HangReport:
    """Every rank's stack (also appended to its log by its host), and the culprits."""
    result = session.stacks(reason(hang))
    stacks = rank_stacks(result.ok)
    dumps = tuple(f"{session.cluster.hosts[i].label}: {session.run_dir(i)}/{name}"
                  for i, reply in sorted(result.ok.items()) for name in reply["nccl_dumps"])
    unreachable = tuple(f"{session.cluster.hosts[i].label}: {exc}"
                        for i, exc in sorted(result.failed.items()))
    return HangReport(hang, stacks, culprits(hang, stacks), dumps, unreachable)


def on_hang(session: Session, mon: Monitor, finished: Callable[[], bool],
            report: HangReport) -> int:
    """A hang fails the job: the report, then every rank stopped (a restart would start
    the job again here instead)."""
    console.print(render_hang(session.cluster, report))
    started = time.monotonic()
    result = stop_job(session, mon, finished)
    console.print(stop_summary(session.cluster, mon, result, time.monotonic() - started))
    return EXIT_JOB_FAILED


def render_hang(cluster: Cluster, report: HangReport) -> str:
    lines = [f"[bold red]job '{cluster.name}' failed[/]: {escape(reason(report.hang))}"]
    shown = 0
    for rank, why in sorted(report.found.why.items()):
        host = cluster.host_of(rank)
        lines.append(f"root cause rank {rank} on host {escape(host.label)} (local rank "
                     f"{rank - host.first_rank}): {escape(why)}")
        stack = report.stacks.get(rank)
        if stack is not None and stack.frames and shown < 4:
            shown += 1
            lines.append(f"stack of rank {rank} (main thread, most recent call first):")
            lines += [escape(text) for text in stack_lines(stack)]
    if not report.found.why:
        lines.append("no rank stands out: each is where the others are (a deadlock in the "
                     "job itself, or every rank waiting on something outside it)")
    if report.stacks:
        lines.append("where every rank was:")
        lines += [f"  {escape(text)}" for text in places(report.stacks)]
    for text in report.nccl_dumps:
        lines.append(f"NCCL flight recorder dump: {escape(text)}")
    for text in report.unreachable:
        lines.append(f"no stacks from {escape(text)}")
    first = min(report.found.why or report.hang.idle or (0,))
    lines.append(f"every rank's stack (all its threads) is at the end of its log: "
                 f"`{escape(hint_cmd(cluster, f'logs --rank {first}'))}`")
    return "\n".join(lines)


def stop_summary(cluster: Cluster, mon: Monitor, result: GroupResult[StopReport],
                 seconds: float) -> str:
    """What was stopped and what was not: a lost host's ranks may run on."""
    not_stopped = {i: why for i, why in mon.lost.items() if i not in result.ok}
    if not not_stopped:
        return f"stopped the job on every host in {seconds:.1f} s"
    done = [cluster.hosts[i].label for i in sorted(result.ok)]
    lines = [f"stopped the job on {len(done)} of {plural(len(cluster.hosts), 'host')} in "
             f"{seconds:.1f} s"
             + (f" ({escape(', '.join(done))})" if done else "")]
    for i, why in sorted(not_stopped.items()):
        lines.append(f"[red]NOT stopped on {escape(cluster.hosts[i].label)}[/] "
                     f"(lost: {escape(why)}): its ranks may still be running there")
    lines.append(f"`{escape(hint_cmd(cluster, 'stop'))}` ends them once the host is "
                 "reachable again")
    return "\n".join(lines)


def interrupt_stop(session: Session, mon: Monitor) -> None:
    """First Ctrl-C: graceful stop everywhere. Another Ctrl-C: SIGKILL at once.
    Either way the stop runs to the end and is verified on every host."""
    cluster = session.cluster
    console.print(f"\n[yellow]interrupted: stopping job '{cluster.name}' on every host "
                  f"(Ctrl-C again to kill at once)[/]")
    skip = set(mon.lost)
    results: list[Any] = []
    stops = [threading.Thread(target=lambda: results.append(
        session.stop(timeouts.INTERRUPT_GRACE, skip)), daemon=True)]

    def force(signum: int, frame: FrameType | None) -> None:
        console.print("[yellow]killing every process of the job now[/]")
        th = threading.Thread(target=lambda: results.append(session.stop(0, skip)), daemon=True)
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
    print_stop_results(cluster, results)


def print_stop_results(cluster: Cluster, results: list[Any]) -> None:
    if not results:
        return
    last = results[-1]
    for i, reply in sorted(last.ok.items()):
        console.print(f"  {escape(cluster.hosts[i].label)}: {reply.describe()}")
    for i, exc in sorted(last.failed.items()):
        console.print(f"  [red]{escape(cluster.hosts[i].label)}:[/] {escape(str(exc))}")


def signal_name(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def describe(cluster: Cluster, f: Failure) -> str:
    return f"rank {f.rank} on {cluster.hosts[f.host].label} ({signal_name(f.code)})"


def rank_failure(session: Session, mon: Monitor, f: Failure) -> RankFailure:
    host = session.cluster.hosts[f.host]
    error_file, dumps = session.failure_files(f.rank)
    return RankFailure(host.label, f.rank, f.rank - host.first_rank, f.code, error_file,
                       tuple(mon.printer.tail(f.rank)[-10:]), dumps)


def render_verdict(session: Session, mon: Monitor, v: Verdict) -> str:
    cluster = session.cluster
    if v.silent:
        return render_silent(cluster, mon, v)
    if not v.failures:
        return host_level_cause(cluster, mon)
    lines = [render_cause(cluster, mon, rank_failure(session, mon, v.failures[0]))]
    if len(v.failures) > 1:
        spread = max(f.at for f in v.failures) - min(f.at for f in v.failures)
        unc = max(f.uncertainty for f in v.failures)
        lines.append(f"{escape(' and '.join(describe(cluster, f) for f in v.failures))} failed "
                     f"within {spread * 1000:.0f} ms of each other (clock uncertainty "
                     f"{unc * 1000:.0f} ms): either may be the cause")
    if v.later:   # failed after the cause by the clocks: listed, earliest first
        more = f" and {len(v.later) - 8} more" if len(v.later) > 8 else ""
        lines.append("also failed after it: "
                     + escape(", ".join(describe(cluster, f) for f in v.later[:8])) + more)
    return "\n".join(lines)


def render_silent(cluster: Cluster, mon: Monitor, v: Verdict) -> str:
    names = ", ".join(cluster.hosts[i].label for i in v.silent)
    why = "; ".join(mon.lost[i] for i in v.silent)
    lines = [f"[bold red]job '{cluster.name}' failed[/]: root cause host {escape(names)}: it "
             f"went silent before any rank failed ({escape(why)})"]
    for f in v.later:
        lines.append(f"  then {escape(describe(cluster, f))}: a consequence")
    return "\n".join(lines)


def render_cause(cluster: Cluster, mon: Monitor, cause: RankFailure) -> str:
    rank = cause.rank
    lines = [f"[bold red]job '{cluster.name}' failed[/]: root cause rank {rank} on host "
             f"{escape(cause.host)} (local rank {cause.local_rank}): {signal_name(cause.code)}"]
    if cause.last_lines:
        lines.append(f"last lines of rank {rank}:")
        lines += [f"  {escape(text)}" for text in cause.last_lines]
    if cause.error_file:
        lines.append("torchrun error file:\n  " + "\n  ".join(
            escape(text) for text in cause.error_file.splitlines()))
    for path in cause.nccl_dumps:
        lines.append(f"NCCL flight recorder dump: {escape(cause.host)}: {escape(path)}")
    lines.append(f"full log: `{escape(hint_cmd(cluster, f'logs --rank {rank}'))}`")
    for i, why in sorted(mon.lost.items()):
        lines.append(f"also: host {escape(cluster.hosts[i].label)} was lost ({escape(why)})")
    return "\n".join(lines)


def host_level_cause(cluster: Cluster, mon: Monitor) -> str:
    for i, info in sorted(mon.host_exits.items()):
        if info.get("code") != 0:
            host = cluster.hosts[i]
            log = f"run/{host.part}/torchrun.log"
            read = hint_cmd(cluster, f"exec --hosts {host.label} -- tail -n 50 {log}")
            return (f"[bold red]job '{cluster.name}' failed[/]: torchrun on host "
                    f"{escape(host.label)} ended with {info.get('code')} before its ranks "
                    f"reported; see <job dir>/{escape(log)} there\n"
                    f"  read it with `{escape(read)}`")
    return f"job '{cluster.name}' failed"
