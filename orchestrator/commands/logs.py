"""`orch logs`: one rank's raw log (pipes cleanly), or every rank with prefixes;
`--list`: each rank's host, state and log size."""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from rich.table import Table

from orchestrator.arrays import plan
from orchestrator.commands.common import (
    console,
    emit_json,
    hint_cmd,
    inventory,
    open_job,
    open_session,
    require_state,
    saved_state,
    unreachable,
    warn_unreachable,
)
from orchestrator.commands.status import rank_rows
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_HOST, EXIT_OK, UsageError
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.ui.termsafe import for_terminal, plain
from orchestrator.ui.wording import plural
from orchestrator.watch.follow import HostStream, LineSink, PrefixPrinter, follow


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
        return array_logs(cluster, require_state(cluster), args)
    st = saved_state(cluster)   # None: an `up` killed mid-launch; open_job asks the hosts
    if args.list:
        return list_logs(cluster, st, args.json)
    if args.task is not None:
        raise UsageError(f"job '{cluster.name}' is not a job array: it has ranks, not tasks",
                         hint=f"use `{hint_cmd(cluster, 'logs --rank R')}`")
    if args.rank is not None:
        host = cluster.host_of(args.rank)
        session = open_job(cluster, st, hosts=(host,))
        try:
            session.require_all("to connect")
            return raw_log(session, host.index, args)
        finally:
            session.close()
    session = open_job(cluster, st)
    try:
        if not args.json:
            warn_unreachable(session)
        code = all_logs(session, args)
    finally:
        session.close()
    return EXIT_HOST if session.failed and code == EXIT_OK else code


def list_logs(cluster: Cluster, st: JobState | None, as_json: bool) -> int:
    """`logs --list`: the status of each rank, reduced to what finding a log needs."""
    session = open_job(cluster, st)
    try:
        result = session.status()
    finally:
        session.close()
    failed = dict(session.failed)
    failed.update(result.failed)
    ranks = [{"rank": r["rank"], "host": r["host"], "state": r["state"],
              "log_bytes": info.get("log_bytes")} for r, info in rank_rows(cluster, result)]
    if as_json:
        emit_json({"job": cluster.name, "ranks": ranks,
                   "unreachable": unreachable(cluster, failed)})
    else:
        for _, exc in sorted(failed.items()):
            console.print("[yellow]warning:[/]", plain(str(exc)))
        t = Table(title=plain(f"job {cluster.name}: {plural(len(ranks), 'rank')}"))
        for col in ("rank", "host", "state", "log"):
            t.add_column(col, no_wrap=True, overflow="ellipsis")
        for r in ranks:
            size = "-" if r["log_bytes"] is None else f"{r['log_bytes']} B"
            t.add_row(str(r["rank"]), plain(r["host"]), plain(r["state"]), size)
        console.print(t)
    return EXIT_HOST if failed else EXIT_OK


class RawSink:
    """The rank's bytes as they are when piped: no prefix, nothing re-encoded. On a
    terminal, each line goes through termsafe (no control sequence reaches it).
    Under --json, the lines are kept for one document."""

    def __init__(self, tty: bool | None = None, collect: bool = False) -> None:
        self.out = sys.stdout.buffer
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.collect: list[bytes] | None = [] if collect else None
        self.ended = threading.Event()
        self.broken = False
        self.why = ""

    def shown(self, data: bytes) -> bytes:
        if not self.tty:
            return data
        return b"\n".join(for_terminal(line) for line in data.split(b"\n"))

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        if self.broken:
            return
        data = data if partial or data.endswith(b"\n") else data + b"\n"
        if self.collect is not None:
            self.collect.append(data)
            return
        try:
            self.out.write(self.shown(data))
            self.out.flush()
        except BrokenPipeError:   # `orch logs ... | head` closed the pipe: fine
            self.broken = True
            self.ended.set()

    def rank_exit(self, host: int, rank: int, code: int, when: float,
                  after_stop: bool = False) -> None:
        pass

    def host_done(self, host: int, info: dict[str, Any]) -> None:
        self.ended.set()

    def host_lost(self, host: int, why: str) -> None:
        self.why = why
        self.ended.set()


