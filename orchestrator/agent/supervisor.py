"""A detached supervisor's life, for the job (launch.py, warm.py) and a job array's runner
(array.py): double fork + setsid so that a dropped connection or the agent's end does not
touch it, torchrun started without subprocess, the record and run/host.exit written
whatever happens. Stdlib only, Python 3.8.

The supervisor is a child subreaper (Linux 3.4): whatever its run starts that loses its
parent (a daemon, a setsid'd double fork) becomes its child, never init's, so its tree
is the whole run and a stop needs no look at every process on the host (procs.stop).
The job ends when torchrun ends (run/host.exit, as before); what a rank left behind then
is stopped (SIGTERM, LEFTOVER_GRACE, SIGKILL) and reaped, and once nothing of the tree is
left the supervisor says so in host.exit (`reaped`) and ends (drain)."""
from __future__ import annotations

import os
import sys
import time

from orchestrator.agent import libc, spares
from orchestrator.agent.common import AgentError, read_json, write_atomic
from orchestrator.agent.procs import STOP_FILE, proc_start_time, signal_all, subtree
from orchestrator.wire import jsonc, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    import signal
    from typing import Any, Callable

    from orchestrator.agent.paths import JobDir
else:   # signal's enums are 6-8 ms of CPU and ~0.4 MiB in every agent: the C module
    import _signal as signal


def claim_fds(job: str) -> tuple[int, ...]:
    """The descriptors of the GPU claims this agent took for the job (agent/gpus.py): a
    supervisor keeps them open for its life, the kernel's lock with them. gpus.py is only
    imported by a preflight that claimed."""
    gpus = sys.modules.get("orchestrator.agent.gpus")
    return tuple(fd for _, fd in getattr(gpus, "HELD", {}).get(job, ()))


PR_SET_CHILD_SUBREAPER = 36   # prctl(2), Linux 3.4
SUBREAPER = False   # this process (a supervisor) is one, and can see its tree


