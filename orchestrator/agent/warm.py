"""Warm start: the job's supervisor and torchrun, started before the go.

`prewarm` (as soon as this host passed its own preflight, while the controller waits
for slower hosts) starts the supervisor detached, as a launch does, but waiting: it starts
the user's python on agent/launcher.py, which imports torch.distributed.run (the seconds
of a torchrun start) and waits too. Nothing of the job runs and nothing is written in
the job folder; the warm torchrun has the job's environment but its marker
(ORCH_JOB_DIR, agent/procs.py), so it is no process of the job yet: it is this agent's,
and ends with it. `launch` then sends the spec to the waiting supervisor (`Warm.go`): it
becomes the job's supervisor (supervisor.run_supervisor) and hands the warm torchrun
its arguments, the log and code/. Without a go (another host failed, the controller went
away) both end at once: the supervisor reads the end of its pipe when this agent ends.

A launch without a prewarm goes the same way, its go sent at once.
"""
from __future__ import annotations

import os
import sys

from orchestrator.agent import supervisor
from orchestrator.agent.common import AgentError, job_paths
from orchestrator.agent.paths import write_all
from orchestrator.agent.procs import MARKER
from orchestrator.wire import jsonc

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    import signal
    from typing import Any
else:   # signal's enums are 6-8 ms of CPU and ~0.4 MiB in every agent: the C module
    import _signal as signal

TAG = "orch-warm-torchrun"   # in the warm torchrun's command line, for ps
BOOT = ("import os;exec(compile(b''.join(iter(lambda:os.read(0,65536),b'')),"
        "'orch-launcher','exec'))")
RECORD_MAX = 1 << 20


class Warm:
    """This agent's end of one waiting supervisor: the go pipe, the record pipe."""

    def __init__(self, go: int, record: int, launcher: int, python: str,
                 env: dict[str, str]) -> None:
        self.go_fd, self.record_fd, self.launcher = go, record, launcher
        self.python, self.env = python, env

    def matches(self, spec: dict[str, Any]) -> bool:
        return matches(spec, self.python, self.env)

    def go(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Start the job: the supervisor's record (launch's reply)."""
        try:
            write_all(self.go_fd, jsonc.dumps(spec).encode())
        except OSError as e:   # the supervisor is gone (killed since the prewarm)
            self.cancel()
            raise AgentError("supervisor did not start: %s" % e) from None
        os.close(self.go_fd)
        self.go_fd = -1
        reply = read_all(self.record_fd, RECORD_MAX)
        os.close(self.record_fd)
        self.record_fd = -1
        info = jsonc.loads(reply) if reply else {"error": "it ended before its record"}
        if "error" in info:
            raise AgentError("supervisor did not start: %s" % info["error"])
        return {"supervisor": info}

    def cancel(self) -> None:
        """No go: the supervisor ends its warm torchrun and itself."""
        for fd in (self.go_fd, self.record_fd):
            if fd >= 0:
                os.close(fd)
        self.go_fd = self.record_fd = -1


WAITING: dict[str, Warm] = {}   # job dir -> the supervisor this agent started, waiting


def prewarm(p: dict[str, Any], configured: str, env: dict[str, str]) -> None:
    """Preflight passed on this host: start torchrun warm. `env` names the job folder as
    configured (a `~`, a link in remote_dir): the host's resolved path goes in its place,
    as the launch's environment will have it. Best effort: without it the launch starts
    torchrun cold."""
    env = {k: resolved(v, configured, p["job"]) for k, v in env.items()}
    old = WAITING.pop(p["job"], None)
    if old is not None:
        old.cancel()
    try:
        WAITING[p["job"]] = start(p, sys.executable, env)
    except (OSError, AgentError):
        pass


def resolved(value: str, configured: str, job: str) -> str:
    if value == configured or value.startswith(configured + "/"):
        return job + value[len(configured):]
    return value


def end_all() -> None:
    """The agent's end: each warm torchrun that got no go is killed now, not when its
    supervisor reads the end of the pipe a moment later. The controller waits for the
    agent's end, so an `up` that failed elsewhere returns with nothing left here. (The
    pid is safe: the waiting supervisor reaps its torchrun only after the go's pipe.)"""
    for job in list(WAITING):
        warm = WAITING.pop(job)
        warm.cancel()
        try:
            os.kill(warm.launcher, signal.SIGKILL)
        except OSError:
            pass