def raw_log(session: Session, host: int, args: argparse.Namespace, unit: str = "rank") -> int:
    sink = RawSink(collect=args.json)
    link = session.links[host]
    which = args.rank if unit == "rank" else args.task
    extra = {"unit": unit} if unit != "rank" else {}
    link.follow(sink, job_dir=session.records[host].job_dir, ranks=[which],
                tail=args.tail, mode="raw-follow" if args.follow else "raw", **extra)
    while not sink.ended.wait(0.2):
        pass
    if sink.why and not sink.broken:
        console.print("[yellow]warning:[/]", plain(f"{link.name}: {sink.why}"))
    if sink.collect is not None:
        text = b"".join(sink.collect).decode("utf-8", "replace")
        emit_json({"job": session.cluster.name, unit: which, "host": link.name,
                   "lines": text.splitlines()})
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

    def host_done(self, host: int, info: dict[str, Any]) -> None:
        pass

    def host_lost(self, host: int, why: str) -> None:
        self.lost[host] = why
        if self.printer is not None:
            console.print("[yellow]warning:[/]", plain(f"host {self.labels[host]}: {why}"))


def array_logs(cluster: Cluster, st: JobState, args: argparse.Namespace) -> int:
    """`--task I`: task I's raw log; else every task, prefixed `[t<i> host]`."""
    inv = cluster.path.name
    if args.rank is not None or args.list:
        raise UsageError(f"job '{cluster.name}' is a job array: it has tasks, not ranks",
                         hint=f"use `orch logs -c {inv} --task I` (`orch status -c {inv}` lists the tasks)")
    rec = plan.load(cluster)
    if args.task is not None:
        host = cluster.hosts[plan.task_of(rec, args.task)]
        session = open_job(cluster, st, hosts=(host,))
        try:
            session.require_all("to connect")
            return raw_log(session, host.index, args, unit="task")
        finally:
            session.close()
    session = open_session(cluster, st)
    try:
        if not args.json:
            warn_unreachable(session)
        labels = {h.index: h.label for h in cluster.hosts}
        sink = LogSink(None if args.json else PrefixPrinter(labels, tag="t"), labels)
        streams = {i: HostStream(link, session.records[i].job_dir, rec.tasks_of(i))
                   for i, link in session.links.items()}
        finished = follow(streams, sink, args.tail, "events" if args.follow else "snapshot",
                          unit="task")
        while not finished():
            time.sleep(0.1)
    finally:
        session.close()
    if args.json:
        emit_json({"job": cluster.name,
                   "tasks": [{"task": i, "lines": sink.kept.get(i, [])} for i in range(len(rec.host))],
                   "lost": {labels[i]: why for i, why in sorted(sink.lost.items())}})
    return EXIT_HOST if sink.lost or session.failed else EXIT_OK


def all_logs(session: Session, args: argparse.Namespace) -> int:
    """Every rank, interleaved, prefixed; without -f it prints what is there and stops."""
    cluster = session.cluster
    labels = {h.index: h.label for h in cluster.hosts}
    sink = LogSink(None if args.json else PrefixPrinter(labels), labels)
    streams = {i: HostStream(link, session.records[i].job_dir, list(cluster.hosts[i].ranks))
               for i, link in session.links.items()}
    finished = follow(streams, sink, args.tail, "events" if args.follow else "snapshot")
    while not finished():
        time.sleep(0.1)
    if args.json:
        emit_json({"job": cluster.name,
                   "ranks": [{"rank": r, "lines": sink.kept.get(r, [])}
                             for r in range(cluster.world_size)],
                   "lost": {labels[i]: why for i, why in sorted(sink.lost.items())}})
    return EXIT_HOST if sink.lost else EXIT_OK
