"""CPU seconds per process kind across a whole command, from BSD process accounting.

The kernel writes one record per process as it exits (acct(2), root only): pid, parent,
uid, command name, user and system time. Every process of a command is counted, also the
ones no parent waits for (orch's detached supervisor), and none is sampled: the counts do
not depend on the machine's load, unlike wall time. Records are in 1/100 s and each is cut
down to its tick, so many short processes read a little low (at most 10 ms each).

`Accounting()` is on only while its `with` block runs; `kinds()` sorts the records of one
command into kinds (login shell, agent, supervisor, torchrun, job...)
by their place in the process tree. Used by bench/scale.py (--cpu).
"""
from __future__ import annotations

import ctypes
import os
import struct
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")   # struct acct_v3, 64 bytes
AFORK = 0x01        # forked, never exec'd
AHZ = 100.0


def comp_t(v: int) -> float:
    """comp_t: 13-bit mantissa, 3-bit base-8 exponent, in AHZ ticks -> seconds."""
    return ((v & 0x1FFF) << (3 * (v >> 13))) / AHZ


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    comm: str
    cpu: float          # user + system seconds
    forked_only: bool


class Accounting:
    """Process accounting on for the block; `records` after it (root only)."""

    def __init__(self) -> None:
        self.records: list[Proc] = []
        fd, self.path = tempfile.mkstemp(prefix="orch-acct-")
        os.close(fd)
        self.libc = ctypes.CDLL(None, use_errno=True)

    def __enter__(self) -> Accounting:
        if self.libc.acct(self.path.encode()) != 0:
            os.unlink(self.path)
            raise OSError(ctypes.get_errno(), "acct(2) failed (root needed)")
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(1.0)   # the sessions' last processes end just after the command
        self.libc.acct(None)
        with open(self.path, "rb") as f:
            data = f.read()
        os.unlink(self.path)
        self.records = [parse(data[i:i + RECORD.size])
                        for i in range(0, len(data) - RECORD.size + 1, RECORD.size)]


def parse(raw: bytes) -> Proc:
    (flag, _ver, _tty, _code, uid, _gid, pid, ppid, _btime, _etime, utime, stime,
     *_rest, comm) = RECORD.unpack(raw)
    return Proc(pid, ppid, uid, comm.split(b"\0")[0].decode("ascii", "replace"),
                comp_t(utime) + comp_t(stime), bool(flag & AFORK))


def descendants(records: list[Proc], roots: set[int]) -> list[Proc]:
    """Records whose parent chain (parents as they were at exit) reaches a root pid."""
    by_pid = {p.pid: p for p in records}
    memo: dict[int, bool] = {}

    def under(pid: int, depth: int = 0) -> bool:
        if pid in roots:
            return True
        if pid in memo or depth > 64 or pid not in by_pid:
            return memo.get(pid, False)
        memo[pid] = under(by_pid[pid].ppid, depth + 1)
        return memo[pid]
    return [p for p in records if p.pid not in roots and under(p.ppid)]


def kinds(records: list[Proc], sshds: set[int], host_uid: int, controller: int,
          side: str) -> dict[str, list[float]]:
    """{kind: [cpu of each process]} of one command. Host side: the sessions under the
    fake hosts' sshd (`sshds`) and, for orch, the processes of the host user whose parent
    is gone (the detached supervisor and what it started). `side`: "orch" or "pdsh"."""
    host = descendants(records, sshds)
    seen = {p.pid for p in host}
    orphans = [p for p in records if p.uid == host_uid and p.pid not in seen
               and p.ppid not in seen and is_python(p.comm)]
    tree = host + orphans + descendants(records, {p.pid for p in orphans})
    tree = list({p.pid: p for p in tree}.values())
    by_pid = {p.pid: p for p in tree}
    out: dict[str, list[float]] = defaultdict(list)
    for p in tree:
        out[kind_of(p, by_pid, side)].append(p.cpu)
    ctl = [p for p in records if p.pid == controller]
    out["controller"] = [p.cpu for p in ctl + descendants(records, {controller})]
    return dict(out)


def is_python(comm: str) -> bool:
    """A python process: torch renames a process that imported it (its main thread's
    name, which is what the record keeps) to pt_main_thread."""
    return comm.startswith(("python", "pt_main"))


def python_depth(p: Proc, by_pid: dict[int, Proc]) -> tuple[int, bool]:
    """(python processes above p, whether the chain leaves the sessions: a detached one)."""
    depth, q = 0, by_pid.get(p.ppid)
    while q is not None:
        if is_python(q.comm):
            depth += 1
        if q.comm.startswith("sshd"):
            return depth, False
        q = by_pid.get(q.ppid)
    return depth, True


ORCH_KINDS = {(0, False): "agent", (1, False): "agent fork", (0, True): "supervisor",
              (1, True): "torchrun", (2, True): "job", (3, True): "job"}
PDSH_KINDS = {(0, False): "torchrun", (1, False): "job"}


def kind_of(p: Proc, by_pid: dict[int, Proc], side: str) -> str:
    if p.comm.startswith("sshd"):
        return "sshd"
    if not is_python(p.comm):
        return "login shell" if p.comm in ("sh", "bash", "dash") else "shell's commands"
    depth, detached = python_depth(p, by_pid)
    if p.forked_only and side == "orch" and not detached:
        return "agent fork"
    table = ORCH_KINDS if side == "orch" else PDSH_KINDS
    return table.get((depth, detached), f"python (depth {depth})")


def summary(k: dict[str, list[float]]) -> list[list[object]]:
    """Rows: kind, processes, CPU seconds; then the host side's total."""
    rows: list[list[object]] = [[name, len(v), sum(v)] for name, v in sorted(k.items())]
    host = [c for name, v in k.items() if name != "controller" for c in v]
    rows.append(["host side, all", len(host), sum(host)])
    return rows
