"""Stop and fail-fast latency on 4 fake hosts, against what a pdsh + torchrun user gets.

1. stop: a detached job (workers that exit on SIGTERM, each with a child process) on
   4 hosts; seconds from `orch stop` to its return, which is after it verified on every
   host that no process of the job is left (default grace 10 s).
2. crash: rank 1 exits with code 7 after 2 s while the other ranks keep working; seconds
   from the crash (the rank prints its clock just before exiting; one machine, one
   clock) to `orch up` returning with every host stopped and verified. The baseline is
   the same job under pdsh + torchrun: nothing stops the other hosts, which run until
   their own end (capped here at --cap seconds; in a real job, until the collective
   timeout: 10 min for NCCL, 30 min for gloo).

    .venv/bin/python bench/lifecycle.py [--reps 3] [--cap 60]
"""
from __future__ import annotations

import argparse
import os
import time

from common import (
    ORCH,
    ROOT_SHELL,
    VENV_PY,
    Bed,
    clean_env,
    crash_time,
    fake_cluster,
    kill_pids,
    median,
    pdsh_crash,
    print_table,
    save_json,
    scan_marked,
    timed_run,
)

HOSTS = 4
JOB = """\
import os, subprocess, sys, time
rank = int(os.environ["RANK"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print("started", rank, flush=True)
if rank == 1 and os.environ.get("CRASH"):
    time.sleep(2)
    print("crash_at", repr(time.time()), flush=True)
    os._exit(7)
time.sleep(float(os.environ.get("WORK_S", "3600")))
child.kill()
"""


def wait_running(bed: Bed, timeout: float = 120) -> None:
    """Every host's worker and its child are up (2 marked processes per host at least)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(len(scan_marked([f"ORCH_JOB_DIR={d}\0"])) >= 4 for d in bed.dirs):
            return
        time.sleep(0.2)
    raise SystemExit("the job did not start on every host")


def bench_stop(bed: Bed, reps: int) -> list[float]:
    inv = bed.inventory("bench-stop", JOB)
    samples = []
    for rep in range(reps):
        up = timed_run([str(ORCH), "up", "--detach", str(inv)], env=clean_env(), cwd=inv.parent)
        if not up.ok:
            raise SystemExit(f"orch up --detach failed: {up.tail()}")
        wait_running(bed)
        stop = timed_run([str(ORCH), "stop", str(inv)], env=clean_env(), cwd=inv.parent)
        left = bed.left_over()
        if not stop.ok or left:
            kill_pids(left)
            raise SystemExit(f"orch stop failed or left {left}: {stop.tail()}")
        samples.append(stop.seconds)
        print(f"  stop rep {rep + 1}: {stop.seconds:.2f} s, verified empty", flush=True)
    return samples


def bench_crash_orch(bed: Bed, reps: int) -> list[float]:
    inv = bed.inventory("bench-crash", JOB, {"CRASH": "1"})
    samples = []
    for rep in range(reps):
        run = timed_run([str(ORCH), "up", str(inv)], env=clean_env(), cwd=inv.parent)
        ended = time.time()
        left = bed.left_over()
        if run.returncode != 1 or left:
            kill_pids(left)
            raise SystemExit(f"expected exit 1 and nothing left, got {run.returncode}, {left}")
        samples.append(ended - crash_time(run.stdout))
        print(f"  crash rep {rep + 1}: every host stopped {samples[-1]:.2f} s after the crash",
              flush=True)
    return samples


def bench_crash_pdsh(bed: Bed, cap: float) -> float:
    """run_dist.sh style: pdsh + torchrun, no fail-fast. Returns crash -> pdsh returned."""
    return pdsh_crash(bed, JOB, f"CRASH=1 WORK_S={cap:g}", timeout=cap + 120)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cap", type=float, default=60.0,
                    help="how long the baseline's surviving ranks work before ending")
    args = ap.parse_args()
    with fake_cluster(HOSTS) as cluster:
        work = cluster.root.parent / "lifecycle"
        bed = Bed(cluster, cluster.hosts[:HOSTS], ROOT_SHELL, str(VENV_PY), work, work)
        stop = bench_stop(bed, args.reps)
        crash = bench_crash_orch(bed, args.reps)
        base = bench_crash_pdsh(bed, args.cap)
    rows = [["orch stop -> verified empty (4 hosts)", median(stop), "-", "target <= 2 s"],
            ["rank crash -> every host stopped (4 hosts)", median(crash), base,
             f"baseline/orch = {base / median(crash):.0f}x"]]
    print_table(f"lifecycle, median of {args.reps} (load {os.getloadavg()[0]:.1f})",
                ["what", "orch s", "pdsh+torchrun s", "note"], rows)
    raw = save_json("lifecycle.json", {"stop_s": stop, "crash_s": crash, "pdsh_crash_s": base})
    print(f"raw samples: {raw}")


if __name__ == "__main__":
    main()
