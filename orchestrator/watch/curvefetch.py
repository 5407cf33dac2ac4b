"""The job's metrics files fetched from every rank's host while it runs (#35 item 2),
so that curves (watch/curves.py) are live: `orch pull` run every few seconds on the
session's open links, for the files whose names curves knows (`curves.GLOBS` under
output/), into the local copies (`curves.local_root`: rank 0's host at outputs/<name>/,
where `orch pull` puts it, so a later pull finds them there unchanged).

Each round is one listing request per host (the host hashes a file only when it
changed), then only the new or changed files, each written beside and renamed. A file
still being appended to comes back as the bytes it held when sent (the readers drop a
last line cut short). Capped: a file over its kind's size, more than `curves.MAX_FILES`
files a host, more than MAX_ROUND bytes a round from a host; what is left out is a note.
A host let go as its ranks end well (Session.release) gets one last round
first, unless its follow's `done` counted no file there (`Link.ended.curves`).
Nothing local is ever deleted. A failed round (host lost, the folder held by an
`orch pull`) is recorded and tried again; nothing is raised into the caller.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import HostError
from orchestrator.files.localfiles import DigestCache
from orchestrator.files.pull import (
    Listing,
    ManifestReply,
    PullReport,
    Receiver,
    ask_manifest,
    manifest_of,
    plan,
    receive,
)
from orchestrator.files.pulldest import Dest
from orchestrator.remote.ask import gather
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.link import Link
from orchestrator.session.session import Session
from orchestrator.watch import curves
from orchestrator.wire import timeouts

INTERVAL = 2.0            # seconds between rounds: an epoch's row shows within about that
ROUND_HOSTS = 100.0       # hosts asked a second at most, past 200 hosts (round_interval)
MAX_ROUND = 64 << 20      # bytes fetched from one host in one round (the rest next round)
log = logging.getLogger("orchestrator")


def round_interval(hosts: int) -> float:
    """Seconds between rounds for `hosts` hosts: INTERVAL, longer past 200 hosts. A round
    asks every host; at 300 hosts one every 2 s was 150 requests and as many threads a
    second, on the cores the hosts share (a fail-fast's stop ran beside them)."""
    return max(INTERVAL, hosts / ROUND_HOSTS)


def fetched_hosts(cluster: Cluster) -> tuple[Host, ...]:
    """The hosts that run ranks (a spare runs none)."""
    return tuple(h for h in cluster.hosts if len(h.ranks))


def capped(remote: Listing, notes: curves.Notes, host: str) -> Listing:
    """The listed files worth fetching: a kind curves reads, within its size cap, at
    most curves.MAX_FILES of them."""
    out: Listing = {}
    for rel, entry in sorted(remote.items()):
        kind = curves.kind_of(rel)
        cap = curves.MAX_EVENTS if kind == "tfevents" else curves.MAX_TEXT
        if kind is None:
            continue
        if entry.size > cap:
            notes.add(f"{host}: output/{rel}: {entry.size} bytes, more than {cap} (not fetched)",
                      f"{host}: output/{rel}")
        elif len(out) >= curves.MAX_FILES:
            notes.add(f"{host}: more than {curves.MAX_FILES} metrics files; the rest are "
                      "not fetched")
            break
        else:
            out[rel] = entry
    return out


def within_round(fetch: Listing) -> Listing:
    """The first files up to MAX_ROUND bytes (always one): the rest wait a round."""
    out: Listing = {}
    total = 0
    for rel, entry in fetch.items():
        if out and total + entry.size > MAX_ROUND:
            break
        out[rel] = entry
        total += entry.size
    return out


def fetch_host(session: Session, host: Host, cache: DigestCache, notes: curves.Notes,
               link: Link | None = None, timeout: float = timeouts.PULL_MANIFEST) -> int:
    """One host's metrics files into their local copy, on `link` (default: the
    session's open one), its listing within `timeout`; the number of files fetched."""
    link = link or session.links.get(host.index)
    if link is None:
        raise HostError(f"{host.label}: not connected")
    asked = ask_manifest(link, session.records[host.index].job_dir, [], **listing())
    return fetch_listed(session, host, link, manifest_of(link, asked, timeout), cache, notes)


def listing() -> dict[str, object]:
    """The listing's request: the files curves reads; the host hashes no bigger file."""
    return {"globs": list(curves.GLOBS), "max_size": curves.MAX_EVENTS}


def fetch_listed(session: Session, host: Host, link: Link, listed: tuple[ManifestReply, Listing],
                 cache: DigestCache, notes: curves.Notes) -> int:
    """The files of a host's listing that are new or changed here, fetched."""
    reply, remote = listed
    for skip in reply.skipped[:3]:   # too big, a link: named by the host
        where = f"{host.label}: output/{skip.path[:300]}"
        notes.add(f"{where}: {skip.why[:200]}", where)
    wanted = capped(remote, notes, host.label)
    if not wanted:
        return 0
    with Dest(curves.local_root(session.cluster, host)) as dest:
        todo = plan(wanted, dest, cache)
        fetch = within_round(todo.fetch)
        if not fetch:
            return 0
        report = PullReport(link.name, "output", dest.show(""))
        receive(link, session.records[host.index].job_dir, Receiver(dest, fetch, cache, report, None))
    for failed in report.failed[:3]:
        notes.add(f"{host.label}: output/{failed['p']}: {failed['why']}", say=False)
    return report.files


class Round:
    """One round, host by host: on the session's open links (`once`), or each host on
    the link of its turn (`Session.visit`, a one-shot `status`). A host that fails is a
    note; `save` keeps the digests learned."""

    def __init__(self, session: Session, notes: curves.Notes | None = None) -> None:
        self.session = session
        self.notes = notes if notes is not None else curves.Notes()
        self.cache = DigestCache(session.cluster.state_dir / "curve-digests.bin")
        self.files = 0
        self.lock = threading.Lock()

    def host(self, host: Host, link: Link | None = None) -> None:
        if len(host.ranks):   # a spare runs no rank
            self.run(host, lambda: fetch_host(self.session, host, self.cache, self.notes, link))

    def run(self, host: Host, fetch: Callable[[], int]) -> None:
        """fetch() for one host: its files counted, its failure a note."""
        try:
            got = fetch()
        except Exception as exc:  # a note: the status or the run goes on
            self.failed(host, exc)
            return
        with self.lock:
            self.files += got

    def failed(self, host: Host, exc: BaseException) -> None:
        text = str(exc)
        self.notes.add(text if text.startswith(host.label + ":") else f"{host.label}: {text}",
                       say=False)

    def save(self) -> None:
        self.cache.save()


def once(session: Session, notes: curves.Notes | None = None) -> int:
    """One round from every rank's host of the session; the files fetched. Every host's
    listing is asked before any is read (no thread per host: at 1,000 hosts a round was
    1,000 threads every 10 s for listings that mostly say nothing changed); only the
    hosts with files to fetch get a thread. A host that fails is a note."""
    this, links = Round(session, notes), session.links   # as they are now: a host let go
    hosts = [h for h in fetched_hosts(session.cluster) if h.index in links]  # keeps its own
    got = gather({h.index: links[h.index] for h in hosts},
                 lambda i, link: ask_manifest(link, session.records[i].job_dir, [], **listing()),
                 manifest_of, timeouts.PULL_MANIFEST)
    for i, exc in got.failed.items():   # lost, or no answer in time: a note
        this.failed(session.cluster.hosts[i], exc)
    listed = got.ok
    # a listing with no file and nothing skipped needs no thread (most hosts, most rounds)
    changed = tuple(h for h in hosts if h.index in listed and
                    (listed[h.index][1] or listed[h.index][0].skipped))
    try:
        fan_out(changed, lambda h: this.run(h, lambda: fetch_listed(
            session, h, links[h.index], listed[h.index], this.cache, this.notes)))
    finally:
        this.save()
    return this.files


class CurveFetch:
    """`once` every `interval` seconds in a thread, on the session's open links, until
    stopped. `version` grows each time a file changed here (a reader re-reads then);
    `notes`: the latest round's (files skipped, hosts failed)."""

    def __init__(self, session: Session, interval: float | None = None) -> None:
        self.session = session
        self.interval = interval if interval is not None else round_interval(
            len(fetched_hosts(session.cluster)))
        self.lock = threading.Condition()
        self.looking = 0   # last looks under way (hosts being let go)
        self.version = 0
        self.rounds = 0
        self.notes: list[str] = []
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, wait_first: bool = False) -> CurveFetch:
        """The rounds, in a thread. `wait_first`: the first after `interval`, not at once
        (a job just launched has written nothing yet: at 1,000 hosts, 1,000 listings
        while its ranks start, and a crash's stop beside them)."""
        self.done.clear()
        self.session.before_release.append(self.last_look)
        self.thread = threading.Thread(target=self._run, args=(wait_first,), daemon=True,
                                       name="curve-fetch")
        self.thread.start()
        return self

    def stop(self, final: bool = False, timeout: float | None = None) -> None:
        """End the thread; `final`: one last round first (the files' last rows), in the
        caller's thread, never raising."""
        self.done.set()
        if self.last_look in self.session.before_release:
            self.session.before_release.remove(self.last_look)
        if self.thread is not None:
            self.thread.join(timeout)
        if final and (self.thread is None or not self.thread.is_alive()):
            with self.lock:   # the hosts let go last: their rows too
                self.lock.wait_for(lambda: not self.looking, timeouts.LAST_LOOKS)
            self.round()

    def _run(self, wait_first: bool) -> None:
        if wait_first and self.done.wait(self.interval):
            return
        while not self.done.is_set():
            self.round()
            self.done.wait(self.interval)

    def last_look(self, index: int) -> Callable[[Link], None] | None:
        """A host about to be let go (its ranks ended well): the rows they wrote last, on
        its link, in the release's thread. Counted from now: `stop` waits for the looks
        under way."""
        host = self.session.cluster.hosts[index]
        # its own record, not `session.links`: that builds a dict of every host's link,
        # once per release (1,000 times at the end of a 1,000-host job)
        link = self.session.records[index].link
        ended = link.ended if link is not None else None
        if not len(host.ranks) or (ended is not None and ended.curves == 0):
            return None   # a spare; a host whose `done` counted no curves' file there
        with self.lock:
            self.looking += 1

        def look(link: Link) -> None:
            notes, files = curves.Notes(), 0
            try:
                cache = DigestCache(self.session.cluster.state_dir / "curve-digests.bin")
                # a hung host holds one of the few looks at once: not for long
                files = fetch_host(self.session, host, cache, notes, link, timeouts.LAST_LOOKS)
                cache.save()
            except Exception as e:   # its last rows are missed, nothing else
                notes.add(f"{host.label}: {e}", say=False)
            finally:
                with self.lock:
                    self.version += bool(files)
                    self.notes += list(notes)[:curves.MAX_NOTES]
                    self.looking -= 1
                    self.lock.notify_all()
        return look

    def round(self) -> int:
        notes = curves.Notes()
        try:
            files = once(self.session, notes)
        except Exception as e:   # recorded, never raised: a job is watched
            notes.add(str(e), say=False)
            files = 0
        with self.lock:
            self.rounds += 1
            self.version += bool(files)
            self.notes = list(notes)
        return files
