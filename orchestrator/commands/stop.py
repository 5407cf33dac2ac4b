"""`orch stop`: end every process of the job on every host and prove nothing is left
(api.stop)."""
from __future__ import annotations

import argparse
from typing import Any

from orchestrator.api import stopping
from orchestrator.api.outcomes import StopResult
from orchestrator.commands.common import (
    console,
    emit_json,
    emit_json_failed,
    inventory,
    plural,
    warn,
)
from orchestrator.errors import EXIT_OK, OrchError
from orchestrator.ui.termsafe import plain
from orchestrator.wire import timeouts


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stop")
    p.add_argument("file", nargs="?", help="inventory (default: -c, or cluster.yaml)")
    p.add_argument("--grace", type=float, default=timeouts.STOP_GRACE, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (default: 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Idempotent: a stopped job stops again with success. Unreachable hosts are named
    (exit 3) after every reachable one has been stopped."""
    cluster = inventory(args)
    try:
        result = stopping.stop(cluster, grace=args.grace, warn=warn)
    except OrchError as e:   # some hosts were stopped: what they did, then the error
        if isinstance(e.result, StopResult) and args.json:
            emit_json_failed(args, e.result, e, e.exit_code)
        elif isinstance(e.result, StopResult):
            show(e.result, args.json)
        raise
    show(result, args.json)
    if not args.json:
        console.print(plain(summary(cluster.name, result)))
    return EXIT_OK


def show(result: StopResult, as_json: bool) -> None:
    """A line per host that had something of the job (the idle ones are counted once,
    in the summary)."""
    if as_json:
        emit_json(result)
        return
    for label, report in result.hosts.items():
        if report.found or report.left:
            console.print(plain(label), f": {report.describe()}", sep="")


def summary(name: str, result: StopResult) -> str:
    """What the stop did, said once: on how many hosts something was stopped, and on how
    many nothing was running."""
    stopped = sum(1 for r in result.hosts.values() if r.found)
    idle = len(result.hosts) - stopped
    if not stopped:
        return f"job '{name}': nothing was running on {plural(idle, 'host')}"
    more = f" (nothing was running on {plural(idle, 'other host')})" if idle else ""
    return f"job '{name}' stopped on {plural(stopped, 'host')}{more}"
