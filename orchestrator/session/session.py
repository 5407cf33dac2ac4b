"""A command's hold on the cluster: per host one connection, one agent (one SSH session)
and one record; the verbs every command is made of: preflight, sync, launch, watch
(watch/monitor.py), stop, status, follow.

Commands (orchestrator/commands/) parse their arguments, call these verbs and render
the outcome; nothing here parses arguments, and messages go through `ui`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import EXIT_USAGE, DataError, HostError, OrchError
from orchestrator.files.feed import Feed
from orchestrator.files.localfiles import DigestCache, LocalFile, Pushable
from orchestrator.files.pull import PullReport, ReceiveProgress
from orchestrator.files.pull import pull as pull_files
from orchestrator.files.sync import Same, SyncReport, push
from orchestrator.remote.ask import ask_all
from orchestrator.remote.bundle import bundle
from orchestrator.remote.early import Begun
from orchestrator.remote.fanout import GroupResult, fan_out
from orchestrator.remote.link import Link
from orchestrator.remote.transport import Transport
from orchestrator.session import gpuclaims, setupstep, shellcmd
from orchestrator.session import state as job_state
from orchestrator.session.launch import launch_all, new_run_id, warm_env, warm_start
from orchestrator.session.preflight import (
    Checked,
    PreflightReport,
    asks_net,
    check_host,
    preflight,
    unshare,
)
from orchestrator.session.replies import CommandReply, HostStacks, StatusReply, Supervisor
from orchestrator.session.shelloutput import HostOutput, Printer
from orchestrator.session.stopper import StopReport, stop_all
from orchestrator.wire import timeouts

T = TypeVar("T")
# hosts `visit` has logged in to at once: its agents, sshd sessions and logins are alive
# together beside the job; the CPU the hosts share is kept busy well before that many
VISIT_LIMIT = 128
LOOKS_AT_ONCE = 4   # hosts let go (release) whose last look runs at once


@dataclass
class HostRecord:
    """Everything this command knows about one host."""

    host: Host
    job_dir: str                       # the inventory's (or state's); absolute after preflight
    part: str = ""                     # its part of the job folder: run/<part>/
    link: Link | None = None           # its agent, once started
    error: BaseException | None = None  # why it could not be reached


@dataclass(frozen=True)
class HostFiles:
    """What one host must hold: the code, and its own shards (None: no data section)."""

    code: list[LocalFile]
    data: list[LocalFile] | Feed | None   # a Feed: the shards still being listed
    cache: DigestCache | None = None   # learns the digests of shard files hashed by the push

    def data_bytes(self) -> int:
        if isinstance(self.data, Feed):
            return self.data.nbytes
        return sum(f.size for f in self.data or ())


def group_files(files: dict[int, HostFiles], pre: PreflightReport) -> dict[int, HostFiles]:
    """{pushing host: what its job folder must hold}: per group of hosts sharing a job
    folder, its first host, the code, and every member's shards (each once): a push
    deletes only what no host of the folder needs."""
    out = {}
    for group in pre.groups():
        first = files[group[0]]
        data = first.data   # alone in its folder: the very list preflight's token was of
        if first.data is not None and len(group) > 1:
            merged: dict[str, LocalFile] = {}
            for member in group:
                for f in whole(files[member].data) or ():
                    merged.setdefault(f.rel, f)
            data = list(merged.values())
        out[group[0]] = HostFiles(first.code, data, first.cache)
    return out


def whole(data: list[LocalFile] | Feed | None) -> list[LocalFile] | None:
    """A host's shard files, complete (a Feed waited for)."""
    return data.whole() if isinstance(data, Feed) else data


def end_link(link: Link) -> None:
    """The agent's stdin closed (it ends, a running stop finished first), then the connection."""
    try:
        link.close()
    finally:
        link.transport.close()


