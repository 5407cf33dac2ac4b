"""`job.checkpoint_to: host`: the checkpoints kept on another host of the job instead of
the controller (session/keeper.py keeps them on the controller; session/checkpoints.py
chooses between the two).

Hosts cannot reach each other over SSH, so the copy goes through the controller. Each
round (`HostKeeper`, every half second, on the session's open links) asks the keeper
host for what its `<job dir>/checkpoints/` holds (its listing, with sha256) and rank 0's
host for the files the globs match; what differs is fetched from rank 0's host with
`orch pull`'s machinery (only complete files, verified, `KeptReceiver`) into a staging
folder here (`.orch/<name>/checkpoint-relay/`), sent at once to the keeper host
(`keep_receive`: written beside, verified, renamed, recorded in that folder's ledger),
and the staging copy deleted. The keeper host mirrors rank 0's newest set: the files it
holds that rank 0 no longer lists go in the same stream's deletions, by the same
`stale` rule as the controller's copy. A round with nothing new sends nothing but the
two listings.

The keeper host (`choose`): a host of the run other than rank 0's whose job folder is
not rank 0's (preflight found which are shared), the first in rank order; none (one
host, or every host shares rank 0's folder): the controller keeps the copy, said in a
line. Chosen again at each attempt.

Before a restart's launch (`put_back`), the copy comes back through the controller
(`fetch`, into the staging folder) and goes to every job folder of the new run
(`keeper.restore`), then the staging folder is deleted. When the keeper host is
lost, what survives is used instead: rank 0's old host if it is in the new run, else a
controller copy of an earlier run (`.orch/<name>/checkpoints/`).
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.config.inventory import Cluster, Host, RankSlot
from orchestrator.errors import HostError, OrchError
from orchestrator.files.localfiles import DigestCache, LocalFile
from orchestrator.files.pull import Listing, PullReport, manifest, receive
from orchestrator.files.pulldest import Dest
from orchestrator.files.sync import Stall, stream_and_wait
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.link import Link
from orchestrator.session.keeper import (
    INTERVAL,
    SETTLE,
    Keeper,
    KeptReceiver,
    folder_globs,
    kept_here,
    raise_put_back_failures,
    restore,
    stale,
)
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import Session
from orchestrator.wire import globs

RELAY = "checkpoint-relay"     # .orch/<name>/checkpoint-relay/: in transit only
# seconds before a keeper host that refused the copy (a link planted in its way, a full
# disk, a permission) is sent it again: each try fetches every file from rank 0's host
REFUSED_RETRY = 30.0
log = logging.getLogger("orchestrator")


# ---------------------------------------------------------------- the keeper host

@dataclass(frozen=True)
class Choice:
    host: Host | None          # None: the controller keeps the copy
    line: str                  # what is printed


def choose(cluster: Cluster, groups: list[tuple[int, ...]]) -> Choice:
    """The keeper host of this attempt: the first host in rank order whose job folder
    is not rank 0's; the controller when there is none."""
    host0 = cluster.host_of(0)
    shared = next((g for g in groups if host0.index in g), (host0.index,))
    others = sorted((h for h in cluster.hosts if h.index not in shared),
                    key=lambda h: h.first_rank)
    if others:
        return Choice(others[0], f"checkpoints kept on {others[0].label} (checkpoint_to: "
                                 f"host), off rank 0's host {host0.label}")
    why = ("the run has one host" if len(cluster.hosts) == 1 else
           f"every other host shares {host0.label}'s job folder")
    return Choice(None, f"checkpoints kept on the controller, not on a host: {why}")


