"""`orch exec [--hosts SEL] [--json] -- CMD ARGS...`: one command on every host (or a
selection) in parallel, through one agent per host: live output prefixed with the host,
then one line per host with its exit code (api.exec).

Exit codes: 0 every host's command succeeded; 1 one failed; 2 bad usage; 3 a host could
not be reached (or lost); 130 interrupted (the command was ended on every host)."""

from __future__ import annotations

import argparse
import posixpath
import re
import shlex
from typing import Any

from rich.markup import escape

from orchestrator.api import executing
from orchestrator.api.outcomes import ExecResult
from orchestrator.commands.common import console, emit_json, hint_cmd, inventory
from orchestrator.config.inventory import Cluster
from orchestrator.errors import GroupError, UsageError
from orchestrator.ui.console import STDOUT_CLOSED

PYTHON_NAME = re.compile(r"python[0-9.]*")   # python, python3, python3.11


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
        hint = python_hint(cluster, result)
        if hint:
            console.print(f"[yellow]hint:[/] {escape(hint)}")
    return result.exit_code


def python_hint(cluster: Cluster, result: ExecResult) -> str:
    """`orch exec -- python3 -c 'import torch'` failed where `python:` names another
    interpreter (a venv's): the command ran the first python on the host's PATH, not the
    inventory's one, which `$ORCH_PYTHON` names."""
    argv = result.command
    if not PYTHON_NAME.fullmatch(posixpath.basename(argv[0])):
        return ""
    others = sorted({cluster.hosts[h.index].python for h in result.hosts
                     if h.exit_code not in (None, 0) and cluster.hosts[h.index].python != argv[0]})
    if not others:
        return ""
    again = hint_cmd(cluster, "exec -- '$ORCH_PYTHON' " + shlex.join(argv[1:])).rstrip()
    return (f"`{argv[0]}` is the first python on the host's PATH, not the inventory's "
            f"`python: {', '.join(others)}`; `{again}` runs that one "
            "(ORCH_PYTHON is in every exec's environment)")


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
