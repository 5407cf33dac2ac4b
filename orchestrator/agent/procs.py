"""Finding a job's processes by their marker, and stopping them (SIGTERM, grace, SIGKILL,
verify)."""
from __future__ import annotations

import contextlib
import os
import time

from orchestrator.agent import paths
from orchestrator.agent.common import job_paths, read_json, write_atomic

# (re-exported: the process primitives moved to pids.py, their callers still say procs.)
from orchestrator.agent.pids import Exits as Exits
from orchestrator.agent.pids import proc_start_time as proc_start_time
from orchestrator.agent.pids import stat_fields as stat_fields
from orchestrator.wire import jsonc, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    import signal
    from typing import Any, Callable, Iterable

    from orchestrator.agent.main import Request
else:   # signal's enums are 6-8 ms of CPU and ~0.4 MiB in every agent: the C module
    import _signal as signal

MARKER = "ORCH_JOB_DIR"        # in the environment of every process of a job
PART_MARKER = "ORCH_JOB_PART"  # and which host's part of it (hosts sharing one job folder)
STOP_FILE = "run/stop.json"   # when this host received a stop, by its own clock
ENVIRON_READ = 32768          # most environments are a few KiB: one read holds them
TREE_MAX = 65536              # processes a stop takes from the known tree (a fork bomb's cap)


def child_of(pid: int, parent: int) -> bool:
    """pid lives and is parent's child (field 4 of its stat): not a recycled pid."""
    fields = stat_fields(pid)
    return fields is not None and int(fields[1]) == parent


def read_environ(pid: int) -> bytes:
    """The environment of pid, b"" when it cannot be read or is not this user's process
    (never another user's, even as root). A stop scans every process on the host, so
    this is its cost: one descriptor, one unbuffered read. The kernel fills a read of
    /proc/<pid>/environ up to its size or to the environment's end, so a short read is
    the end: no second read to see it (a few per cent of a scan's CPU, measured with
    2,000 processes; the open is most of the cost)."""
    try:
        fd = os.open("/proc/%d/environ" % pid, os.O_RDONLY)
    except OSError:
        return b""
    try:
        if os.fstat(fd).st_uid != os.getuid():   # /proc/<pid>/* belongs to its owner
            return b""
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, ENVIRON_READ)
            chunks.append(chunk)
            if len(chunk) < ENVIRON_READ:
                return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


def marked_pids(job_dir: str) -> list[Any]:
    """Every process of this job: its environment carries ORCH_JOB_DIR=<abs job dir>.

    torchrun puts each worker in a session of its own, so a process group alone misses
    them; the marker is inherited by torchrun, the workers and their data-loader children.

    Its cost is one open and read per process on the host: a stop signals the known tree
    first and scans once, to verify (stop). Prefilters weighed, and left out:
    - the start time (stat field 22) against the launch: reading /proc/<pid>/stat costs
      as much as the environment, and the marker is the job folder's, not a launch's:
      a former run's orphan, whose stop was cut short, carries it too and must be found;
    - /proc/<pid>'s owner by stat() before the open: the fstat below tells the same at
      no extra call for this user's processes (most of them, where stops cost most).
    A process in the middle of an exec reads an empty environment for a moment; in a
    stop, the known tree finds it while its parent lives.
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
    marker does: after a stop that was cut short (its `orch stop` killed), ranks wait out
    their grace (their supervisor, a subreaper, waits for them; an older one, or one
    killed, is gone); a new launch beside them would be a second copy (and the
    unfinished stop, still running on the host, would kill it).

    The marker scan reads every process's environment (on a fake cluster of N hosts on
    one machine, N agents each read all N hosts' processes: seconds of CPU at 128). It
    is skipped when the last run ended by itself: its supervisor, a subreaper, ended with
    nothing of its tree left (reaped), and no recorded rank lives (the ranks' own
    records, run/rank-<r>.pid); and when a stop of the last run ended verified
    (stopped_clean): the `up` after a stop."""
    if supervisor_alive(p):
        return True
    alive = ranks_alive(p)
    if alive is not None and (alive or ended_by_itself(p) or stopped_clean(p)):
        return alive
    return bool(marked_pids(p["job"]))


def ranks_alive(p: dict[str, Any]) -> bool | None:
    """Whether a rank (or task) of the last run still lives, by its record (pid and start
    time: not a recycled pid); None when a record cannot tell."""
    live = recorded_pids(p, first=True)
    return None if live is None else bool(live)


