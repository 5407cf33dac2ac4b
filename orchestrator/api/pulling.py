"""`pull`: files from a host's job output/ to this machine, incrementally and verified."""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

from orchestrator.api import jobs
from orchestrator.api.outcomes import PullResult
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import OrchError, UsageError
from orchestrator.files.pull import PullReport, check_paths, raise_failed
from orchestrator.session import state as job_state
from orchestrator.session.session import Session


class Transfer:
    """How a pull shows its progress: `planned(total bytes)` once the plan is made,
    `received(n)` as bytes arrive. This one shows nothing (the CLI draws a bar)."""

    def planned(self, total: int) -> None:
        pass

    def received(self, nbytes: int) -> None:
        pass


# a pull from the host labelled so: the display around it (entered before, left after)
Progress = Callable[[str], AbstractContextManager[Transfer]]


def quiet(host: str) -> AbstractContextManager[Transfer]:
    return nullcontext(Transfer())


def pull(inventory: jobs.Inventory, paths: Sequence[str] = (), *, rank: int | None = None,
         host: str | None = None, dest: str | Path | None = None,
         progress: Progress = quiet) -> PullResult:
    """`paths` under the job's output/ (all of it by default) from the host of global
    `rank` (default 0), or from `host` (an address or label), into `dest` (default:
    outputs/<name>/ beside the inventory). Only what differs is sent; nothing local is
    deleted. A file that cannot be written here raises UsageError with `result` set."""
    cluster = jobs.run_cluster(inventory)
    rel = check_paths(list(paths))
    source = pick_host(cluster, rank, host)
    out = Path(dest).absolute() if dest else default_dest(cluster)
    session = jobs.open_session(cluster, job_state.load(cluster), hosts=(source,))
    try:
        session.require_all("to connect")
        return pull_on(session, source, rel, out, progress)
    finally:
        session.close()


def job_output(session: Session, progress: Progress = quiet) -> PullResult:
    """`up`'s pull when the job ended: rank 0's output/ on the up's open links."""
    cluster = session.cluster
    return pull_on(session, cluster.host_of(0), [], default_dest(cluster), progress)


def pull_on(session: Session, host: Host, paths: list[str], dest: Path,
            progress: Progress = quiet) -> PullResult:
    with progress(host.label) as shown:
        report = session.pull(host, paths, dest, shown.received, shown.planned)
    result = as_result(report)
    try:
        raise_failed(report)
    except OrchError as e:
        e.result = result
        raise
    return result


def as_result(r: PullReport) -> PullResult:
    return PullResult(host=r.host, source=r.source, destination=r.dest, files=r.files,
                      bytes=r.bytes, unchanged=r.unchanged, listed=r.listed,
                      skipped=list(r.skipped), skipped_count=r.skipped_count,
                      failed=list(r.failed))


def default_dest(cluster: Cluster) -> Path:
    return cluster.base_dir / "outputs" / cluster.name


def pick_host(cluster: Cluster, rank: int | None, name: str | None) -> Host:
    if name is None:
        return cluster.host_of(0 if rank is None else rank)
    found = [h for h in cluster.hosts if name in (h.label, h.address)]
    if len(found) == 1:
        return found[0]
    labels = ", ".join(h.label for h in (found or cluster.hosts))
    if found:
        raise UsageError(f"--host {name} names {len(found)} hosts ({labels})",
                         hint="give one of those labels, or use --rank R")
    raise UsageError(f"--host {name}: no such host in {cluster.path.name}",
                     hint=f"give one of: {labels}")