def become_subreaper() -> bool:
    """Make this process a child subreaper: an orphan of its tree is reparented to it.
    True only when the kernel took it and each process's children can be listed
    (/proc/<pid>/task/<tid>/children, CONFIG_PROC_CHILDREN): the tree is then the run.
    Before anything of the run starts, so nothing can have left it already."""
    global SUBREAPER
    try:
        me = os.getpid()
        SUBREAPER = libc.function("prctl")(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0 and \
            os.path.exists("/proc/%d/task/%d/children" % (me, me))
    except (ImportError, OSError, AttributeError):   # not Linux, or no libc to ask
        SUBREAPER = False
    return SUBREAPER


def detach(body: Callable[[], None]) -> None:
    """Double fork + setsid: body() runs in a grandchild, in a session of its own (a
    dropped connection does not end it), a subreaper, and must not return; the middle
    child is reaped."""
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                become_subreaper()
                body()
        finally:
            os._exit(0)
    os.waitpid(child, 0)


# the children reaped besides torchrun, (pid, code, time): a rank among them lost its
# torchrun first (a stop SIGKILLs torchrun; a crash), so its exit record is written here
REAPED = []   # type: list[tuple[int, int, float]]
# [{pid: (rank, its start's time)}], read once after torchrun's end: it starts no more
RANK_PIDS = []   # type: list[dict[int, tuple[int, float]]]


def say(message: str) -> None:
    """A line on the supervisor's stderr, the log (detach_stdio): straight to descriptor 2,
    never raising. sys.stderr may be no longer usable in a forked process (one whose
    stderr object wrote to a descriptor closed since), and a full disk must not end the
    supervisor before it has stopped what the ranks left and said so in host.exit."""
    try:
        os.write(2, message.encode("utf-8", "replace"))
    except OSError:
        pass


def exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def wait_for(pid: int) -> int:
    """pid's exit code (-signal when killed), reaping every other child meanwhile: the
    orphans a subreaper adopts must not stay zombies for the job's life."""
    while True:
        got, status = os.waitpid(-1, 0)   # (an interrupted wait is retried: PEP 475)
        if got == pid:
            return exit_code(status)
        REAPED.append((got, exit_code(status), time.time()))


def reap_ended() -> bool:
    """Reap every child that has ended; True when no child is left at all."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False
        REAPED.append((pid, exit_code(status), time.time()))


def record_orphan_ranks(jd: JobDir) -> None:
    """The exit records of the ranks reaped here: torchrun's process (agent/launcher.py)
    writes them as each rank ends, but a rank that outlived it (a stop SIGKILLs torchrun
    and SIGTERMs the ranks) became this subreaper's child. A rank whose record this run
    already has (written after its pid record) is left as it is."""
    if not REAPED:
        return
    if not RANK_PIDS:
        RANK_PIDS.append(rank_pids(jd))
    ranks = RANK_PIDS[0]
    for pid, code, when in REAPED:
        if pid not in ranks:
            continue
        rank, started = ranks[pid]
        done = read_json(jd, "run/rank-%d.exit" % rank)
        if isinstance(done, dict) and isinstance(done.get("time"), (int, float)) \
                and done["time"] >= started:
            continue
        try:
            write_atomic(jd, "run/rank-%d.exit" % rank,
                         jsonc.dumps({"code": code, "time": when}).encode(), 0o644)
        except (OSError, AgentError) as e:
            say("orch supervisor: cannot write rank %d's exit: %s\n" % (rank, e))
    del REAPED[:]


def rank_pids(jd: JobDir) -> dict[int, tuple[int, float]]:
    """{pid: (rank, its start's time)} from this run's run/rank-<r>.pid records."""
    try:
        with jd.dirfd("run") as fd:
            names = [n for n in os.listdir(fd) if n.startswith("rank-") and n.endswith(".pid")]
    except (OSError, AgentError):
        return {}
    out = {}
    for name in names:
        rec = read_json(jd, "run/" + name)
        rank = name[len("rank-"):-len(".pid")]
        if isinstance(rec, dict) and isinstance(rec.get("pid"), int) and rank.isdigit():
            out[rec["pid"]] = (int(rank), float(rec.get("time") or 0))
    return out


def left_behind() -> list[int]:
    """This user's live processes of the tree, what ended reaped; [] when the tree holds
    none (another user's process, a rank's sudo, is not ours to end, as in a stop)."""
    return [] if reap_ended() else subtree(os.getpid())


def wait_empty(jd: JobDir, deadline: float) -> bool:
    """Until nothing is left_behind (True) or the deadline. Sleeps on SIGCHLD (blocked,
    so none is lost between a look and the sleep): the last of a tree to end is always
    a child of ours, its children ended or adopted; a look each half second besides.
    The ranks reaped meanwhile get their exit records at once."""
    while left_behind():
        record_orphan_ranks(jd)
        rest = deadline - time.time()
        if rest <= 0:
            return False
        signal.sigtimedwait([signal.SIGCHLD], min(rest, 0.5))
    record_orphan_ranks(jd)
    return True


def drain(jd: JobDir, began: float, stop: dict[str, Any] | None = None) -> bool:
    """After torchrun's end: stop what the run left behind and reap it; True once nothing
    is left. A stop received during this run (run/stop.json, from `began` on; `stop`: its
    record, read already) signals the tree itself, its ranks with its own grace: this
    only waits, and SIGKILLs past that grace should the stopping agent be gone. Otherwise
    the ranks ended by themselves, and what they left (a daemon, a server) gets SIGTERM,
    LEFTOVER_GRACE, SIGKILL."""
    # torchrun is gone: a signal forwarded to its pid now could reach a recycled one; a
    # stop does not signal the supervisor (an array runner's SIGUSR1 has nothing to hold)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    left = left_behind()
    record_orphan_ranks(jd)
    if not left:
        return True
    if stop is None:   # none yet when torchrun ended: one may have come since
        stop = stop_since(jd, began)
    if stop is not None:
        grace = stop.get("grace")
        kill_at = stop["time"] + (grace if isinstance(grace, (int, float)) else
                                  timeouts.STOP_GRACE) + timeouts.STOP_VERIFY
    else:
        say("orch: the ranks ended; stopping what they left: %s\n" % left)
        signal_all(left, signal.SIGTERM)
        kill_at = time.time() + timeouts.LEFTOVER_GRACE
    if wait_empty(jd, kill_at):
        return True
    signal_all(left_behind(), signal.SIGKILL)
    return wait_empty(jd, time.time() + timeouts.STOP_VERIFY)


def stop_since(jd: JobDir, began: float) -> dict[str, Any] | None:
    """The record of a stop received during this run (run/stop.json, from `began` on)."""
    stop = read_json(jd, STOP_FILE)
    when = stop.get("time") if isinstance(stop, dict) else None
    return stop if isinstance(when, (int, float)) and when >= began else None


def start_detached(body: Callable[[dict[str, Any], dict[str, Any], int], None],
                   p: dict[str, Any], spec: dict[str, Any], what: str) -> dict[str, Any]:
    """Double fork + setsid: `body(p, spec, wfd)` runs detached (a dropped connection
    does not end it) and writes its record (or {"error"}) to wfd; that record is the reply."""
    rfd, wfd = os.pipe()

    def detached() -> None:
        os.close(rfd)
        body(p, spec, wfd)
    detach(detached)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        reply = r.read()
    info = jsonc.loads(reply) if reply else {"error": "%s did not start" % what}
    if "error" in info:
        raise AgentError("%s did not start: %s" % (what, info["error"]))
    return {"supervisor": info}


def detach_stdio(jd: JobDir, log_rel: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = jd.open_for_write(log_rel, 0o644, append=True)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)


def spawn(argv: list[str], env: dict[str, str]) -> int:
    """torchrun's pid. posix_spawn instead of subprocess: subprocess's imports cost more
    than the rest of a launch, at every host. Only stdio passes to torchrun: the agent's
    descriptors are close-on-exec (Python's default), any inherited one is made so here;
    an argv that cannot be started raises OSError, as Popen does."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        if int(name) > 2:
            try:
                os.set_inheritable(int(name), False)
            except OSError:   # the listing's own descriptor, closed by now
                pass
    return os.posix_spawnp(argv[0], argv, env)


def run_supervisor(p: dict[str, Any], spec: dict[str, Any], wfd: int, what: str, log_rel: str,
                   start: Callable[[], tuple[int, Callable[[], int]]]) -> None:
    """The life of a detached supervisor (the job's or an array's runner): output to
    log_rel, default signals, cwd code/; `start()` gives the pid `stop` kills first and
    how to wait for the exit code; the record goes to run/supervisor.json and wfd (the
    launch reply); run/host.exit is written whatever happened. Never returns."""
    jd = p["jd"]
    began = time.time()
    detach_stdio(jd, log_rel)
    # the agent ignores SIGINT and SIGHUP; an ignored signal survives exec, and the
    # user's code must get the defaults
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    code = 1
    try:
        with jd.dirfd("code") as code_fd:
            os.fchdir(code_fd)   # the cwd of what it starts, reached without a link
        worker_pid, wait = start()
        me = os.getpid()
        info = {"pid": me, "pgid": os.getpgid(0), "start_ticks": proc_start_time(me),
                "torchrun_pid": worker_pid, "run_id": spec["run_id"], "started": time.time(),
                "subreaper": SUBREAPER}
        write_atomic(jd, "run/supervisor.json", jsonc.dumps(info).encode())
        os.write(wfd, jsonc.dumps(info).encode())
        os.close(wfd)
        make_spares(jd, spec)
        code = wait()
    except BaseException as e:  # anything here must still leave host.exit behind
        say("orch %s: %r\n" % (what, e))
        try:
            os.write(wfd, jsonc.dumps({"error": repr(e)}).encode())
        except OSError:
            pass
    end = {"code": code, "time": time.time()}
    done = SUBREAPER and left_behind() == []
    record_orphan_ranks(jd)   # before host.exit: a follow reads them first
    # the job's end is said at once, unless the tree is empty (said reaped, now) or a
    # stop is under way: the stopping agent waits for the last word, and on 1,000 hosts
    # that stop at once a second host.exit each (a file made, a follow woken) is seconds
    stop = stop_since(jd, began) if SUBREAPER and not done else None
    early = not done and stop is None
    if early:
        write_end(jd, what, end)
    if SUBREAPER and drain(jd, began, stop):
        me = os.getpid()
        write_end(jd, what, dict(end, reaped=True, pid=me, start_ticks=proc_start_time(me)))
    elif not early and not done:   # the stop's SIGKILL did not empty the tree: said as is
        write_end(jd, what, end)
    os._exit(0)


def make_spares(jd: JobDir, spec: dict[str, Any]) -> None:
    """The files a stop has this supervisor write, made now, after the launch's reply and
    while the job starts (agent/spares.py): run/host.exit and each rank's exit (a stop
    SIGKILLs torchrun, so the ranks' exits are written here). The agent's own spares,
    copied by the fork, are not this process's to use."""
    spares.drop_all()
    try:
        for rel in ["run/host.exit"] + ["run/rank-%d.exit" % r for r in spec.get("ranks", ())]:
            jd.spare(rel, 0o644)
    except Exception:  # a spare only saves time: the write makes its file without one
        pass


def write_end(jd: JobDir, what: str, end: dict[str, Any]) -> None:
    try:
        write_atomic(jd, "run/host.exit", jsonc.dumps(end).encode(), 0o644)
    except OSError as e:
        say("orch %s: cannot write host.exit: %s\n" % (what, e))
