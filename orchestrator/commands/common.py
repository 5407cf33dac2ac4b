"""What every command needs: the inventory, a session on its hosts, messages."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from orchestrator.config.inventory import Cluster, Host, load
from orchestrator.errors import UsageError
from orchestrator.remote.fanout import GroupResult
from orchestrator.session import state as job_state
from orchestrator.session.session import Session
from orchestrator.ui.console import console
from orchestrator.ui.termsafe import plain
from orchestrator.ui.wording import hint_cmd, plural, set_inventory

__all__ = [
    "console",
    "emit_json",
    "hint_cmd",
    "inventory",
    "open_job",
    "open_session",
    "plural",
    "require_a_run",
    "require_state",
    "saved_state",
    "unreachable",
    "wants_json",
    "warn_unreachable",
]


def inventory(args: argparse.Namespace) -> Cluster:
    path = Path(getattr(args, "file", None) or args.config)
    if not path.exists():
        raise UsageError(f"{path}: no such inventory file",
                         hint="run in the folder of your cluster.yaml, or pass -c FILE")
    set_inventory(path)
    return load(path)


def open_session(cluster: Cluster, state: job_state.JobState | None = None,
                 hosts: tuple[Host, ...] | None = None) -> Session:
    """A session with every host's (or `hosts`') agent started; the caller closes it."""
    session = Session(cluster, state)
    try:
        return session.open(hosts)
    except BaseException:
        session.close()
        raise


def warn_unreachable(session: Session) -> None:
    for exc in session.failed.values():
        console.print("[yellow]warning:[/]", plain(str(exc)))


def require_state(cluster: Cluster) -> job_state.JobState:
    st = job_state.load(cluster)
    if st is None:
        raise UsageError(f"job '{cluster.name}' has not been started from {cluster.path}",
                         hint=f"start it with `{hint_cmd(cluster, 'up')}`")
    return st


def saved_state(cluster: Cluster) -> job_state.JobState | None:
    """The state `up` saved; None when there is none. An `up` killed after its launch
    request reached the hosts saved no state, yet the job runs: the hosts are asked at
    the inventory's job folders all the same. A damaged state is still refused."""
    try:
        return require_state(cluster)
    except job_state.StateDamaged:
        raise
    except UsageError:
        return None


def require_a_run(session: Session, result: GroupResult[dict[str, Any]]) -> None:
    """With no saved state: "not started" (exit 2) when every host answered `status` and
    none holds a trace of a run (a supervisor, its exit, a rank's pid)."""
    ran = any(reply.get("supervisor") or reply.get("host_exit")
              or any(r.get("pid") is not None for r in reply["ranks"])
              for reply in result.ok.values())
    if not ran and not session.failed and not result.failed:
        require_state(session.cluster)


def open_job(cluster: Cluster, st: job_state.JobState | None,
             hosts: tuple[Host, ...] | None = None) -> Session:
    """open_session for a job that may have run without saving its state (see
    saved_state): then one `status` round trip on the same agents tells whether it ran."""
    session = open_session(cluster, st, hosts)
    if st is not None:
        return session
    try:
        require_a_run(session, session.status())
    except BaseException:
        session.close()
        raise
    return session


def unreachable(cluster: Cluster, failed: dict[int, BaseException]) -> dict[str, str]:
    """--json: the hosts that could not be reached or answer, and why."""
    return {cluster.hosts[i].label: str(e) for i, e in sorted(failed.items())}


def emit_json(obj: Any) -> None:
    """The one JSON document of a command run with --json, on stdout."""
    sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")
    sys.stdout.flush()


def wants_json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))
