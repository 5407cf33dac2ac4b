"""What the hosts say of a job: every rank's status, a job array's tasks, its results.

These calls report: a host that cannot be reached or answer is named in the result
(`unreachable`), never raised, and a failed rank is a state, not an exception."""
from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import replace

from orchestrator.api import jobs
from orchestrator.api.outcomes import (
    ArrayStatus,
    GpuStatus,
    RankStatus,
    Restart,
    Results,
    Status,
)
from orchestrator.arrays import plan
from orchestrator.arrays import results as array_results
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import UsageError
from orchestrator.remote.fanout import GroupResult
from orchestrator.remote.link import Link
from orchestrator.session import state as job_state
from orchestrator.session.network import PlanDoc
from orchestrator.session.replies import GpuReply, RankReply, StatusReply
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.ui.wording import hint_cmd
from orchestrator.watch import curvefetch
from orchestrator.watch.events import runtime_of, state_text


def rank_status(rank: int, host: str, local: int, info: RankReply,
                offset: float) -> RankStatus:
    """One rank from its host's `status` reply; its runtime on the host's clock (`offset`
    from ours) while it runs."""
    state = state_text(info.state, info.code)
    runtime = runtime_of(info.started, info.ended, offset)
    return RankStatus(rank=rank, host=host, local_rank=local, pid=info.pid, state=state,
                      exit_code=info.code, runtime_s=runtime,
                      last_line=info.last_line, log_bytes=info.log_bytes)


def rank_statuses(cluster: Cluster, result: GroupResult[StatusReply]) -> list[RankStatus]:
    """Every rank, `unreachable` where its host did not answer."""
    out = []
    for h in cluster.hosts:
        reply = result.ok.get(h.index)
        for local, rank in enumerate(h.ranks):
            info = reply.ranks[local] if reply else RankReply(rank, "unreachable")
            offset = reply.time - time.time() if reply else 0.0
            out.append(rank_status(rank, h.label, local, info, offset))
    return out


def status(inventory: jobs.Inventory) -> Status:
    """`orch status` of a distributed job: every rank, and every GPU of its hosts with
    `gpus:` (whose it is). With no saved state the hosts are asked at the inventory's job
    folders; "not started" (UsageError) when none holds a trace of a run. A job array's
    tasks: `array_status`.

    One visit per host (Session.visit): log in, ask, fetch its metrics files, let go;
    at most VISIT_LIMIT hosts' agents are alive at once beside the job."""
    cluster = jobs.run_cluster(inventory)
    if cluster.job.array is not None:
        raise jobs.kind_error(cluster, "a job array", "array_status")
    st = jobs.saved_state(cluster)
    session = jobs.new_session(cluster, st)
    fetch = metrics_round(session, st)

    def ask(h: Host, link: Link) -> StatusReply:
        reply = session.status_on(h, link)
        if fetch is not None:
            fetch.host(h, link)
        return reply
    try:
        result = session.visit(ask)
    finally:
        if fetch is not None:
            fetch.save()
    if st is None:
        jobs.require_a_run(session, result)
    return with_latest(session.cluster, status_of(session, st, result), fetched=fetch is not None
                       or st is None)


def watch(inventory: jobs.Inventory, every: float = 2.0,
          rounds: int | None = None) -> Generator[Status, None, None]:
    """`orch status --watch`: a Status every `every` seconds (`rounds` of them, or until
    the caller stops), over one session: the hosts are logged in to once."""
    cluster = jobs.run_cluster(inventory)
    if cluster.job.array is not None:
        raise jobs.kind_error(cluster, "a job array", "array_status")
    st = jobs.saved_state(cluster)
    session = jobs.open_session(cluster, st)
    try:
        done = 0
        while rounds is None or done < rounds:
            t0 = time.monotonic()
            result = session.status()
            if st is None and done == 0:
                jobs.require_a_run(session, result)
            yield with_metrics(session, st, status_of(session, st, result))
            done += 1
            if rounds is None or done < rounds:
                time.sleep(max(0.0, every - (time.monotonic() - t0)))
    finally:
        session.close()


