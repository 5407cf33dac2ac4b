"""`orch up`'s lines after the start: a reader of the run's events (watch/events.py).

Each rank's lines go to stdout as `[r3 host] line` (watch/follow.PrefixPrinter); the
rest to stderr: the live line of hosts still quiet, the root cause, the hang's report,
what a stop did, the restarts. Nothing here decides: api/running.py and
watch/monitor.py do, and emit what they did."""
from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from orchestrator.api import running
from orchestrator.api.launching import UpProgress
from orchestrator.api.outcomes import Pulled
from orchestrator.commands.common import console, hint_cmd, plural
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_INTERRUPTED
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.ui.liveline import LiveLine, started_text
from orchestrator.ui.termsafe import markup_safe as escape
from orchestrator.ui.termsafe import plain, plain_lines
from orchestrator.watch import events as ev
from orchestrator.watch.follow import PrefixPrinter
from orchestrator.watch.hang import places, stack_lines

if TYPE_CHECKING:
    from orchestrator.api.pulling import Transfer


def attached(cluster: Cluster, args: argparse.Namespace, restarts: int,
             view: Callable[[], UpProgress], also: ev.Emit | None = None,
             using: running.SessionUser | None = None) -> int:
    """`orch up` without --detach: the run to its end, rendered; its exit code. `also`:
    one more reader of its events (the dashboard's board); `using`: one more user of
    each attempt's session (the dashboard's GPU samples)."""
    shown = UpRenderer(cluster)
    opts = running.Options(restarts, setup=args.setup, wait=args.wait, pull=not args.no_pull,
                           transfer=pull_bar, using=using)
    reader: ev.Emit = shown if also is None else Tee(shown, also)
    try:
        return running.run_job(cluster, opts, running.Serial(reader), view).code
    except KeyboardInterrupt:
        if shown.interrupted:   # the job was stopped everywhere, and that was said
            return EXIT_INTERRUPTED
        raise   # before the job ran (the start's own stop): `orch: interrupted`
    finally:
        shown.close()


def with_dashboard(cluster: Cluster, args: argparse.Namespace, restarts: int,
                   view: Callable[[], UpProgress]) -> int:
    """`orch up --dashboard`: the page served (its URL printed) beside the attached run,
    fed its events; after the run, on a terminal, kept until Ctrl-C."""
    from orchestrator.commands.common import inventory_path
    from orchestrator.dashboard import page
    opened = page.open_beside_run(cluster, inventory_path(args))
    try:
        console.print(plain(f"dashboard: {opened.url}"), soft_wrap=True)
        page.open_browser(opened.url, lambda line: console.print(plain(line)))
        code = attached(cluster, args, restarts, view, also=opened.board,
                        using=opened.feeds.runs)
        if sys.stdin.isatty():
            console.print("the run ended; the dashboard stays open until Ctrl-C", markup=False)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
        return code
    finally:
        opened.close()


class Tee:
    """Two readers of one stream: each gets every event, and `many` where it has one."""

    def __init__(self, *readers: ev.Emit) -> None:
        self.readers = readers

    def __call__(self, event: ev.Event) -> None:
        for reader in self.readers:
            reader(event)

    def many(self, events: Sequence[ev.Event]) -> None:
        for reader in self.readers:
            ev.emit_all(reader, events)


def attach(session: Session, state: JobState) -> int:
    """Follow a started job on its open session as `orch up` does, without restarts or
    the pull; the exit code."""
    from orchestrator.watch.monitor import watch
    shown = UpRenderer(session.cluster)
    try:
        return watch(session, state, running.Serial(shown)).code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        shown.close()


def pull_bar(host: str) -> AbstractContextManager[Transfer]:
    """The pull's bar (commands/render.py, imported once the job ran)."""
    from orchestrator.commands import render
    return render.pull_bar(host)


