"""Status: per rank, its pid, state, exit code, times, last line and torchrun's error file."""
from __future__ import annotations

import os
import time

from orchestrator.host.common import job_paths, read_json
from orchestrator.host.follow import rank_exit, tail_offset
from orchestrator.host.procs import proc_start_time, supervisor_alive


def last_line(path: str) -> str:
    off = tail_offset(path, 1)
    try:
        with open(path, "rb") as f:
            f.seek(off)
            return f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def error_file(p: dict, local_rank: int) -> str:
    """torchrun's error file of a rank (written when the script uses @record)."""
    base = os.path.join(p["run"], "torchrun")
    for d, _, files in os.walk(base):
        if "error.json" in files and d.rstrip("/").endswith("/%d" % local_rank):
            try:
                with open(os.path.join(d, "error.json")) as f:
                    return f.read()[-4000:]
            except OSError:
                return ""
    return ""


def rank_status(p: dict, rank: int, local_rank: int, sup) -> dict:
    info = {"rank": rank, "last_line": last_line(os.path.join(p["logs"], "rank-%d.log" % rank))}
    pid = read_json(os.path.join(p["run"], "rank-%d.pid" % rank))
    pid = pid if isinstance(pid, dict) and isinstance(pid.get("pid"), int) else {}
    info["pid"], info["started"] = pid.get("pid"), pid.get("time")
    ex = rank_exit(p, rank)
    if ex is not None:
        info.update(state="exited", code=ex["code"], ended=ex["time"])
        info["error_file"] = error_file(p, local_rank) if ex["code"] != 0 else ""
    elif pid and proc_start_time(pid["pid"]) == pid.get("start_ticks"):
        info["state"] = "running"
    elif pid:
        info["state"] = "lost"      # vanished without an exit code (e.g. the wrapper was killed)
    else:
        info["state"] = "starting" if sup else "lost"
    return info


def run(req) -> dict:
    """`ranks` are the host's ranks from its local rank `first_local` on (all: 0)."""
    p = job_paths(req.args["job_dir"])
    sup = supervisor_alive(p["run"])
    ranks = req.args["ranks"]
    first = req.args.get("first_local", 0)
    return {"supervisor": sup, "host_exit": read_json(os.path.join(p["run"], "host.exit")),
            "time": time.time(),
            "ranks": [rank_status(p, r, first + i, sup) for i, r in enumerate(ranks)]}
