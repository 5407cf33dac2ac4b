"""A job array on one host: a detached runner works through this host's queue of tasks,
at most `slots` at once; each task's state lives in run/task-<i>.start|.exit, its output in
logs/task-<i>.log and output/task-<i>/.

The runner is the job's supervisor (run/supervisor.json, with itself as `torchrun_pid`),
a subreaper like the job's: `stop` sends it SIGUSR1 first (SIGKILL without a subreaper),
so no queued task starts after a stop began, then ends every task, found in the runner's
tree (or by the ORCH_JOB_DIR marker they all carry). Stdlib only, Python 3.8.
"""
from __future__ import annotations

import collections
import os
import signal
import time

from orchestrator.agent.common import AgentError, job_paths, read_json, write_atomic
from orchestrator.agent.follow import open_log, rank_exit, tail_offset
from orchestrator.agent.launch import ALREADY_RUNNING, job_folders
from orchestrator.agent.procs import job_running, proc_start_time, supervisor_alive
from orchestrator.agent.supervisor import exit_code, run_supervisor, start_detached
from orchestrator.wire import jsonc, protocol

MYPY = False
if MYPY:   # annotations only: typing's import (and its `re`) is ~11 ms of CPU in an agent
    from typing import Any, Callable

LINE_CAP = 4096          # bytes of one metrics.csv line sent back
TAIL_READ = 64 << 10     # how far back from the end the last row is looked for


def clean(p: dict[str, Any], tasks: list[Any]) -> None:
    jd = p["jd"]
    for name in job_folders(jd):
        if name.endswith((".exit", ".pid", ".start")):
            jd.unlink("run/" + name)
    for t in tasks:
        os.close(jd.open_for_write("logs/task-%d.log" % t["i"]))   # emptied; a link is refused
        os.close(jd.open_dir("output/task-%d" % t["i"], create=True))


def run_launch(req: Any) -> dict[str, Any]:
    """Start the runner (double fork + setsid) and reply with its pid, like `launch`."""
    spec = req.args["spec"]
    p = job_paths(req.args["job_dir"])
    if job_running(p):
        raise AgentError(ALREADY_RUNNING, protocol.USAGE)
    clean(p, spec["tasks"])
    write_atomic(p["jd"], "run/launch.json", jsonc.dumps(spec).encode(), 0o600)
    return start_detached(runner, p, spec, "array runner")


class Runner:
    """The queue of one host: start tasks into free slots, record their ends."""

    def __init__(self, p: dict[str, Any], spec: dict[str, Any]) -> None:
        self.p, self.jd, self.spec = p, p["jd"], spec
        self.queue = collections.deque(spec["tasks"])
        self.free = list(range(spec["slots"]))[::-1]
        self.running: dict[int, Any] = {}          # pid -> (task index, slot)
        self.failed = 0
        self.held = False   # a stop came (hold)
        self.env = dict(os.environ)
        self.env.update(spec["env"])

    def stop_queue(self, signum: int, frame: Any) -> None:
        """SIGTERM to the runner itself: nothing more starts; the running tasks get it too."""
        self.queue.clear()
        for pid in list(self.running):
            try:
                os.kill(pid, signum)
            except OSError:
                pass

    def hold(self, signum: int, frame: Any) -> None:
        """SIGUSR1, a stop's: nothing more starts; the stop signals the running tasks, and
        their ends are not recorded: a task a stop ended reads `stopped`, as it did when
        the stop killed the runner first."""
        self.queue.clear()
        self.held = True

    def start(self, task: dict[str, Any]) -> None:
        i, slot = task["i"], self.free.pop()
        env = dict(self.env, ORCH_TASK=str(i), ORCH_TASK_ARGS=task["args"],
                   ORCH_TASK_SLOT=str(slot),
                   ORCH_OUTPUT_DIR=os.path.join(self.p["job"], "output", "task-%d" % i))
        per = self.spec.get("gpus_per_task", 0)
        if per:   # the slot's own GPUs of the job's claimed ones
            mine = self.spec["gpus"][slot * per:(slot + 1) * per]
            env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, mine)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        log = self.jd.open_for_write("logs/task-%d.log" % i, 0o644, append=True)
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.execve(task["argv"][0], task["argv"], env)
            except OSError as e:
                os.write(2, ("orch: cannot start %s: %s\n" % (task["argv"][0], e)).encode())
            finally:
                os._exit(127)
        os.close(log)
        self.running[pid] = (i, slot)
        write_atomic(self.jd, "run/task-%d.start" % i, jsonc.dumps(
            {"pid": pid, "start_ticks": proc_start_time(pid), "time": time.time(),
             "slot": slot}).encode(), 0o644)

    def reap(self) -> None:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            self.running.clear()
            return
        if pid not in self.running:
            return
        i, slot = self.running.pop(pid)
        if self.held:
            return
        code = exit_code(status)
        self.failed += code != 0
        self.free.append(slot)
        write_atomic(self.jd, "run/task-%d.exit" % i,
                     jsonc.dumps({"code": code, "time": time.time()}).encode(), 0o644)

    def loop(self) -> int:
        while self.queue or self.running:
            while self.queue and self.free:
                self.start(self.queue.popleft())
            if self.running:
                self.reap()
        return 1 if self.failed else 0


