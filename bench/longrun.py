"""A long attached `orch up` on a few fake hosts: the controller's and each host agent's
open descriptors, threads and RSS, every 15 s, while the ranks write a metrics file
(the curves fetch it every 2 s) and rank 0 a checkpoint (`restarts: 1`,
`job.checkpoint`: the keeper lists it every half second).

    .venv/bin/python bench/longrun.py [--hosts 4] [--seconds 150]

A request that leaves something open on a host shows as a column that grows: before
the fix of a request's job-folder descriptor, every agent grew by one to five
descriptors a second, and reached a login's 1,024 within minutes.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

import fleet
import hostmem
from common import ORCH, Bed, bed_cluster, compile_orch, orch_env, remote_base

JOB = '''
import json, os, time
out = os.environ["ORCH_OUTPUT_DIR"]
os.makedirs(out, exist_ok=True)
for step in range({seconds}):
    if os.environ["RANK"] == "0":
        with open(os.path.join(out, "ckpt.tmp"), "wb") as f:
            f.write(os.urandom(1000))
        os.replace(os.path.join(out, "ckpt.tmp"), os.path.join(out, "ckpt.pt"))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({{"step": step, "loss": 1.0 / (step + 1)}}) + "\\n")
    time.sleep(1)
print("done", flush=True)
'''


def looked(pid: int) -> tuple[int, int, int] | None:
    """(open descriptors, threads, RSS MiB) of pid; None once it is gone."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        fields = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return None
    return fds, int(fields["Threads"]), int(fields["VmRSS"].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=150)
    args = ap.parse_args()
    compile_orch()
    with bed_cluster(args.hosts, ["plain"], wide=True) as beds:
        sh = beds.shells["plain"]
        bed = Bed(beds.cluster, beds.cluster.hosts[:args.hosts], sh, beds.python,
                  beds.cluster.root.parent / "work" / "longrun",
                  remote_base(beds.cluster, sh) / "longrun", ssh=dict(fleet.SSH))
        inv = bed.inventory("longrun", JOB.format(seconds=args.seconds))
        data = yaml.safe_load(inv.read_text())
        data["job"].update(restarts=1, checkpoint=["output/*.pt"])
        inv.write_text(yaml.safe_dump(data))
        proc = subprocess.Popen([str(ORCH), "up", "-c", str(inv)], env=orch_env(),
                                cwd=inv.parent, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        uid, t0 = hostmem.user_uid(bed), time.monotonic()
        print("seconds  controller (fds, threads, RSS MiB)  each host's agent (the same)")
        while proc.poll() is None:
            agents = [pid for pid, ppid, _, a in hostmem.processes(uid)
                      if "orch-agent" in a and ppid != 1]
            print(f"{time.monotonic() - t0:7.0f}  {looked(proc.pid)}  "
                  f"{[looked(a) for a in agents]}", flush=True)
            time.sleep(15)
        print(f"orch up ended with {proc.returncode}")
    if not beds.clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
