"""Job arrays on the controller: dealing tasks to hosts, each task's command line, the
array's record in `.orch/<name>/array.json`, and the launch on every host.

The controller deals the tasks up front (see `deal`); each host's runner
(agent/array.py) then works through its own queue, so the array goes on without the
controller.
"""
from __future__ import annotations

import json
import shlex
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypedDict, TypeVar

from orchestrator.config.arrayspec import ArraySpec
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import UsageError
from orchestrator.remote.fanout import GroupResult, fan_out
from orchestrator.remote.link import Body, Link
from orchestrator.session.launch import rank_env
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.state import write_record
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import timeouts


@dataclass(frozen=True)
class ArrayRecord:
    """What later commands need: each task's args and host (from the `up` that dealt them)."""

    run_id: str
    keys: list[str]
    args: list[list[str]]          # task i's own args
    host: list[int]                # task i's host index
    procs_per_task: int

    def tasks_of(self, host: int) -> list[int]:
        return [i for i, h in enumerate(self.host) if h == host]


class TaskSpec(TypedDict):
    """One task of a host's `array_launch` spec: its index, command line and args."""

    i: int
    argv: list[str]
    args: str


class _HostSpec(TypedDict):
    run_id: str
    slots: int
    env: dict[str, str]
    tasks: list[TaskSpec]


class HostSpec(_HostSpec, total=False):
    """A host's `array_launch` spec (agent/array.py reads it); the GPUs only with
    gpus_per_task."""

    gpus: list[int]
    gpus_per_task: int


@dataclass(frozen=True)
class TaskReply:
    """One task in a host's `array_status` reply (protocol.py's TASK_STATUS); times on
    the host's clock."""

    task: int
    state: str
    last_line: str = ""
    slot: int | None = None
    started: float | None = None
    code: int | None = None
    ended: float | None = None

    @classmethod
    def of(cls, t: Mapping[str, Any]) -> TaskReply:
        return cls(t["task"], t["state"], t["last_line"], t.get("slot"), t.get("started"),
                   t.get("code"), t.get("ended"))


@dataclass(frozen=True)
class ArrayStatus:
    """A host's `array_status` replies (its batches) together: its clock at the last
    one, and each of its tasks."""

    time: float
    tasks: tuple[TaskReply, ...]


@dataclass(frozen=True)
class TaskMetrics:
    """One task in an `array_results` reply (TASK_RESULT): its metrics.csv's header and
    last row, None where it wrote none."""

    task: int
    header: str | None
    last: str | None


def slots(host: Host, spec: ArraySpec) -> int:
    """Tasks at once on the host: by its processes, and with gpus_per_task by its GPUs
    (those it claimed, once claimed): a task waits for a free GPU as for a free slot."""
    by_procs = host.procs // spec.procs_per_task
    if not spec.gpus_per_task:
        return by_procs
    gpus = len(host.gpu_ids) if host.gpu_ids is not None else host.gpus
    return min(by_procs, gpus // spec.gpus_per_task)


def deal(cluster: Cluster, spec: ArraySpec) -> list[int]:
    """The host of each task: round-robin over the slots, one slot of each host per round
    (a host with 4 slots gets 4 tasks for every 1 of a host with 1 slot), so the first
    tasks start at once everywhere and every host's queue is about as long, in tasks."""
    order: list[int] = []
    most = max(slots(h, spec) for h in cluster.hosts)
    for r in range(most):
        order += [h.index for h in cluster.hosts if slots(h, spec) > r]
    return [order[i % len(order)] for i in range(len(spec.tasks))]


def task_argv(cluster: Cluster, python: str, job_dir: str, i: int, part: str = "") -> list[str]:
    """procs_per_task 1: the entrypoint with python itself (no torchrun, no process group);
    more: a torchrun of its own (--standalone: its own rendezvous on a free port)."""
    job, spec = cluster.job, cluster.job.array
    assert spec is not None
    target = ["-m", job.entrypoint] if job.is_module else [job.entrypoint]
    args = [*job.args, *spec.tasks[i]]
    if spec.procs_per_task == 1:
        return [python, "-u", *target, *args]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(spec.procs_per_task),
            "--log-dir", f"{job_dir}/run/{part + '/' if part else ''}torchrun-task-{i}", *target, *args]


def host_spec(cluster: Cluster, host: Host, python: str, job_dir: str, run_id: str,
              tasks: list[int]) -> HostSpec:
    spec = cluster.job.array
    assert spec is not None
    env, n = rank_env(cluster, host, job_dir, run_id), slots(host, spec)
    each = [TaskSpec(i=i, argv=task_argv(cluster, python, job_dir, i, host.part),
                     args=shlex.join(spec.tasks[i])) for i in tasks]
    if spec.gpus_per_task:
        return HostSpec(run_id=run_id, slots=n, env=env, gpus=list(host.gpu_ids or ()),
                        gpus_per_task=spec.gpus_per_task, tasks=each)
    return HostSpec(run_id=run_id, slots=n, env=env, tasks=each)


