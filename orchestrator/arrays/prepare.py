"""A job array before it starts: what each host must hold (the code, and the whole
dataset as one task sees it), and the plan `up --dry-run` prints."""
from __future__ import annotations

from dataclasses import replace

from orchestrator.arrays import plan
from orchestrator.config.inventory import Cluster, RankSlot
from orchestrator.files.localfiles import HOLD, DigestCache, check_entrypoint, code_files
from orchestrator.files.shards import host_files, load_split
from orchestrator.remote.transport import remote_command
from orchestrator.session.session import HostFiles


def data_view(cluster: Cluster) -> Cluster:
    """The inventory as the data sees an array: one task is the whole world (procs_per_task
    ranks), so the split is `orch split-data --workers <procs_per_task>` and every host
    holds all of its shards."""
    assert cluster.job.array is not None
    ppt = cluster.job.array.procs_per_task
    return replace(cluster, world_size=ppt, ranks=tuple(RankSlot(r, 0, r) for r in range(ppt)))


def array_files(cluster: Cluster) -> dict[int, HostFiles]:
    cache = DigestCache(cluster.state_dir.parent / "digests.bin", hold=HOLD)
    check_entrypoint(cluster.base_dir, cluster.code.paths, cluster.code.exclude,
                     cluster.job.entrypoint, str(cluster.path))
    code = code_files(cluster.base_dir, cluster.code.paths, cluster.code.exclude, cache,
                      str(cluster.path))
    data = None
    if cluster.data.shards:
        view = data_view(cluster)
        whole = replace(cluster.hosts[0], first_rank=0, procs=view.world_size)
        data = host_files(view, whole, load_split(view, cache), cache)
    cache.save()
    return {h.index: HostFiles(code, data) for h in cluster.hosts}


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
