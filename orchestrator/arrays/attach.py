"""Following an attached job array: every task's output as `[t<i> host] line`, each end
recorded; a failing task does not stop the others unless --fail-fast; Ctrl-C stops all.
Meanwhile each task's metrics files come back every few seconds, as a single job's do
(watch/curvefetch.py), into the copies `orch results` and `orch pull` read."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.markup import escape

from orchestrator.arrays.plan import ArrayRecord
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK
from orchestrator.remote.link import HostDone
from orchestrator.session.session import Session
from orchestrator.ui.console import console
from orchestrator.ui.wording import hint_cmd
from orchestrator.watch import events as ev
from orchestrator.watch.curvefetch import CurveFetch
from orchestrator.watch.events import signal_name
from orchestrator.watch.follow import HostStream, LineSink, PrefixPrinter, follow
from orchestrator.watch.monitor import interrupt_stop
from orchestrator.wire import timeouts


@dataclass
class ArrayMonitor(LineSink):
    printer: PrefixPrinter
    labels: dict[int, str]
    exits: dict[int, int] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    wake: threading.Event = field(default_factory=threading.Event)

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.printer.lines(host, rank, texts)

    def rank_exit(self, host: int, rank: int, code: int, when: float,
                  after_stop: bool = False) -> None:
        self.exits[rank] = code
        if code != 0:
            console.print(f"[yellow]task {rank} on {escape(self.labels[host])} failed "
                          f"({signal_name(code)})[/]; the others go on")
            self.wake.set()

    def host_done(self, host: int, info: HostDone) -> None:
        self.wake.set()

    def host_lost(self, host: int, why: str) -> None:
        self.lost[host] = why
        console.print(f"[red]host {escape(self.labels[host])} lost:[/] {escape(why)}")
        self.wake.set()

    def failures(self) -> list[int]:
        # copied at once: the links' reader threads add to it while the main loop reads
        return sorted(t for t, c in self.exits.copy().items() if c != 0)


def said(job: str) -> ev.Emit:
    """The Ctrl-C stop's lines, as `orch up` prints them (commands/uprender.py)."""
    from orchestrator.ui.termsafe import markup_safe as safe

    def emit(e: ev.Event) -> None:
        if isinstance(e, ev.Stopping) and e.why == "interrupt":
            console.print(f"\n[yellow]interrupted: stopping job '{job}' on every host "
                          f"(Ctrl-C again to kill at once)[/]")
        elif isinstance(e, ev.Stopping) and e.why == "kill":
            console.print("[yellow]killing every process of the job now[/]")
        elif isinstance(e, ev.Stopped):
            for label, report in e.reports:
                console.print(f"  {safe(label)}: {report.describe()}")
            for label, why in e.not_stopped:
                console.print(f"  [red]{safe(label)}:[/] {safe(why)}")
    return emit


def attach_array(session: Session, rec: ArrayRecord, fail_fast: bool) -> int:
    """Follow every host's tasks to the end; the exit code (1 if any task failed)."""
    cluster = session.cluster
    labels = {h.index: h.label for h in cluster.hosts}
    mon = ArrayMonitor(PrefixPrinter(labels, tag="t"), labels)
    streams = {h.index: HostStream(session.links[h.index], session.records[h.index].job_dir,
                                   rec.tasks_of(h.index)) for h in cluster.hosts}
    finished = follow(streams, mon, unit="task")
    # the tasks' curves, live (the results fetch the rest); just launched: nothing yet
    fetch = CurveFetch(session).start(wait_first=True)
    try:
        while not finished() and not (fail_fast and (mon.failures() or mon.lost)):
            mon.wake.wait(0.2)
            mon.wake.clear()
    except KeyboardInterrupt:
        fetch.stop(timeout=1.0)
        interrupt_stop(session, set(mon.lost), said(cluster.name))
        return EXIT_INTERRUPTED
    fetch.stop(timeout=30.0)
    if not finished():
        fail_fast_stop(session, mon, finished)
    failed, n = mon.failures(), len(rec.host)
    if mon.lost or failed or len(mon.exits) < n:
        done = sum(c == 0 for c in mon.exits.copy().values())
        console.print(f"[bold red]job array '{cluster.name}'[/]: {done} of {n} tasks exited 0; "
                      f"failed: {', '.join(map(str, failed[:20])) or 'none'}"
                      + (" ..." if len(failed) > 20 else "")
                      + (f"; see `{hint_cmd(cluster, f'logs --task {failed[0]}')}`" if failed else ""))
        return EXIT_JOB_FAILED
    console.print(f"job array '{cluster.name}' finished: all {n} tasks exited 0")
    return EXIT_OK


def fail_fast_stop(session: Session, mon: ArrayMonitor, finished: Callable[[], bool]) -> None:
    started = time.monotonic()
    console.print("[yellow]--fail-fast: stopping every task on every host[/]")
    session.stop(timeouts.FAILFAST_GRACE, skip=set(mon.lost))
    deadline = time.monotonic() + timeouts.DRAIN
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.05)
    console.print(f"stopped the array on every host in {time.monotonic() - started:.1f} s")
