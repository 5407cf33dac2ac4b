"""`orch exec [--hosts SEL] [--json] -- CMD ARGS...`: one command on every host (or a
selection) in parallel, through one agent per host: live output prefixed with the host,
then one line per host with its exit code (api.exec).

Exit codes: 0 every host's command succeeded; 1 one failed; 2 bad usage; 3 a host could
not be reached (or lost); 130 interrupted (the command was ended on every host)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

from orchestrator.api import executing
from orchestrator.api.outcomes import ExecResult
from orchestrator.commands.common import console, emit_json, inventory
from orchestrator.errors import GroupError, UsageError
from orchestrator.ui.console import STDOUT_CLOSED


def add_parser(sub: Any) -> None:
    p = sub.add_parser("exec")
    p.add_argument(
        "--hosts",
        metavar="SEL",
        help="comma-separated addresses, labels, ranges (127.0.0.[2-3]) or indexes (0,2)",
    )
    p.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ARGS",
        help="the command and its arguments (no shell: write `sh -c '...'` for one)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:   # before the inventory is read: the usage is wrong whatever it holds
        raise UsageError(
            "no command given", hint="orch exec -- nvidia-smi   (or: -- sh -c 'cmd | cmd')"
        )
    cluster = inventory(args)
    try:
        result = executing.exec(cluster, argv, hosts=args.hosts, echo=not args.json, warn=warn)
    except GroupError as e:   # a host could not run it: every host's line all the same
        if not isinstance(e.result, ExecResult):
            raise
        result = e.result
    if args.json:
        emit_json(result)
    elif not STDOUT_CLOSED.is_set():   # `orch exec -- cat big | head`: ended quietly (141)
        summary(result)
    return result.exit_code


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(message)}")


def summary(result: ExecResult) -> None:
    """One line per host on stderr (stdout keeps only the hosts' output)."""
    for h in result.hosts:
        label = escape(h.host)
        if h.exit_code is not None:
            code = h.exit_code
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            colour = "green" if code == 0 else "red"
            console.print(f"{label}: [{colour}]{how}[/]")
        else:
            console.print(f"{label}: [red]no exit code[/]: {escape(str(h.error))}")
    if result.interrupted:
        console.print("interrupted: the command was ended on every host")
