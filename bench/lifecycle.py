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
import re
import signal
import time
from pathlib import Path

from common import (
    ORCH,
    VENV_PY,
    SshdCluster,
    clean_env,
    fake_cluster,
    free_port,
    median,
    print_table,
    save_json,
    timed_run,
)
from sshd_cluster import pids_with_env

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


def inventory(cluster: SshdCluster, work: Path, name: str, env: dict) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.py").write_text(JOB)
    return cluster.write_inventory(work / "cluster.yaml", hosts=cluster.hosts[:HOSTS],
                                   name=name, entrypoint="job.py", code_paths=["job.py"], env=env)


def wait_running(job_dirs: list[str], timeout: float = 120) -> None:
    """Every host's worker and its child are up (2 marked processes per host at least)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(len(pids_with_env(f"ORCH_JOB_DIR={d}")) >= 4 for d in job_dirs):
            return
        time.sleep(0.2)
    raise SystemExit("the job did not start on every host")


def bench_stop(cluster: SshdCluster, work: Path, reps: int) -> list[float]:
    inv = inventory(cluster, work / "stop", "bench-stop", {})
    dirs = [f"{h.remote_dir}/bench-stop" for h in cluster.hosts[:HOSTS]]
    samples = []
    for rep in range(reps):
        up = timed_run([str(ORCH), "up", "--detach", str(inv)], env=clean_env(), cwd=inv.parent)
        if not up.ok:
            raise SystemExit(f"orch up --detach failed: {up.tail()}")
        wait_running(dirs)
        stop = timed_run([str(ORCH), "stop", str(inv)], env=clean_env(), cwd=inv.parent)
        left = [p for d in dirs for p in pids_with_env(f"ORCH_JOB_DIR={d}")]
        if not stop.ok or left:
            raise SystemExit(f"orch stop failed or left {left}: {stop.tail()}")
        samples.append(stop.seconds)
        print(f"  stop rep {rep + 1}: {stop.seconds:.2f} s, verified empty", flush=True)
    return samples


def crash_time(output: str) -> float:
    m = re.search(r"crash_at (\d+\.\d+)", output)
    if not m:
        raise SystemExit(f"no crash line in the output:\n{output[-1500:]}")
    return float(m.group(1))


def bench_crash_orch(cluster: SshdCluster, work: Path, reps: int) -> list[float]:
    inv = inventory(cluster, work / "crash", "bench-crash", {"CRASH": "1"})
    dirs = [f"{h.remote_dir}/bench-crash" for h in cluster.hosts[:HOSTS]]
    samples = []
    for rep in range(reps):
        run = timed_run([str(ORCH), "up", str(inv)], env=clean_env(), cwd=inv.parent)
        ended = time.time()
        left = [p for d in dirs for p in pids_with_env(f"ORCH_JOB_DIR={d}")]
        if run.returncode != 1 or left:
            raise SystemExit(f"expected exit 1 and nothing left, got {run.returncode}, {left}")
        samples.append(ended - crash_time(run.stdout))
        print(f"  crash rep {rep + 1}: every host stopped {samples[-1]:.2f} s after the crash",
              flush=True)
    return samples


def bench_crash_pdsh(cluster: SshdCluster, work: Path, cap: float) -> float:
    """run_dist.sh style: pdsh + torchrun, no fail-fast. Returns crash -> pdsh returned."""
    hosts = cluster.hosts[:HOSTS]
    d = work / "pdsh"
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.py").write_text(JOB)
    port = free_port([hosts[0].address], 29500, 29900)
    cases = " ".join(f"{h.address}) R={i};;" for i, h in enumerate(hosts))
    marker = f"ORCH_JOB_DIR={d}/marker"   # lets this bench find and end what it started
    remote = (f"case %h in {cases} esac; cd {d} && {marker} CRASH=1 WORK_S={cap:g} "
              f"{VENV_PY} -m torch.distributed.run --nnodes {HOSTS} --node-rank $R "
              f"--nproc-per-node 1 --master-addr {hosts[0].address} --master-port {port} job.py")
    env = clean_env(PDSH_SSH_ARGS_APPEND=f"-F {cluster.ssh_config}")
    run = timed_run(["pdsh", "-R", "ssh", "-f", "64", "-w", ",".join(h.address for h in hosts),
                     remote], env=env, timeout=cap + 120)
    ended = time.time()
    for pid in pids_with_env(marker):
        os.kill(pid, signal.SIGKILL)
    return ended - crash_time(run.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cap", type=float, default=60.0,
                    help="how long the baseline's surviving ranks work before ending")
    args = ap.parse_args()
    with fake_cluster(HOSTS) as cluster:
        work = cluster.root.parent / "lifecycle"
        stop = bench_stop(cluster, work, args.reps)
        crash = bench_crash_orch(cluster, work, args.reps)
        base = bench_crash_pdsh(cluster, work, args.cap)
    rows = [["orch stop -> verified empty (4 hosts)", median(stop), "-", "target <= 2 s"],
            ["rank crash -> every host stopped (4 hosts)", median(crash), base,
             f"baseline/orch = {base / median(crash):.0f}x"]]
    print_table(f"lifecycle, median of {args.reps} (load {os.getloadavg()[0]:.1f})",
                ["what", "orch s", "pdsh+torchrun s", "note"], rows)
    raw = save_json("lifecycle.json", {"stop_s": stop, "crash_s": crash, "pdsh_crash_s": base})
    print(f"raw samples: {raw}")


if __name__ == "__main__":
    main()
