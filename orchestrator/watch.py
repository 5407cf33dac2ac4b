"""Watching an attached job: print every rank, fail fast, stop on Ctrl-C, name the root cause.

`attach(session, state)` returns the exit code and the outcome: a RankFailure (the
earliest failing rank by the hosts' corrected clocks) or a host-level cause."""
from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from orchestrator import timeouts
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK
from orchestrator.follow import HostStream, LineSink, PrefixPrinter, follow
from orchestrator.inventory import Cluster
from orchestrator.liveline import LiveLine, started_text
from orchestrator.session import Session
from orchestrator.state import JobState
from orchestrator.termsafe import markup_safe as escape
from orchestrator.ui import console
from orchestrator.words import hint_cmd, plural


@dataclass(frozen=True)
class RankFailure:
    """The root cause of a failed job: the earliest non-zero rank exit."""

    host: str
    rank: int
    local_rank: int
    code: int
    error_file: str
    last_lines: tuple[str, ...]


@dataclass
class Monitor(LineSink):
    """The follow() sink of `orch up`: records exits, wakes the main loop on failure."""

    cluster: Cluster
    state: JobState
    printer: PrefixPrinter
    exits: dict[int, tuple[int, float]] = field(default_factory=dict)
    host_exits: dict[int, dict] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    wake: threading.Event = field(default_factory=threading.Event)
    stop_started: float | None = None   # exits after this are our own stop's doing
    live: LiveLine = field(default_factory=lambda: LiveLine(enabled=False))
    started: set[int] = field(default_factory=set)   # a pid reported, output or an exit
    printed: set[int] = field(default_factory=set)   # output or an exit

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.printer.lines(host, rank, texts)
        self.seen(rank, printed=True)

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

    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None:
        self.seen(rank, printed=True)
        # host clock -> ours, so that exits on different hosts can be ordered
        self.exits[rank] = (code, when - self.state.host(host).clock_offset)
        if code != 0:
            self.wake.set()

    def host_done(self, host: int, info: dict) -> None:
        self.host_exits[host] = info
        self.wake.set()

    def host_lost(self, host: int, why: str) -> None:
        self.lost[host] = why
        self.wake.set()

    def failed(self) -> bool:
        return bool(self.lost) or any(c != 0 for c, _ in self.exits.values()) or any(
            i.get("code") != 0 for i in self.host_exits.values())


def attach(session: Session, state: JobState) -> int:
    """Follow the job to its end over the session's agents."""
    cluster = session.cluster
    printer = PrefixPrinter({h.index: h.label for h in cluster.hosts})
    live = LiveLine(sys.stderr)   # the console's file: stderr
    mon = Monitor(cluster, state, printer, live=live)
    printer.above = live.above
    live.update(mon.started_line())
    links = session.links
    streams = {h.index: HostStream(links[h.index], h.job_dir, h.ranks) for h in state.hosts}
    try:
        finished = follow(streams, mon)
        while not finished() and not mon.failed():
            mon.wake.wait(0.2)
            mon.wake.clear()
    except KeyboardInterrupt:
        live.close()
        interrupt_stop(session, mon)
        return EXIT_INTERRUPTED
    finally:
        live.close()
    if not mon.failed():
        console.print(f"job '{cluster.name}' finished: "
                      f"{'all ' if cluster.world_size > 1 else ''}"
                      f"{plural(cluster.world_size, 'rank')} "
                      f"exited 0")
        return EXIT_OK
    fail_fast(session, mon, finished)
    return EXIT_JOB_FAILED


def fail_fast(session: Session, mon: Monitor, finished) -> None:
    """Stop every other rank on every host at once, then report the earliest failure."""
    cluster = session.cluster
    started = time.monotonic()
    mon.stop_started = time.time()
    result = session.stop(timeouts.FAILFAST_GRACE, skip=set(mon.lost))
    deadline = time.monotonic() + timeouts.DRAIN
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.05)  # let the last lines and exit codes arrive
    for i, exc in result.failed.items():
        console.print(f"[red]could not stop {escape(cluster.hosts[i].label)}:[/] "
                      f"{escape(str(exc))}")
    console.print(render_cause(cluster, mon, root_cause(session, mon)))
    console.print(stop_summary(cluster, mon, result, time.monotonic() - started))


