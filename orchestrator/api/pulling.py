"""`pull`: files from a host's job output/ to this machine, incrementally and verified."""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

from orchestrator.api import jobs
from orchestrator.api.outcomes import PullResult
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import OrchError, UsageError
from orchestrator.files.pull import PullReport, check_paths, raise_failed
from orchestrator.files.pulldest import set_aside
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
    st = job_state.load(cluster)
    out, aside = (Path(dest).absolute(), None) if dest else run_dest(cluster, st)
    session = jobs.open_session(cluster, st, hosts=(source,))
    try:
        session.require_all("to connect")
        return pull_on(session, source, rel, out, progress, aside)
    finally:
        session.close()


def job_output(session: Session, progress: Progress = quiet) -> PullResult:
    """`up`'s pull when the job ended: rank 0's output/ on the up's open links."""
    cluster = session.cluster
    dest, aside = run_dest(cluster, job_state.load(cluster))
    return pull_on(session, cluster.host_of(0), [], dest, progress, aside)


def run_dest(cluster: Cluster, st: job_state.JobState | None) -> tuple[Path, Path | None]:
    """outputs/<name>/, holding this run's files only: when it holds an earlier run's
    (`.orch/<name>/pulled-run.json` says which), that folder is renamed first to
    outputs/<name>.<when that run started>/, so runs never mix and nothing is deleted.
    (the destination, where the earlier run's files went or None)."""
    dest, record = default_dest(cluster), cluster.state_dir / "pulled-run.json"
    if st is None:   # an `up` killed before it saved its run: nothing to tell runs apart
        return dest, None
    try:
        held = json.loads(record.read_text())
    except (OSError, ValueError):
        held = {}
    aside = None
    earlier = isinstance(held, dict) and held.get("run_id") not in (None, st.run_id)
    if earlier and dest.is_dir() and not dest.is_symlink() and any(dest.iterdir()):
        started = held.get("started")
        when = time.localtime(started if isinstance(started, (int, float)) else None)
        aside = set_aside(dest, time.strftime("%Y%m%d-%H%M%S", when))
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"run_id": st.run_id, "started": st.started}))
    return dest, aside


def pull_on(session: Session, host: Host, paths: list[str], dest: Path,
            progress: Progress = quiet, aside: Path | None = None) -> PullResult:
    with progress(host.label) as shown:
        report = session.pull(host, paths, dest, shown.received, shown.planned)
    result = as_result(report, aside)
    try:
        raise_failed(report)
    except OrchError as e:
        e.result = result
        raise
    return result


def as_result(r: PullReport, aside: Path | None = None) -> PullResult:
    return PullResult(host=r.host, source=r.source, destination=r.dest, files=r.files,
                      bytes=r.bytes, unchanged=r.unchanged, listed=r.listed,
                      skipped=list(r.skipped), skipped_count=r.skipped_count,
                      failed=list(r.failed), earlier_run=str(aside) if aside else None)


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
