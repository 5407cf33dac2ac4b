"""What every command needs: the inventory, connections, a console for messages."""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.markup import escape

from orchestrator import state as job_state
from orchestrator.connect import GroupResult, close_all, connect_all
from orchestrator.errors import UsageError
from orchestrator.inventory import Cluster, load
from orchestrator.transport import Transport

# Messages and progress go to stderr; stdout carries only the job's output (it pipes).
console = Console(stderr=True, highlight=False, soft_wrap=True)


def inventory(args: argparse.Namespace) -> Cluster:
    path = Path(getattr(args, "file", None) or args.config)
    if not path.exists():
        raise UsageError(f"{path}: no such inventory file",
                         hint="run in the folder of your cluster.yaml, or pass -c FILE")
    return load(path)


def connected(cluster: Cluster, done=None,
              hosts=None) -> tuple[dict[int, Transport], dict[int, BaseException]]:
    result = connect_all(cluster.hosts if hosts is None else hosts, cluster.base_dir, done)
    return result.ok, result.failed


@contextmanager
def connections(cluster: Cluster, require_all: bool = True,
                hosts=None) -> Iterator[dict[int, Transport]]:
    """Open each host's connection (every host, or `hosts`) once for the whole command;
    close them at the end."""
    transports, failed = connected(cluster, hosts=hosts)
    try:
        if failed and require_all:
            GroupResult(failed=failed).raise_failures(cluster.hosts, "to connect")
        for i, exc in failed.items():
            console.print(f"[yellow]warning:[/] {escape(str(exc))}")
        yield transports
    finally:
        close_all(transports)


def require_state(cluster: Cluster) -> job_state.JobState:
    st = job_state.load(cluster)
    if st is None:
        raise UsageError(f"job '{cluster.name}' has not been started from {cluster.path}",
                         hint=f"start it with `orch up {cluster.path.name}`")
    return st
