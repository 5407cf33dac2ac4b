"""Launch: start the job's supervisor fully detached; it runs torchrun and records its
exit. A dropped connection, or the agent's end, does not touch it."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from orchestrator.agent import rankexec
from orchestrator.agent.common import AgentError, job_paths, write_atomic
from orchestrator.agent.procs import LOCKED, job_running, proc_start_time
from orchestrator.wire import protocol

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Callable

    from orchestrator.agent.main import Request
    from orchestrator.agent.paths import JobDir

ALREADY_RUNNING = "already running"


def job_folders(jd: Any) -> list[str]:
    """Make the job's folders (a link at any of them is refused) and return run/'s names.
    code/ too: without `code:` in the inventory nothing was pushed, and a missing
    entrypoint should fail as the rank's own error, not as a missing folder."""
    for d in ("run", "logs", "output", "code"):
        os.close(jd.open_dir(d, create=True))
    jd.check_layout()
    with jd.dirfd("run") as fd:
        return os.listdir(fd)


def clean_run_dir(p: dict[str, Any]) -> None:
    jd = p["jd"]
    for name in job_folders(jd):
        if name.endswith((".exit", ".pid")) or name in ("host.exit", "stop.json"):
            jd.unlink("run/" + name)
    # torchrun's --log-dir: a none_<id>/ folder per run would pile up; only the new
    # run's error files are of use (links inside are removed, never followed)
    jd.rmtree("run/torchrun")


def rankexec_source() -> bytes:
    """The per-rank wrapper, from the bundle this agent was started from (or the file)."""
    loader: Any = rankexec.__loader__   # a file or zip loader: both have get_source
    source: str = loader.get_source(rankexec.__name__)
    return source.encode()


def run(req: Request) -> dict[str, Any]:
    """Start the job: the supervisor this host's prewarm left waiting (agent/warm.py), or
    one started now, gets the spec and starts torchrun; its record is the reply. The
    spec holds the job's env (secrets): it is kept in run/launch.json, mode 0600."""
    from orchestrator.agent import warm  # warm imports this module
    spec = req.args["spec"]
    p = job_paths(req.args["job_dir"])
    waiting = warm.take(p["job"])
    try:
        # this agent's preflight found it not running and holds its lock since: no other
        # `up` can have started it (no second scan of every process)
        if p["job"] not in LOCKED and job_running(p):
            raise AgentError(ALREADY_RUNNING, protocol.USAGE)
        clean_run_dir(p)
        jd = p["jd"]
        write_atomic(jd, "run/launch.json", json.dumps(spec).encode(), 0o600)
        write_atomic(jd, "run/rankexec.py", rankexec_source(), 0o644)
        for r in spec["ranks"]:
            os.close(jd.open_for_write("logs/rank-%d.log" % r))   # emptied; a link is refused
        if waiting is None or not waiting.matches(spec):
            if waiting is not None:
                waiting.cancel()
            waiting = warm.start(p, spec["argv"][0], spec["env"])
        return waiting.go(spec)
    except BaseException:
        if waiting is not None:
            waiting.cancel()
        raise


def detach(body: Callable[[], None]) -> None:
    """Double fork + setsid: body() runs in a grandchild, in a session of its own (a
    dropped connection does not end it), and must not return; the middle child is reaped."""
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                body()
        finally:
            os._exit(0)
    os.waitpid(child, 0)


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
    info = json.loads(reply) if reply else {"error": "%s did not start" % what}
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
                "torchrun_pid": worker_pid, "run_id": spec["run_id"], "started": time.time()}
        write_atomic(jd, "run/supervisor.json", json.dumps(info).encode())
        os.write(wfd, json.dumps(info).encode())
        os.close(wfd)
        code = wait()
    except BaseException as e:  # anything here must still leave host.exit behind
        sys.stderr.write("orch %s: %r\n" % (what, e))
        try:
            os.write(wfd, json.dumps({"error": repr(e)}).encode())
        except OSError:
            pass
    try:
        write_atomic(jd, "run/host.exit", json.dumps({"code": code, "time": time.time()}).encode(),
                     0o644)
    except OSError as e:
        sys.stderr.write("orch %s: cannot write host.exit: %s\n" % (what, e))
    os._exit(0)
