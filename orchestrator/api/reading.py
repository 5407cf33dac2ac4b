"""The ranks' (or a job array's tasks') logs, read on the hosts that hold them: one
rank's raw bytes (`logs`), or every rank's lines into a sink (what `orch logs` prints)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.api import jobs
from orchestrator.arrays import plan
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import HostError, UsageError
from orchestrator.remote.link import HostDone
from orchestrator.session.state import JobState
from orchestrator.ui.wording import hint_cmd
from orchestrator.watch.follow import HostStream, Sink
from orchestrator.watch.follow import follow as follow_hosts


class RawLog:
    """A follow sink for one rank's (or task's) log, its bytes as the host sends them:
    each piece goes to `write` (here: kept, for `data()`; the CLI writes to stdout).
    `ended` is set at the end of the log (or of -f: the job's end), or when the host is
    lost (`why`) or the reader went away (`broken`: a closed pipe)."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.broken = False
        self.why = ""
        self.kept: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.kept.append(data)

    def data(self) -> bytes:
        return b"".join(self.kept)

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        if self.broken:
            return
        data = data if partial or data.endswith(b"\n") else data + b"\n"
        try:
            self.write(data)
        except BrokenPipeError:   # `orch logs ... | head` closed the pipe: fine
            self.broken = True
            self.ended.set()

    def rank_exit(self, host: int, rank: int, code: int, when: float,
                  after_stop: bool = False) -> None:
        pass

    def host_done(self, host: int, info: HostDone) -> None:
        self.ended.set()

    def host_lost(self, host: int, why: str) -> None:
        self.why = why
        self.ended.set()


def logs(inventory: jobs.Inventory, rank: int | None = None, *, task: int | None = None,
         tail: int = -1) -> bytes:
    """Global `rank`'s log (default rank 0), or a job array's `task`'s, its bytes exactly
    as written; `tail`: only the last N lines. Works while the job runs and after.
    A host lost while reading raises HostError (exit 3), the bytes read in `result`."""
    host, log = read_log(inventory, rank=rank, task=task, tail=tail, sink=RawLog())
    if log.why:
        err = HostError(f"{host}: {log.why}")
        err.result = log.data()
        raise err
    return log.data()


def read_log(inventory: jobs.Inventory, *, rank: int | None = None, task: int | None = None,
             tail: int = -1, follow: bool = False, sink: RawLog) -> tuple[str, RawLog]:
    """One rank's (or task's) log into `sink`, up to its end (with `follow`: until the job
    ends), from the host that ran it; (that host's label, the sink)."""
    cluster = jobs.run_cluster(inventory)
    host, st = log_host(cluster, rank, task)
    unit, which = ("rank", 0 if rank is None else rank) if task is None else ("task", task)
    session = jobs.open_job(cluster, st, hosts=(host,))
    try:
        session.require_all("to connect")
        extra = {"unit": unit} if unit != "rank" else {}
        session.links[host.index].follow(
            sink, job_dir=session.records[host.index].job_dir, ranks=[which], tail=tail,
            mode="raw-follow" if follow else "raw", **extra)
        while not sink.ended.wait(0.2):
            pass
    finally:
        session.close()
    return host.label, sink


def log_host(cluster: Cluster, rank: int | None, task: int | None) -> tuple[Host, JobState | None]:
    """The host that holds the log, and the job's state (checked in `orch logs`' order)."""
    st: JobState | None
    if cluster.job.array is not None:
        st = jobs.require_state(cluster)
        if rank is not None:
            raise not_ranks(cluster)
        rec = plan.load(cluster)
        if task is None:
            raise UsageError(f"job '{cluster.name}' is a job array: name the task whose log to read",
                             hint=f"use `{hint_cmd(cluster, 'logs --task I')}`")
        return cluster.hosts[plan.task_of(rec, task)], st
    if rank is not None:
        cluster.host_of(rank)   # a rank outside the job is a usage error, run or not
    st = jobs.saved_state(cluster)   # None: an `up` killed mid-launch; open_job asks the hosts
    if task is not None:
        raise UsageError(f"job '{cluster.name}' is not a job array: it has ranks, not tasks",
                         hint=f"use `{hint_cmd(cluster, 'logs --rank R')}`")
    return cluster.host_of(0 if rank is None else rank), st


def not_ranks(cluster: Cluster) -> UsageError:
    return UsageError(f"job '{cluster.name}' is a job array: it has tasks, not ranks",
                      hint=f"use `{hint_cmd(cluster, 'logs --task I')}` "
                           f"(`{hint_cmd(cluster, 'status')}` lists the tasks)")


@dataclass(frozen=True)
class Followed:
    units: list[int]                      # every rank (a job array: every task), in order
    unreached: dict[int, BaseException]   # the hosts that could not be reached


def follow_logs(inventory: jobs.Inventory, sink: Sink, *, tail: int = -1, follow: bool = False,
                unreached: Callable[[BaseException], None] | None = None) -> Followed:
    """Every rank's output (a job array: every task's) into `sink`, host by host as it
    comes; without `follow` what is there now, with it until the job ends. `unreached`
    hears of each host that could not be reached, before the reading starts."""
    cluster = jobs.run_cluster(inventory)
    units: Callable[[int], list[int]]
    unit: str | None
    if cluster.job.array is not None:
        st = jobs.require_state(cluster)
        rec = plan.load(cluster)
        session = jobs.open_session(cluster, st)
        units, unit, every = rec.tasks_of, "task", list(range(len(rec.host)))
    else:
        session = jobs.open_job(cluster, jobs.saved_state(cluster))
        units, unit = (lambda i: list(cluster.hosts[i].ranks)), None
        every = list(range(cluster.world_size))
    streams = {i: HostStream(link, session.records[i].job_dir, units(i))
               for i, link in session.links.items()}
    try:
        for exc in session.failed.values():
            if unreached is not None:
                unreached(exc)
        finished = follow_hosts(streams, sink, tail, "events" if follow else "snapshot", unit=unit)
        while not finished():
            time.sleep(0.1)
    finally:
        # ended here (Ctrl-C, SIGTERM): the connections this call closes are no lost hosts
        for s in streams.values():
            s.done = True
        session.close()
    return Followed(every, dict(session.failed))