def runner(p: dict[str, Any], spec: dict[str, Any], wfd: int) -> None:
    """The detached runner: the host's queue to its end, then run/host.exit; never returns.
    It is its own `torchrun_pid`: `stop` kills it before any task."""
    def start() -> tuple[int, Callable[[], int]]:
        run = Runner(p, spec)

        def wait() -> int:
            signal.signal(signal.SIGTERM, run.stop_queue)
            signal.signal(signal.SIGUSR1, run.hold)
            return run.loop()
        return os.getpid(), wait
    run_supervisor(p, spec, wfd, "array runner", "run/runner.log", start)


# ---------------------------------------------------------------- status and results

def last_line(jd: Any, rel: str) -> str:
    f = open_log(jd, rel)
    if f is None:
        return ""
    with f:
        f.seek(tail_offset(f, 1))
        return f.read(4096).decode("utf-8", "replace").strip()


def task_status(p: dict[str, Any], i: int, sup: Any) -> dict[str, Any]:
    info = {"task": i, "last_line": last_line(p["jd"], "logs/task-%d.log" % i)}
    start = read_json(p["jd"], "run/task-%d.start" % i)
    start = start if isinstance(start, dict) and isinstance(start.get("pid"), int) else {}
    info["pid"], info["started"], info["slot"] = start.get("pid"), start.get("time"), start.get("slot")
    ex = rank_exit(p, i, "task")
    if ex is not None:
        info.update(state="exited", code=ex["code"], ended=ex["time"])
    elif start and proc_start_time(start["pid"]) == start.get("start_ticks"):
        info["state"] = "running"
    elif sup:
        info["state"] = "queued" if not start else "running"   # between its end and the record
    else:
        info["state"] = "stopped"   # the runner is gone: stopped (or killed) before it ended
    return info


def run_status(req: Any) -> dict[str, Any]:
    p = job_paths(req.args["job_dir"])
    sup = supervisor_alive(p)
    return {"supervisor": sup, "host_exit": read_json(p["jd"], "run/host.exit"),
            "time": time.time(), "tasks": [task_status(p, i, sup) for i in req.args["tasks"]]}


def csv_ends(jd: Any, rel: str) -> tuple[Any, ...]:
    """(header, last non-empty row) of a CSV file, each capped; (None, None) if missing."""
    try:
        f = os.fdopen(jd.open_for_read(rel), "rb")
    except OSError:
        return None, None
    with f:
        header = f.readline(LINE_CAP).rstrip(b"\r\n")
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - TAIL_READ))
        rows = [r for r in f.read(TAIL_READ).splitlines() if r.strip()]
    last = rows[-1][:LINE_CAP] if rows else b""
    return header.decode("utf-8", "replace"), last.decode("utf-8", "replace")


def run_results(req: Any) -> dict[str, Any]:
    p = job_paths(req.args["job_dir"])
    out = []
    for i in req.args["tasks"]:
        header, last = csv_ends(p["jd"], "output/task-%d/metrics.csv" % i)
        out.append({"task": i, "header": header, "last": last})
    return {"tasks": out}
