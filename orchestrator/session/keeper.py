"""The controller's copy of `job.checkpoint`'s files (#22 item 3): copied off rank 0's
host while the job runs (`Keeper`), and put back where the next rank 0 looks for them
before a (re)launch (`restore`). What a run does with them, attempt after attempt, is
session/checkpoints.py's.

The keeper is `orch pull` run every few seconds on the session's open link to rank 0's
host, for the files the globs match (wire/globs.py), into
`.orch/<name>/checkpoints/<output or code>/...` (their path relative to the job folder):
the host lists them with their sha256 (hashed once per change), this side asks only for
the new or changed ones, writes each beside its name, checks it and renames it. Never a
half-written file: the host leaves out a file written in the last `settle` seconds (a
job that saves in place), and a file is kept only when the bytes sent are those the
listing hashed (`Receiver.exact`): one rewritten meanwhile is fetched next round. Once
a round holds every file the host lists, the local files the host no longer has (the
job pruned them) are removed, so the folder holds the host's newest set; a host that
lists nothing removes nothing.

`restore` sends the kept files that the new rank 0's job folder lacks (or holds
otherwise) with the agent's `restore` request: written beside and renamed through its
JobDir, and never recorded in code/'s ledger, so a later code sync leaves them alone.
"""
from __future__ import annotations

import errno
import logging
import os
import shlex
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import DataError, HostError
from orchestrator.files.localfiles import DigestCache, LocalFile
from orchestrator.files.pull import (
    Listing,
    ManifestReply,
    PullReport,
    Receiver,
    manifest,
    plan,
    receive,
)
from orchestrator.files.pulldest import Dest
from orchestrator.files.sync import Stall, stream_and_wait
from orchestrator.remote.fanout import GroupResult
from orchestrator.remote.link import Link
from orchestrator.session.session import Session
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import globs, protocol, timeouts

# seconds between two rounds: a round is one listing request on the open link, and the
# host hashes a file only when it changed, so rounds are cheap; a short interval keeps
# the work lost to a host's death close to one checkpoint interval
INTERVAL = 0.5
SETTLE = 1.0       # a file written less than this long ago waits for the next round
log = logging.getLogger("orchestrator")


class KeptReceiver(Receiver):
    exact = True


def folder_globs(patterns: Iterable[str]) -> dict[str, list[str]]:
    """{"output" or "code": the globs relative to it}."""
    out: dict[str, list[str]] = {}
    for pattern in patterns:
        folder, rest = globs.split(pattern)
        out.setdefault(folder, []).append(rest)
    return out


def stale(held: dict[str, str], listed: Listing) -> list[str]:
    """The local files to remove after a round: those the host no longer lists, and only
    when every file it lists is held with its digest (the new set is complete here) and
    it lists at least one."""
    if not listed or any(held.get(rel) != entry.sha256 for rel, entry in listed.items()):
        return []
    return sorted(rel for rel in held if rel not in listed)


def local_files(root: Path, cache: DigestCache) -> dict[str, LocalFile]:
    """{rel: LocalFile} of the regular files under root (no link followed, no half-written
    `.orch-part-` file), digests cached."""
    out: dict[str, LocalFile] = {}
    for top, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
        for name in names:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or protocol.pull_path_problem(rel):
                continue
            out[rel] = LocalFile(rel, path, st.st_size, st.st_mode & 0o777, cache.digest(path, st))
    return out


def kept(root: Path, cache: DigestCache, patterns: Iterable[str]) -> dict[str, LocalFile]:
    """{rel to the job folder: LocalFile} of the kept files that the globs match."""
    out: dict[str, LocalFile] = {}
    for folder, rests in folder_globs(patterns).items():
        for rel, f in local_files(root / folder, cache).items():
            if globs.matches_any(rests, rel):
                out[f"{folder}/{rel}"] = LocalFile(f"{folder}/{rel}", f.path, f.size, f.mode, f.digest)
    return out


class LocalCopyError(DataError):
    """This machine's copy of the kept checkpoints (a file of the controller's, not the
    host's) failed during a put-back: no host is to blame for it, and no connection."""


def local_copy_error(e: OSError, root: Path) -> LocalCopyError:
    """An OSError on the controller's copy under `root`: the file, the cause, the fix."""
    named = e.filename2 or e.filename   # a rename's: where it was going
    path = os.fsdecode(named) if named else str(root)
    folder = shlex.quote(str(root))
    fix = {errno.EACCES: f"give your user access to it (`chmod -R u+rwX {folder}`)",
           errno.EPERM: f"give your user access to it (`chmod -R u+rwX {folder}`)",
           errno.ENOENT: f"it went away while it was read: leave {folder} alone while the "
                         "job runs",
           errno.ENOSPC: f"free space on the disk that holds it (`df -h {folder}`)",
           errno.EDQUOT: f"free space within your disk quota there (`df -h {folder}`)",
           errno.EROFS: f"{folder} is on a read-only file system: make it writable",
           }.get(e.errno or 0, f"check it on this machine (`ls -l {shlex.quote(path)}`)")
    return LocalCopyError(
        f"this machine's copy of the kept checkpoints failed: {path}: {e.strerror or e} "
        "(the controller's own file, not a host's), so the restart cannot put it back",
        hint=f"{fix}, then run `{hint_cmd(None, 'up')}` again")