def metrics_round(session: Session, st: JobState | None) -> curvefetch.Round | None:
    """A fetch round of the job's metrics files into this run's outputs/<name>/; None
    when there is no run to fetch for, or that folder holds an earlier run's files:
    `orch status` moves nothing (the pull or the attached run sets them aside, and says
    so) and shows no stale metric."""
    from orchestrator.api import pulling
    if st is None or pulling.earlier_run(session.cluster, st) is not None:
        return None
    pulling.adopt(session.cluster, st)
    return curvefetch.Round(session)


def with_metrics(session: Session, st: JobState | None, status: Status) -> Status:
    """Each rank's latest metric values from the job's own files: one fetch round of
    them on the open links, then the local copies read."""
    fetch = metrics_round(session, st)
    if fetch is not None:
        curvefetch.once(session, fetch.notes)
    return with_latest(session.cluster, status, fetched=fetch is not None or st is None)


def with_latest(cluster: Cluster, status: Status, fetched: bool) -> Status:
    """Each rank's latest metric values from the local copies of its files (none when
    they hold an earlier run's: `fetched` is False). A file whose rank is not known
    counts as its host's first rank's."""
    from orchestrator.watch import curves
    latest = curves.latest(curves.read_curves(cluster)) if fetched else {}
    if not latest:
        return status
    first = {h.label: h.ranks.start for h in cluster.hosts if len(h.ranks)}

    def of(r: RankStatus) -> dict[str, float]:
        got = dict(latest.get((r.host, None), {})) if first.get(r.host) == r.rank else {}
        got.update(latest.get((r.host, r.rank), {}))
        return got
    return replace(status, ranks=[replace(r, metrics=of(r)) for r in status.ranks])


def status_of(session: Session, st: JobState | None,
              result: GroupResult[StatusReply]) -> Status:
    cluster = session.cluster
    failed = {**session.failed, **result.failed}
    gpus = gpu_statuses(session, st, result)
    errors = {cluster.hosts[i].label: r.gpu_error for i, r in result.ok.items()
              if r.gpu_error is not None}
    restarts = [Restart(a.attempt, a.of, a.why, a.at, list(a.hosts))
                for a in st.attempts] if st is not None else []
    return Status(job=cluster.name, ranks=rank_statuses(cluster, result),
                  unreachable=jobs.labelled(cluster, failed), gpus=gpus, gpu_errors=errors,
                  restarts=restarts, network=saved_network(cluster, st),
                  unreached=dict(session.failed), unanswered=dict(result.failed))


def saved_network(cluster: Cluster, st: JobState | None) -> PlanDoc | None:
    """The network plan this run's `up` proved and saved (session/network.save)."""
    from orchestrator.session import network
    return network.load(cluster, st.run_id) if st is not None else None


def gpu_statuses(session: Session, st: JobState | None,
                 result: GroupResult[StatusReply]) -> list[GpuStatus]:
    """Every GPU the hosts reported, with its holder: this job's (its ranks by the
    GPUs it claimed, in local rank order), another orch job's, or foreign processes."""
    out = []
    for h in session.cluster.hosts:
        reply = result.ok.get(h.index)
        rec = session.records[h.index]
        claimed = claimed_ids(h.index, st)
        for g in reply.gpus if reply else ():
            out.append(gpu_status(h.label, g, rec.job_dir, rec.part,
                                  ranks_on(g.index, claimed, h.ranks)))
    return out


def claimed_ids(index: int, st: JobState | None) -> list[int]:
    if st is None or index >= len(st.hosts):
        return []
    return list(st.hosts[index].gpu_ids or ())


def ranks_on(gpu: int, claimed: list[int], ranks: range) -> list[int]:
    """Local rank l sees the claimed GPU l first (CUDA_VISIBLE_DEVICES' order)."""
    return [ranks[claimed.index(gpu)]] if gpu in claimed and claimed.index(gpu) < len(ranks) \
        else []


