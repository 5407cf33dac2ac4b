"""Commands the user gives orch to run on a host: `setup:` (before launch, in code/)
and `orch exec` (in the job folder). Their output goes back live as S frames
(protocol.command_output) and, for setup, into logs/setup.log.

Each command runs in a process group of its own (a new session), so `cancel` and the
end of the agent's stdin (the controller is gone, or Ctrl-C) end it and its children.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.agent.common import AgentError, job_paths, read_json, write_atomic
from orchestrator.agent.procs import stat_fields
from orchestrator.wire import jsonc, protocol, timeouts

CHUNK = protocol.MAX_OUTPUT
SETUP_LOG = "logs/setup.log"
SETUP_STATE = "run/setup.json"                # this host's (run/<part>/setup.json)
SHARED_SETUP_STATE = "run/shared-setup.json"  # a setup run once per shared filesystem

_running: Dict[int, "subprocess.Popen[bytes]"] = {}  # request id -> its command
_lock = threading.Lock()
_closing = threading.Event()


def shell() -> str:
    """bash when the host has it (its `-c` is what users expect), else POSIX sh."""
    return "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"


def environment(extra: Dict[str, Any]) -> Dict[str, Any]:
    """The agent's own environment, ORCH_PYTHON, then what the controller sent."""
    env = dict(os.environ)
    env["ORCH_PYTHON"] = interpreter()
    env.update({str(k): str(v) for k, v in extra.items()})
    return env


def interpreter() -> str:
    """The inventory's `python:` as a path this host runs: the agent was started with it
    (`sys.executable` keeps a venv's path as invoked), unless it is missing yet and the
    agent runs on python3 instead (bundle.FALLBACK): then the path asked for, which a
    `setup:` may be about to make (`python3 -m venv`)."""
    missing = os.environ.get("ORCH_PYTHON_MISSING")
    if missing:
        return os.path.expanduser(missing)
    return sys.executable or "python3"


# `orch exec -- '$ORCH_PYTHON' -c ...`: no shell expands it, so the first word is
# replaced here (the only word that is; `sh -c '"$ORCH_PYTHON" ...'` for anything else)
PYTHON_WORDS = ("$ORCH_PYTHON", "${ORCH_PYTHON}")


# ---------------------------------------------------------------- one command


def start(
    req: Any, argv: List[str], cwd_fd: int, env: Dict[str, Any]
) -> "subprocess.Popen[bytes]":
    """argv in the folder of cwd_fd (reached without following a link: the child
    changes into /proc/self/fd/N, which is still open before it execs)."""
    if _closing.is_set():
        raise AgentError("the controller is gone")
    proc = subprocess.Popen(
        argv,
        cwd="/proc/self/fd/%d" % cwd_fd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        restore_signals=True,
        preexec_fn=_default_signals,
    )
    with _lock:
        _running[req.id] = proc
    return proc


def _default_signals() -> None:
    # the agent ignores SIGINT and SIGHUP; an ignored signal survives exec
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def pump(req: Any, proc: "subprocess.Popen[bytes]", log_fd: Optional[int] = None) -> int:
    """Send the command's output as it comes (and append it to log_fd) until it ends.
    A background child that keeps the pipe open is read at most DRAIN more seconds."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    ended_at = None
    try:
        while True:
            ready = select.select([fd], [], [], 0.2)[0]
            data = os.read(fd, CHUNK) if ready else b""
            if ready and not data:
                break
            if data:
                if log_fd is not None:
                    os.write(log_fd, data)
                req.out.send(protocol.command_output(req.id, data))
            if ended_at is None and proc.poll() is not None:
                ended_at = time.monotonic()
            if (
                ended_at is not None
                and not data
                and time.monotonic() - ended_at > timeouts.COMMAND_DRAIN
            ):
                break
        return proc.wait()
    except BaseException:  # the controller is gone (broken pipe): so is the command
        end_group(proc)
        raise
    finally:
        proc.stdout.close()
        with _lock:
            _running.pop(req.id, None)


def group_alive(pgid: int) -> bool:
    """A process of the group that is not a zombie (a zombie still takes signals, so
    killpg(pgid, 0) would say yes until someone reaps it)."""
    for name in os.listdir("/proc"):
        fields = stat_fields(name) if name.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def end_group(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM the command's process group, SIGKILL what is left after COMMAND_GRACE."""
    grace = timeouts.COMMAND_GRACE   # read here, not bound at import: tests shorten it
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # our child: reaped here, so it does not count as alive
            if not group_alive(proc.pid):
                return
            time.sleep(0.05)


def run_cancel(req: Any) -> Dict[str, Any]:
    with _lock:
        proc = _running.get(req.args["request"])
    if proc is not None:
        end_group(proc)
    return {"found": proc is not None}


def end_all() -> None:
    """The controller is gone (end of stdin): no command of ours goes on without it."""
    _closing.set()
    with _lock:
        procs = list(_running.values())
    threads = [threading.Thread(target=end_group, args=(p,)) for p in procs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


# ---------------------------------------------------------------- exec


def exec_dir(p: Dict[str, Any]) -> Tuple[Any, ...]:
    """(descriptor, path): the job folder when it exists, else remote_dir, else home."""
    jd = p["jd"]
    try:
        return jd.open_dir(""), jd.path
    except FileNotFoundError:
        pass
    for path in (jd.parent, os.path.expanduser("~")):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY), path
        except OSError:
            continue
    return os.open("/", os.O_RDONLY | os.O_DIRECTORY), "/"