def recorded_pids(p: dict[str, Any], first: bool = False) -> list[int] | None:
    """The ranks (and tasks) of the last run that still live, by their own records
    (run/rank-<r>.pid: pid and start time, not a recycled pid); only the first one found
    when `first`; None when a record cannot tell."""
    try:
        with p["jd"].dirfd("run") as fd:
            names = [n for n in os.listdir(fd) if n.startswith(("rank-", "task-"))
                     and n.endswith((".pid", ".start"))]
    except OSError:   # no run/ (never launched here): nothing recorded
        return []
    if len(names) > 4096:
        return None
    live = []
    for name in names:
        rec = read_json(p["jd"], "run/" + name)
        if not (isinstance(rec, dict) and isinstance(rec.get("pid"), int)
                and isinstance(rec.get("start_ticks"), int)):
            return None
        if proc_start_time(rec["pid"]) == rec["start_ticks"]:
            live.append(rec["pid"])
            if first:
                break
    return live


def ended_by_itself(p: dict[str, Any]) -> bool:
    """Never launched here, or the last run's supervisor ended with nothing of its tree
    left (reaped). torchrun's end alone (host.exit) says nothing of a daemon a rank left
    behind: an older agent's supervisor, or one killed before its tree was empty, is
    followed by a scan; a stop may have come (its own record says what it verified)."""
    jd = p["jd"]
    if jd.lstat("run/launch.json") is None:   # (run/ itself is made by preflight's claim)
        return True
    return reaped(p)


def launch_id(p: dict[str, Any]) -> list[int] | None:
    """Which launch the job folder's run is: run/launch.json, written anew (a new file
    renamed over the old one) by every launch and array launch."""
    st = p["jd"].lstat("run/launch.json")
    return None if st is None else [st.st_ino, st.st_mtime_ns, st.st_size]


def stopped_clean(p: dict[str, Any]) -> bool:
    """A stop of the last launch ended with its marker scan finding nothing left (the
    stop record says so, for this launch): no process of the job can live since, for
    only a launch starts one, and a launch writes launch.json anew (and a job's launch
    removes the record). The `up` after a stop then needs no scan of every process."""
    rec = read_json(p["jd"], STOP_FILE)
    launch = launch_id(p)
    return isinstance(rec, dict) and rec.get("verified") is True and launch is not None \
        and rec.get("launch") == launch


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


