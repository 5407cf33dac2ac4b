"""`pull`: files from a host's job output/ to this machine, incrementally and verified."""
from __future__ import annotations

import json
import shlex
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.api import jobs
from orchestrator.api.outcomes import PullResult
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import OrchError, UsageError
from orchestrator.files.pull import PullReport, check_paths, manifest, raise_failed
from orchestrator.files.pulldest import set_aside
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.link import Link, Stream
from orchestrator.session import state as job_state
from orchestrator.session.session import Session
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import timeouts


class Transfer:
    """How a pull shows its progress: `planned(total bytes)` once the plan is made,
    `received(n)` as bytes arrive. This one shows nothing (the CLI draws a bar)."""

    def planned(self, total: int) -> None:
        pass

    def received(self, nbytes: int) -> None:
        pass


# a pull from the host labelled so: the display around it (entered before, left after)
PullShown = Callable[[str], AbstractContextManager[Transfer]]   # a pull's display, per host


def quiet(host: str) -> AbstractContextManager[Transfer]:
    return nullcontext(Transfer())


def pull(inventory: jobs.Inventory, paths: Sequence[str] = (), *, rank: int | None = None,
         host: str | None = None, dest: str | Path | None = None,
         progress: PullShown = quiet, warn: jobs.Warn | None = None) -> PullResult:
    """`paths` under the job's output/ (all of it by default) from the host of global
    `rank` (default 0), or from `host` (an address or label), into `dest` (default:
    outputs/<name>/ beside the inventory). Only what differs is sent; nothing local is
    deleted. A file that cannot be written here raises UsageError with `result` set; a
    PATH the host does not have, UsageError naming the hosts that have it. Files an
    earlier run wrote (older than this run's start there) are pulled and named to
    `warn` (default: the `orchestrator` logger)."""
    cluster = jobs.run_cluster(inventory)
    rel = check_paths(list(paths))
    source = pick_host(cluster, rank, host)
    st = job_state.load(cluster)
    out, aside = (Path(dest).absolute(), None) if dest else run_dest(cluster, st)
    session = jobs.open_session(cluster, st, hosts=(source,))
    try:
        session.require_all("to connect")
        try:
            return pull_on(session, source, rel, out, progress, aside, st, warn)
        except UsageError as e:
            if not (rel and NOT_THERE in e.message):
                raise
    finally:
        session.close()
    raise not_there(cluster, st, source, rel, rank)


def job_output(session: Session, progress: PullShown = quiet,
               aside: Path | None = None) -> PullResult:
    """`up`'s pull when the job ended: rank 0's output/ on the up's open links. `aside`:
    where an earlier run's files went when the run began (the curves' fetch made the
    folder then), said with this pull."""
    cluster = session.cluster
    st = job_state.load(cluster)
    dest, now = run_dest(cluster, st)
    return pull_on(session, cluster.host_of(0), [], dest, progress, now or aside, st)


def adopt(cluster: Cluster, st: job_state.JobState) -> None:
    """outputs/<name>/ holds this run's files from now on, as they are: a restart's
    attempt goes on with the files its run's earlier attempts brought there."""
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    (cluster.state_dir / "pulled-run.json").write_text(
        json.dumps({"run_id": st.run_id, "started": st.started}))


def run_dest(cluster: Cluster, st: job_state.JobState | None) -> tuple[Path, Path | None]:
    """outputs/<name>/, holding this run's files only: when it holds an earlier run's
    (`.orch/<name>/pulled-run.json` says which), that folder is renamed first to
    outputs/<name>.<when that run started>/, so runs never mix and nothing is deleted.
    (the destination, where the earlier run's files went or None)."""
    dest = default_dest(cluster)
    if st is None:   # an `up` killed before it saved its run: nothing to tell runs apart
        return dest, None
    aside, held = None, earlier_run(cluster, st)
    if held is not None:
        when = time.localtime(held.started)
        aside = set_aside(dest, time.strftime("%Y%m%d-%H%M%S", when))
    adopt(cluster, st)
    return dest, aside


