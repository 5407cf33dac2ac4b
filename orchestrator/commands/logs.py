"""`orch logs`: one rank's raw log (pipes cleanly), or every rank with prefixes."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from rich.markup import escape

from orchestrator import state as job_state
from orchestrator.commands.common import connections, console, inventory
from orchestrator.errors import EXIT_OK
from orchestrator.follow import HostStream, PrefixPrinter, follow
from orchestrator.remote import open_agent


def add_parser(sub: Any) -> None:
    p = sub.add_parser("logs", help="print a rank's output (or every rank's, prefixed)")
    p.add_argument("--rank", type=int, metavar="R", help="global rank (default: all, prefixed)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--tail", type=int, default=-1, metavar="N", help="start with the last N lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    dirs = job_state.job_dirs(cluster, job_state.load(cluster))
    if args.rank is not None:
        host = cluster.host_of(args.rank)
        with connections(cluster, hosts=(host,)) as transports:
            return raw_log(transports[host.index], dirs[host.index], args)
    with connections(cluster, require_all=False) as transports:
        return all_logs(cluster, transports, dirs, args)


def raw_log(t, job_dir: str, args: argparse.Namespace) -> int:
    """Copy the rank's log bytes as they are: no prefix, nothing re-encoded."""
    mode = "raw-follow" if args.follow else "raw"
    chan = open_agent(t, "follow", job_dir, str(args.rank), str(args.tail), mode)
    chan.close_stdin()
    out = sys.stdout.buffer
    try:
        for data in iter(chan.read, b""):
            out.write(data)
            out.flush()
    except BrokenPipeError:   # `orch logs ... | head` closed the pipe: fine
        return EXIT_OK
    finally:
        chan.close()
    return EXIT_OK


class LogSink:
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


def all_logs(cluster, transports, dirs, args: argparse.Namespace) -> int:
    """Every rank, interleaved, prefixed; without -f it prints what is there and stops."""
    printer = PrefixPrinter({h.index: h.label for h in cluster.hosts})
    streams = {i: HostStream(t, dirs[i], list(cluster.hosts[i].ranks)) for i, t in transports.items()}
    finished = follow(streams, LogSink(printer), args.tail, "events" if args.follow else "tagged")
    while not finished():
        time.sleep(0.1)
    return EXIT_OK