def gpu_status(host: str, g: GpuReply, job_dir: str, part: str,
               ranks: list[int]) -> GpuStatus:
    holder = g.holder
    facts = GpuStatus(host=host, index=g.index, name=g.name, holder="free", util=g.util,
                      mem_used=g.mem_used, mem_total=g.mem_total, pids=[p.pid for p in g.procs])
    if holder is None:
        return facts
    if "pids" in holder:
        users = [p.user for p in g.procs]
        return replace(facts, holder="process", user=users[0] if users else None)
    mine = holder.get("job_dir") == job_dir and holder.get("part") in (part, None)
    return replace(facts, holder="this job" if mine else "job", job=str(holder.get("job", "?")),
                   user=str(holder.get("user", "?")), ranks=ranks if mine else [])


def array_status(inventory: jobs.Inventory) -> ArrayStatus:
    """`orch status` of a job array: every task's args, host and slot, state, runtime,
    last line."""
    cluster = jobs.run_cluster(inventory)
    if cluster.job.array is None:
        raise jobs.kind_error(cluster, "not a job array", "status")
    rec = plan.load(cluster)
    session = jobs.open_session(cluster, jobs.require_state(cluster))
    try:
        result = plan.host_status(session, rec)
        tasks = array_results.status_rows(cluster, rec, result)
    finally:
        session.close()
    failed = {**session.failed, **result.failed}
    return ArrayStatus(job=cluster.name, tasks=tasks, unreachable=jobs.labelled(cluster, failed),
                       unreached=dict(session.failed), unanswered=dict(result.failed))


def results(inventory: jobs.Inventory) -> Results:
    """`orch results`: a job array's tasks, the last row of each one's metrics.csv, and
    the groups over folds (mean, sample std); also written to .orch/<name>/results.csv."""
    cluster = jobs.run_cluster(inventory)
    if cluster.job.array is None:   # the CLI's message
        raise UsageError(f"{cluster.path.name}: job '{cluster.name}' is not a job array",
                         hint="add `array:` under `job:` (see the README's Job arrays), "
                              f"or use `{hint_cmd(cluster, 'status')}`")
    rec = plan.load(cluster)
    session = jobs.open_session(cluster, jobs.require_state(cluster))
    try:
        return results_of(session, rec)
    finally:
        session.close()


CURVE_METRICS = ("val_acc", "val/acc", "accuracy", "acc", "val_loss", "val/loss", "loss",
                 "train_loss", "train/loss")   # a task's curve: the first of these it has
CURVE_POINTS = 200                             # values kept (the last ones)


def task_curve(cluster: Cluster, task: int) -> tuple[str, list[float]]:
    """(its metric, its values): one metric of the task's files, epoch by epoch (or step
    by step), from the local copies; ("", []) when it wrote none."""
    from orchestrator.watch import curves
    found = {s.name: s for s in curves.read_curves(cluster, task=task)}
    name = next((m for m in CURVE_METRICS if m in found), None) or next(iter(sorted(found)), None)
    if name is None:
        return "", []
    return name, [p.value for p in found[name].points][-CURVE_POINTS:]


def results_of(session: Session, rec: plan.ArrayRecord) -> Results:
    """The results over an open session (`up` of an attached array ends with them)."""
    cluster = session.cluster
    status = plan.host_status(session, rec)
    fetched = plan.host_results(session, rec)
    rows = array_results.result_rows(rec, array_results.status_rows(cluster, rec, status), fetched)
    from orchestrator.api import pulling
    st = job_state.load(cluster)
    aside = pulling.own_outputs(cluster, st, new_run=False) if st is not None else None
    curvefetch.once(session)   # each task's metrics files, for its curve
    path = cluster.state_dir / "results.csv"
    array_results.write_csv(path, rows)
    tasks = []
    for r in rows:
        metric, curve = task_curve(cluster, r.task)
        tasks.append(replace(r, curve_metric=metric, curve=curve) if metric else r)
    moved = (str(pulling.default_dest(cluster)), str(aside)) if aside else None
    return Results(job=cluster.name, tasks=tasks, groups=array_results.group(rows), csv=path,
                   unreached=dict(session.failed), earlier_run=moved)
