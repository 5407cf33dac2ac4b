"""`orch logs`: one rank's raw log (pipes cleanly), or every rank with prefixes;
`--list`: each rank's host, state and log size (api.reading, api.status). `-f` of every
rank is a reader of the job's events (api.following, watch/events.py), as `orch up` is."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.table import Table

from orchestrator.api import following, jobs, querying, reading
from orchestrator.api.outcomes import (
    AllLogs,
    ArrayLogs,
    LogEntry,
    LogLines,
    LogList,
    RankLines,
    TaskLines,
)
from orchestrator.commands.common import emit_json, inventory, out, warn, warn_unreachable
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_HOST, EXIT_OK, UsageError
from orchestrator.remote.link import HostDone
from orchestrator.ui.termsafe import for_terminal, plain
from orchestrator.ui.wording import plural
from orchestrator.watch import events as ev
from orchestrator.watch.follow import LineSink, PrefixPrinter


def add_parser(sub: Any) -> None:
    p = sub.add_parser("logs")
    p.add_argument("--rank", type=int, metavar="R", help="global rank (default: all, prefixed)")
    p.add_argument("--task", type=int, metavar="I", help="job arrays: task I's output, raw")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--tail", type=int, default=-1, metavar="N", help="start with the last N lines")
    p.add_argument("--list", action="store_true",
                   help="each rank's host, state and log size, no log text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    if args.rank is not None and cluster.job.array is None:
        cluster.host_of(args.rank)   # a rank outside the job is a usage error, run or not
    if args.json and args.follow:
        raise UsageError("--json prints one document: it cannot follow (-f)",
                         hint="leave out -f, or leave out --json")
    if cluster.job.array is not None:
        if args.rank is not None or args.list:
            jobs.require_state(cluster)
            raise reading.not_ranks(cluster)
        return raw_log(cluster, args) if args.task is not None else all_logs(cluster, args)
    if args.list:
        return list_logs(cluster, args.json)
    if args.task is not None or args.rank is not None:
        return raw_log(cluster, args)
    if args.follow and not args.json:
        followed = follow_events(cluster, args.tail)
        if followed is not None:
            return followed
    return all_logs(cluster, args)


def list_logs(cluster: Cluster, as_json: bool) -> int:
    """`logs --list`: the status of each rank, reduced to what finding a log needs."""
    status = querying.status(cluster)
    listed = LogList(job=cluster.name, unreachable=status.unreachable,
                     ranks=[LogEntry(r.rank, r.host, r.state, r.log_bytes) for r in status.ranks])
    if as_json:
        emit_json(listed)
    else:
        for why in status.unreachable.values():
            warn(why)
        t = Table(title=plain(f"job {cluster.name}: {plural(len(listed.ranks), 'rank')}"))
        for col in ("rank", "host", "state", "log"):
            t.add_column(col, no_wrap=True, overflow="ellipsis")
        for r in listed.ranks:
            size = "-" if r.log_bytes is None else f"{r.log_bytes} B"
            t.add_row(str(r.rank), plain(r.host), plain(r.state), size)
        out.print(t)
    return EXIT_HOST if status.unreachable else EXIT_OK


class RawSink(reading.RawLog):
    """The rank's bytes as they are when piped: no prefix, nothing re-encoded. On a
    terminal, each line goes through termsafe (no control sequence reaches it).
    Under --json, the lines are kept for one document."""

    def __init__(self, tty: bool | None = None, collect: bool = False) -> None:
        super().__init__()
        self.out = sys.stdout.buffer
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.collect = collect

    def shown(self, data: bytes) -> bytes:
        if not self.tty:
            return data
        return b"\n".join(for_terminal(line) for line in data.split(b"\n"))

    def write(self, data: bytes) -> None:
        if self.collect:
            super().write(data)
            return
        self.out.write(self.shown(data))
        self.out.flush()


def raw_log(cluster: Cluster, args: argparse.Namespace) -> int:
    """One rank's (or task's) log, raw; -f: until the job ends."""
    host, sink = reading.read_log(cluster, rank=args.rank, task=args.task, tail=args.tail,
                                  follow=args.follow, sink=RawSink(collect=args.json))
    if sink.why and not sink.broken:
        warn(f"{host}: {sink.why}")
    if args.json:
        text = sink.data().decode("utf-8", "replace")
        emit_json(LogLines(job=cluster.name, host=host, lines=text.splitlines(),
                           rank=args.rank if args.task is None else None, task=args.task))
    return EXIT_HOST if sink.why else EXIT_OK


class LogSink(LineSink):
    def __init__(self, printer: PrefixPrinter | None, labels: dict[int, str]) -> None:
        self.printer, self.labels = printer, labels
        self.kept: dict[int, list[str]] = {}   # under --json: every rank's lines
        self.lost: dict[int, str] = {}

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        if self.printer is None:
            self.kept.setdefault(rank, []).extend(t.decode("utf-8", "replace") for t in texts)
        else:
            self.printer.lines(host, rank, texts)

    def rank_exit(self, host: int, rank: int, code: int, when: float,
                  after_stop: bool = False) -> None:
        pass

    def host_done(self, host: int, info: HostDone) -> None:
        pass

    def host_lost(self, host: int, why: str) -> None:
        self.lost[host] = why
        if self.printer is not None:
            warn_lost(self.labels[host], why)


def warn_lost(label: str, why: str) -> None:
    warn(why if why.startswith(label) else f"host {label}: {why}")   # the link's name it


def follow_events(cluster: Cluster, tail: int) -> int | None:
    """`logs -f` of every rank, to the job's end: its events rendered (each rank's lines
    prefixed, a host lost said; the exits and the root cause are `orch status`'s). None
    without a saved state (an `up` killed mid-launch: no run to attach to), which
    `all_logs` reads from the inventory's job folders instead."""
    run = jobs.run_cluster(cluster)
    st = jobs.saved_state(run)
    if st is None:
        return None
    session = jobs.open_job(run, st)
    unreached = {run.hosts[i].label for i in session.failed}
    printer = PrefixPrinter({h.index: h.label for h in run.hosts})
    lost = False
    try:
        warn_unreachable(session.failed.values())
        for e in following.events(session, st, tail):
            if isinstance(e, ev.RankLine):
                printer.print_as(e.host, e.rank, [e.data])
            elif isinstance(e, ev.HostLost) and e.host not in unreached:
                lost = True
                warn_lost(e.host, e.why)
    finally:
        session.close()   # also when the events were never read
    return EXIT_HOST if lost or unreached else EXIT_OK


def all_logs(cluster: Cluster, args: argparse.Namespace) -> int:
    """Every rank (a job array: every task), interleaved, prefixed; without -f it prints
    what is there and stops."""
    labels = {h.index: h.label for h in cluster.hosts}
    array = cluster.job.array is not None
    printer = PrefixPrinter(labels, tag="t") if array else PrefixPrinter(labels)
    sink = LogSink(None if args.json else printer, labels)
    followed = reading.follow_logs(
        cluster, sink, tail=args.tail, follow=args.follow,
        unreached=None if args.json else lambda exc: warn_unreachable([exc]))
    if args.json:
        lost = {labels[i]: why for i, why in sorted(sink.lost.items())}
        if array:
            emit_json(ArrayLogs(job=cluster.name, lost=lost,
                                tasks=[TaskLines(i, sink.kept.get(i, [])) for i in followed.units]))
        else:
            emit_json(AllLogs(job=cluster.name, lost=lost,
                              ranks=[RankLines(r, sink.kept.get(r, [])) for r in followed.units]))
    return EXIT_HOST if sink.lost or followed.unreached else EXIT_OK
