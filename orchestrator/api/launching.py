"""`up`: preflight every host, push the code and each host's shards, run `setup:`,
start torchrun everywhere (or a job array's runners), save the job's state.

`start` is the one sequence: `up` returns its result (detached), and the CLI follows the
job on the same open session (`orch up` without --detach). What the steps show as they
go is an `UpProgress`; this module prints nothing."""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, TypedDict

from orchestrator.api import jobs
from orchestrator.api.outcomes import ArrayHost, ArrayUpResult, Plan, UpHost, UpResult
from orchestrator.arrays import plan as array_plan
from orchestrator.arrays import prepare
from orchestrator.config.hostselect import narrow
from orchestrator.config.inventory import Cluster, Host, RankSlot
from orchestrator.errors import DataError, GroupError, OrchError, UsageError
from orchestrator.files.feed import Feed
from orchestrator.files.localfiles import HOLD, DigestCache, check_entrypoint, code_files
from orchestrator.files.shards import (
    forget_gone_folders,
    host_chunks,
    host_files,
    load_split,
    resplit,
    resplit_size,
    shard_bytes,
)
from orchestrator.files.splitdata import SplitResult
from orchestrator.files.sync import SyncReport
from orchestrator.remote.early import Begun
from orchestrator.remote.fanout import fan_out
from orchestrator.session import gpuclaims
from orchestrator.session import state as job_state
from orchestrator.session.launch import dry_run_plan, prove_network, run_master
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import HostFiles, Session, group_files, whole
from orchestrator.session.setupstep import needs_check
from orchestrator.session.shelloutput import Printer
from orchestrator.session.state import Attempt
from orchestrator.ui.wording import hint_cmd

SyncReports = dict[int, dict[str, SyncReport]]   # host index -> "code"/"data" -> what was sent


class SyncShown:
    """The sync's display: `sent(n)` bytes as they go, `host_done(index)` per host."""

    def sent(self, nbytes: int) -> None:
        pass

    def host_done(self, index: int) -> None:
        pass


def _nothing() -> None:
    pass


class UpProgress:
    """What `up` tells as it goes, step by step. This one shows nothing; the CLI's
    (commands/up.py) draws the bars and prints a line per step."""

    def resplit(self, cluster: Cluster, result: SplitResult) -> None:
        """The data was split again for the run's world size (`up --hosts/--exclude`)."""

    def preflight(self, hosts: int) -> AbstractContextManager[Callable[[], None]]:
        """Around connect + preflight; the callable is called as each host is checked."""
        return nullcontext(_nothing)

    def preflight_done(self, cluster: Cluster, pre: PreflightReport) -> None:
        """`cluster`: the run as claimed (`gpus: all` counted)."""

    def gpu_wait(self, line: str) -> None:
        """`up --wait`: who holds the GPUs this run waits for (again every 2 s)."""

    def gpus_claimed(self, cluster: Cluster, waited: float) -> None:
        """The GPUs each host's ranks see; `waited`: seconds spent in `--wait`'s queue."""

    def sync(self, hosts: int, total: int) -> AbstractContextManager[SyncShown]:
        """Around the push of `total` bytes to `hosts` hosts."""
        return nullcontext(SyncShown())

    def synced(self, cluster: Cluster, reports: SyncReports,
               shared: dict[int, list[str]]) -> None:
        """`shared`: for a host that pushed for a job folder other hosts share, their labels."""

    def python_missing(self, host: Host, python: str) -> None:
        """The host's python is not there yet: checked again after `setup:`."""

    def setup_printer(self) -> Printer:
        """Where the `setup:` commands' output goes (prefixed with the host)."""
        return Printer(quiet=True)

    def setup_done(self, cluster: Cluster, skipped: int, ran: int, seconds: float,
                   covered: int = 0) -> None:
        """`covered`: hosts whose shared job folder had setup run by another host."""


@dataclass(frozen=True)
class Started:
    """A started job and the session that started it (open until `start` returns)."""

    session: Session
    state: job_state.JobState
    result: UpResult | ArrayUpResult
    record: array_plan.ArrayRecord | None = None   # a job array's tasks


