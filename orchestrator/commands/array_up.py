"""`orch up` for a job array: every host gets the code and the whole dataset, a runner
per host works through its share of the tasks; followed until every task ended, then
the results."""
from __future__ import annotations

import argparse
from dataclasses import replace

from orchestrator.arrays import plan
from orchestrator.arrays.attach import attach_array
from orchestrator.commands.common import console, emit_json, hint_cmd
from orchestrator.commands.results import show
from orchestrator.config.inventory import Cluster, RankSlot
from orchestrator.errors import EXIT_OK
from orchestrator.files.localfiles import DigestCache, check_entrypoint, code_files
from orchestrator.files.shards import host_files, load_split
from orchestrator.remote.transport import remote_command
from orchestrator.session import state as job_state
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import HostFiles, Session


def data_view(cluster: Cluster) -> Cluster:
    """The inventory as the data sees an array: one task is the whole world (procs_per_task
    ranks), so the split is `orch split-data --workers <procs_per_task>` and every host
    holds all of its shards."""
    assert cluster.job.array is not None
    ppt = cluster.job.array.procs_per_task
    return replace(cluster, world_size=ppt, ranks=tuple(RankSlot(r, 0, r) for r in range(ppt)))


def array_files(cluster: Cluster) -> dict[int, HostFiles]:
    cache = DigestCache(cluster.state_dir.parent / "digests.json")
    check_entrypoint(cluster.base_dir, cluster.code.paths, cluster.code.exclude,
                     cluster.job.entrypoint, str(cluster.path))
    code = code_files(cluster.base_dir, cluster.code.paths, cluster.code.exclude, cache,
                      str(cluster.path))
    data = None
    if cluster.data.shards:
        view = data_view(cluster)
        whole = replace(cluster.hosts[0], first_rank=0, procs=view.world_size)
        data = host_files(view, whole, load_split(view), cache)
    cache.save()
    return {h.index: HostFiles(code, data) for h in cluster.hosts}


def up_array(session: Session, pre: PreflightReport, args: argparse.Namespace) -> int:
    cluster = session.cluster
    rec, sups = plan.start(session, pre)
    st = job_state.new_state(cluster, rec.run_id, "-", 0, pre.hosts, sups)
    job_state.save(cluster, st)
    plan.save(cluster, rec)
    spec = cluster.job.array
    assert spec is not None
    total = sum(plan.slots(h, spec) for h in cluster.hosts)
    console.print(f"started job array '{cluster.name}': {len(rec.host)} tasks on "
                  f"{len(cluster.hosts)} hosts, {total} at a time")
    if args.detach:
        console.print(f"detached: watch with `{hint_cmd(cluster, 'status')}`, "
                      f"`{hint_cmd(cluster, 'logs -f')}`; results with `{hint_cmd(cluster, 'results')}`; "
                      f"stop with `{hint_cmd(cluster, 'stop')}`", markup=False)
        if args.json:
            emit_json({"job": cluster.name, "run_id": rec.run_id, "tasks": len(rec.host),
                       "hosts": [{"host": h.label, "job_dir": h.job_dir, "tasks": rec.tasks_of(h.index)}
                                 for h in st.hosts]})
        return EXIT_OK
    code = attach_array(session, rec, args.fail_fast)
    show(session, rec, as_json=False)
    return code


def array_plan(cluster: Cluster) -> str:
    spec = cluster.job.array
    assert spec is not None
    hosts = plan.deal(cluster, spec)
    lines = [f"job array {cluster.name}: {len(spec.tasks)} tasks, {spec.procs_per_task} "
             f"process(es) each, on {len(cluster.hosts)} hosts"]
    if cluster.data.shards:
        lines.append(f"push data: {cluster.data.shards}/worker_<r>_of_{spec.procs_per_task} "
                     "-> <job dir>/data/ on every host (the whole dataset)")
    for h in cluster.hosts:
        mine = [i for i, x in enumerate(hosts) if x == h.index]
        lines.append(f"host {h.index} {h.label}: {plan.slots(h, spec)} at a time, "
                     f"{len(mine)} tasks queued")
        job_dir = f"{h.remote_dir.rstrip('/')}/{cluster.name}"
        for i in mine[:3]:
            lines.append(f"  task {i}: " + remote_command(plan.task_argv(cluster, h.python, job_dir, i, h.part)))
        if len(mine) > 3:
            lines.append(f"  ... {len(mine) - 3} more")
    return "\n".join(lines)