def launch_all(cluster: Cluster, links: dict[int, Link], pre: PreflightReport
               ) -> tuple[ArrayRecord, dict[int, Supervisor]]:
    """Start every host's runner in parallel; raise naming every host that failed."""
    spec = cluster.job.array
    assert spec is not None
    rec = ArrayRecord(uuid.uuid4().hex, list(spec.keys), [list(t) for t in spec.tasks],
                      deal(cluster, spec), spec.procs_per_task)

    def one(h: Host) -> Supervisor:
        info = pre.hosts[h.index]
        body = host_spec(cluster, h, info.executable, info.job_dir, rec.run_id, rec.tasks_of(h.index))
        reply = links[h.index].request("array_launch", timeouts.LAUNCH, job_dir=info.job_dir,
                                       spec=body)
        return Supervisor.of(reply["supervisor"])
    result = fan_out(cluster.hosts, one)
    result.raise_failures(cluster.hosts, "to start")
    return rec, result.ok


# ---------------------------------------------------------------- the record

def record_path(cluster: Cluster) -> Path:
    return cluster.state_dir / "array.json"


def save(cluster: Cluster, rec: ArrayRecord) -> None:
    write_record(record_path(cluster), rec.__dict__)


def load(cluster: Cluster) -> ArrayRecord:
    """The array `orch up` started from this inventory; a usage error naming the fix."""
    path = record_path(cluster)
    fix = f"start it with `{hint_cmd(cluster, 'up')}`"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        rec = ArrayRecord(str(raw["run_id"]), list(raw["keys"]), raw["args"], raw["host"],
                          int(raw["procs_per_task"]))
    except FileNotFoundError:
        raise UsageError(f"job array '{cluster.name}' has not been started from {cluster.path}",
                         hint=fix) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: the array's record is damaged ({exc})", hint=fix) from None
    good = (len(rec.args) == len(rec.host)
            and all(isinstance(h, int) and 0 <= h < len(cluster.hosts) for h in rec.host)
            and all(isinstance(a, list) and all(isinstance(x, str) for x in a) for a in rec.args))
    if not good:
        raise UsageError(f"{path}: the array's record does not match {cluster.path.name}'s hosts",
                         hint=fix)
    return rec


def task_of(rec: ArrayRecord, task: int) -> int:
    """Task's host, or a usage error naming the tasks there are."""
    if not 0 <= task < len(rec.host):
        raise UsageError(f"task {task} does not exist: this array has tasks 0 to {len(rec.host) - 1}",
                         hint=f"give a task from 0 to {len(rec.host) - 1}")
    return rec.host[task]


def start(session: Session, pre: PreflightReport) -> tuple[ArrayRecord, dict[int, Supervisor]]:
    """Every host's runner, all or none (like `Session.launch`)."""
    try:
        return launch_all(session.cluster, session.links, pre)
    except BaseException:
        session.stop(0)
        raise


Reply = TypeVar("Reply")


def host_status(session: Session, rec: ArrayRecord) -> GroupResult[ArrayStatus]:
    """Each host's `array_status` of its tasks."""
    def merged(replies: list[Body]) -> ArrayStatus:
        tasks = tuple(TaskReply.of(t) for r in replies for t in r["tasks"])
        return ArrayStatus(float(replies[-1]["time"]), tasks)
    return host_request(session, "array_status", rec, merged)


def host_results(session: Session, rec: ArrayRecord) -> GroupResult[tuple[TaskMetrics, ...]]:
    """Each host's `array_results`: its tasks' last metrics rows."""
    def merged(replies: list[Body]) -> tuple[TaskMetrics, ...]:
        return tuple(TaskMetrics(t["task"], t["header"], t["last"])
                     for r in replies for t in r["tasks"])
    return host_request(session, "array_results", rec, merged)


def host_request(session: Session, command: str, rec: ArrayRecord,
                 decode: Callable[[list[Body]], Reply], batch: int = 1000) -> GroupResult[Reply]:
    """`command` on each host for its tasks, in batches (a reply stays far under the
    frame cap); `decode` makes one host's reply of its batches' replies."""
    links = session.links
    hosts = tuple(h for h in session.cluster.hosts if h.index in links)

    def one(h: Host) -> Reply:
        mine = rec.tasks_of(h.index)
        return decode([links[h.index].request(command, timeouts.STATUS,
                                              job_dir=session.records[h.index].job_dir,
                                              tasks=mine[at:at + batch])
                       for at in range(0, max(len(mine), 1), batch)])
    return fan_out(hosts, one)