def up(inventory: jobs.Inventory, *, hosts: str | None = None, exclude: str | None = None,
       setup: bool = False, wait: bool = False, progress: UpProgress | None = None) -> UpResult:
    """`orch up --detach` of a distributed job: returns once every host started. All or
    nothing: a host failing preflight (HostError, GroupError: exit 3) or a bad inventory
    or dataset (exit 2) starts nothing anywhere. `setup`: run `setup:` even where it ran
    before, unchanged. The job runs on without this process; follow it with `status` and
    `logs`, end it with `stop`. A job array: `array_up`.

    `hosts`, `exclude`: the hosts of this run (`orch up --hosts/--exclude`: indexes,
    addresses, labels, ranges, `host:0,1` for GPUs); the world size follows, and the
    later calls act on these hosts. `wait`: GPUs held by other jobs are waited for
    (`orch up --wait`) instead of refused (GroupError of GpusBusy, exit 3)."""
    cluster = narrow(jobs.cluster_of(inventory), hosts, exclude)
    if cluster.job.array is not None:
        raise jobs.kind_error(cluster, "a job array", "array_up")
    with start(cluster, setup=setup, wait=wait, progress=progress) as started:
        assert isinstance(started.result, UpResult)
        return started.result


def array_up(inventory: jobs.Inventory, *, hosts: str | None = None,
             exclude: str | None = None, setup: bool = False, wait: bool = False,
             progress: UpProgress | None = None) -> ArrayUpResult:
    """`orch up --detach` of a job array: every host's runner started with its share of
    the tasks; they go on without this process (`array_status`, `results`, `stop`).
    `hosts`, `exclude`, `wait`: as `up`'s."""
    cluster = narrow(jobs.cluster_of(inventory), hosts, exclude)
    if cluster.job.array is None:
        raise jobs.kind_error(cluster, "not a job array", "up")
    with start(cluster, setup=setup, wait=wait, progress=progress) as started:
        assert isinstance(started.result, ArrayUpResult)
        return started.result


def plan(inventory: jobs.Inventory, *, hosts: str | None = None,
         exclude: str | None = None) -> Plan:
    """`orch up --dry-run`: the plan and the exact command per host; no host is touched.
    Every check `up` makes before it connects is made here too (the entrypoint, the code,
    the data split for this world size, each host's shards, identity_file and
    known_hosts), with the same errors: a dry
    run that passes means `up` passes all that needs no host.
    `hosts`, `exclude`: as `up`'s (the plan is the narrowed run's)."""
    cluster = narrow(jobs.cluster_of(inventory), hosts, exclude)
    again = resplit_size(cluster)   # the data cannot be split again: its error, as in up
    # a split up would make is not checked, nor one for a world size counted at preflight
    local_files(cluster, data=again is None and not counted_at_preflight(cluster))
    if any(not h.is_local for h in cluster.hosts):
        # imported here, as in Session: paramiko only where SSH is used
        from orchestrator.ssh import connect, sshconfig

        sshconfig.ssh_config()
        connect.check_local_files(cluster.hosts)
    text = prepare.array_plan(cluster) if cluster.job.array else dry_run_plan(cluster)
    return Plan(job=cluster.name, plan=text)


