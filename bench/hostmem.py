"""Memory per host while a job runs, by process kind: orch's (`orch up` attached, so its
follow agents count) against pdsh + torchrun's, on the same fake hosts.

On a real cluster each host has its own memory; on the fake one every host's processes
share this machine's, so the per-host sum times the host count is what 1,000 hosts need
here. Counted: PSS (each shared page split between the processes that map it) from
/proc/PID/smaps_rollup of every process of the bed's user (sshd's session process, the
login shell, the agent, supervisor, torchrun and the rank), and under
pdsh its ssh clients too (on this machine, one per host).

    used by bench/fleet.py (`--measures memory`)
"""
from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from common import Bed, kill_pids, pdsh_env

KINDS = (
    ("supervisor", lambda comm, args, ppid: "orch-agent" in args and ppid == 1),
    ("login shell", lambda comm, args, ppid: comm == "sh"),
    ("agent", lambda comm, args, ppid: "orch-agent" in args),
    ("torchrun", lambda comm, args, ppid: "orch-warm-torchrun" in args
     or "torch.distributed.run" in args or "orch-launcher" in args),
    ("rank", lambda comm, args, ppid: "rankexec.py" in args or "job.py" in args),
    ("sshd", lambda comm, args, ppid: comm == "sshd"),
)


def pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    m = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def processes(uid: int | None = None, ppid_of: int | None = None) -> list[tuple[int, int, str, str]]:
    """(pid, ppid, comm, args) of the processes of `uid`, or the children of `ppid_of`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            args = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        ppid, owner = int(fields["PPid"]), int(fields["Uid"].split()[0])
        if (uid is not None and owner == uid) or (ppid_of is not None and ppid == ppid_of):
            out.append((int(name), ppid, fields["Name"].strip(), args))
    return out


def by_kind(procs: list[tuple[int, int, str, str]]) -> dict[str, list[int]]:
    """kind -> [PSS KiB of each process of that kind]."""
    kinds: dict[str, list[int]] = defaultdict(list)
    for pid, ppid, comm, args in procs:
        kind = next((k for k, test in KINDS if test(comm, args, ppid)), comm)
        kinds[kind].append(pss_kib(pid))
    return kinds


def per_host(kinds: dict[str, list[int]], hosts: int) -> dict[str, tuple[float, float]]:
    """kind -> (processes per host, PSS MiB per host); "all" sums them."""
    out = {k: (len(v) / hosts, sum(v) / 1024 / hosts) for k, v in sorted(kinds.items())}
    out["all"] = (sum(p for p, _ in out.values()), sum(m for _, m in out.values()))
    return out


def user_uid(bed: Bed) -> int:
    return pwd.getpwnam(bed.shell.user).pw_uid


def wait_ranks(uid: int, hosts: int, timeout: float) -> bool:
    """Every host's rank runs (one per host)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(by_kind(processes(uid)).get("rank", [])) >= hosts:
            return True
        time.sleep(1)
    return False


def pdsh_memory(bed: Bed, remote: str, timeout: float = 600) -> dict[str, tuple[float, float]]:
    """pdsh + torchrun of a sleeping job: memory per host once every rank runs (the
    hosts' processes and pdsh's ssh clients here), then everything ended."""
    uid = user_uid(bed)
    proc = subprocess.Popen(bed.pdsh_argv(remote), env=pdsh_env(bed.cluster),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        if not wait_ranks(uid, bed.n, timeout):
            raise RuntimeError("pdsh: not every rank started")
        time.sleep(2)
        kinds = by_kind(processes(uid))
        clients = by_kind(processes(ppid_of=proc.pid))
        kinds["pdsh's ssh clients"] = [k for v in clients.values() for k in v]
        kinds["pdsh"] = [pss_kib(proc.pid)]
        return per_host(kinds, bed.n)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
        kill_pids([pid for pid, _, _, args in processes(uid)
                   if "job.py" in args or "torch.distributed.run" in args])


def orch_memory(bed: Bed, start: subprocess.Popen, timeout: float = 600) -> dict[str, tuple[float, float]]:
    """`orch up` (started by the caller) of a sleeping job: memory per host once every
    rank runs; the controller's own PSS is added as "orch"."""
    uid = user_uid(bed)
    if not wait_ranks(uid, bed.n, timeout):
        raise RuntimeError("orch: not every rank started")
    time.sleep(2)
    kinds = by_kind(processes(uid))
    kinds["orch"] = [pss_kib(start.pid)]
    return per_host(kinds, bed.n)


def mem_available_mib() -> float:
    text = Path("/proc/meminfo").read_text()
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else float("nan")