def run_exec(req: Any) -> Dict[str, Any]:
    a = req.args
    if not a["argv"]:
        raise AgentError("no command given", protocol.USAGE)
    fd, cwd = exec_dir(job_paths(a["job_dir"]))
    t0 = time.time()
    env = environment(a["env"])
    argv = list(a["argv"])
    if argv[0] in PYTHON_WORDS:
        argv[0] = env["ORCH_PYTHON"]
    try:
        proc = start(req, argv, fd, env)
    except OSError as e:  # as a shell says it: 127 not found, 126 not executable
        text = "orch: cannot run %r: %s\n" % (argv[0], e.strerror or e)
        req.out.send(protocol.command_output(req.id, text.encode("utf-8", "replace")))
        code = 127 if isinstance(e, FileNotFoundError) else 126
        return {"code": code, "cwd": cwd, "seconds": round(time.time() - t0, 3)}
    finally:
        os.close(fd)
    code = pump(req, proc)
    return {"code": code, "cwd": cwd, "seconds": round(time.time() - t0, 3)}


# ---------------------------------------------------------------- setup


def setup_argvs(a: Dict[str, Any], sh: str) -> List[Tuple[str, List[str]]]:
    if a["script"] is not None:
        return [(a["script"], [sh, a["script"]])]
    return [(c, [sh, "-c", c]) for c in a["commands"]]


def run_setup(req: Any) -> Dict[str, Any]:
    """Every command in order, in code/, until one fails; run/setup.json (the
    fingerprint) is written only after all succeeded and removed before they run."""
    a, sh, t0 = req.args, shell(), time.time()
    if len(a["commands"]) > protocol.MAX_COMMANDS:
        raise AgentError("more than %d setup commands" % protocol.MAX_COMMANDS, protocol.USAGE)
    jd = job_paths(a["job_dir"])["jd"]
    # once per filesystem (hosts sharing the job folder): one record for them all
    state_rel = SHARED_SETUP_STATE if a.get("shared") else SETUP_STATE
    done = read_json(jd, state_rel)
    if not a["force"] and isinstance(done, dict) and done.get("fingerprint") == a["fingerprint"]:
        return {"skipped": True, "code": 0, "failed": None, "shell": sh, "seconds": 0.0}
    jd.unlink(state_rel)
    env = environment(a["env"])
    log_fd = jd.open_for_write("logs/" + a["log"] if "log" in a else SETUP_LOG)
    try:
        code, failed = run_all(req, jd, setup_argvs(a, sh), env, log_fd)
    finally:
        os.close(log_fd)
    if code == 0:
        state = {"fingerprint": a["fingerprint"], "time": time.time(), "shell": sh}
        write_atomic(jd, state_rel, jsonc.dumps(state).encode(), 0o644)
    return {
        "skipped": False,
        "code": code,
        "failed": failed,
        "shell": sh,
        "seconds": round(time.time() - t0, 3),
    }


def run_all(
    req: Any, jd: Any, argvs: List[Tuple[str, List[str]]], env: Dict[str, Any], log_fd: int
) -> Tuple[Any, ...]:
    """(exit status, the command that failed or None)."""
    for text, argv in argvs:
        header = ("$ %s\n" % text).encode("utf-8", "surrogateescape")
        os.write(log_fd, header)
        req.out.send(protocol.command_output(req.id, header))
        with jd.dirfd("code", create=True) as fd:
            try:
                proc = start(req, argv, fd, env)
            except OSError as e:
                return 127, "%s (%s)" % (text, e.strerror or e)
        code = pump(req, proc, log_fd)
        if code != 0:
            return code, text
    return 0, None


# ---------------------------------------------------------------- probe

PROBE = r"""
import glob, importlib.util, os, sys
print(sys.executable)
version = ""
for d in sys.path:
    found = sorted(glob.glob(os.path.join(d or ".", "torch-*.dist-info")))
    if found:
        version = os.path.basename(found[0])[len("torch-"):-len(".dist-info")]
        break
print(version)
ep, module = sys.argv[1], sys.argv[2] == "1"
if not module:
    print("" if os.path.isfile(ep) else "code/" + ep)
else:
    parts = ep.split(".")
    spec = importlib.util.find_spec(parts[0])
    ok = spec is not None
    if ok and len(parts) > 1 and spec.submodule_search_locations:
        ok = any(os.path.isfile(os.path.join(loc, *parts[1:]) + ".py")
                 or os.path.isdir(os.path.join(loc, *parts[1:]))
                 for loc in spec.submodule_search_locations)
    print("" if ok else "module " + ep + " (in code/ or installed for this python)")
"""


def run_probe(req: Any) -> Dict[str, Any]:
    """The configured python (which setup may just have made): its executable, its
    torch (from the dist-info on its path: no import), and whether the entrypoint is
    there. Run in code/, as the ranks are."""
    a = req.args
    jd = job_paths(a["job_dir"])["jd"]
    python = os.path.expanduser(a["python"])  # `python: ~/venv/bin/python`
    argv = [python, "-c", PROBE, a["entrypoint"], "1" if a["module"] else "0"]
    with jd.dirfd("code", create=True) as fd:
        try:
            r = subprocess.run(
                argv,
                cwd="/proc/self/fd/%d" % fd,
                env=environment(a["env"]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                timeout=timeouts.PROBE,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return {
                "executable": None,
                "torch": None,
                "entrypoint": None,
                "error": "cannot run %s: %s" % (a["python"], getattr(e, "strerror", None) or e),
            }
    lines = r.stdout.decode("utf-8", "replace").splitlines()
    if r.returncode != 0 or len(lines) < 3:
        err = r.stderr.decode("utf-8", "replace").strip()[-500:]
        return {
            "executable": None,
            "torch": None,
            "entrypoint": None,
            "error": "%s failed (exit %d): %s" % (a["python"], r.returncode, err or "no output"),
        }
    return {
        "executable": lines[0][:4096],
        "torch": lines[1][:200] or None,
        "entrypoint": lines[2][:4096] or None,
        "error": None,
    }