class UpRenderer:
    """Every event of an attached run, as `orch up` prints it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster        # the inventory (hints name it) and the job's name
        self.printer = PrefixPrinter({})
        self.live = LiveLine(enabled=False)
        self.hosts: tuple[ev.StartedHost, ...] = ()
        self.started: set[int] = set()     # a pid reported, output or an exit
        self.printed: set[int] = set()     # output or an exit
        self.failed = False
        self.interrupted = False     # Ctrl-C while the job ran: its stop was said
        self.world = 0

    def __call__(self, event: ev.Event) -> None:
        handler = getattr(self, "on_" + type(event).__name__, None)
        if handler is not None:
            handler(event)

    def many(self, events: Sequence[ev.Event]) -> None:
        """A frame's lines (one rank's) in one write."""
        first = events[0] if events else None
        if isinstance(first, ev.RankLine):
            lines = [e for e in events if isinstance(e, ev.RankLine) and e.rank == first.rank]
            if len(lines) == len(events):
                self.printer.print_as(first.host, first.rank, [e.data for e in lines])
                self.seen(first.rank, printed=True)
                return
        for event in events:
            self(event)

    def close(self) -> None:
        self.live.close()

    # ---------------------------------------------------------------- the ranks

    def on_Started(self, e: ev.Started) -> None:
        if e.attempt:
            console.print(plain(f"attempt {e.attempt + 1} of {e.attempts} "
                                f"(ORCH_RESTART_COUNT={e.attempt})"))
        console.print(f"started job '{e.job}' on {plural(len(e.hosts), 'host')} "
                      f"({plural(e.world_size, 'rank')}, "
                      f"MASTER_ADDR={e.master_addr}:{e.master_port})")
        self.close()
        self.hosts, self.world = e.hosts, e.world_size
        self.started, self.printed, self.failed = set(), set(), False
        self.live = LiveLine(sys.stderr)   # the console's file: stderr
        self.printer.above = self.live.above
        self.live.update(self.started_line())

    def started_line(self) -> str:
        hosts = [(h.label, sum(r in self.started for r in h.ranks), len(h.ranks))
                 for h in self.hosts]
        return started_text(hosts, len(self.printed))

    def seen(self, rank: int, printed: bool) -> None:
        """Until every rank has printed, the live line says which hosts are still quiet."""
        if rank in self.printed or (not printed and rank in self.started):
            return
        self.started.add(rank)
        if printed:
            self.printed.add(rank)
        if not self.live.enabled:
            return
        if len(self.printed) == self.world:
            self.live.close()
        else:
            self.live.update(self.started_line())

    def on_RankStarted(self, e: ev.RankStarted) -> None:
        self.seen(e.rank, printed=False)

    def on_RankLine(self, e: ev.RankLine) -> None:
        self.printer.print_as(e.host, e.rank, [e.data])
        self.seen(e.rank, printed=True)

    def on_RankExited(self, e: ev.RankExited) -> None:
        self.seen(e.rank, printed=True)
        self.failed = self.failed or e.failed

    def on_HostLost(self, e: ev.HostLost) -> None:
        self.failed = True

    def on_NetworkStall(self, e: ev.NetworkStall) -> None:
        console.print(plain_lines(e.text))

    # ---------------------------------------------------------------- the end

    def on_Succeeded(self, e: ev.Succeeded) -> None:
        self.live.close()
        console.print(f"job '{self.cluster.name}' finished: "
                      f"{'all ' if e.world_size > 1 else ''}{plural(e.world_size, 'rank')} "
                      f"exited 0")

    def on_Stopping(self, e: ev.Stopping) -> None:
        self.live.close()
        self.failed = True
        if e.why == "interrupt":
            self.interrupted = True
            console.print(f"\n[yellow]interrupted: stopping job '{self.cluster.name}' on "
                          f"every host (Ctrl-C again to kill at once)[/]")
        elif e.why == "kill":
            console.print("[yellow]killing every process of the job now[/]")

    def on_RootCause(self, e: ev.RootCause) -> None:
        if e.kind != "hang":
            console.print(cause_text(self.cluster, e))

    def on_Hang(self, e: ev.Hang) -> None:
        console.print(hang_text(self.cluster, e))

    def on_Stopped(self, e: ev.Stopped) -> None:
        if e.why == "interrupt":
            for label, report in e.reports:
                console.print(f"  {escape(label)}: {report.describe()}")
            for label, why in e.not_stopped:
                console.print(f"  [red]{escape(label)}:[/] {escape(why)}")
        else:
            console.print(stop_summary(self.cluster, e))

    def on_Pulled(self, e: Pulled) -> None:
        from orchestrator.commands import render
        if e.result is not None:
            render.pulled(e.result)
        if e.error:   # the job's outcome is already printed; say why the pull failed
            console.print(plain(f"pull failed: {e.error}"))
            console.print(f"  get the files later with `{hint_cmd(self.cluster, 'pull')}`",
                          markup=False)

    # ---------------------------------------------------------------- restarts

    def on_Spares(self, e: ev.Spares) -> None:
        if e.error:
            console.print(plain(f"warning: spares not prepared: {e.error}"))
        for label, why in e.refused:
            console.print(plain(f"warning: spare {label} cannot serve: {why}"))
        if e.ready:
            console.print(plain(f"spares ready (preflight passed, code pushed): "
                                f"{', '.join(e.ready)}"))

    def on_KeeperChosen(self, e: ev.KeeperChosen) -> None:
        console.print(plain(e.line))

    def on_CheckpointRestored(self, e: ev.CheckpointRestored) -> None:
        if not e.files:
            console.print(plain(f"no checkpoint to put back: {e.nothing}"))
            return
        files = list(e.files)
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        source = f" from {e.source}" if e.source else ""
        console.print(plain(f"checkpoint put back on {', '.join(e.hosts)}{source}: {shown}"))

    def on_StartFailed(self, e: ev.StartFailed) -> None:
        console.print(plain_lines(f"attempt {e.attempt + 1} could not start: {e.message}"))

    def on_Restarting(self, e: ev.Restarting) -> None:
        none = f"; no checkpoint to put back: {e.no_checkpoint}" if e.no_checkpoint else ""
        console.print(plain(f"restart {e.attempt} of {e.restarts} in {e.delay:.0f} s after: "
                            f"{e.cause}; hosts: {', '.join(e.hosts)}{none}"))

    def on_NoRestart(self, e: ev.NoRestart) -> None:
        if e.kind == "user_stop":
            console.print("stopped with `orch stop`: no restart", markup=False)
        elif e.kind == "none_left":
            console.print(f"no restart left ({e.restarts} made)", markup=False)
        else:
            console.print(plain(f"cannot restart: {e.why}"))


def stop_summary(cluster: Cluster, e: ev.Stopped) -> str:
    """What was stopped and what was not: a lost host's ranks may run on."""
    if not e.not_stopped:
        return f"stopped the job on every host in {e.seconds:.1f} s"
    done = [label for label, _ in e.reports]
    lines = [f"stopped the job on {len(done)} of {plural(e.hosts, 'host')} in "
             f"{e.seconds:.1f} s" + (f" ({escape(', '.join(done))})" if done else "")]
    for label, why in e.not_stopped:
        lines.append(f"[red]NOT stopped on {escape(label)}[/] "
                     f"(lost: {escape(why)}): its ranks may still be running there")
    lines.append(f"`{escape(hint_cmd(cluster, 'stop'))}` ends them once the host is "
                 "reachable again")
    return "\n".join(lines)


