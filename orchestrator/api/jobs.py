"""What every call needs: the inventory, a session on the job's hosts, the job's saved
state (or, after an `up` killed mid-launch, the hosts asked whether it ran).

The other api modules call these through the module (`jobs.open_session(...)`), so a
test replaces one name here to run every call over in-process agents.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Union

from orchestrator.config.inventory import Cluster, Host, load
from orchestrator.errors import UsageError
from orchestrator.remote.fanout import GroupResult
from orchestrator.session import state as job_state
from orchestrator.session.replies import StatusReply
from orchestrator.session.session import Session
from orchestrator.ui.wording import hint_cmd, set_inventory

Inventory = Union[str, "os.PathLike[str]", Cluster]   # a cluster.yaml's path, or one loaded
Warn = Callable[[str], None]

log = logging.getLogger("orchestrator")


def cluster_of(inventory: Inventory) -> Cluster:
    """The loaded inventory (an InventoryError names file and line); hints name it (-c)."""
    if isinstance(inventory, Cluster):
        set_inventory(inventory.path)
        return inventory
    path = Path(inventory)
    if not path.exists():
        raise UsageError(f"{path}: no such inventory file",
                         hint="run in the folder of your cluster.yaml, or pass -c FILE")
    set_inventory(path)
    return load(path)


def run_cluster(inventory: Inventory) -> Cluster:
    """The hosts of the job's last `up`: the inventory less what `--hosts/--exclude` left
    out (session/state.run_cluster). A damaged state gives the whole inventory: the
    call that reads the state next reports it."""
    cluster = cluster_of(inventory)
    try:
        st = job_state.load(cluster)
    except job_state.StateDamaged:
        return cluster
    return job_state.run_cluster(cluster, st)


def new_session(cluster: Cluster, state: job_state.JobState | None = None) -> Session:
    """A session of `cluster` not yet connected: every call's sessions start here (the
    tests' in-process hosts come in through it)."""
    return Session(cluster, state)


def open_session(cluster: Cluster, state: job_state.JobState | None = None,
                 hosts: tuple[Host, ...] | None = None) -> Session:
    """A session with every host's (or `hosts`') agent started; the caller closes it."""
    session = new_session(cluster, state)
    try:
        return session.open(hosts)
    except BaseException:
        session.close()
        raise


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


def state_or_warn(cluster: Cluster, warn: Warn, instead: str) -> job_state.JobState | None:
    """For stop and exec, which must work without a usable state: None, and a warning
    saying what is done `instead`."""
    try:
        return job_state.load(cluster)
    except job_state.StateDamaged as exc:
        warn(f"{exc.message}; {instead}")
        return None


def require_a_run(session: Session, result: GroupResult[StatusReply]) -> None:
    """With no saved state: "not started" (exit 2) when every host answered `status` and
    none holds a trace of a run (a supervisor, its exit, a rank's pid)."""
    ran = any(reply.ran or any(r.pid is not None for r in reply.ranks)
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


def labelled(cluster: Cluster, failed: dict[int, BaseException]) -> dict[str, str]:
    """Hosts that could not be reached or answer, by label, and why (index order)."""
    return {cluster.hosts[i].label: str(e) for i, e in sorted(failed.items())}


def kind_error(cluster: Cluster, kind: str, call: str) -> UsageError:
    """A call made for the other kind of job (distributed job, job array) than this one."""
    return UsageError(f"{cluster.path.name}: job '{cluster.name}' is {kind}",
                      hint=f"use orchestrator.api.{call}()")
