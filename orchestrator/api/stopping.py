"""`stop`: every process of the job on every host, verified gone."""
from __future__ import annotations

from collections.abc import Iterable

from orchestrator.api import jobs
from orchestrator.api.outcomes import StopResult
from orchestrator.config.inventory import Cluster
from orchestrator.errors import GroupError, HostError
from orchestrator.remote.fanout import GroupResult
from orchestrator.session import state as job_state
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import timeouts


def stop(inventory: jobs.Inventory, *, grace: float = timeouts.STOP_GRACE,
         warn: jobs.Warn | None = None) -> StopResult:
    """SIGTERM, `grace` seconds, SIGKILL, then verify, on every host in parallel.
    Idempotent: a stopped job stops again with success. A damaged state is warned about
    (`warn`, default: the `orchestrator` logger) and the job is found by its marker.

    Raises GroupError (exit code 3) when a host could not be reached or stopped, or a
    process survived SIGKILL, after every other host was stopped; its `result` is this
    StopResult, its `failures` each failed host's exception."""
    cluster = jobs.run_cluster(inventory)
    # a damaged state.json must not keep a job from being stopped: the processes are
    # found by their marker under the inventory's job folders
    st = job_state.load_or_warn(cluster, warn or jobs.log.warning)
    session = jobs.open_session(cluster, st)
    try:
        result = session.stop(max(0.0, grace))
    finally:
        session.close()
    failures = {**session.failed, **result.failed}
    done = StopResult(job=cluster.name,
                      hosts={cluster.hosts[i].label: r for i, r in sorted(result.ok.items())},
                      failed=jobs.labelled(cluster, failures), failures=failures)
    if failures:
        GroupResult(failed=failures).raise_failures(cluster.hosts, "to stop", result=done,
                                                    hint=not_stopped(cluster, failures))
    left = {i: cluster.hosts[i].label for i, r in result.ok.items() if r.left}
    if left:
        raise GroupError(
            f"processes of job '{cluster.name}' survived SIGKILL on {', '.join(left.values())}",
            {i: HostError(f"{label}: {result.ok[i].describe()}") for i, label in left.items()},
            left, result=done,
            hint="they may be stuck in the kernel (D state, e.g. a hung GPU driver); "
                 "check them with ps on those hosts")
    return done


def not_stopped(cluster: Cluster, failed: Iterable[int]) -> str:
    """What a host that could not be stopped may still run, and how to finish: a failed
    stop there means its ranks were never signalled, and `status` would show them
    running once the host is back."""
    held = []
    for i in sorted(failed):
        h = cluster.hosts[i]
        if cluster.job.array is not None:
            held.append(f"the tasks on {h.label}")
        elif len(h.ranks) == 1:
            held.append(f"rank {h.ranks.start} on {h.label}")
        else:
            held.append(f"ranks {h.ranks.start}-{h.ranks.stop - 1} on {h.label}")
    return (f"{', '.join(held)} {'are' if len(held) > 1 or 'ranks' in held[0] else 'is'} "
            f"NOT stopped and may still be running; once the host is reachable, "
            f"`{hint_cmd(cluster, 'stop')}` again finishes the stop "
            "(the other hosts are stopped)")