def cause_text(cluster: Cluster, v: ev.RootCause) -> str:
    if v.user_stop and v.kind in ("host", "unknown"):
        return stopped_text(cluster, v)
    if v.kind == "silent":
        return silent_text(cluster, v)
    if v.kind == "host":
        log, host = v.host_log, v.host
        read = hint_cmd(cluster, f"exec --hosts {host} -- tail -n 50 {log}")
        return (f"[bold red]job '{cluster.name}' failed[/]: torchrun on host "
                f"{escape(host)} ended with {v.host_code} before its ranks "
                f"reported; see <job dir>/{escape(log)} there\n"
                f"  read it with `{escape(read)}`")
    if v.rank is None:
        return f"job '{cluster.name}' failed"
    lines = [rank_text(cluster, v, v.rank)]
    if len(v.failures) > 1:
        spread = max(f.at for f in v.failures) - min(f.at for f in v.failures)
        unc = max(f.uncertainty for f in v.failures)
        lines.append(f"{escape(' and '.join(f.describe() for f in v.failures))} failed "
                     f"within {spread * 1000:.0f} ms of each other (clock uncertainty "
                     f"{unc * 1000:.0f} ms): either may be the cause")
    if v.later:   # failed after the cause by the clocks: listed, earliest first
        more = f" and {len(v.later) - 8} more" if len(v.later) > 8 else ""
        lines.append("also failed after it: "
                     + escape(", ".join(f.describe() for f in v.later[:8])) + more)
    return "\n".join(lines)


