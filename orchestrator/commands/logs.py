"""`orch logs`: one rank's raw log (pipes cleanly), or every rank with prefixes."""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from rich.markup import escape

from orchestrator import arrays
from orchestrator import state as job_state
from orchestrator.commands.common import console, inventory, open_session, warn_unreachable
from orchestrator.errors import EXIT_OK, UsageError
from orchestrator.inventory import Cluster
from orchestrator.follow import HostStream, LineSink, PrefixPrinter, follow
from orchestrator.session import Session


def add_parser(sub: Any) -> None:
    p = sub.add_parser("logs", help="print a rank's output (or every rank's, prefixed)")
    p.add_argument("--rank", type=int, metavar="R", help="global rank (default: all, prefixed)")
    p.add_argument("--task", type=int, metavar="I", help="job arrays: task I's output, raw")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--tail", type=int, default=-1, metavar="N", help="start with the last N lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    st = job_state.load(cluster)
    if cluster.job.array is not None:
        return array_logs(cluster, st, args)
    if args.task is not None:
        raise UsageError(f"job '{cluster.name}' is not a job array: it has ranks, not tasks",
                         hint=f"use `orch logs -c {cluster.path.name} --rank R`")
    if args.rank is not None:
        host = cluster.host_of(args.rank)
        session = open_session(cluster, st, hosts=(host,))
        try:
            session.require_all("to connect")
            return raw_log(session, host.index, args)
        finally:
            session.close()
    session = open_session(cluster, st)
    try:
        warn_unreachable(session)
        return all_logs(session, args)
    finally:
        session.close()


class RawSink:
    """The rank's bytes as they are: no prefix, nothing re-encoded."""

    def __init__(self) -> None:
        self.out = sys.stdout.buffer
        self.ended = threading.Event()
        self.broken = False
        self.why = ""

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        if self.broken:
            return
        try:
            self.out.write(data if partial or data.endswith(b"\n") else data + b"\n")
            self.out.flush()
        except BrokenPipeError:   # `orch logs ... | head` closed the pipe: fine
            self.broken = True
            self.ended.set()

    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None:
        pass

    def host_done(self, host: int, info: dict) -> None:
        self.ended.set()

    def host_lost(self, host: int, why: str) -> None:
        self.why = why
        self.ended.set()


def raw_log(session: Session, host: int, args: argparse.Namespace, unit: str = "rank") -> int:
    sink = RawSink()
    link = session.links[host]
    which = args.rank if unit == "rank" else args.task
    extra = {"unit": unit} if unit != "rank" else {}
    link.follow(sink, job_dir=session.records[host].job_dir, ranks=[which],
                tail=args.tail, mode="raw-follow" if args.follow else "raw", **extra)
    while not sink.ended.wait(0.2):
        pass
    if sink.why and not sink.broken:
        console.print(f"[yellow]{escape(link.name)}:[/] {escape(sink.why)}")
    return EXIT_OK


class LogSink(LineSink):
    def __init__(self, printer: PrefixPrinter) -> None:
        self.printer = printer

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.printer.lines(host, rank, texts)

    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None:
        pass

    def host_done(self, host: int, info: dict) -> None:
        pass

    def host_lost(self, host: int, why: str) -> None:
        console.print(f"[yellow]host {host}:[/] {escape(why)}")


def array_logs(cluster: Cluster, st: job_state.JobState | None, args: argparse.Namespace) -> int:
    """`--task I`: task I's raw log; else every task, prefixed `[t<i> host]`."""
    if args.rank is not None:
        raise UsageError(f"job '{cluster.name}' is a job array: it has tasks, not ranks",
                         hint=f"use `orch logs -c {cluster.path.name} --task I` (`orch status` lists the tasks)")
    rec = arrays.load(cluster)
    if args.task is not None:
        host = cluster.hosts[arrays.task_of(rec, args.task)]
        session = open_session(cluster, st, hosts=(host,))
        try:
            session.require_all("to connect")
            return raw_log(session, host.index, args, unit="task")
        finally:
            session.close()
    session = open_session(cluster, st)
    try:
        warn_unreachable(session)
        printer = PrefixPrinter({h.index: h.label for h in cluster.hosts}, tag="t")
        streams = {i: HostStream(link, session.records[i].job_dir, rec.tasks_of(i))
                   for i, link in session.links.items()}
        finished = follow(streams, LogSink(printer), args.tail,
                          "events" if args.follow else "snapshot", unit="task")
        while not finished():
            time.sleep(0.1)
        return EXIT_OK
    finally:
        session.close()


def all_logs(session: Session, args: argparse.Namespace) -> int:
    """Every rank, interleaved, prefixed; without -f it prints what is there and stops."""
    cluster = session.cluster
    printer = PrefixPrinter({h.index: h.label for h in cluster.hosts})
    streams = {i: HostStream(link, session.records[i].job_dir, list(cluster.hosts[i].ranks))
               for i, link in session.links.items()}
    finished = follow(streams, LogSink(printer), args.tail,
                      "events" if args.follow else "snapshot")
    while not finished():
        time.sleep(0.1)
    return EXIT_OK
