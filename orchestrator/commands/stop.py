"""`orch stop`: end every process of the job on every host and prove nothing is left."""
from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

from orchestrator import state as job_state
from orchestrator import timeouts
from orchestrator.commands.common import console, inventory, open_session
from orchestrator.connect import GroupResult
from orchestrator.errors import EXIT_OK, HostError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stop", help="stop every process of the job on every host")
    p.add_argument("file", nargs="?", help="inventory (default: -c, or cluster.yaml)")
    p.add_argument("--grace", type=float, default=timeouts.STOP_GRACE, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (default: 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Idempotent: a stopped job stops again with success. Unreachable hosts are named
    (exit 3) after every reachable one has been stopped."""
    cluster = inventory(args)
    # a damaged state.json must not keep a job from being stopped: the processes are
    # found by their marker under the inventory's job folders
    st = job_state.load_or_warn(cluster, lambda m: console.print(f"[yellow]warning:[/] {escape(m)}"))
    session = open_session(cluster, st)
    try:
        result = session.stop(max(0.0, args.grace))
    finally:
        session.close()
    for i, report in sorted(result.ok.items()):
        console.print(f"{cluster.hosts[i].label}: {report.describe()}")
    failures = dict(session.failed)
    failures.update(result.failed)
    left = [cluster.hosts[i].label for i, r in result.ok.items() if r.left]
    if failures:
        GroupResult(failed=failures).raise_failures(cluster.hosts, "to stop")
    if left:
        raise HostError(f"processes of job '{cluster.name}' survived SIGKILL on {', '.join(left)}",
                        hint="they may be stuck in the kernel (D state, e.g. a hung GPU driver); "
                             "check them with ps on those hosts")
    console.print(f"job '{cluster.name}' stopped on {len(result.ok)} hosts")
    return EXIT_OK
