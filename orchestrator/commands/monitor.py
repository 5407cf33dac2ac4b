"""Watching an attached job: print every rank, fail fast, stop on Ctrl-C, name the root cause."""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

from rich.markup import escape

from orchestrator.commands.common import console
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK
from orchestrator.follow import HostStream, PrefixPrinter, follow
from orchestrator.inventory import Cluster
from orchestrator.remote import call
from orchestrator.state import JobState
from orchestrator.stopper import describe, stop_all
from orchestrator.transport import Transport

FAILFAST_GRACE_S = 3.0
INTERRUPT_GRACE_S = 10.0
DRAIN_S = 5.0


@dataclass
class Monitor:
    """The follow() sink of `orch up`: records exits, wakes the main loop on failure."""

    cluster: Cluster
    state: JobState
    printer: PrefixPrinter
    exits: dict[int, tuple[int, float]] = field(default_factory=dict)
    host_exits: dict[int, dict] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    wake: threading.Event = field(default_factory=threading.Event)
    stop_started: float | None = None   # exits after this are our own stop's doing

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.printer.lines(host, rank, texts)

    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None:
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


def attach(cluster: Cluster, transports: dict[int, Transport], state: JobState,
           open_streams: dict[int, tuple] | None = None) -> int:
    """Follow the job to its end. `open_streams`: per host, an agent already streaming
    events (launch ... follow) and the bytes it sent so far."""
    printer = PrefixPrinter({h.index: h.label for h in cluster.hosts})
    mon = Monitor(cluster, state, printer)
    open_streams = open_streams or {}
    streams = {h.index: HostStream(transports[h.index], h.job_dir, h.ranks,
                                   chan=open_streams.get(h.index, (None, b""))[0],
                                   pending=open_streams.get(h.index, (None, b""))[1])
               for h in state.hosts}
    finished = follow(streams, mon)
    try:
        while not finished() and not mon.failed():
            mon.wake.wait(0.2)
            mon.wake.clear()
    except KeyboardInterrupt:
        interrupt_stop(cluster, transports, state, mon)
        return EXIT_INTERRUPTED
    if not mon.failed():
        console.print(f"job '{cluster.name}' finished: all {cluster.world_size} ranks exited 0")
        return EXIT_OK
    fail_fast(cluster, transports, state, mon, finished)
    return EXIT_JOB_FAILED


def reachable(transports: dict[int, Transport], mon: Monitor) -> dict[int, Transport]:
    return {i: t for i, t in transports.items() if i not in mon.lost}


def fail_fast(cluster: Cluster, transports: dict[int, Transport], state: JobState,
              mon: Monitor, finished) -> None:
    """Stop every other rank on every host at once, then report the earliest failure."""
    started = time.monotonic()
    mon.stop_started = time.time()
    dirs = {h.index: h.job_dir for h in state.hosts}
    result = stop_all(cluster, reachable(transports, mon), dirs, FAILFAST_GRACE_S)
    deadline = time.monotonic() + DRAIN_S
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.05)  # let the last lines and exit codes arrive
    for i, exc in result.failed.items():
        console.print(f"[red]could not stop {cluster.hosts[i].label}:[/] {escape(str(exc))}")
    console.print(root_cause(cluster, transports, state, mon))
    console.print(f"stopped the job on every host in {time.monotonic() - started:.1f} s")


def interrupt_stop(cluster: Cluster, transports: dict[int, Transport], state: JobState,
                   mon: Monitor) -> None:
    """First Ctrl-C: graceful stop everywhere. Another Ctrl-C: SIGKILL at once.
    Either way the stop runs to the end and is verified on every host."""
    dirs = {h.index: h.job_dir for h in state.hosts}
    console.print(f"\n[yellow]interrupted: stopping job '{cluster.name}' on every host "
                  f"(Ctrl-C again to kill at once)[/]")
    targets = reachable(transports, mon)
    stops = [threading.Thread(target=lambda: results.append(
        stop_all(cluster, targets, dirs, INTERRUPT_GRACE_S)), daemon=True)]
    results: list = []

    def force(signum, frame) -> None:
        console.print("[yellow]killing every process of the job now[/]")
        th = threading.Thread(target=lambda: results.append(stop_all(cluster, targets, dirs, 0)),
                              daemon=True)
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
        console.print(f"  {cluster.hosts[i].label}: {describe(reply)}")
    for i, exc in sorted(last.failed.items()):
        console.print(f"  [red]{cluster.hosts[i].label}:[/] {escape(str(exc))}")


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


def root_cause(cluster: Cluster, transports: dict[int, Transport], state: JobState,
               mon: Monitor) -> str:
    first = first_failure(mon)
    if first is None:
        return host_level_cause(cluster, mon)
    rank, code = first
    host = cluster.host_of(rank)
    local = rank - host.first_rank
    lines = [f"[bold red]job '{cluster.name}' failed[/]: root cause rank {rank} on host "
             f"{host.label} (local rank {local}): {signal_name(code)}"]
    tail = mon.printer.tail(rank)
    if tail:
        lines.append(f"last lines of rank {rank}:")
        lines += [f"  {escape(l)}" for l in tail[-10:]]
    err = error_file(transports.get(host.index), state.host(host.index).job_dir, rank)
    if err:
        lines.append(f"torchrun error file:\n  {escape(err)}")
    lines.append(f"full log: `orch logs --rank {rank}`")
    for i, why in sorted(mon.lost.items()):
        lines.append(f"also: host {cluster.hosts[i].label} was lost ({escape(why)})")
    return "\n".join(lines)


def host_level_cause(cluster: Cluster, mon: Monitor) -> str:
    for i, why in sorted(mon.lost.items()):
        return (f"[bold red]job '{cluster.name}' failed[/]: host {cluster.hosts[i].label} "
                f"was lost ({why}); the other hosts were stopped")
    for i, info in sorted(mon.host_exits.items()):
        if info.get("code") != 0:
            return (f"[bold red]job '{cluster.name}' failed[/]: torchrun on host "
                    f"{cluster.hosts[i].label} ended with {info.get('code')} before its ranks "
                    f"reported; see <job dir>/run/torchrun.log there")
    return f"job '{cluster.name}' failed"


def error_file(t: Transport | None, job_dir: str, rank: int) -> str:
    if t is None:
        return ""
    try:
        reply = call(t, "status", job_dir, str(rank), timeout=15)
    except Exception:  # the report is still useful without the error file
        return ""
    return reply["ranks"][0].get("error_file", "")[-2000:]