@contextmanager
def start(inventory: jobs.Inventory, *, hosts: str | None = None, exclude: str | None = None,
          setup: bool = False, wait: bool = False, progress: UpProgress | None = None,
          attempts: list[Attempt] | None = None,
          before_launch: Callable[[Session, PreflightReport], None] | None = None,
          restart: bool = False, begin_follows: bool = False) -> Iterator[Started]:
    """Every step up to the start on every host; the session closes when the block ends.
    `hosts`, `exclude`, `wait`: as `up`'s (a loaded Cluster may come narrowed already).
    `attempts`: the restarts so far of this run (api/healing.py), kept in its state.
    `before_launch`: called with the session and preflight once every host is ready,
    just before the start (a restart puts the kept checkpoints back there). `restart`: an
    attempt of a run that started and stopped the last one itself: the hosts it leaves
    out (lost ones among them, which may not even answer a connect) are not asked.
    `begin_follows`: the caller watches the job (`monitor.watch`): each host's follow
    begins as its launch is answered, not once every host has started."""
    cluster = narrow(jobs.cluster_of(inventory), hosts, exclude)
    shown = progress or UpProgress()
    if not restart:
        refuse_running_elsewhere(cluster)
    # the local files are listed (and bad data refused) while the connections open: no
    # request reaches a host before the list is complete. With `gpus: all` the world
    # size is known once the GPUs are claimed, and the shards are checked then
    listing = None if counted_at_preflight(cluster) else Listing(cluster, shown)
    begun: Begun | None = None
    session = Session(cluster, attempts=attempts,
                      expected=listing.first if listing else None,
                      waiting=gpuclaims.Waiting(shown.gpu_wait) if wait else None)
    try:
        with shown.preflight(len(cluster.hosts)) as checked:
            try:
                pre = session.open_and_preflight(checked=checked)
            except BaseException:
                if listing:
                    listing.get()   # bad data is the cause (exit 2), not the hosts that waited
                raise
        # shards still being listed go to the hosts as they are (files.feed)
        files = listing.first() if listing else None
        claimed = session.claimed(pre)
        if files is None or claimed.world_size != cluster.world_size:
            if listing:
                listing.get()
            files = prepared_files(claimed, shown)
        cluster = claimed
        pre = prove_network(cluster, session.links, pre, session.run_id)
        shown.preflight_done(cluster, pre)
        if any(h.gpu_ids is not None for h in cluster.hosts):
            shown.gpus_claimed(cluster, session.waiting.waited if session.waiting else 0.0)
        try:
            try:
                sync(session, files, pre, shown)
            except DataError:   # a listing that failed half way is the cause, not the push
                if listing:
                    listing.raise_failure()
                raise
            if listing:
                listing.get()
            pre = setup_and_check(session, files, pre, setup, shown)
            if before_launch is not None:
                before_launch(session, pre)
            if cluster.job.array:
                started = launch_array(session, pre)
            else:
                begun = follows(cluster) if begin_follows else None
                started = launch(session, pre, begun)
        except GroupError as err:
            err.reached = True   # every host passed preflight: a step failed on one it reached
            raise
        yield started
    finally:
        if begun is not None:   # never watched (the caller failed first): no reader waits
            begun.drop()
        session.close()


