"""A detached supervisor's life, for the job (launch.py, warm.py) and a job array's runner
(array.py): double fork + setsid so that a dropped connection or the agent's end does not
touch it, torchrun started without subprocess, the record and run/host.exit written
whatever happens. Stdlib only, Python 3.8."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from orchestrator.agent.common import AgentError, write_atomic
from orchestrator.agent.procs import proc_start_time

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Callable

    from orchestrator.agent.paths import JobDir


def claim_fds(job: str) -> tuple[int, ...]:
    """The descriptors of the GPU claims this agent took for the job (agent/gpus.py): a
    supervisor keeps them open for its life, the kernel's lock with them. gpus.py is only
    imported by a preflight that claimed."""
    gpus = sys.modules.get("orchestrator.agent.gpus")
    return tuple(fd for _, fd in getattr(gpus, "HELD", {}).get(job, ()))


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