def take(job: str) -> Warm | None:
    return WAITING.pop(job, None)


# set at the launch from the network probe (session/network.py), after the warm start;
# torchrun's import does not read them: the launcher's go hands them to the ranks
LATE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def matches(spec: dict[str, Any], python: str, env: dict[str, str]) -> bool:
    """The launch's spec is the warm torchrun's: its python running torchrun, its env
    (but for what the network probe added since)."""
    late = {k for k in LATE_ENV if k in spec["env"] and k not in env}
    return bool(spec["argv"][:3] == [python, "-m", "torch.distributed.run"]
                and {k: v for k, v in spec["env"].items() if k not in late} == env)


def read_all(fd: int, cap: int) -> bytes:
    chunks, size = [], 0
    while size <= cap:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_line(fd: int) -> bytes:
    out = b""
    while not out.endswith(b"\n") and len(out) < 4096:
        chunk = os.read(fd, 1)
        if not chunk:
            break
        out += chunk
    return out


def start(p: dict[str, Any], python: str, env: dict[str, str]) -> Warm:
    """Double fork + setsid, as a launch: the waiting supervisor; its first line is the
    warm torchrun's pid (or why it could not start)."""
    go_r, go_w = os.pipe()
    rec_r, rec_w = os.pipe()
    claims = supervisor.claim_fds(p["job"])   # the job's GPUs: held as long as it lives
    supervisor.detach(lambda: waiting(p, python, env, go_r, rec_w, claims))
    os.close(go_r)
    os.close(rec_w)
    first = read_line(rec_r)
    got = jsonc.loads(first) if first.strip() else {"error": "it ended at once"}
    if "error" in got:
        os.close(go_w)
        os.close(rec_r)
        raise AgentError("supervisor did not start: %s" % got["error"])
    return Warm(go_w, rec_r, int(got["launcher"]), python, env)


def keep_only(fds: tuple[int, ...]) -> None:
    """The forked supervisor holds every descriptor of the agent: its stdio (the SSH
    channel, which must close when the agent ends) and other pipes. Keep only fds."""
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    os.close(null)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in fds:
            try:
                os.close(fd)
            except OSError:   # the listing's own descriptor
                pass


def waiting(p: dict[str, Any], python: str, env: dict[str, str], go_r: int, rec_w: int,
            claims: tuple[int, ...] = ()) -> None:
    """The waiting supervisor's life; never returns."""
    keep_only((go_r, rec_w) + claims)
    p = job_paths(p["job"])   # its JobDir's descriptor was one of those closed
    for sig in (signal.SIGINT, signal.SIGHUP):   # ignored by the agent; the job needs them
        signal.signal(sig, signal.SIG_DFL)
    # not yet a process of the job: the marker (which `stop` and the "already running"
    # check look for) comes with the go; everything the import may read is there now
    try:
        pid, sock = spawn_launcher(p["job"], python, unmarked(dict(os.environ, **env)))
    except OSError as e:
        write_all(rec_w, jsonc.dumps({"error": str(e)}).encode() + b"\n")
        os._exit(0)
    write_all(rec_w, jsonc.dumps({"launcher": pid}).encode() + b"\n")
    raw = read_all(go_r, 1 << 24)
    os.close(go_r)
    if not raw:   # no go: end the warm torchrun, which has run nothing
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os._exit(0)
    spec = jsonc.loads(raw)
    warm = matches(spec, python, env)

    def begin() -> tuple[int, Any]:
        torchrun = pid if warm and hand_over(sock, spec) else cold(pid, spec, p["job"])

        def wait() -> int:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, lambda s, f: os.kill(torchrun, s))
            return supervisor.wait_for(torchrun)
        return torchrun, wait
    supervisor.run_supervisor(p, spec, rec_w, "supervisor", "run/torchrun.log", begin)