class Listing:
    """prepared_files() in a thread of its own, begun before the hosts are connected to:
    at 100,000 files the list takes about as long as opening the connections, which
    then no longer wait for it. `first` gives what each host must hold as soon as the
    code is listed, the shards still being listed as Feeds (a first push starts with
    their first chunk); `get` waits for the whole list. Both raise what the listing
    raised."""

    def __init__(self, cluster: Cluster, shown: UpProgress) -> None:
        self.files: dict[int, HostFiles] | None = None
        self.early: dict[int, HostFiles] | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()   # early, files or error is set
        self.thread = threading.Thread(target=self._run, args=(cluster, shown), daemon=True,
                                       name="local-files")
        self.thread.start()

    def _run(self, cluster: Cluster, shown: UpProgress) -> None:
        try:
            self.files = prepared_files(cluster, shown, early=self._early)
        except BaseException as e:  # handed to whoever waits: raised there
            self.error = e
        finally:
            self.ready.set()

    def _early(self, files: dict[int, HostFiles]) -> None:
        self.early = files
        self.ready.set()

    def first(self) -> dict[int, HostFiles]:
        self.ready.wait()
        if self.error is not None:
            raise self.error
        files = self.files if self.files is not None else self.early
        assert files is not None
        return files

    def raise_failure(self) -> None:
        """The listing's own error, if it met one (also in a host's shards listed by its
        push), without listing what is left."""
        if self.error is not None:
            raise self.error
        for hf in (self.files or self.early or {}).values():
            if isinstance(hf.data, Feed) and hf.data.error is not None:
                raise hf.data.error

    def get(self) -> dict[int, HostFiles]:
        """Every list complete (what a push listed as it went, the rest listed here)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.files is not None
        if any(isinstance(hf.data, Feed) for hf in self.files.values()):
            self.files = {i: replace(hf, data=whole(hf.data)) for i, hf in self.files.items()}
            for cache in {id(hf.cache): hf.cache for hf in self.files.values() if hf.cache}.values():
                cache.save()
        return self.files


def prepare_spares(cluster: Cluster) -> dict[str, str]:
    """Every spare (`hosts[].spare: true`) preflighted and given the code, then left idle:
    a replacement then only needs its shards. Label -> why it cannot serve ("": ready).
    One spare at a time is its own one-host run: a bad spare does not spoil the others."""
    code = code_files(cluster.base_dir, cluster.code.paths, cluster.code.exclude,
                      DigestCache(cluster.state_dir.parent / "digests.bin"), str(cluster.path))

    def one(spare: Host) -> str:
        alone = replace(spare, index=0, first_rank=0, spare=False)
        run = replace(cluster, hosts=(alone,), world_size=alone.procs, spares=(),
                      ranks=tuple(RankSlot(r, 0, r) for r in alone.ranks))
        session = Session(run, warm=False)
        try:
            pre = session.open_and_preflight()
            session.sync({0: HostFiles(code, None)}, pre)
            return ""
        except OrchError as e:
            return e.message
        finally:
            session.close()
    result = fan_out(cluster.spares, one)
    return {h.label: result.ok[h.index] if h.index in result.ok else str(result.failed[h.index])
            for h in cluster.spares}


def refuse_running_elsewhere(cluster: Cluster) -> None:
    """The job's last run on hosts this run leaves out (`up --hosts A` after a run on
    B, C) may still run there: preflight asks only this run's hosts, so those are asked
    here. "Already running" (exit 2) when one of them runs it; one that cannot be
    reached does not hold the run back."""
    try:
        st = job_state.load(cluster)
    except job_state.StateDamaged:
        return
    left = {h.label for h in st.hosts} - {h.label for h in cluster.hosts} if st else set()
    if not st or not left:
        return
    run = job_state.run_cluster(jobs.cluster_of(cluster.path), st)
    others = tuple(h for h in run.hosts if h.label in left)
    if not others:
        return
    session = Session(run, st)
    try:
        session.open(others)
        result = session.status()
    finally:
        session.close()
    busy = [run.hosts[i].label for i, r in sorted(result.ok.items())
            if r.running or any(x.state in ("running", "starting") for x in r.ranks)]
    if busy:
        raise UsageError(f"job '{cluster.name}' is already running on {', '.join(busy)} "
                         "(its last run, which this one leaves out)",
                         hint=f"stop it first with `{hint_cmd(cluster, 'stop')}`, "
                              "or give this job another name")


def follows(cluster: Cluster) -> Begun:
    """The follows of monitor.watch, begun at the launch; imported only now, after the
    logins (`orch up` imports before its first login only what the start needs)."""
    from orchestrator.watch.monitor import begun_follows
    return begun_follows(cluster)


def launch(session: Session, pre: PreflightReport, begin: Begun | None = None) -> Started:
    cluster, sent = session.cluster, time.time()
    run_id, sups = session.launch(pre, begin)
    st = job_state.new_state(cluster, run_id, run_master(cluster, pre),
                             pre.master_port, pre.hosts, sups, session.attempts, sent)
    job_state.save(cluster, st)
    result = UpResult(job=cluster.name, run_id=st.run_id, world_size=cluster.world_size,
                      master_addr=st.master_addr, master_port=st.master_port,
                      hosts=[UpHost(h.label, h.job_dir, list(h.ranks)) for h in st.hosts],
                      network=pre.network.document() if pre.network is not None else None)
    return Started(session, st, result)


def launch_array(session: Session, pre: PreflightReport) -> Started:
    cluster, sent = session.cluster, time.time()
    rec, sups = array_plan.start(session, pre)
    st = job_state.new_state(cluster, rec.run_id, "-", 0, pre.hosts, sups, started=sent)
    job_state.save(cluster, st)
    array_plan.save(cluster, rec)
    result = ArrayUpResult(job=cluster.name, run_id=rec.run_id, tasks=len(rec.host),
                           hosts=[ArrayHost(h.label, h.job_dir, rec.tasks_of(h.index))
                                  for h in st.hosts])
    return Started(session, st, result, rec)


def counted_at_preflight(cluster: Cluster) -> bool:
    """`gpus: all` on a host without `procs:`: its ranks are its free GPUs, counted then."""
    return any(h.all_gpus and not h.procs_given for h in cluster.hosts)


def prepared_files(cluster: Cluster, shown: UpProgress,
                   early: Early | None = None) -> dict[int, HostFiles]:
    """The data split again where the run's world size needs it, then every host's files."""
    if resplit_size(cluster) is not None:   # before the data is checked: it is made here
        shown.resplit(cluster, resplit(cluster))
    return local_files(cluster, early=early)


Early = Callable[[dict[int, HostFiles]], None]


def local_files(cluster: Cluster, data: bool = True,
                early: Early | None = None) -> dict[int, HostFiles]:
    """What each host must hold, checked here (the code is hashed, cached); a shard file
    the cache does not know is hashed by the push as it reads it (DigestCache's
    `defer`), which saves the cache again. `early`: given, once the code is listed, each
    host's files with its shards as a Feed that fills as they are listed.
    `data`: False leaves the shards out (a dry run's split that `up` would make first)."""
    if cluster.job.array is not None:
        return prepare.array_files(cluster)
    cache = DigestCache(cluster.state_dir.parent / "digests.bin", hold=HOLD, defer=True,
                        lazy=early is not None)
    split = load_split(cluster, cache) if cluster.data.shards and data else None
    if split:
        forget_gone_folders(cache)
    check_entrypoint(cluster.base_dir, cluster.code.paths, cluster.code.exclude,
                     cluster.job.entrypoint, str(cluster.path))
    code = code_files(cluster.base_dir, cluster.code.paths, cluster.code.exclude, cache,
                      str(cluster.path))
    if split and early is not None:
        # each host's shards made as they are needed (files.feed): this thread lists
        # ahead until a push takes them over
        feeds = {h.index: Feed(shard_bytes(split, h), host_chunks(cluster, h, split, cache))
                 for h in cluster.hosts}
        files = {i: HostFiles(code, feed, cache) for i, feed in feeds.items()}
        early(files)
        for feed in feeds.values():
            feed.run_ahead()
        return files
    files = {h.index: HostFiles(code, host_files(cluster, h, split, cache) if split else None,
                                cache) for h in cluster.hosts}
    cache.save()
    return files


def sync(session: Session, files: dict[int, HostFiles], pre: PreflightReport,
         shown: UpProgress) -> None:
    cluster = session.cluster
    total = sum(sum(f.size for f in hf.code) + hf.data_bytes()
                for hf in group_files(files, pre).values())
    with shown.sync(len(cluster.hosts), total) as bar:
        reports = session.sync(files, pre, bar.sent, bar.host_done)
    shared = {i: [cluster.hosts[m].label for m in pre.group_of(i) if m != i] for i in reports}
    shared = {i: labels for i, labels in shared.items() if labels}
    shown.synced(cluster, reports, shared)
    record_sync(cluster, reports, shared)


class SyncedPart(TypedDict):
    """What one push (code or data) sent to a host, in last_sync.json."""

    files: int
    bytes: int
    deleted: int
    sent: list[str]


def record_sync(cluster: Cluster, reports: SyncReports, shared: dict[int, list[str]]) -> None:
    """.orch/<name>/last_sync.json: what was sent where; a host whose job folder another
    host pushed for says `pushed_by`, the one that pushed `shared_with`."""
    record: dict[str, dict[str, SyncedPart | list[str] | str]] = {}   # host -> its entry
    for i, parts in sorted(reports.items()):
        label = cluster.hosts[i].label
        entry: dict[str, SyncedPart | list[str] | str] = {
            k: SyncedPart(files=r.files, bytes=r.bytes, deleted=r.deleted, sent=list(r.sent))
            for k, r in parts.items()}
        record[label] = entry
        if i in shared:
            entry["shared_with"] = shared[i]
        for other in shared.get(i, []):
            record[other] = {"pushed_by": label}
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    path = cluster.state_dir / "last_sync.json"
    path.write_text(json.dumps(record, indent=1))
    os.chmod(path, 0o600)


def setup_and_check(session: Session, files: dict[int, HostFiles], pre: PreflightReport,
                    force: bool, shown: UpProgress) -> PreflightReport:
    """`setup:` everywhere (all or nothing), then the python, torch and entrypoint check
    where setup may have changed them, or where nothing was pushed."""
    cluster = session.cluster
    for i, info in sorted(pre.hosts.items()):
        if info.python_missing:
            shown.python_missing(cluster.hosts[i], info.python_missing)
    if cluster.setup is not None:
        t0 = time.monotonic()
        replies = session.setup(pre, files[0].code, force, shown.setup_printer())
        skipped = sum(1 for r in replies.values() if r.skipped)
        shown.setup_done(cluster, skipped, len(replies) - skipped, time.monotonic() - t0,
                         covered=len(cluster.hosts) - len(replies))
    return session.check_ready(pre) if needs_check(cluster) else pre