def own_outputs(cluster: Cluster, st: job_state.JobState, new_run: bool) -> Path | None:
    """Before a run's files are fetched into outputs/<name>/ (an attached run's curves,
    a job array's task files, the dashboard's): run_dest, so that no curve or result
    mixes two runs, and the
    other hosts' copies cleared where an earlier run's folder went aside, or always at a
    new run's start (`new_run`). Where the earlier run's files went, or None."""
    from orchestrator.watch import curves
    _, aside = run_dest(cluster, st)
    if aside is not None or new_run:
        curves.clear_copies(cluster)
    return aside


@dataclass(frozen=True)
class PulledRun:
    """`.orch/<name>/pulled-run.json`: the run whose files outputs/<name>/ holds, and
    when it started (None where the record does not say)."""

    run_id: str
    started: float | None


def earlier_run(cluster: Cluster, st: job_state.JobState) -> PulledRun | None:
    """The record of the earlier run whose files outputs/<name>/ holds (None: it holds
    this run's, or nothing)."""
    dest, record = default_dest(cluster), cluster.state_dir / "pulled-run.json"
    try:
        held = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    earlier = isinstance(held, dict) and held.get("run_id") not in (None, st.run_id)
    if earlier and dest.is_dir() and not dest.is_symlink() and any(dest.iterdir()):
        started = held.get("started")
        return PulledRun(str(held["run_id"]), started if isinstance(started, (int, float)) else None)
    return None


def pull_on(session: Session, host: Host, paths: list[str], dest: Path,
            progress: PullShown = quiet, aside: Path | None = None,
            st: job_state.JobState | None = None, warn: jobs.Warn | None = None) -> PullResult:
    with progress(host.label) as shown:
        report = session.pull(host, paths, dest, shown.received, shown.planned)
    result = as_result(report, aside)
    since = run_start(st, host)
    if report.listed and since is not None:
        older = earlier(session.links[host.index], session.records[host.index].job_dir,
                        since, paths)
        if older is not None and older.count:
            (warn or jobs.log.warning)(describe(host.label, since, older))
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


# ---------------------------------------------------------------- a PATH not on that host

NOT_THERE = "no such file or folder"   # the agent's words for a PATH output/ lacks
CHECKED = 16                           # other hosts asked who has it (the first ones)


def not_there(cluster: Cluster, st: job_state.JobState | None, source: Host,
              paths: list[str], rank: int | None) -> UsageError:
    """What a user can act on: which PATHs the host lacks, and which host has them."""
    hosts = (source, *[h for h in cluster.hosts if h.index != source.index][:CHECKED])
    have = holders(cluster, st, hosts, paths)
    lacking = [p for p in paths if p not in have.get(source.index, [])] or paths
    what = f"{', '.join(lacking)} {'is' if len(lacking) == 1 else 'are'}"
    text = f"{what} not in output/ on {source.label} ({whose(source, rank)})"
    for h in hosts[1:]:
        got = [p for p in lacking if p in have.get(h.index, [])]
        if got:
            which = "it" if got == lacking else ", ".join(got)
            again = hint_cmd(cluster, f"pull --rank {h.ranks.start} {shlex.join(got)}")
            return UsageError(f"{text}; {h.label} ({whose(h, None)}) has {which}",
                              hint=f"pull it from there: `{again}`")
    asked = len(hosts) - 1
    others = "" if not asked else ", nor on the other host" if asked == 1 else \
        f", nor on any of the {asked} other hosts asked"
    listing = hint_cmd(cluster, "exec -- find output -type f")
    return UsageError(f"{text}{others}",
                      hint=f"name a path relative to the job's output/; `{listing}` lists "
                           "what each host's output/ holds (a file the job has not "
                           "written yet is not there)")


def holders(cluster: Cluster, st: job_state.JobState | None, hosts: tuple[Host, ...],
            paths: list[str]) -> dict[int, list[str]]:
    """host index -> the PATHs its output/ holds (the hosts that answer)."""
    session = Session(cluster, st)
    try:
        session.open(hosts)

        def held(h: Host) -> list[str]:
            link, job_dir = session.links[h.index], session.records[h.index].job_dir
            found = []
            for p in paths:
                try:
                    manifest(link, job_dir, [p])
                    found.append(p)
                except OrchError:
                    pass
            return found
        return fan_out(tuple(h for h in hosts if h.index in session.links), held).ok
    finally:
        session.close()


