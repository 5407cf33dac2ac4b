"""Finding a job's processes by their marker, and stopping them (SIGTERM, grace, SIGKILL,
verify)."""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time

from orchestrator.agent import paths
from orchestrator.agent.common import job_paths, read_json, write_atomic
from orchestrator.wire import timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Iterable

    from orchestrator.agent.main import Request

MARKER = "ORCH_JOB_DIR"        # in the environment of every process of a job
PART_MARKER = "ORCH_JOB_PART"  # and which host's part of it (hosts sharing one job folder)
STOP_FILE = "run/stop.json"   # when this host received a stop, by its own clock


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses):
    [0] is field 3 (the state), [1] the parent, [2] the process group, [19] the start
    time. None when the process is gone."""
    try:
        with open("/proc/%s/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a live pid from a recycled one. None for a
    zombie: a container's init may never reap our double-forked supervisor."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def child_of(pid: int, parent: int) -> bool:
    """pid lives and is parent's child (field 4 of its stat): not a recycled pid."""
    fields = stat_fields(pid)
    return fields is not None and int(fields[1]) == parent


def read_environ(pid: int) -> bytes:
    """The environment of pid, b"" when it cannot be read or is not this user's process
    (never another user's, even as root). One descriptor, unbuffered reads: a stop scans
    every process on the host (twice), so this is its cost."""
    try:
        fd = os.open("/proc/%d/environ" % pid, os.O_RDONLY)
    except OSError:
        return b""
    try:
        if os.fstat(fd).st_uid != os.getuid():   # /proc/<pid>/* belongs to its owner
            return b""
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return b""
    finally:
        os.close(fd)


def marked_pids(job_dir: str) -> list[Any]:
    """Every process of this job: its environment carries ORCH_JOB_DIR=<abs job dir>.

    torchrun puts each worker in a session of its own, so a process group alone misses
    them; the marker is inherited by torchrun, the workers and their data-loader children.
    """
    marker = b"\0%s=%s\0" % (MARKER.encode(), job_dir.encode())   # a whole entry, not a prefix
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            env = b"\0" + read_environ(int(name)) + b"\0"
            if marker in env and this_part(env):
                out.append(int(name))
    return out


