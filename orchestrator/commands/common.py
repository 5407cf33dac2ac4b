"""What every command needs: the inventory, a session on its hosts, messages."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from orchestrator import state as job_state
from orchestrator.errors import UsageError
from orchestrator.inventory import Cluster, load
from orchestrator.session import Session
from orchestrator.ui import console

__all__ = ["console", "inventory", "require_state", "open_session", "warn_unreachable"]


def inventory(args: argparse.Namespace) -> Cluster:
    path = Path(getattr(args, "file", None) or args.config)
    if not path.exists():
        raise UsageError(f"{path}: no such inventory file",
                         hint="run in the folder of your cluster.yaml, or pass -c FILE")
    return load(path)


def open_session(cluster: Cluster, state: job_state.JobState | None = None,
                 hosts=None) -> Session:
    """A session with every host's (or `hosts`') agent started; the caller closes it."""
    session = Session(cluster, state)
    try:
        return session.open(hosts)
    except BaseException:
        session.close()
        raise


def warn_unreachable(session: Session) -> None:
    for exc in session.failed.values():
        console.print(f"[yellow]warning:[/] {escape(str(exc))}")


def require_state(cluster: Cluster) -> job_state.JobState:
    st = job_state.load(cluster)
    if st is None:
        raise UsageError(f"job '{cluster.name}' has not been started from {cluster.path}",
                         hint=f"start it with `orch up {cluster.path.name}`")
    return st
