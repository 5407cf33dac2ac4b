"""Status: per rank, its pid, state, exit code, times, last line and torchrun's error file."""
from __future__ import annotations

import os
import stat
import time

from orchestrator.agent.common import job_paths, read_json
from orchestrator.agent.follow import open_log, rank_exit
from orchestrator.agent.procs import proc_start_time, supervisor_alive

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request
    from orchestrator.agent.paths import JobDir

ERROR_FILE_CAP = 1 << 20


LAST_LINE_WINDOW = 1 << 16


def last_line(jd: JobDir, rel: str) -> str:
    """The log's last line that is not blank (a log that ends with an empty line still
    shows what the rank said last), at most 4096 characters from its start."""
    f = open_log(jd, rel)
    if f is None:
        return ""
    with f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - LAST_LINE_WINDOW))
        text = f.read(LAST_LINE_WINDOW).decode("utf-8", "replace")
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:4096] if lines else ""


def log_size(jd, rel: str):  # type: ignore[no-untyped-def]  # as the module's other helpers
    """The log's size; None when it is missing or not a plain file (a link is not followed)."""
    try:
        st = jd.lstat(rel)
    except OSError:
        return None
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None


def stopped(p: dict[str, Any], info: dict[str, Any]) -> bool:
    """A rank that ended badly (or vanished) after a stop orch made: the stop's doing."""
    stop = read_json(p["jd"], "run/stop.json")
    if not isinstance(stop, dict) or not isinstance(stop.get("time"), (int, float)):
        return False
    if info["state"] == "lost":
        return True
    ended = info.get("ended")
    return info.get("code") != 0 and isinstance(ended, (int, float)) and ended >= stop["time"]


def error_file(p: dict[str, Any], local_rank: int) -> str:
    """torchrun's error file of a rank (written when the script uses @record)."""
    for rel, _ in p["jd"].walk("run/torchrun"):
        if rel.endswith("/%d/error.json" % local_rank):
            try:
                data = p["jd"].read(rel, ERROR_FILE_CAP) or b""
            except OSError:
                return ""
            return data.decode("utf-8", "replace")[-4000:]
    return ""


def rank_status(p: dict[str, Any], rank: int, local_rank: int,
                sup: dict[str, Any] | None) -> dict[str, Any]:
    log = "logs/rank-%d.log" % rank
    info = {"rank": rank, "last_line": last_line(p["jd"], log), "log_bytes": log_size(p["jd"], log)}
    pid = read_json(p["jd"], "run/rank-%d.pid" % rank)
    pid = pid if isinstance(pid, dict) and isinstance(pid.get("pid"), int) else {}
    info["pid"], info["started"] = pid.get("pid"), pid.get("time")
    ex = rank_exit(p, rank)
    if ex is not None:
        info.update(state="exited", code=ex["code"], ended=ex["time"])
        info["error_file"] = error_file(p, local_rank) if ex["code"] != 0 else ""
    elif pid and proc_start_time(pid["pid"]) == pid.get("start_ticks"):
        info["state"] = "running"
    elif pid:
        info["state"] = "lost"      # vanished without an exit code (e.g. torchrun and the
        # supervisor were both killed before its end)
    elif sup:
        info["state"] = "starting"
    else:   # no launch ever reached this folder (an `up` killed before it): not "lost"
        info["state"] = "lost" if p["jd"].lstat("run/launch.json") else "not started"
    if info["state"] in ("exited", "lost") and stopped(p, info):
        info["state"] = "stopped"
    return info


def run(req: Request) -> dict[str, Any]:
    """`ranks` are the host's ranks from its local rank `first_local` on (all: 0)."""
    p = job_paths(req.args["job_dir"])
    sup = supervisor_alive(p)
    ranks = req.args["ranks"]
    first = req.args.get("first_local", 0)
    reply = {"supervisor": sup, "host_exit": read_json(p["jd"], "run/host.exit"),
             "time": time.time(),
             "ranks": [rank_status(p, r, first + i, sup) for i, r in enumerate(ranks)]}
    if any(r.get("code") for r in reply["ranks"]):   # a failed rank: NCCL may have dumped
        from orchestrator.agent.stacks import nccl_dumps
        reply["nccl_dumps"] = nccl_dumps(p)
    if req.args.get("gpus"):   # the GPU view: every GPU and its holder (agent/gpus.py)
        from orchestrator.agent import gpus
        try:
            reply["gpus"] = gpus.survey()["gpus"]
        except gpus.GpuError as e:
            reply["gpu_error"] = str(e)
    return reply