def open_for_writing(wanted: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of the files `wanted` ((st_dev, st_ino) pairs) a process of this user holds
    open for writing now: a checkpoint still being written in place, by the job or by a
    copy the user started (`orch exec -- cp`). Another user's process cannot write into
    this user's job folder unless given the right, and its /proc/<pid>/fd is not ours to
    read; a process or descriptor that vanishes meanwhile is skipped."""
    held: set[tuple[int, int]] = set()
    uid = os.getuid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat("/proc/" + name).st_uid != uid:
                continue
        except OSError:
            continue
        held |= writing_in(int(name), wanted - held)
        if held == wanted:
            break
    return held


def fds_of(pid: int) -> list[str]:
    """pid's open descriptors (names in /proc/<pid>/fd); none when it is gone or not ours."""
    try:
        return os.listdir("/proc/%d/fd" % pid)
    except OSError:
        return []


def writing_in(pid: int, wanted: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The files of `wanted` that pid has open with O_WRONLY or O_RDWR."""
    out: set[tuple[int, int]] = set()
    for fd in fds_of(pid):
        try:
            st = os.stat("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted and fd_writes(pid, fd):
            out.add((st.st_dev, st.st_ino))
    return out


def fd_writes(pid: int, fd: str) -> bool:
    """fdinfo's `flags:` (octal) carry an access mode of write or read-write."""
    try:
        with open("/proc/%d/fdinfo/%s" % (pid, fd)) as f:
            for line in f:
                if line.startswith("flags:"):
                    return (int(line.split()[1], 8) & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
    except (OSError, ValueError, IndexError):
        pass
    return False


def this_part(env: bytes) -> bool:
    """A process of this host's part of the job: hosts that share the job folder on one
    machine (a bind mount, the same path) share ORCH_JOB_DIR too. A process without a
    part (started by an orch before parts) counts as this host's."""
    if not paths.HOST_PART or b"\0%s=" % PART_MARKER.encode() not in env:
        return True
    return b"\0%s=%s\0" % (PART_MARKER.encode(), paths.HOST_PART.encode()) in env


def supervisor_alive(p: dict[str, Any]) -> dict[str, Any] | None:
    sup = read_json(p["jd"], "run/supervisor.json")
    if not isinstance(sup, dict) or not isinstance(sup.get("pid"), int):
        return None
    if proc_start_time(sup["pid"]) != sup.get("start_ticks"):
        return None
    return sup


def job_running(p: dict[str, Any]) -> bool:
    """The job's supervisor lives, or one of its ranks, or any process with the job's
    marker does: after a stop that was cut short (its `orch stop` killed), torchrun and
    the supervisor are gone while ranks wait out their grace; a new launch beside them
    would be a second copy (and the unfinished stop, still running on the host, would
    kill it).

    The marker scan reads every process's environment (on a fake cluster of N hosts on
    one machine, N agents each read all N hosts' processes: seconds of CPU at 128). It
    is skipped when the last run ended by itself: torchrun ended after its ranks, no stop
    came, and no recorded rank lives (the ranks' own records, run/rank-<r>.pid)."""
    if supervisor_alive(p):
        return True
    alive = ranks_alive(p)
    if alive is not None and (alive or ended_by_itself(p)):
        return alive
    return bool(marked_pids(p["job"]))


def ranks_alive(p: dict[str, Any]) -> bool | None:
    """Whether a rank (or task) of the last run still lives, by its record (pid and start
    time: not a recycled pid); None when a record cannot tell."""
    try:
        with p["jd"].dirfd("run") as fd:
            names = [n for n in os.listdir(fd) if n.startswith(("rank-", "task-"))
                     and n.endswith((".pid", ".start"))]
    except OSError:   # no run/ (never launched here): nothing recorded
        return False
    if len(names) > 4096:
        return None
    for name in names:
        rec = read_json(p["jd"], "run/" + name)
        if not (isinstance(rec, dict) and isinstance(rec.get("pid"), int)
                and isinstance(rec.get("start_ticks"), int)):
            return None
        if proc_start_time(rec["pid"]) == rec["start_ticks"]:
            return True
    return False


def ended_by_itself(p: dict[str, Any]) -> bool:
    """Never launched here, or the last run's supervisor recorded torchrun's end
    (host.exit) and no stop was received during it."""
    jd = p["jd"]
    if jd.lstat("run/launch.json") is None:   # (run/ itself is made by preflight's claim)
        return True
    return jd.lstat("run/host.exit") is not None and jd.lstat(STOP_FILE) is None


LOCKED: dict[str, int] = {}   # job dir -> a descriptor of it, holding its lock (claim)
MADE: dict[str, Any] = {}     # job dir -> its JobDir, where the claim made run/<part>/


def claim(p: dict[str, Any]) -> bool | None:
    """Lock this host's part of the job folder for this agent's life (flock on the folder
    itself, run/<part>/, or the job folder without parts: nothing is written): one `orch
    up` at a time prepares and starts a job there, and hosts sharing the job folder each
    lock their own part. False: another agent holds it (an `up` of this job is under
    way). None: this filesystem has no locks."""
    if p["job"] in LOCKED:
        return True
    import fcntl
    # a description of its own (not a dup of the JobDir's): flock belongs to the open
    # file description, and release() must end the lock while the JobDir stays open
    jd = p["jd"]
    if jd.part and jd.lstat("run") is None:
        MADE[p["job"]] = jd
    fd = jd.open_dir("run", create=True) if jd.part else \
        os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=jd.fd())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:
        os.close(fd)
        return None
    LOCKED[p["job"]] = fd
    return True


def release(job: str) -> None:
    fd = LOCKED.pop(job, None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """The agent ends: its locks end, and a part (and run/) that the claim made and
    nothing used since is removed: a refused preflight leaves no run/ behind."""
    for job in list(LOCKED):
        release(job)
        jd = MADE.pop(job, None)
        if jd is not None and jd.rmdir("run"):   # run/<part>/, only when empty
            jd.rmdir_top("run")


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def wait_gone(job_dir: str, sup: dict[str, Any] | None, deadline: float,
              known: Iterable[int] = ()) -> list[Any]:
    """Wait until the job's processes are gone; what is left at the deadline.

    The pids already found are watched through their own /proc/<pid>/stat (cheap); only
    once they have all ended is /proc scanned again for the marker (every process's
    environment: the costly part, which the old 50 ms full-scan loop paid every time)
    to verify that nothing new appeared; what that scan finds is watched in turn."""
    watch = {p: proc_start_time(p) for p in known}
    polls = 0
    with Exits() as exits:
        while True:
            watch = {p: t for p, t in watch.items() if t is not None and proc_start_time(p) == t}
            if not watch:
                left = marked_pids(job_dir)
                if sup and proc_start_time(sup["pid"]) == sup.get("start_ticks"):
                    left.append(sup["pid"])
                if not left or time.time() >= deadline:
                    return left
                watch = {p: proc_start_time(p) for p in left}
            elif time.time() >= deadline:
                return sorted(set(watch) | set(marked_pids(job_dir)))
            # signalled processes mostly end within milliseconds: look again soon at first
            polls += 1
            exits.sleep(watch, min(0.5, max(0.0, deadline - time.time())),
                        0.01 if polls <= 20 else 0.05)


class Exits:
    """The watched processes' ends as pidfds (Linux 5.3, Python 3.9): a stop sleeps until
    one of them ends, instead of reading each one's /proc/<pid>/stat 20 to 100 times a
    second. With 300 hosts' agents stopping at once on one machine, those reads were
    cores' worth of CPU, taken from the very processes being waited for. Without a
    pidfd for every watched process it sleeps `poll` seconds, as before."""

    def __init__(self) -> None:
        self.fds = {}   # type: dict[int, int]
        self.poller = getattr(select, "poll", lambda: None)()

    def __enter__(self) -> Exits:
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in list(self.fds):
            self.drop(pid)

    def sleep(self, watch: dict[int, int | None], most: float, poll: float) -> None:
        for pid in [p for p in self.fds if p not in watch]:   # ended: its fd reads ready
            self.drop(pid)
        for pid, ticks in watch.items():
            if pid not in self.fds:
                self.open(pid, ticks)
        if self.poller is None or any(p not in self.fds for p in watch):
            time.sleep(poll)
            return
        self.poller.poll(most * 1000)

    def open(self, pid: int, ticks: int | None) -> None:
        opener = getattr(os, "pidfd_open", None)
        if opener is None or self.poller is None:
            return
        try:
            fd = opener(pid)
        except OSError:   # ended already, or no pidfd in this kernel
            return
        if proc_start_time(pid) != ticks:   # ended before the open: the pid is not its own
            os.close(fd)
            return
        self.fds[pid] = fd
        self.poller.register(fd, select.POLLIN)

    def drop(self, pid: int) -> None:
        fd = self.fds.pop(pid)
        if self.poller is not None:
            self.poller.unregister(fd)
        os.close(fd)


def stop(job_dir: str, grace: float) -> dict[str, Any]:
    """SIGTERM every process of the job, wait up to grace, SIGKILL the rest, verify.
    Runs in a thread of its own that the agent waits for: a stop runs to the end even
    if the controller (and so the connection) goes away."""
    p = job_paths(job_dir)
    sup = supervisor_alive(p)
    t0 = time.time()
    found = marked_pids(p["job"]) + ([sup["pid"]] if sup else [])
    torchrun: int | None = sup.get("torchrun_pid") if sup else None
    if sup and torchrun is not None and torchrun not in found and child_of(torchrun, sup["pid"]):
        found.append(torchrun)   # a warm-started torchrun has no marker of its own
    if found:
        mark_stop(p, t0)
    # torchrun itself has nothing to save, and its own SIGTERM shutdown takes seconds;
    # the ranks (the user's code) get SIGTERM from us directly and the full grace.
    signal_all([torchrun] if torchrun is not None and torchrun in found else [], signal.SIGKILL)
    signal_all([x for x in found if x != torchrun], signal.SIGTERM)
    left = wait_gone(p["job"], sup, time.time() + grace, found)
    killed = list(left)
    if left:   # else wait_gone's last scan has just verified that nothing is left
        signal_all(left, signal.SIGKILL)
        left = wait_gone(p["job"], sup, time.time() + timeouts.STOP_VERIFY, left)
    return {"found": len(found), "killed": len(killed), "left": left,
            "seconds": round(time.time() - t0, 3)}


def mark_stop(p: dict[str, Any], when: float) -> None:
    """Record the stop before any signal: a rank that exits after this moment was ended
    by orch (or by torchrun reacting to it) and is never reported as the job's cause.
    A full disk must not keep the stop from happening."""
    with contextlib.suppress(OSError):
        write_atomic(p["jd"], STOP_FILE, json.dumps({"time": when}).encode(), 0o644)


def stop_time(p: dict[str, Any]) -> float | None:
    """The host time of the stop received during this run, or None."""
    got = read_json(p["jd"], STOP_FILE)
    when = got.get("time") if isinstance(got, dict) else None
    return when if isinstance(when, (int, float)) and not isinstance(when, bool) else None


def run_stop(req: Request) -> dict[str, Any]:
    return stop(req.args["job_dir"], max(0.0, float(req.args["grace"])))