def kept_here(root: Path, cache: DigestCache, patterns: Iterable[str]) -> dict[str, LocalFile]:
    """kept(), and the digests saved: only this machine's files are touched, so any
    OSError is this machine's (the fan-out would tell a bare one as the host's
    connection lost)."""
    try:
        files = kept(root, cache, patterns)
        cache.save()
    except OSError as e:
        raise local_copy_error(e, root) from None
    return files


class Keeper:
    """Copies job.checkpoint's files off the host of global rank 0, every `interval`
    seconds, on the session's open link. Never raises into its caller: a failed round
    (host lost, disk full here) is recorded in `errors`/`last_error` and tried again.
    Stop it before another pull on the same session (one file stream per link)."""

    def __init__(self, session: Session, cluster: Cluster, interval: float = INTERVAL,
                 settle: float = SETTLE) -> None:
        self.session, self.cluster = session, cluster
        self.interval, self.settle = interval, settle
        self.root = cluster.state_dir / "checkpoints"
        self.cache = DigestCache(cluster.state_dir / "checkpoint-digests.bin")
        self.lock = threading.Lock()
        self.held: dict[str, str] = {}          # rel to the job folder -> sha256, held here
        self.rounds = 0                          # rounds that ended well
        self.fetched = 0                         # files fetched since start
        self.errors = 0                          # rounds that failed
        self.last_error: str | None = None
        self.fresh: set[str] = set()             # files left out as still being written
        self.listed = 0                          # files the host listed, all rounds
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------ the thread

    def start(self) -> Keeper:
        self.done.clear()
        self.thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-keeper")
        self.thread.start()
        return self

    def stop(self, final: bool = False, timeout: float | None = None) -> None:
        """End the thread (after the file being received, if any); `final`: one last
        round first, in the caller's thread (still never raising)."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(timeout)
        if final:
            self.round()

    def _run(self) -> None:
        while not self.done.is_set():
            self.round()
            self.done.wait(self.interval)

    def saw(self, folder: str, reply: ManifestReply, remote: Listing) -> None:
        """A listing's news for `nothing_kept`: what it offered, what it left out."""
        with self.lock:
            self.listed += len(remote)
            self.fresh.update(f"{folder}/{rel}" for rel in reply.fresh_paths)

    def nothing_kept(self) -> str | None:
        """None when a checkpoint is held (this attempt's, or one kept before it); else
        why there is none, in words for the restart line."""
        with self.lock:
            if self.held:
                return None
            found, unread = self.kept_before()
            if found:
                return None
            if unread is not None:   # an earlier attempt's copy may be there, unseen
                return (f"this machine's copy of the kept checkpoints cannot be read: "
                        f"{unread.filename}: {unread.strerror or unread} (give your user "
                        f"access to it: `chmod -R u+rwX {shlex.quote(str(self.root))}`)")
            host = self.cluster.host_of(0).label
            if self.fresh:
                names = ", ".join(sorted(self.fresh)[:3])
                return (f"{names} never stayed unchanged for {self.settle:g} s on {host} "
                        f"(written in place at every look; write it beside and rename it)")
            if self.rounds == 0 and self.last_error:
                return f"no round of the keeper ended well: {self.last_error}"
            if self.listed == 0:
                return (f"job.checkpoint ({', '.join(self.cluster.job.checkpoint)}) "
                        f"matched no file on {host}")
            return "no complete copy was taken before the failure"

    def kept_before(self) -> tuple[bool, OSError | None]:
        """Whether a kept file from an earlier attempt is on this side (the controller's
        copy), and the first folder of it that could not be listed: a listing's error
        is not "nothing kept" (pathlib's glob would pass over it without a word)."""
        errors: list[OSError] = []
        if not self.root.is_dir():
            return False, None
        for folder, _, files in os.walk(self.root, onerror=errors.append):
            if any(os.path.isfile(os.path.join(folder, f)) for f in files):
                return True, None
        return False, errors[0] if errors else None

    def latest(self) -> dict[str, str]:
        """What it holds: {path relative to the job folder: sha256}, complete files only."""
        with self.lock:
            return dict(sorted(self.held.items()))

    # ------------------------------------------------------------ one round

    def round(self) -> bool:
        """One round now; False (and the reason recorded) when it failed."""
        host = self.cluster.host_of(0)
        try:
            link, job_dir = self.link_to(host)
            self.one_round(link, job_dir)
        except Exception as e:  # recorded, never raised: the caller is watching a job
            text = str(e)
            with self.lock:
                self.errors += 1
                self.last_error = text if text.startswith(host.label + ":") else f"{host.label}: {text}"
            log.debug("checkpoint keeper: %s", self.last_error)
            return False
        with self.lock:
            self.rounds += 1
            self.last_error = None
        return True

    def link_to(self, host: Host) -> tuple[Link, str]:
        """The session's link to a host and its job folder; HostError when it has none."""
        link = self.session.links.get(host.index)
        if link is None:
            raise HostError(f"{host.label}: not connected")
        return link, self.session.records[host.index].job_dir

    def one_round(self, link: Link, job_dir: str) -> None:
        """Rank 0's files (on `link`) into the controller's copy."""
        for folder, rests in folder_globs(self.cluster.job.checkpoint).items():
            self._folder(link, job_dir, folder, rests)

    def _folder(self, link: Link, job_dir: str, folder: str, rests: list[str]) -> None:
        reply, remote = manifest(link, job_dir, [], folder=folder, globs=rests,
                                 settle=self.settle)
        self.saw(folder, reply, remote)
        with Dest(self.root / folder) as dest:
            dest.sweep()
            todo = plan(remote, dest, self.cache)
            if todo.fetch:
                report = PullReport(link.name, folder, dest.show(""))
                try:
                    receive(link, job_dir, KeptReceiver(dest, todo.fetch, self.cache, report, None),
                            folder=folder)
                finally:
                    self.cache.save()
                self.fetched += report.files
            here = {rel: f.digest for rel, f in local_files(dest.root, self.cache).items()}
            for rel in stale(here, remote):
                dest.remove(rel)
                del here[rel]
        self.cache.save()
        with self.lock:
            self.held = {k: v for k, v in self.held.items() if not k.startswith(folder + "/")}
            self.held.update({f"{folder}/{rel}": digest for rel, digest in here.items()
                              if globs.matches_any(rests, rel)})