class Session:
    def __init__(self, cluster: Cluster, state: job_state.JobState | None = None,
                 connector: Callable[[Host], Transport] | None = None, *,
                 waiting: gpuclaims.Waiting | None = None,
                 attempts: list[job_state.Attempt] | None = None, warm: bool = True,
                 expected: Callable[[], dict[int, HostFiles]] | None = None) -> None:
        """`connector` opens one host's transport (default: SSH or local, per the
        inventory); unit tests pass an in-process fake. The keywords: see below."""
        self.cluster, self.connector = cluster, connector
        self.run_id = new_run_id()   # known before preflight: a warm start's environment
        # a preflight left its share markers (the nonce, run_id) on the hosts: removed by
        # the launch's own request, else at close (1,000 `unshare` requests less an `up`)
        self.markers = False
        dirs, parts = job_state.job_dirs(cluster, state), job_state.job_parts(cluster, state)
        self.records = {h.index: HostRecord(h, dirs[h.index], parts[h.index])
                        for h in cluster.hosts}
        self.releasing: list[threading.Thread] = []
        self.looking = threading.BoundedSemaphore(LOOKS_AT_ONCE)   # release()'s last looks
        self.waiting = waiting   # `up --wait`: GPUs are queued for
        self.attempts = list(attempts or [])   # the run's restarts so far (its state keeps them)
        self.pinned: set[int] = set()   # hosts release() leaves open (a checkpoint keeper host)
        # called with a host's index as release() lets it go; what it returns runs on the
        # host's link in the release's own thread before the link is closed: the last
        # look at it (the curves' fetch takes the rows a rank wrote as it ended); neither
        # raises
        self.before_release: list[Callable[[int], Callable[[Link], None] | None]] = []
        self.warm = warm   # torchrun started warm at preflight (not on a spare: it runs nothing)
        # what each host's folders will hold, when known before preflight (a call that
        # waits for the local list): a folder that holds exactly that is not listed back
        # (preflight.manifests_of); a preflight request waits for it
        self.expected = expected

    # ------------------------------------------------------------ connections

    @property
    def links(self) -> dict[int, Link]:
        return {i: r.link for i, r in self.records.items() if r.link is not None}

    @property
    def failed(self) -> dict[int, BaseException]:
        return {i: r.error for i, r in self.records.items() if r.error is not None}

    def open(self, hosts: tuple[Host, ...] | None = None,
             done: Callable[[], None] | None = None,
             then: Callable[[Host, Link], None] | None = None) -> Session:
        """Connect to every host (or `hosts`) and start its agent, all in parallel. A
        mistake on this machine (exit 2: a missing identity file, an unreadable ssh config)
        is raised, not collected: it is the same for every host and no host is at fault.
        `then(host, link)` runs in the host's thread once its agent is up (it must not
        raise): a first request goes out while slower logins go on."""
        hosts = self.cluster.hosts if hosts is None else hosts
        opener, seal = (self.connector, None) if self.connector else self._ssh(hosts)
        bundle()   # built once here: the hosts' threads would each build it (lru_cache
        # does not hold them back), 64 builds of ~40 ms of CPU at 64 hosts

        def one(h: Host) -> Link:
            link = self._start(h, opener(h))
            if then is not None:
                then(h, link)
            return link
        try:
            result = fan_out(hosts, one, done=done)
        finally:
            if seal is not None:
                seal()
        for i, link in result.ok.items():
            self.records[i].link = link
        self._unreached(result.failed)
        return self

    def _unreached(self, failed: dict[int, BaseException]) -> None:
        """The hosts that could not be reached, recorded; a mistake on this machine (exit
        2), the same for every host, raised."""
        for i, exc in failed.items():
            self.records[i].error = exc
        local = [e for e in failed.values()
                 if isinstance(e, OrchError) and e.exit_code == EXIT_USAGE]
        if local:
            self.close()
            raise local[0]

    def visit(self, fn: Callable[[Host, Link], T], limit: int = VISIT_LIMIT) -> GroupResult[T]:
        """A one-shot question of every host, `limit` hosts at a time: log in, start the
        agent, fn(host, link), let the agent go. Every host's agent stays alive only for
        its own turn: `status` of 1,000 hosts holds at most `limit` agents and logins at
        once beside the job, not 1,000 (which ran a 24 GB machine out of memory). Hosts
        not reached are the session's `failed`; fn's failures are the result's."""
        opener, seal = (self.connector, None) if self.connector else self._ssh(self.cluster.hosts)
        bundle()
        answered: GroupResult[T] = GroupResult()
        lock = threading.Lock()

        def one(h: Host) -> None:
            link = self._start(h, opener(h))   # raising: not reached
            try:
                value = fn(h, link)
                with lock:
                    answered.ok[h.index] = value
            except Exception as exc:  # collected: the host was reached, it did not answer
                with lock:
                    answered.failed[h.index] = exc
            finally:
                with contextlib.suppress(Exception):   # best effort: the host may be gone
                    end_link(link)
        try:
            reached = fan_out(self.cluster.hosts, one, limit=limit)
        finally:
            if seal is not None:
                seal()
        self._unreached(reached.failed)
        return answered

    def _ssh(self, hosts: tuple[Host, ...]) -> tuple[Callable[[Host], Transport], Callable[[], None]]:
        """A connector over SSH, and what ends its bastions' sharing. connect.py is imported
        here, not at the top: it brings paramiko, which commands that reach no host (help,
        a broken inventory) would load for nothing."""
        from orchestrator.ssh import connect, sshconfig
        config = sshconfig.ssh_config()   # exit 2 for an unreadable ~/.ssh/config, files next
        connect.check_local_files(hosts)
        connect.check_fd_limit(len(hosts))
        bastions = connect.Bastions()   # one connection per bastion, shared by its hosts
        base_dir, count = self.cluster.base_dir, len(self.cluster.hosts)
        return (lambda h: connect.connect(h, config, base_dir, bastions, count)), bastions.seal

    def _start(self, host: Host, transport: Transport) -> Link:
        """The host's agent over its new connection."""
        record = self.records[host.index]
        link = Link(transport, record.job_dir, record.part)
        link.python_fallback = self.cluster.setup is not None
        try:
            link.start(timeouts.scaled(timeouts.AGENT_START, len(self.cluster.hosts)))
        except BaseException:
            link.close(0)
            transport.close()
            raise
        return link

    def require_all(self, what: str) -> None:
        if self.failed:
            GroupResult(failed=self.failed).raise_failures(self.cluster.hosts, what)

    def close(self) -> None:
        """Close every agent's stdin, then wait for their ends by one deadline they share,
        then close the connections: the waits overlap (one after the other, 128 agents'
        ends took a quarter second; in waves of fan_out's 256, 300 hosts took two), and
        no thread per host (a thread each made 1,000 at once at 1,000 hosts)."""
        links = list(self.links.values())
        if self.markers:   # no launch took them: preflight's markers go now
            self.markers = False
            unshare(self.cluster, self.links, self.run_id)
        try:
            ending = [link for link in links if link.close_input()]
            deadline = time.monotonic() + timeouts.CLOSE
            for link in ending:
                with contextlib.suppress(Exception):   # best effort: the host may be gone
                    link.finish(max(0.0, deadline - time.monotonic()))
        finally:
            for link in links:
                with contextlib.suppress(Exception):
                    link.transport.close()
        # hosts let go: by one deadline they share (each waited for in turn, 1,000 of them
        # behind a hung host's last look would have been a second each)
        deadline = time.monotonic() + timeouts.CLOSE + 1
        for th in self.releasing:
            th.join(max(0.0, deadline - time.monotonic()))

    def release(self, index: int) -> None:
        """Close one host's agent now, in the background: a host whose part of the job
        ended well is not needed again (fail-fast stops the others; the pull is rank 0's
        host). At 128 hosts, closing them all at the end cost a third of a second."""
        link = self.records[index].link
        if link is None or index in self.pinned:
            return
        # asked while the host is still the session's: a hook reads its link (its `done`)
        looks = [look for look in (hook(index) for hook in self.before_release) if look]
        self.records[index].link = None

        def last(link: Link) -> None:
            # the last look in this thread, not the caller's: 1,000 hosts ending together
            # were 1,000 round trips one after the other in the monitor's loop; a few at
            # a time (LOOKS_AT_ONCE): all 1,000 at once made every host's agent list its
            # files together, on the cores the fake hosts share, and the job's own end
            # took twice as long
            if looks:
                with self.looking:
                    for look in looks:
                        look(link)
            end_link(link)
        th = threading.Thread(target=last, args=(link,), daemon=True)
        th.start()
        self.releasing.append(th)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ verbs

    def preflight(self, done: Callable[[], None] | None = None,
                  checked: Checked | None = None) -> PreflightReport:
        self.markers = True
        pre = preflight(self.cluster, self.links, self.failed, done, checked, self.run_id,
                        self.waiting)
        for i, info in pre.hosts.items():
            self.records[i].job_dir = info.job_dir
        return pre

    def claimed(self, pre: PreflightReport) -> Cluster:
        """The run as the hosts' GPU claims made it (gpuclaims.apply): from now on the
        session's cluster, which the launch and the saved state use."""
        claims = {i: list(info.gpu_ids) for i, info in pre.hosts.items()
                  if info.gpu_ids is not None}
        if not claims:
            return self.cluster
        self.cluster = gpuclaims.apply(self.cluster, claims)
        for h in self.cluster.hosts:
            self.records[h.index].host = h
        return self.cluster

    def open_and_preflight(self, opened: Callable[[], None] | None = None,
                           checked: Callable[[], None] | None = None) -> PreflightReport:
        """`open` and `preflight` in one pass per host: each host is checked as soon as
        its agent is up, while the slower logins go on (at 64 hosts the last logins take
        seconds). The verdict still waits for every host: all or nothing, as `preflight`.
        `opened` / `checked`: called as each host is up / checked (progress)."""
        early: Checked = GroupResult()
        lock = threading.Lock()
        warm = warm_start(self.cluster) and self.warm
        net = asks_net(self.cluster)

        def check(h: Host, link: Link) -> None:
            try:
                got = check_host(self.cluster, link, warm_env(self.cluster, h, self.run_id)
                                 if warm else None, self.run_id, self.expect(h), net=net)
                with lock:
                    early.ok[h.index] = got
            except Exception as exc:  # collected: judged with every other host's
                with lock:
                    early.failed[h.index] = exc
            if checked is not None:
                checked()
        self.open(done=opened, then=check)
        return self.preflight(checked, early)

    def expect(self, h: Host) -> dict[str, list[LocalFile]] | None:
        mine = self.expected().get(h.index) if self.expected is not None else None
        if mine is None:
            return None
        out = {"code": mine.code}
        # shards still being listed stand for a token only once every file is hashed
        data = mine.data.known() if isinstance(mine.data, Feed) else mine.data
        if data is not None:
            out["data"] = data
        return out

    def sync(self, files: dict[int, HostFiles], pre: PreflightReport,
             progress: Callable[[int], None] | None = None,
             host_done: Callable[[int], None] | None = None) -> dict[int, dict[str, SyncReport]]:
        """Code and shards once per job folder, all folders in parallel: a host with a
        folder of its own gets the code and its own shards; hosts that share one (NFS)
        get it through their first host: the code once, and each of their shards once.
        The reports are keyed by the host that pushed (pushing_hosts)."""
        # what the ignore rules leave out (a host's __pycache__) is never proposed for deletion
        pushable = Pushable(self.cluster.base_dir, self.cluster.code.paths,
                            self.cluster.code.exclude)
        grouped = group_files(files, pre)

        def one(h: Host) -> dict[str, SyncReport]:
            link, info, mine = self.links[h.index], pre.hosts[h.index], grouped[h.index]
            tick = (lambda nbytes, nfiles: progress(nbytes)) if progress else None
            out = {}
            if self.cluster.code.paths:
                code = info.manifests["code"]
                out["code"] = push(link, f"{info.job_dir}/code", mine.code, tick,
                                   code if isinstance(code, Same) else pushable(code))
            if mine.data is not None:
                out["data"] = push(link, f"{info.job_dir}/data", mine.data, tick,
                                   info.manifests["data"], mine.cache)
            if host_done:
                for member in pre.group_of(h.index):
                    host_done(member)
            return out
        pushers = tuple(self.cluster.hosts[i] for i in grouped)
        try:
            result = fan_out(pushers, one)
        finally:   # the digests the pushes learned, also of a push that broke off
            for cache in {id(hf.cache): hf.cache for hf in grouped.values() if hf.cache}.values():
                cache.save()
        unreadable = [e for e in result.failed.values() if isinstance(e, DataError)]
        if unreadable:
            raise unreadable[0]   # a local file (exit 2), not the host that was pushed to
        result.raise_failures(self.cluster.hosts, "to receive code or data")
        return result.ok

    def setup(self, pre: PreflightReport, code: list[LocalFile], force: bool,
              printer: Printer) -> dict[int, CommandReply]:
        """`setup:` on every host, all or nothing (setupstep.py); skipped on a host
        while its fingerprint is unchanged there, unless `force`."""
        digest = setupstep.setup_fingerprint(self.cluster, code)
        return setupstep.run_setup(self.cluster, self.links, pre, digest, force, printer)

    def check_ready(self, pre: PreflightReport) -> PreflightReport:
        """After setup, or without pushed code: python, torch, entrypoint per host."""
        return setupstep.check_ready(self.cluster, self.links, pre)

    def exec(self, argv: list[str], outputs: dict[int, HostOutput]) -> shellcmd.Outcome:
        """argv on every host with an open agent (in its job folder, with the job's
        env), in parallel; Ctrl-C cancels it everywhere (Outcome.interrupted)."""
        links = {i: link for i, link in self.links.items() if i in outputs}
        running, failed = shellcmd.submit_all(links, "exec", outputs, lambda i: dict(
            job_dir=self.records[i].job_dir, argv=argv,
            env=setupstep.command_env(self.cluster, self.records[i].job_dir)))
        return shellcmd.wait_all(running, None, failed)

    def launch(self, pre: PreflightReport, begin: Begun | None = None
               ) -> tuple[str, dict[int, Supervisor]]:
        """All hosts or none: if one host fails to start (or Ctrl-C comes now), the hosts
        that did start are stopped again before the error is reported. `begin`: an
        attached run's follows, begun as each host is started (launch_all)."""
        try:
            got = launch_all(self.cluster, self.links, pre, self.run_id, self.markers, begin)
            self.markers = False   # each host's launch removed its marker
            return got
        except BaseException:
            self.stop(0)
            raise

    def dirs(self) -> dict[int, str]:
        return {i: r.job_dir for i, r in self.records.items()}

    def stop(self, grace: float, skip: set[int] = frozenset()) -> GroupResult[StopReport]:  # type: ignore[assignment]
        """Stop the job on every host but those in `skip` (lost to the caller) whose link
        is gone. One lost to its follow alone (the follow refused on the host, its link
        still up) is stopped all the same: its ranks never run on behind a reachable host."""
        links = {i: link for i, link in self.links.items()
                 if i not in skip or link.dead is None}
        return stop_all(self.cluster, links, self.dirs(), grace)

    def status(self) -> GroupResult[StatusReply]:
        """`status` of every host with an open link, all asked at once (ask_all)."""
        return ask_all(self.links, "status", lambda i: self._status_fields(self.cluster.hosts[i]),
                       timeouts.STATUS, StatusReply.of)

    def status_on(self, h: Host, link: Link) -> StatusReply:
        """One host's `status`."""
        return StatusReply.of(link.request("status", timeouts.STATUS, **self._status_fields(h)))

    def _status_fields(self, h: Host) -> dict[str, Any]:
        # a host with GPUs also says every GPU's facts and holder (the GPU view)
        return dict(job_dir=self.records[h.index].job_dir, ranks=list(h.ranks),
                    **({"gpus": True} if h.gpus else {}))

    def stacks(self, reason: str) -> GroupResult[HostStacks]:
        """A hang: every rank's Python stack, or why it has none (agent/stacks.py); the
        hosts also append them to each rank's log."""
        return ask_all(self.links, "stacks",
                       lambda i: {"job_dir": self.records[i].job_dir, "reason": reason,
                                  "ranks": list(self.cluster.hosts[i].ranks)},
                       timeouts.STACKS, HostStacks.of)

    def failure_files(self, rank: int) -> tuple[str, tuple[str, ...]]:
        """torchrun's error file of a failed rank ("" when there is none or no answer), and
        the NCCL flight recorder dumps in its host's run/ (paths on that host)."""
        host = self.cluster.host_of(rank)
        link = self.links.get(host.index)
        if link is None:
            return "", ()
        try:
            reply = link.request("status", timeouts.ERROR_FILE, job_dir=self.records[host.index].job_dir,
                                 ranks=[rank], first_local=rank - host.first_rank)
        except Exception:  # the report is still useful without the error file
            return "", ()
        got = StatusReply.of(reply)
        run = self.run_dir(host.index)
        return got.ranks[0].error_file[-2000:], tuple(f"{run}/{name}" for name in got.nccl_dumps)

    def run_dir(self, host: int) -> str:
        """The host's part of run/, as its agent maps it."""
        record = self.records[host]
        return f"{record.job_dir}/run" + (f"/{record.part}" if record.part else "")

    def pull(self, host: Host, paths: list[str], dest: Path, progress: ReceiveProgress | None = None,
             planned: Callable[[int], None] | None = None) -> PullReport:
        """`paths` under the job's output/ on `host` (all of it when empty) into dest, on
        the host's open link (no new login)."""
        link = self.links.get(host.index)
        if link is None:
            self.require_all("to connect")
            raise HostError(f"{host.label}: not connected")
        cache = DigestCache(self.cluster.state_dir / "pull-digests.bin")
        return pull_files(link, self.records[host.index].job_dir, paths, dest, cache,
                          progress, planned)
