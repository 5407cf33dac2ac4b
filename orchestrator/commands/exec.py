"""`orch exec [--hosts SEL] [--json] -- CMD ARGS...`: one command on every host (or a
selection) in parallel, through one agent per host: live output prefixed with the host,
then one line per host with its exit code.

Exit codes: 0 every host's command succeeded; 1 one failed; 2 bad usage; 3 a host could
not be reached (or lost); 130 interrupted (the command was ended on every host)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.markup import escape

from orchestrator.commands.common import console, inventory
from orchestrator.config import hostranges
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import (
    EXIT_HOST,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    OrchError,
    UsageError,
)
from orchestrator.session import state as job_state
from orchestrator.session.session import Session
from orchestrator.session.shellcmd import Outcome
from orchestrator.session.shelloutput import HostOutput, Printer

KEEP = 1 << 20  # --json: the last bytes of each host's output


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
    if not argv:
        raise UsageError(
            "no command given", hint="orch exec -- nvidia-smi   (or: -- sh -c 'cmd | cmd')"
        )
    cluster = inventory(args)
    hosts = select(cluster, args.hosts)
    printer = Printer(quiet=args.json)  # one for all hosts: lines never interleave
    outputs = {
        h.index: HostOutput(printer, f"[{h.label}]", keep=KEEP if args.json else 0) for h in hosts
    }
    session = Session(cluster, exec_state(cluster))
    try:
        session.open(hosts)
        outcome = session.exec(argv, outputs)
    finally:
        session.close()
    outcome.failed.update({i: e for i, e in session.failed.items() if i in outputs})
    code = exit_code(outcome)
    if args.json:
        print(json.dumps(document(cluster, hosts, argv, outcome, outputs, code), indent=1))
    else:
        summary(cluster, hosts, outcome)
    return code


def exec_state(cluster: Cluster) -> job_state.JobState | None:
    """The job folders from the state (as `up` resolved them); the inventory's when the
    job never started or its state is damaged (exec must work then too)."""
    try:
        return job_state.load(cluster)
    except job_state.StateDamaged as exc:
        console.print(
            f"[yellow]warning:[/] {escape(exc.message)}; using the inventory's job folders"
        )
        return None


def exit_code(outcome: Outcome) -> int:
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    if outcome.failed:
        return EXIT_HOST
    return EXIT_JOB_FAILED if any(r["code"] != 0 for r in outcome.ok.values()) else EXIT_OK


def summary(cluster: Cluster, hosts: tuple[Host, ...], outcome: Outcome) -> None:
    """One line per host on stderr (stdout keeps only the hosts' output)."""
    for h in hosts:
        label = escape(h.label)
        if h.index in outcome.ok:
            code = outcome.ok[h.index]["code"]
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            colour = "green" if code == 0 else "red"
            console.print(f"{label}: [{colour}]{how}[/]")
        else:
            err = outcome.failed.get(h.index)
            text = err.message if isinstance(err, OrchError) else str(err)
            console.print(f"{label}: [red]no exit code[/]: {escape(text)}")
    if outcome.interrupted:
        console.print("interrupted: the command was ended on every host")


def document(
    cluster: Cluster,
    hosts: tuple[Host, ...],
    argv: list[str],
    outcome: Outcome,
    outputs: dict[int, HostOutput],
    code: int,
) -> dict[str, Any]:
    rows = []
    for h in hosts:
        row: dict[str, Any] = {
            "host": h.label,
            "index": h.index,
            "exit_code": outcome.ok.get(h.index, {}).get("code"),
            "output": outputs[h.index].text(),
            "output_truncated": outputs[h.index].dropped > 0,
        }
        if h.index in outcome.failed:
            err = outcome.failed[h.index]
            row["error"] = err.message if isinstance(err, OrchError) else str(err)
        rows.append(row)
    return {"command": argv, "hosts": rows, "interrupted": outcome.interrupted, "exit_code": code}


# ---------------------------------------------------------------- --hosts


def split_selection(text: str) -> list[str]:
    """Comma-separated items; a comma inside a range's brackets (node[1,3]) stays."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    items.append(cur.strip())
    return [i for i in items if i]


def select(cluster: Cluster, text: str | None) -> tuple[Host, ...]:
    """The hosts SEL names, in inventory order: an index, an address or label, or a
    range of addresses. Anything that names no host is a usage error (exit 2)."""
    if text is None:
        return cluster.hosts
    chosen: set[int] = set()
    for item in split_selection(text) or [text]:
        chosen |= _match(cluster, item)
    return tuple(h for h in cluster.hosts if h.index in chosen)


def _match(cluster: Cluster, item: str) -> set[int]:
    if item.isdigit():
        if int(item) < len(cluster.hosts):
            return {int(item)}
        raise UsageError(
            f"--hosts: there is no host {item} (this job has hosts 0 to {len(cluster.hosts) - 1})",
            hint="give an index, an address or a label",
        )
    try:
        names = (
            set(hostranges.expand(item, len(cluster.hosts) * 4 + 64))
            if hostranges.is_range(item)
            else {item}
        )
    except hostranges.BadAddress as e:
        raise UsageError(f"--hosts: {e.message}", hint=e.hint) from None
    found = {h.index for h in cluster.hosts if h.label in names or h.address in names}
    if not found:
        known = ", ".join(h.label for h in cluster.hosts[:8]) + (
            ", ..." if len(cluster.hosts) > 8 else ""
        )
        raise UsageError(
            f"--hosts: {item!r} names no host of job '{cluster.name}'",
            hint=f"give indexes, addresses or labels of its hosts ({known})",
        )
    return found
