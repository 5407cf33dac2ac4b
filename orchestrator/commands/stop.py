"""`orch stop`: end every process of the job on every host and prove nothing is left."""
from __future__ import annotations

import argparse
from typing import Any

from orchestrator.commands.common import console, emit_json, inventory, open_session, plural
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_OK, HostError
from orchestrator.remote.fanout import GroupResult
from orchestrator.session import state as job_state
from orchestrator.session.stopper import StopReport
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
    # a damaged state.json must not keep a job from being stopped: the processes are
    # found by their marker under the inventory's job folders
    st = job_state.load_or_warn(cluster, lambda m: console.print("[yellow]warning:[/]", plain(m)))
    session = open_session(cluster, st)
    try:
        result = session.stop(max(0.0, args.grace))
    finally:
        session.close()
    failures = dict(session.failed)
    failures.update(result.failed)
    left = [cluster.hosts[i].label for i, r in result.ok.items() if r.left]
    if args.json:
        emit_json(stop_doc(cluster, result, failures))
    else:
        for i, report in sorted(result.ok.items()):
            console.print(plain(cluster.hosts[i].label), f": {report.describe()}", sep="")
    if failures:
        GroupResult(failed=failures).raise_failures(cluster.hosts, "to stop")
    if left:
        raise HostError(f"processes of job '{cluster.name}' survived SIGKILL on {', '.join(left)}",
                        hint="they may be stuck in the kernel (D state, e.g. a hung GPU driver); "
                             "check them with ps on those hosts")
    if not args.json:
        console.print(f"job '{cluster.name}' stopped on {plural(len(result.ok), 'host')}")
    return EXIT_OK


def stop_doc(cluster: Cluster, result: GroupResult[StopReport],
             failures: dict[int, BaseException]) -> dict[str, Any]:
    """--json: per host what its stop did, and the hosts that could not be reached."""
    return {"job": cluster.name,
            "hosts": {cluster.hosts[i].label: {"found": r.found, "killed": r.killed,
                                               "left": list(r.left), "seconds": r.seconds}
                      for i, r in sorted(result.ok.items())},
            "failed": {cluster.hosts[i].label: str(e) for i, e in sorted(failures.items())}}