class HostKeeper(Keeper):
    """A Keeper whose copy is on `keeper`, a host of the session, relayed through the
    controller. Never raises into its caller (Keeper.round records a failed round)."""

    def __init__(self, session: Session, cluster: Cluster, keeper: Host,
                 interval: float = INTERVAL, settle: float = SETTLE) -> None:
        super().__init__(session, cluster, interval, settle)
        self.keeper = keeper
        session.pinned.add(keeper.index)   # its ranks may end before rank 0's last save
        self.stage = cluster.state_dir / RELAY
        self.pushed = 0                            # files sent to the keeper host
        self.deleted = 0                           # files it pruned
        self.refused: str | None = None            # why the keeper host refused the copy
        self.retry_at = 0.0                        # (monotonic) when it is sent again

    def one_round(self, link: Link, job_dir: str) -> None:
        klink, kdir = self.link_to(self.keeper)
        if self.refused is not None and time.monotonic() < self.retry_at:
            raise HostError(self.refused)   # a failed round, without fetching everything again
        _, there = manifest(klink, kdir, [], folder=globs.KEEP)
        listed: Listing = {}
        for folder, rests in folder_globs(self.cluster.job.checkpoint).items():
            reply, remote = manifest(link, job_dir, [], folder=folder, globs=rests,
                                     settle=self.settle)
            self.saw(folder, reply, remote)
            listed.update({f"{folder}/{rel}": entry for rel, entry in remote.items()})
        fetch = {rel: entry for rel, entry in listed.items() if there.get(rel) != entry}
        try:
            got = fetch_into(link, job_dir, self.stage, fetch) if fetch else {}
            have = {rel: entry[1] for rel, entry in there.items()}
            have.update({rel: f.digest for rel, f in got.items()})
            gone = stale(have, listed)
            if got or gone:
                self.send_copy(klink, kdir, list(got.values()), gone)
        finally:
            clear(self.stage)
        self.fetched += len(got)
        with self.lock:
            self.pushed += len(got)
            self.deleted += len(gone)
            self.held = {rel: d for rel, d in sorted(have.items())
                         if rel not in gone and matches(self.cluster, rel)}


    def send_copy(self, klink: Link, kdir: str, files: list[LocalFile], gone: list[str]) -> None:
        """The round's files to the keeper host. Refused there (its link still up: the
        host answered), the cause is said once as a warning and the copy is sent again
        only after REFUSED_RETRY seconds; a keeper host lost is the round's failure."""
        try:
            send(klink, kdir, files, gone, "keep_receive")
        except OrchError as e:
            if klink.dead is None:
                first, self.refused = self.refused is None, e.message
                self.retry_at = time.monotonic() + REFUSED_RETRY
                if first:
                    fix = f" (fix: {e.hint})" if e.hint else ""
                    log.warning("checkpoints are not being kept on %s: %s%s; tried again "
                                "every %g s", self.keeper.label, e.message, fix, REFUSED_RETRY)
            raise
        if self.refused is not None:
            log.warning("checkpoints are kept on %s again", self.keeper.label)
        self.refused = None


def matches(cluster: Cluster, rel: str) -> bool:
    folder, _, sub = rel.partition("/")
    return globs.matches_any(folder_globs(cluster.job.checkpoint).get(folder, []), sub)


def fetch_into(link: Link, job_dir: str, stage: Path, fetch: Listing,
               source: str | None = None) -> dict[str, LocalFile]:
    """`fetch` ({rel to the job folder: [size, sha256]}) from the host into stage/<rel>,
    complete and verified files only. `source`: the host's folder they are listed in
    (globs.KEEP: its copy, rel kept whole), else the job folder's output/ or code/.
    Returns the files that landed, as LocalFile to push on."""
    by_folder: dict[str, Listing] = {}
    for rel, entry in fetch.items():
        if source:
            by_folder.setdefault(source, {})[rel] = entry
        else:
            folder, sub = rel.split("/", 1)
            by_folder.setdefault(folder, {})[sub] = entry
    cache = DigestCache(stage / ".unused")   # never saved: staged files live one round
    for folder, wanted in by_folder.items():
        root = stage if source else stage / folder
        with Dest(root) as dest:
            report = PullReport(link.name, folder, str(root))
            receive(link, job_dir, KeptReceiver(dest, wanted, cache, report, None), folder=folder)
    out: dict[str, LocalFile] = {}
    for rel, (size, digest) in fetch.items():
        path = stage / rel
        try:
            st = os.lstat(path)
        except OSError:
            continue   # changed on the host meanwhile: the next round fetches it
        if stat.S_ISREG(st.st_mode) and st.st_size == size:
            out[rel] = LocalFile(rel, str(path), size, st.st_mode & 0o777, digest)
    return out


def send(link: Link, job_dir: str, files: list[LocalFile], delete: list[str],
         command: str) -> None:
    """The files (and deletions) to a host in one receive stream, under the stall
    watchdog of a push."""
    with Stall(link) as stall:
        try:
            stream_and_wait(link, stall, job_dir, sorted(files, key=lambda f: f.rel), delete,
                            None, command, job_dir=job_dir)
        except Exception:
            if stall.fired:
                raise HostError(f"{link.name}: the checkpoint copy stalled: the host took "
                                f"nothing for {stall.idle:g} s") from None
            raise


def clear(stage: Path) -> None:
    """The staging folder gone (ours alone; rmtree follows no link)."""
    shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------- across attempts

