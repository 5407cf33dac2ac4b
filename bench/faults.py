"""Faults: how long orch takes to see one and to have the job stopped everywhere, at
4, 16 and 64 fake hosts (one sshd per loopback address; a stand-in job: a plain Python
script under torchrun, no model).

Per fault and host count, on this one machine (one clock for all "hosts"):

- detection: from the fault to the first host receiving orch's stop (the host writes
  run/stop.json with its clock before it signals anything);
- all stopped: from the fault to `orch up` returning, after every reachable host
  verified that no process of the job is left.

Faults: `crash` (one rank exits 3; the time it printed just before), `freeze` (one host's
sshd and agent SIGSTOPped: found after timeouts.HOST_LOST without a heartbeat). The
baseline, pdsh + torchrun, has no fail-fast: the surviving ranks block in their next
collective until its timeout (gloo 30 min, NCCL 10 min by default); bench/lifecycle.py
measures it at 4 hosts with a capped stand-in.

    .venv/bin/python bench/faults.py [--hosts 4 16 64] [--faults crash freeze] [--reps 1]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

from common import ORCH, SshdCluster, clean_env, fake_cluster, median, print_table, save_json
from sshd_cluster import pids_with_env

JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
print("ready", rank, flush=True)
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    time.sleep(float(os.environ["FAIL_AFTER"]))
    print("crash_at", repr(time.time()), flush=True)
    sys.exit(3)
time.sleep(3600)
"""


def inventory(cluster: SshdCluster, work: Path, name: str, env: dict) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.py").write_text(JOB)
    return cluster.write_inventory(work / "cluster.yaml", name=name, entrypoint="job.py",
                                   code_paths=["job.py"], env=env)


def first_stop(cluster: SshdCluster, name: str) -> float:
    """The earliest time a host received orch's stop (run/stop.json), inf if none did."""
    times = []
    for h in cluster.hosts:
        try:
            stop = h.remote_dir / name / "run" / "stop.json"
            times.append(json.loads(stop.read_text())["time"])
        except (OSError, ValueError, KeyError):
            continue
    return min(times, default=float("inf"))


def left(cluster: SshdCluster, name: str) -> list[int]:
    return [p for h in cluster.hosts for p in pids_with_env(f"ORCH_JOB_DIR={h.remote_dir}/{name}")]


def crash(cluster: SshdCluster, work: Path, n: int) -> tuple[float, float]:
    name = f"fault-crash-{n}"
    inv = inventory(cluster, work / name, name, {"FAIL_RANK": str(n // 2),
                                                  "FAIL_AFTER": str(5 + n / 4)})
    up = subprocess.run([str(ORCH), "up", str(inv)], env=clean_env(), cwd=inv.parent,
                        capture_output=True, text=True, timeout=900)
    ended = time.time()
    m = re.search(r"crash_at (\d+\.\d+)", up.stdout)
    named = f"root cause rank {n // 2} on host" in " ".join(up.stderr.split())
    if up.returncode != 1 or not m or not named or left(cluster, name):
        raise SystemExit(f"crash at {n} hosts: exit {up.returncode}, named={named}, "
                         f"left={left(cluster, name)}\n{up.stderr[-2000:]}")
    at = float(m.group(1))
    return first_stop(cluster, name) - at, ended - at


def freeze(cluster: SshdCluster, work: Path, n: int) -> tuple[float, float]:
    name = f"fault-freeze-{n}"
    inv = inventory(cluster, work / name, name, {})
    up = subprocess.Popen([str(ORCH), "up", str(inv)], env=clean_env(), cwd=inv.parent,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert up.stdout is not None
    ready = 0
    for line in up.stdout:
        ready += "] ready" in line
        if ready == n:
            break
    frozen = cluster.hosts[n // 2]
    at = time.time()
    frozen.pause()
    try:
        _, err = up.communicate(timeout=300)
        ended = time.time()
    finally:
        frozen.resume()
    named = f"root cause host {frozen.address}" in " ".join(err.split())
    subprocess.run([str(ORCH), "stop", "-c", str(inv)], env=clean_env(), cwd=inv.parent,
                   capture_output=True, timeout=300)
    if up.returncode != 1 or not named or left(cluster, name):
        raise SystemExit(f"freeze at {n} hosts: exit {up.returncode}, named={named}\n{err[-2000:]}")
    return first_stop(cluster, name) - at, ended - at


FAULTS = {"crash": crash, "freeze": freeze}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    rows, raw = [], {}
    for n in args.hosts:
        with fake_cluster(n, first_octet=100 if n <= 150 else 2) as cluster:
            work = cluster.root.parent / "faults"
            for fault in args.faults:
                got = [FAULTS[fault](cluster, work, n) for _ in range(args.reps)]
                raw[f"{fault}-{n}"] = got
                rows.append([fault, n, median([g[0] for g in got]), median([g[1] for g in got])])
                print(f"  {fault} at {n} hosts: {got}", flush=True)
    print_table(f"faults, stand-in job, median of {args.reps} (load {os.getloadavg()[0]:.1f})",
                ["fault", "hosts", "fault -> first host stopping s", "fault -> all stopped s"], rows)
    print(f"raw samples: {save_json('faults.json', raw)}")


if __name__ == "__main__":
    main()