def stop_summary(cluster: Cluster, mon: Monitor, result, seconds: float) -> str:
    """What fail-fast stopped and what it could not: a lost host may still run its ranks."""
    missed = {i: f"lost: {why}" for i, why in mon.lost.items()}
    missed.update({i: str(exc) for i, exc in result.failed.items()})
    if not missed:
        return f"stopped the job on every host in {seconds:.1f} s"
    names = ", ".join(f"{escape(cluster.hosts[i].label)} ({escape(why)})"
                      for i, why in sorted(missed.items()))
    return (f"stopped the job on {len(result.ok)} of {plural(len(cluster.hosts), 'host')} in "
            f"{seconds:.1f} s; [yellow]not stopped[/]: {names}: its processes may still run; "
            f"`{escape(hint_cmd(cluster, 'stop'))}` ends them once the host answers again")


def interrupt_stop(session: Session, mon: Monitor) -> None:
    """First Ctrl-C: graceful stop everywhere. Another Ctrl-C: SIGKILL at once.
    Either way the stop runs to the end and is verified on every host."""
    cluster = session.cluster
    console.print(f"\n[yellow]interrupted: stopping job '{cluster.name}' on every host "
                  f"(Ctrl-C again to kill at once)[/]")
    skip = set(mon.lost)
    results: list = []
    stops = [threading.Thread(target=lambda: results.append(
        session.stop(timeouts.INTERRUPT_GRACE, skip)), daemon=True)]

    def force(signum, frame) -> None:
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


def print_stop_results(cluster: Cluster, results: list) -> None:
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


def first_failure(mon: Monitor) -> tuple[int, int] | None:
    """The earliest non-zero exit (host clocks corrected); at equal times a real exit
    code wins over a rank killed by a signal as a consequence."""
    cutoff = mon.stop_started if mon.stop_started is not None else float("inf")
    failures = [(t, code < 0, rank, code) for rank, (code, t) in mon.exits.items()
                if code != 0 and t < cutoff]
    if not failures:
        return None
    _, _, rank, code = min(failures)
    return rank, code


def root_cause(session: Session, mon: Monitor) -> RankFailure | None:
    first = first_failure(mon)
    if first is None:
        return None
    rank, code = first
    host = session.cluster.host_of(rank)
    return RankFailure(host.label, rank, rank - host.first_rank, code,
                       session.error_file(rank), tuple(mon.printer.tail(rank)[-10:]))


def render_cause(cluster: Cluster, mon: Monitor, cause: RankFailure | None) -> str:
    if cause is None:
        return host_level_cause(cluster, mon)
    rank = cause.rank
    lines = [f"[bold red]job '{cluster.name}' failed[/]: root cause rank {rank} on host "
             f"{escape(cause.host)} (local rank {cause.local_rank}): {signal_name(cause.code)}"]
    if cause.last_lines:
        lines.append(f"last lines of rank {rank}:")
        lines += [f"  {escape(text)}" for text in cause.last_lines]
    if cause.error_file:
        lines.append("torchrun error file:\n  " + "\n  ".join(
            escape(text) for text in cause.error_file.splitlines()))
    lines.append(f"full log: `{escape(hint_cmd(cluster, f'logs --rank {rank}'))}`")
    for i, why in sorted(mon.lost.items()):
        lines.append(f"also: host {escape(cluster.hosts[i].label)} was lost ({escape(why)})")
    return "\n".join(lines)


def host_level_cause(cluster: Cluster, mon: Monitor) -> str:
    for i, why in sorted(mon.lost.items()):
        return (f"[bold red]job '{cluster.name}' failed[/]: host {escape(cluster.hosts[i].label)} "
                f"was lost ({escape(why)})")
    for i, info in sorted(mon.host_exits.items()):
        if info.get("code") != 0:
            return (f"[bold red]job '{cluster.name}' failed[/]: torchrun on host "
                    f"{escape(cluster.hosts[i].label)} ended with {info.get('code')} "
                    f"before its ranks "
                    f"reported; see <job dir>/run/torchrun.log there")
    return f"job '{cluster.name}' failed"