@dataclass
class Kept:
    """Where the last attempt kept its copy: what a restart puts back from."""

    keeper: str | None = None              # the keeper host's label (None: the controller)
    rank0: str | None = None               # the host of rank 0 in that attempt
    hosts: dict[str, Host] = field(default_factory=dict)   # label -> host, as inventoried
    lost: set[str] = field(default_factory=set)            # hosts lost since

    def chosen(self, cluster: Cluster, choice: Choice) -> None:
        self.keeper = choice.host.label if choice.host else None
        self.rank0 = cluster.host_of(0).label
        self.hosts.update({h.label: h for h in cluster.hosts})
        self.lost = set()


Opener = Callable[[Cluster, Host], AbstractContextManager[tuple[Link, str]]]


def put_back(session: Session, pre: PreflightReport, last: Kept,
             opener: Opener | None = None) -> tuple[list[str], list[str], str]:
    """The copy of the last attempt into every job folder of the new run (once per
    shared one), through the controller. Returns (paths sent, hosts that took any, where
    they came from, in words)."""
    cluster = session.cluster
    stage = cluster.state_dir / RELAY
    leaders = tuple(cluster.hosts[g[0]] for g in pre.groups())
    try:
        root, source = gather(session, cluster, last, stage, opener or side_link)
        if root is None:
            return [], [], source
        result = fan_out(leaders, lambda h: restore(session, cluster, h.index, root))
        raise_put_back_failures(result, cluster.hosts)
    finally:
        clear(stage)
    sent = sorted({rel for rels in result.ok.values() for rel in rels})
    return sent, [h.label for h in leaders if result.ok.get(h.index)], source


def gather(session: Session, cluster: Cluster, last: Kept, stage: Path,
           opener: Opener) -> tuple[Path | None, str]:
    """What survives, into `stage` (or the controller's copy): (its folder, in words)."""
    mine = cluster.state_dir / "checkpoints"
    if last.keeper is None and last.rank0 is not None:   # the controller kept it last time
        return mine, "the controller's copy"
    why = ""
    if last.keeper is not None and last.keeper not in last.lost:
        try:
            with host_link(session, cluster, last, last.keeper, opener) as (link, job_dir):
                _, there = manifest(link, job_dir, [], folder=globs.KEEP)
                fetch_into(link, job_dir, stage,
                           {r: e for r, e in there.items() if matches(cluster, r)}, globs.KEEP)
            return stage, f"the copy on {last.keeper}"
        except OrchError as e:
            why = f" (the keeper host {last.keeper} failed: {e.message})"
    elif last.keeper is not None:
        why = f" (the keeper host {last.keeper} is lost)"
    in_run = {h.label for h in cluster.hosts}
    if last.rank0 is not None and last.rank0 in in_run:
        with host_link(session, cluster, last, last.rank0, opener) as (link, job_dir):
            listed: Listing = {}
            for folder, rests in folder_globs(cluster.job.checkpoint).items():
                _, remote = manifest(link, job_dir, [], folder=folder, globs=rests)
                listed.update({f"{folder}/{rel}": e for rel, e in remote.items()})
            fetch_into(link, job_dir, stage, listed)
        return stage, f"rank 0's last host {last.rank0}{why}"
    cache = DigestCache(cluster.state_dir / "checkpoint-digests.bin")
    if kept_here(mine, cache, cluster.job.checkpoint):
        return mine, f"the controller's copy{why}"
    return None, f"nothing survives{why}"


@contextmanager
def host_link(session: Session, cluster: Cluster, last: Kept, label: str,
              opener: Opener) -> Iterator[tuple[Link, str]]:
    """The link to a host by label: the session's when it is in the new run, else one of
    its own (`opener`), closed after."""
    for h in cluster.hosts:
        if h.label == label and h.index in session.links:
            yield session.links[h.index], session.records[h.index].job_dir
            return
    if label not in last.hosts:
        raise HostError(f"{label}: not an inventory host")
    with opener(cluster, last.hosts[label]) as got:
        yield got


@contextmanager
def side_link(cluster: Cluster, host: Host) -> Iterator[tuple[Link, str]]:
    """A host outside the run, as its own one-host session (no preflight: only reads)."""
    alone = replace(host, index=0, first_rank=0, spare=False)
    run = replace(cluster, hosts=(alone,), world_size=alone.procs, spares=(),
                  ranks=tuple(RankSlot(r, 0, r) for r in alone.ranks))
    session = Session(run)
    try:
        session.open()
        if 0 not in session.links:
            raise HostError(f"{host.label}: cannot be reached: {session.records[0].error}")
        yield session.links[0], session.records[0].job_dir
    finally:
        session.close()
