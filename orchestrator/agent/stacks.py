"""`stacks`: a hang was found; every rank of this host is asked for its Python stack.

Each rank's python registered faulthandler on rankexec.STACK_SIGNAL, writing into
run/stack-<r> (rankexec.BOOT); a rank without a handler for it is not signalled (the
signal would end it) but reported as "no answer". A rank that cannot answer is named:
stopped (SIGSTOP, a debugger: /proc state T or t) or in uninterruptible sleep (D). The
stacks are appended to each rank's log under a banner and come back in the reply, each
cut to protocol.MAX_STACK bytes. The NCCL flight recorder's dumps in run/ are named.
"""
from __future__ import annotations

import os
import time

from orchestrator.agent.common import job_paths, read_json
from orchestrator.agent.follow import rank_exit
from orchestrator.agent.procs import stat_fields
from orchestrator.agent.rankexec import STACK_SIGNAL
from orchestrator.wire import protocol, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request

STATES = {"T": "stopped", "t": "stopped", "D": "disk-wait", "Z": "exited", "X": "exited"}
NCCL_DUMP = "nccl-trace-rank-"   # TORCH_NCCL_DEBUG_INFO_TEMP_FILE's prefix (launch env)


def size(p: dict[str, Any], rel: str) -> int:
    st = p["jd"].lstat(rel)
    return st.st_size if st is not None else 0


def catches(pid: int, sig: int) -> bool:
    """Whether pid has a handler for sig (SigCgt in /proc/<pid>/status): one without it
    (still starting, or it exec'd another program) would be killed by the signal."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def probe(p: dict[str, Any], rank: int) -> dict[str, Any]:
    """The rank's pid and whether it can answer; signals it when it can."""
    entry = {"rank": rank, "state": "gone", "pid": None, "stack": ""}   # type: dict[str, Any]
    if rank_exit(p, rank) is not None:
        entry["state"] = "exited"
        return entry
    rec = read_json(p["jd"], "run/rank-%d.pid" % rank)
    if not isinstance(rec, dict) or not isinstance(rec.get("pid"), int):
        return entry
    fields = stat_fields(rec["pid"])
    if fields is None or int(fields[19]) != rec.get("start_ticks"):
        return entry   # gone, or its pid reused by another process
    entry["pid"] = rec["pid"]
    entry["state"] = STATES.get(fields[0], "no answer")
    if entry["state"] == "no answer" and catches(rec["pid"], STACK_SIGNAL):
        entry["offset"] = size(p, "run/stack-%d" % rank)
        try:
            os.kill(rec["pid"], STACK_SIGNAL)
        except OSError:
            entry["state"] = "gone"
    return entry


def collect(p: dict[str, Any], waiting: list[dict[str, Any]], cap: int) -> None:
    """Wait (STACK_WAIT at most) until each signalled rank's stack file grew and then
    held still for 0.2 s: faulthandler writes a dump in a few writes."""
    deadline = time.monotonic() + timeouts.STACK_WAIT
    last = {e["rank"]: (-1, 0.0) for e in waiting}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        for e in list(waiting):
            now, n = time.monotonic(), size(p, "run/stack-%d" % e["rank"])
            seen, since = last[e["rank"]]
            if n != seen:
                last[e["rank"]] = (n, now)
            elif n > e["offset"] and now - since >= 0.2:
                e["stack"], e["state"] = read_stack(p, e["rank"], e["offset"], cap), "answered"
                waiting.remove(e)
    for e in waiting:   # a last look: a dump that came just now
        if size(p, "run/stack-%d" % e["rank"]) > e["offset"]:
            e["stack"], e["state"] = read_stack(p, e["rank"], e["offset"], cap), "answered"


def read_stack(p: dict[str, Any], rank: int, offset: int, cap: int) -> str:
    fd = p["jd"].open_for_read("run/stack-%d" % rank)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, cap)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")[:cap]


def to_log(p: dict[str, Any], e: dict[str, Any], reason: str) -> None:
    """The stack (or why there is none) at the end of the rank's log."""
    if e["state"] == "answered":
        head = "orch: %s; the stack of rank %d (pid %s):" % (reason, e["rank"], e["pid"])
    else:
        head = "orch: %s; rank %d (pid %s) gave no stack: %s" % (reason, e["rank"], e["pid"],
                                                                e["state"])
    text = head + ("\n" + e["stack"].rstrip("\n") if e["stack"] else "") + "\n"
    try:
        fd = p["jd"].open_for_write("logs/rank-%d.log" % e["rank"], append=True)
    except OSError:
        return
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def nccl_dumps(p: dict[str, Any]) -> list[str]:
    try:
        with p["jd"].dirfd("run") as fd:
            names = sorted(n for n in os.listdir(fd) if n.startswith(NCCL_DUMP))
    except OSError:
        return []
    return [n for n in names if len(n) <= 255][:protocol.MAX_NOTES]


def run(req: Request) -> dict[str, Any]:
    p = job_paths(req.args["job_dir"])
    ranks = req.args["ranks"]
    cap = min(protocol.MAX_STACK, protocol.MAX_STACKS_REPLY // max(1, len(ranks)))
    entries = [probe(p, r) for r in ranks]
    collect(p, [e for e in entries if "offset" in e], cap)
    for e in entries:
        e.pop("offset", None)
        if e["state"] not in ("exited", "gone"):
            to_log(p, e, req.args["reason"][:200])
    return {"ranks": entries, "nccl_dumps": nccl_dumps(p), "time": time.time()}