def whose(host: Host, rank: int | None) -> str:
    """`rank 2's host`, `rank 0's host` (the master), `ranks 2-3`, `no ranks`."""
    ranks = host.ranks
    if rank is not None and rank in ranks:
        return f"rank {rank}'s host"
    if len(ranks) == 1 or 0 in ranks:
        return f"rank {ranks.start}'s host"
    return f"ranks {ranks.start}-{ranks.stop - 1}" if len(ranks) else "no ranks"


def run_start(st: job_state.JobState | None, host: Host) -> float | None:
    """When this run's supervisor started on `host`, on that host's own clock (the
    files' times are on it too): before any rank of the run could write."""
    rec = next((h for h in st.hosts if h.index == host.index), None) if st else None
    started = rec.supervisor.started if rec is not None else None
    return float(started) if isinstance(started, (int, float)) else None


# ---------------------------------------------------------------- files of an earlier run

# output/ is the job's one folder on the host (SPEC), kept across runs (a checkpoint to
# resume from): a run that wrote nothing leaves the last run's files there. The
# manifest has no file times, so one `exec` on the open link asks for them: the
# regular files under output/ (no link followed) last written before `since`.
AGE_SCRIPT = """\
import json, os, stat, sys
since, cap, count = float(sys.argv[1]), int(sys.argv[2]), 0
for top, dirs, files in os.walk("output"):
    dirs.sort()
    for name in sorted(files):
        path = os.path.join(top, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mtime < since:
            count += 1
            if count <= cap:
                print(json.dumps([os.path.relpath(path, "output"), st.st_mtime]))
print(json.dumps(count))
"""
SHOWN = 5          # names in the warning
LISTED = 1000      # names the host sends at most


@dataclass(frozen=True)
class Older:
    count: int                              # files written before the run (all of them)
    files: list[tuple[str, float]]          # the first ones: (path under output/, mtime)


class Collect(Stream):
    """The exec's output, kept (at most MAX_AGE_OUTPUT bytes)."""

    def __init__(self) -> None:
        self.kept = bytearray()

    def output(self, data: bytes) -> None:
        if len(self.kept) < MAX_AGE_OUTPUT:
            self.kept += data


MAX_AGE_OUTPUT = 1 << 20


def earlier(link: Link, job_dir: str, since: float, paths: list[str]) -> Older | None:
    """The files under output/ (under `paths` when given) last written before `since`;
    None when the host could not say (the pull itself is done: this is only a note)."""
    out = Collect()
    argv = ["$ORCH_PYTHON", "-S", "-c", AGE_SCRIPT, repr(since), str(LISTED)]
    try:
        _, p = link.submit("exec", stream=out, job_dir=job_dir, argv=argv, env={})
        if link.wait(p, timeouts.PULL_AGE)["code"] != 0:
            return None
        *rows, total = [json.loads(line) for line in out.kept.decode().splitlines()]
        inside = [(str(r), float(t)) for r, t in rows
                  if not paths or any(r == q or r.startswith(q + "/") for q in paths)]
        return Older(int(total) if not paths else len(inside), inside)
    except (OrchError, ValueError, TypeError):   # no python, odd output: no note
        return None


def describe(host: str, since: float, older: Older) -> str:
    """`result.txt was written at 12:01:05, before this run started on h (12:03:40): an
    earlier run's file, ...`; the first few by name, then how many more."""
    def when(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    start = f"before this run started on {host} ({when(since)})"
    kept = "pulled as it is (output/ on the host is kept from run to run)"
    if older.count == 1 and older.files:
        rel, t = older.files[0]
        return f"{rel} was written at {when(t)}, {start}: an earlier run's file, {kept}"
    names = [f"{r} ({when(t)})" for r, t in older.files[:SHOWN]]
    if older.count > len(names):
        names.append(f"{older.count - len(names)} more")
    return (f"{older.count} files were written {start}: {', '.join(names)}; earlier runs' "
            f"files, {kept.replace('it is', 'they are')}")