def children(pid: int) -> list[int]:
    """pid's children now: each of its threads' /proc/<pid>/task/<tid>/children (a child
    belongs to the thread that started it). None for a process that is gone, nor
    without that file (a kernel without CONFIG_PROC_CHILDREN): the marker scan that ends
    every stop still finds them."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def own(pid: int) -> bool:
    """pid is this user's process: what the marker scan would read (/proc/<pid> belongs
    to the process's owner). Another user's process (a rank's sudo) is not signalled: it
    could not be by a plain user, and a stop would wait for it to the end."""
    try:
        return os.stat("/proc/%d" % pid).st_uid == os.getuid()
    except OSError:
        return False


def known_tree(p: dict[str, Any], sup: dict[str, Any] | None) -> list[int]:
    """The job's processes found without reading every process's environment: the
    supervisor, the ranks by their records (they outlive torchrun after a stop cut short)
    and every descendant of these now (torchrun, warm-started without a marker of its
    own, the ranks' wrappers, data-loader children, a child that called setsid while its
    parent lives). A few dozen small reads instead of one per process on the host."""
    todo = ([sup["pid"]] if sup else []) + (recorded_pids(p) or [])
    seen: set[int] = set()
    while todo and len(seen) < TREE_MAX:
        pid = todo.pop()
        if pid not in seen and own(pid):
            seen.add(pid)
            todo.extend(children(pid))
    return sorted(seen)


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def wait_gone(job_dir: str, sup: dict[str, Any] | None, deadline: float,
              known: Iterable[int] = (), found: Callable[[list[int]], None] | None = None,
              scan_by: float | None = None) -> list[Any]:
    """Wait until the job's processes are gone; what is left at the deadline.

    The pids already known are watched through their pidfds or /proc/<pid>/stat (cheap);
    only once they have all ended (or at `scan_by`, if that comes first) is /proc scanned
    for the marker (every process's environment: the costly part), to find what left the
    known tree and to verify that nothing is left. What a scan finds that was not known
    is given to `found` (the stop signals it) and watched in turn; [] only after a scan
    that found nothing, with nothing watched alive."""
    watch = {p: proc_start_time(p) for p in known}
    seen = set(watch)
    polls = 0
    with Exits() as exits:
        while True:
            watch = {p: t for p, t in watch.items() if exits.alive(p, t)}
            if not watch or (scan_by is not None and time.time() >= scan_by):
                scan_by = None
                left = scan(job_dir, sup)
                fresh = [x for x in left if x not in seen]
                seen.update(fresh)
                if fresh and found is not None:
                    found(fresh)
                if not (left or watch) or time.time() >= deadline:
                    return sorted(set(watch) | set(left))
                watch.update((p, proc_start_time(p)) for p in left if p not in watch)
            elif time.time() >= deadline:
                return sorted(set(watch) | set(scan(job_dir, sup)))
            # signalled processes mostly end within milliseconds: look again soon at first
            polls += 1
            exits.sleep(watch, min(0.5, max(0.0, deadline - time.time())),
                        0.01 if polls <= 20 else 0.05)


def scan(job_dir: str, sup: dict[str, Any] | None) -> list[int]:
    """The marker scan, and the supervisor (which has no marker) while it lives."""
    left: list[int] = marked_pids(job_dir)
    if sup and proc_start_time(sup["pid"]) == sup.get("start_ticks"):
        left.append(sup["pid"])
    return left


def stop(job_dir: str, grace: float) -> dict[str, Any]:
    """SIGTERM every process of the job, wait up to grace, SIGKILL the rest, verify.
    Runs in a thread of its own that the agent waits for: a stop runs to the end even
    if the controller (and so the connection) goes away.

    A live supervisor that is a child subreaper (supervisor.become_subreaper) holds every
    process of its run in its tree, whatever called setsid or lost its parent: the stop
    signals that tree and waits for the supervisor's end, whose record says that nothing
    was left (reaped): no process's environment is read (stop_subtree). Without one (it
    was killed, an older agent started it, the kernel has no subreapers) the stop signals
    the known tree and scans for the marker (stop_scanning). After a run whose supervisor
    ended so, nothing of it can be left: there is nothing to stop. A stop verified
    otherwise is recorded as such (mark_verified): the supervisor's word already says it
    for the `up` that follows (ended_by_itself), at one file fewer a host."""
    p = job_paths(job_dir)
    with contextlib.suppress(OSError):   # its records read and written without a walk
        p["jd"].hold("run")
    sup = supervisor_alive(p)
    t0 = time.time()
    launch = launch_id(p)
    if sup is None and reaped(p) and recorded_pids(p) == []:
        return {"found": 0, "killed": 0, "left": [], "seconds": round(time.time() - t0, 3)}
    said = False   # the supervisor's own last word (reaped) verified the stop
    if sup is not None and sup.get("subreaper") is True:
        seen, killed, left, said = stop_subtree(p, sup, t0, grace)
    else:
        seen, killed, left = stop_scanning(p, sup, t0, grace)
    if seen and not left and not said:   # (said: a second record would say it again)
        mark_verified(p, t0, launch)
    return {"found": len(seen), "killed": len(killed), "left": left,
            "seconds": round(time.time() - t0, 3)}


def stop_scanning(p: dict[str, Any], sup: dict[str, Any] | None, t0: float,
                  grace: float) -> tuple[list[int], list[int], list[Any]]:
    """The stop without a subreaper: the known tree (known_tree) is signalled at once, so
    no scan of every process's environment stands between the stop and its signals; one
    marker scan after the tree has ended finds what left it (a child that called setsid
    and lost its parent, an orphan of an earlier run) and verifies that nothing is left.
    A process outside the tree gets its SIGTERM when that scan finds it: after the tree
    ended, or at half the grace if the tree takes longer. (seen, killed, left)"""
    tree = known_tree(p, sup)
    torchrun: int | None = sup.get("torchrun_pid") if sup else None
    if torchrun not in tree:   # (a child of the supervisor: its warm one has no marker)
        torchrun = None
    if tree:
        mark_stop(p, t0, grace)
    # torchrun itself has nothing to save, and its own SIGTERM shutdown takes seconds;
    # the ranks (the user's code) get SIGTERM from us directly and the full grace.
    signal_all([torchrun] if torchrun is not None else [], signal.SIGKILL)
    signal_all([x for x in tree if x != torchrun], signal.SIGTERM)
    seen = list(tree)
    killed, left = finish_scanning(p, sup, t0, t0 + grace, tree, seen)
    return seen, killed, left


def finish_scanning(p: dict[str, Any], sup: dict[str, Any] | None, t0: float, kill_at: float,
                    known: list[int], seen: list[int]) -> tuple[list[int], list[Any]]:
    """Wait for `known` to end, scan for what else carries the marker (SIGTERM to what it
    finds), SIGKILL at kill_at what is left, verify. (killed, left)"""
    def found(pids: list[int]) -> None:
        if not seen:
            mark_stop(p, t0, kill_at - t0)
        seen.extend(pids)
        signal_all(pids, signal.SIGTERM)
    left = wait_gone(p["job"], sup, kill_at, known, found, t0 + (kill_at - t0) / 2)
    killed = list(left)
    if left:   # else wait_gone's last scan has just verified that nothing is left
        signal_all(left, signal.SIGKILL)
        left = wait_gone(p["job"], sup, time.time() + timeouts.STOP_VERIFY, left,
                         lambda pids: signal_all(pids, signal.SIGKILL))
    return killed, left


def job_pids(p: dict[str, Any], sup: dict[str, Any] | None) -> list[int]:
    """The job's processes now, but its supervisor: a subreaper's tree (no process's
    environment read), else those with the marker and a warm-started torchrun (which has
    no marker of its own)."""
    if sup is not None and sup.get("subreaper") is True:
        return subtree(sup["pid"], sup.get("start_ticks"))
    pids: list[int] = marked_pids(p["job"])
    torchrun = sup.get("torchrun_pid") if sup else None
    if sup and isinstance(torchrun, int) and torchrun not in pids and \
            child_of(torchrun, sup["pid"]):
        pids.append(torchrun)
    return pids


def subtree(root: int, ticks: int | None = None) -> list[int]:
    """root's descendants now, this user's and alive (a zombie has ended; another user's
    process is not ours to signal, nor what it started): each one's children files. Under
    a subreaper the whole of what root started, however far it went (setsid, a double
    fork): an orphan's new parent is root, not init. With root's start time: nothing when
    root is not that process after its children were read (ended, its pid recycled)."""
    out: list[int] = []
    todo, seen = children(root), set()  # type: list[int], set[int]
    if ticks is not None and proc_start_time(root) != ticks:
        return []
    while todo and len(seen) < TREE_MAX:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if own(pid) and proc_start_time(pid) is not None:
            out.append(pid)
            todo.extend(children(pid))
    return sorted(out)


def reaped(p: dict[str, Any], sup: dict[str, Any] | None = None) -> bool:
    """The run's supervisor, a subreaper, ended with nothing of its tree left: its last
    word in run/host.exit (`reaped`, with its pid and start time, which must be the
    supervisor record's: not an earlier run's file). Then no process of that run lives
    anywhere, and none of the job can start before the next launch."""
    rec = sup if sup is not None else read_json(p["jd"], "run/supervisor.json")
    done = read_json(p["jd"], "run/host.exit")
    return isinstance(rec, dict) and isinstance(done, dict) and done.get("reaped") is True \
        and isinstance(rec.get("pid"), int) and done.get("pid") == rec["pid"] \
        and done.get("start_ticks") == rec.get("start_ticks")


def stop_subtree(p: dict[str, Any], sup: dict[str, Any], t0: float,
                 grace: float) -> tuple[list[int], list[int], list[Any], bool]:
    """The stop through a subreaper supervisor: its tree signalled (torchrun SIGKILLed,
    the rest SIGTERMed, SIGKILL at the grace), then its end awaited: it reaps its tree
    and ends once nothing is left, saying so (reaped). The supervisor itself is not
    signalled (an array's runner, which is its own torchrun, gets SIGUSR1: no task
    starts after; its tasks get SIGTERM from here, once). Should it end without that
    word (killed meanwhile), or not end in time, the marker scan takes over from what
    is known. (seen, killed, left, whether the supervisor's word verified the stop)"""
    root = sup["pid"]
    tree = subtree(root, sup.get("start_ticks"))
    mark_stop(p, t0, grace)
    torchrun = sup.get("torchrun_pid")
    signal_all([root] if torchrun == root else [], signal.SIGUSR1)
    signal_all([torchrun] if torchrun in tree else [], signal.SIGKILL)
    signal_all([x for x in tree if x != torchrun], signal.SIGTERM)
    seen, killed = [root] + tree, []  # type: list[int], list[int]
    if await_reaped(p, sup, t0 + grace, seen, killed):
        return seen, killed, [], True
    live = supervisor_alive(p)
    known = [x for x in seen if proc_start_time(x) is not None]
    more, left = finish_scanning(p, live, t0, max(t0 + grace, time.time()), known, seen)
    return seen, sorted(set(killed) | set(more)), left, False


def await_reaped(p: dict[str, Any], sup: dict[str, Any], kill_at: float, seen: list[int],
                 killed: list[int]) -> bool:
    """Wait, on pidfds, for the supervisor's end; True once it ended saying that nothing
    was left. What the known part of its tree ended, its tree is looked at again for what
    is new (a rank's child started in its SIGTERM handler): SIGTERM to it, or SIGKILL
    past kill_at, when the whole tree gets SIGKILL; `seen` and `killed` grow."""
    root, ticks = sup["pid"], sup.get("start_ticks")
    watch = {x: proc_start_time(x) for x in seen}
    sig, end = signal.SIGTERM, kill_at + timeouts.STOP_VERIFY
    with Exits() as exits:
        while exits.alive(root, ticks):
            now = time.time()
            if sig == signal.SIGTERM and now >= kill_at:
                # past the supervisor's own SIGKILL (STOP_VERIFY after this one) and its
                # wait after it (supervisor.drain): its word, reaped or not, comes before
                # this stop takes over, which kills the supervisor too. Only a tree that
                # SIGKILL cannot empty (a process stuck in the kernel) waits that long
                sig, end = signal.SIGKILL, now + 2 * timeouts.STOP_VERIFY + \
                    timeouts.STOP_WORD_MARGIN
                tree = subtree(root, ticks)
                killed.extend(tree)
                signal_all(tree, signal.SIGKILL)
                watch.update((x, proc_start_time(x)) for x in tree)
            elif now >= end:
                return False
            watch = {x: t for x, t in watch.items() if exits.alive(x, t)}
            if set(watch) <= {root}:
                fresh = [x for x in subtree(root, ticks) if x not in seen]
                seen.extend(fresh)
                killed.extend(fresh if sig == signal.SIGKILL else [])
                signal_all(fresh, sig)
                watch.update((x, proc_start_time(x)) for x in fresh)
            watch[root] = ticks
            due = kill_at if sig == signal.SIGTERM else end
            exits.sleep(watch, max(0.0, due - time.time()), 0.05)
    return reaped(p, sup)


def mark_stop(p: dict[str, Any], when: float, grace: float | None = None) -> None:
    """Record the stop before any signal: a rank that exits after this moment was ended
    by orch (or by torchrun reacting to it) and is never reported as the job's cause;
    its grace tells the supervisor when the stop's SIGKILL is due (supervisor.drain).
    A full disk must not keep the stop from happening."""
    rec = {"time": when} if grace is None else {"time": when, "grace": grace}
    with contextlib.suppress(OSError):
        write_atomic(p["jd"], STOP_FILE, jsonc.dumps(rec).encode(), 0o644)


def mark_verified(p: dict[str, Any], when: float, launch: list[int] | None) -> None:
    """The stop that began at `when` ended with nothing of the job left: recorded for
    the launch it stopped (stopped_clean), unless a launch came meanwhile (launch.json
    changed, or the stop record is not this stop's)."""
    got = read_json(p["jd"], STOP_FILE)
    if launch is None or launch_id(p) != launch or not isinstance(got, dict) or \
            got.get("time") != when:
        return
    rec = {"time": when, "verified": True, "launch": launch}
    with contextlib.suppress(OSError):
        write_atomic(p["jd"], STOP_FILE, jsonc.dumps(rec).encode(), 0o644)


def stop_time(p: dict[str, Any]) -> float | None:
    """The host time of the stop received during this run, or None."""
    got = read_json(p["jd"], STOP_FILE)
    when = got.get("time") if isinstance(got, dict) else None
    return when if isinstance(when, (int, float)) and not isinstance(when, bool) else None


def run_stop(req: Request) -> dict[str, Any]:
    return stop(req.args["job_dir"], max(0.0, float(req.args["grace"])))