# ---------------------------------------------------------------- restore

def raise_put_back_failures(result: GroupResult[list[str]], hosts: tuple[Host, ...]) -> None:
    """A put-back's failures: this machine's copy failing is said once, as itself (no
    host is blamed: a restart's hosts would take a strike for it); else every host's."""
    local = [e for e in result.failed.values() if isinstance(e, LocalCopyError)]
    if local:
        raise local[0]
    result.raise_failures(hosts, "to take the kept checkpoints back")


def restore(session: Session, cluster: Cluster, index: int | None = None,
            root: Path | None = None) -> list[str]:
    """Put the kept files back into the job folder of host `index` (default: the host of
    global rank 0; its agent up in `session`), those missing or different there only.
    `root`: where the kept files are (default `.orch/<name>/checkpoints/`; the relay's
    staging folder for `checkpoint_to: host`). Returns their paths, relative to the job
    folder. Raises HostError when the host cannot take them."""
    host = cluster.host_of(0) if index is None else cluster.hosts[index]
    link: Link | None = session.links.get(host.index)
    if link is None:
        raise HostError(f"{host.label}: not connected: the checkpoints cannot be put back")
    job_dir = session.records[host.index].job_dir
    cache = DigestCache(cluster.state_dir / "checkpoint-digests.bin")
    root = root or cluster.state_dir / "checkpoints"
    files = kept_here(root, cache, cluster.job.checkpoint)
    if not files:
        return []
    if len(files) > protocol.MAX_RESTORE_FILES:
        raise HostError(f"{len(files)} checkpoint files kept, more than "
                        f"{protocol.MAX_RESTORE_FILES} (the limit)",
                        hint="narrow job.checkpoint to the files the job resumes from")
    asked = {rel: [f.size, f.digest] for rel, f in files.items()}
    want = link.request("restore_check", timeouts.PULL_MANIFEST, job_dir=job_dir, files=asked)["want"]
    if set(want) - files.keys():
        raise HostError(f"{link.name}: the restore check is refused: it names files not offered",
                        hint="the host's agent may be compromised or broken; nothing was sent")
    send = [files[rel] for rel in sorted(set(want))]
    if send:
        with Stall(link) as stall:
            try:
                stream_and_wait(link, stall, job_dir, send, [], None, "restore", job_dir=job_dir)
            except DataError as e:   # a kept file that this side could not read as listed
                raise LocalCopyError(
                    f"this machine's copy of the kept checkpoints failed: {e.message} (the "
                    "controller's own file, not a host's), so the restart cannot put it back",
                    hint=f"check it on this machine, then run `{hint_cmd(None, 'up')}` "
                         "again") from None
            except Exception:
                if stall.fired:
                    raise HostError(f"{link.name}: putting the checkpoints back stalled: the "
                                    f"host took nothing for {stall.idle:g} s",
                                    hint="the files that landed are kept; the next restore "
                                         "sends only the rest") from None
                raise
    return [f.rel for f in send]
