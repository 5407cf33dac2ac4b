"""Launch: start the job's supervisor fully detached; it runs torchrun and records its
exit. A dropped connection, or the agent's end, does not touch it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from orchestrator import protocol
from orchestrator.host import rankexec
from orchestrator.host.common import AgentError, job_paths, write_atomic
from orchestrator.host.procs import proc_start_time, supervisor_alive

ALREADY_RUNNING = "already running"


def clean_run_dir(p: dict) -> None:
    # code/ too: without `code:` in the inventory nothing was pushed, and a missing
    # entrypoint should fail as the rank's own error, not as a missing folder
    for d in (p["run"], p["logs"], p["output"], p["code"]):
        os.makedirs(d, exist_ok=True)
    for name in os.listdir(p["run"]):
        if name.endswith((".exit", ".pid")) or name == "host.exit":
            os.unlink(os.path.join(p["run"], name))


def rankexec_source() -> bytes:
    """The per-rank wrapper, from the bundle this agent was started from (or the file)."""
    return rankexec.__loader__.get_source(rankexec.__name__).encode()


def run(req) -> dict:
    """Start the supervisor (double fork + setsid), reply with its pid and more. The
    spec holds the job's env (secrets): it is kept in run/launch.json, mode 0600."""
    spec = req.args["spec"]
    p = job_paths(req.args["job_dir"])
    if supervisor_alive(p["run"]):
        raise AgentError(ALREADY_RUNNING, protocol.USAGE)
    clean_run_dir(p)
    write_atomic(os.path.join(p["run"], "launch.json"), json.dumps(spec).encode(), 0o600)
    write_atomic(os.path.join(p["run"], "rankexec.py"), rankexec_source(), 0o644)
    for r in spec["ranks"]:
        open(os.path.join(p["logs"], "rank-%d.log" % r), "w").close()
    rfd, wfd = os.pipe()
    if os.fork() == 0:
        os.close(rfd)
        os.setsid()
        if os.fork() == 0:
            supervise(p, spec, wfd)
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        reply = r.read()
    info = json.loads(reply) if reply else {"error": "supervisor did not start"}
    if "error" in info:
        raise AgentError("supervisor did not start: %s" % info["error"])
    return {"supervisor": info}


def detach_stdio(log_path: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)


def supervise(p: dict, spec: dict, wfd: int) -> None:
    """Runs torchrun, records its exit code in run/host.exit; never returns."""
    detach_stdio(os.path.join(p["run"], "torchrun.log"))
    # the agent ignores SIGINT and SIGHUP; an ignored signal survives exec, and the
    # user's code must get the defaults
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    env = dict(os.environ)
    env.update(spec["env"])
    code = 1
    try:
        proc = subprocess.Popen(spec["argv"], cwd=p["code"], env=env)
        me = os.getpid()
        info = {"pid": me, "pgid": os.getpgid(0), "start_ticks": proc_start_time(me),
                "torchrun_pid": proc.pid, "run_id": spec["run_id"], "started": time.time()}
        write_atomic(os.path.join(p["run"], "supervisor.json"), json.dumps(info).encode())
        os.write(wfd, json.dumps(info).encode())
        os.close(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, f: proc.send_signal(s))
        code = proc.wait()
    except BaseException as e:  # anything here must still leave host.exit behind
        sys.stderr.write("orch supervisor: %r\n" % (e,))
        try:
            os.write(wfd, json.dumps({"error": repr(e)}).encode())
        except OSError:
            pass
    write_atomic(os.path.join(p["run"], "host.exit"),
                 json.dumps({"code": code, "time": time.time()}).encode(), 0o644)
    os._exit(0)