def unmarked(env: dict[str, str]) -> dict[str, str]:
    """A launcher's environment before its go: not a process of the job yet, so without
    the marker (which `stop` and the "already running" check look for)."""
    return {k: v for k, v in env.items() if k != MARKER}


def spawn_launcher(job: str, python: str, env: dict[str, str]) -> tuple[int, Any]:
    """The warm torchrun: stdin carries launcher.py's source, stdout and stderr go to
    memory (kept for the log), descriptor 3 is its end of the go socket."""
    import _socket
    import fcntl
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    src_r, src_w = os.pipe()
    early = memory_file()
    # spawn's dup2 onto 0-3 must not find a source already there (it would keep CLOEXEC)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (src_r, early, theirs.fileno())]
    try:
        actions = [(os.POSIX_SPAWN_DUP2, high[0], 0), (os.POSIX_SPAWN_DUP2, high[1], 1),
                   (os.POSIX_SPAWN_DUP2, high[1], 2), (os.POSIX_SPAWN_DUP2, high[2], 3)]
        pid = os.posix_spawnp(python, [python, "-c", BOOT, TAG, job], env,
                              file_actions=actions)
    finally:
        for fd in high + [src_r, early]:
            os.close(fd)
        theirs.close()
    try:
        write_all(src_w, launcher_source())
    finally:
        os.close(src_w)
    return pid, ours


def memory_file() -> int:
    try:
        return os.memfd_create("orch-warm-torchrun")
    except (AttributeError, OSError):   # an old kernel: what the import prints is lost
        return os.open(os.devnull, os.O_WRONLY)


def launcher_source() -> bytes:
    from orchestrator.agent import launcher
    loader: Any = launcher.__loader__   # a file or zip loader: both have get_source
    source: str = loader.get_source(launcher.__name__)
    return source.encode()


def hand_over(sock: Any, spec: dict[str, Any]) -> bool:
    """The go: torchrun's arguments and the ranks' environment, the log (our stdout:
    run_supervisor pointed it there) and code/ (our cwd); False when the warm torchrun
    is gone."""
    import _socket
    import array
    code = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fds = array.array("i", [1, code])
        body = jsonc.dumps({"args": spec["argv"][3:], "env": spec["env"]}).encode()
        sock.sendmsg([body[:65536]], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds.tobytes())])
        rest = body[65536:]
        while rest:
            rest = rest[sock.send(rest):]
        sock.shutdown(_socket.SHUT_WR)
        return True
    except OSError:
        return False
    finally:
        os.close(code)


def cold(pid: int, spec: dict[str, Any], job: str) -> int:
    """torchrun started now: the warm one gone, or not this job's. A launcher again,
    handed the go at once (it writes the ranks' pid and exit records: launcher.py);
    torchrun itself only when that one cannot take the go either (its python does not
    start: torchrun then says why in the log)."""
    end(pid)
    argv, env = spec["argv"], dict(os.environ, **spec["env"])
    if argv[1:3] != ["-m", "torch.distributed.run"]:
        return supervisor.spawn(argv, env)
    try:
        launcher, sock = spawn_launcher(job, argv[0], unmarked(env))
    except OSError:
        return supervisor.spawn(argv, env)
    try:
        if hand_over(sock, spec):
            return launcher
    finally:
        sock.close()
    end(launcher)
    return supervisor.spawn(argv, env)


def end(pid: int) -> None:
    """A launcher that will not run the job: killed and reaped."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