def stopped_text(cluster: Cluster, v: ev.RootCause) -> str:
    """An `orch stop` from another command ended the job: no rank failed on its own (a
    rank's exit after its host got the stop is never a cause, watch/rootcause.py), so
    torchrun's end under the stop is said as what it is, not as a failure."""
    ended = (f": torchrun on host {escape(v.host)} ended with {v.host_code} after the stop"
             if v.kind == "host" else "")
    return f"[bold]job '{escape(cluster.name)}' was stopped by `orch stop`[/]{ended}"


def silent_text(cluster: Cluster, v: ev.RootCause) -> str:
    why = dict(v.lost)
    lines = [f"[bold red]job '{cluster.name}' failed[/]: root cause host "
             f"{escape(', '.join(v.silent))}: it went silent before any rank failed "
             f"({escape('; '.join(why[label] for label in v.silent))})"]
    for f in v.later:
        lines.append(f"  then {escape(f.describe())}: a consequence")
    return "\n".join(lines)


def rank_text(cluster: Cluster, v: ev.RootCause, cause: ev.RankFailure) -> str:
    rank = cause.rank
    lines = [f"[bold red]job '{cluster.name}' failed[/]: root cause rank {rank} on host "
             f"{escape(cause.host)} (local rank {cause.local_rank}): "
             f"{ev.signal_name(cause.code)}"]
    if cause.last_lines:
        lines.append(f"last lines of rank {rank}:")
        lines += [f"  {escape(text)}" for text in cause.last_lines]
    if cause.error_file:
        lines.append("torchrun error file:\n  " + "\n  ".join(
            escape(text) for text in cause.error_file.splitlines()))
    for path in cause.nccl_dumps:
        lines.append(f"NCCL flight recorder dump: {escape(cause.host)}: {escape(path)}")
    lines.append(f"full log: `{escape(hint_cmd(cluster, f'logs --rank {rank}'))}`")
    for label, why in v.lost:
        lines.append(f"also: host {escape(label)} was lost ({escape(why)})")
    return "\n".join(lines)


def hang_text(cluster: Cluster, e: ev.Hang) -> str:
    report = e.report
    lines = [f"[bold red]job '{cluster.name}' failed[/]: {escape(e.reason)}"]
    shown = 0
    for c in e.culprits:
        lines.append(f"root cause rank {c.rank} on host {escape(c.host)} (local rank "
                     f"{c.local_rank}): {escape(c.why)}")
        stack = report.stacks.get(c.rank)
        if stack is not None and stack.frames and shown < 4:
            shown += 1
            lines.append(f"stack of rank {c.rank} (main thread, most recent call first):")
            lines += [escape(text) for text in stack_lines(stack)]
    if not e.culprits:
        lines.append("no rank stands out: each is where the others are (a deadlock in the "
                     "job itself, or every rank waiting on something outside it)")
    if report.stacks:
        lines.append("where every rank was:")
        lines += [f"  {escape(text)}" for text in places(report.stacks)]
    for text in report.nccl_dumps:
        lines.append(f"NCCL flight recorder dump: {escape(text)}")
    for text in report.unreachable:
        lines.append(f"no stacks from {escape(text)}")
    lines.append(f"every rank's stack (all its threads) is at the end of its log: "
                 f"`{escape(hint_cmd(cluster, f'logs --rank {e.first_idle}'))}`")
    return "\n".join(lines)
