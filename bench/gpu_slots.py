"""GPU slots at scale: `orch status` of a running job on N sshd hosts that each have 4
stand-in GPUs (nvidia-smi asked twice per host, every GPU's holder read) against the same
job with `gpus: 0` (the status of before GPU claims), and how long a job queued with
`orch up --wait` takes to start after the job holding its GPUs is stopped.

    .venv/bin/python bench/gpu_slots.py [--hosts 64] [--reps 3]

The hosts run the stand-in torchrun (bench/torchrun_standin.py) and the stand-in
nvidia-smi (tests/gpu_standin.py) from sshd's SetEnv PATH. Run it alone: every fake host
shares these cores. Every process it started is gone at the end (checked).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import (
    ORCH,
    fake_cluster,
    kill_pids,
    make_standin,
    median,
    orch_env,
    print_table,
    scan_marked,
    timed_run,
)
from gpu_standin import describe, install

JOB = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
FIRST_OCTET = 120


def inventory(cluster, work: Path, name: str, python: str, gpus: int,
              hosts: int | None = None) -> Path:
    (work / "job.py").write_text(JOB)
    picked = cluster.hosts[:hosts] if hosts else cluster.hosts
    entries = [{"address": h.address, "procs": 1, "gpus": gpus, "remote_dir": str(h.remote_dir)}
               for h in picked]
    return cluster.write_inventory(work / f"{name}.yaml", hosts=[], extra_hosts=entries,
                                   name=name, top={"python": python})


def orch(work: Path, *args: str, timeout: float = 600):
    return timed_run([str(ORCH), *args], cwd=work, env=orch_env(), timeout=timeout)


def must(run, what: str):
    if not run.ok:
        raise SystemExit(f"{what} failed ({run.code}):\n{run.tail(3000)}")
    return run


def status_times(work: Path, python: str, cluster, reps: int) -> dict[str, list[float]]:
    """`orch status` of a running job, with GPUs and without, interleaved."""
    invs = {"gpus": inventory(cluster, work, "withgpus", python, 4),
            "none": inventory(cluster, work, "nogpus", python, 0)}
    for inv in invs.values():
        must(orch(work, "up", str(inv), "--detach"), "up")
    out: dict[str, list[float]] = {k: [] for k in invs}
    for _ in range(reps):
        for key, inv in invs.items():
            out[key].append(must(orch(work, "status", "-c", str(inv)), "status").seconds)
    for inv in invs.values():
        must(orch(work, "stop", str(inv)), "stop")
    return out


def wait_latency(work: Path, python: str, cluster) -> float:
    """A job holding host 0's 4 GPUs is stopped; seconds from `orch stop` returning to
    the queued job's "gpus: claimed" line."""
    holder = inventory(cluster, work, "holder", python, 4, hosts=1)
    queued = inventory(cluster, work, "queued", python, 4, hosts=1)
    must(orch(work, "up", str(holder), "--detach"), "up holder")
    proc = subprocess.Popen([str(ORCH), "up", str(queued), "--wait", "--detach"], cwd=work,
                            env=orch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for ln in proc.stderr:
            lines.append((time.monotonic(), ln))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not any("waiting" in ln for _, ln in lines):
        if proc.poll() is not None:
            raise SystemExit("the queued up ended before waiting:\n" + "".join(ln for _, ln in lines))
        time.sleep(0.05)
    must(orch(work, "stop", str(holder)), "stop holder")
    freed = time.monotonic()
    proc.wait(120)
    reader.join(10)
    claimed = [t for t, ln in lines if "gpus: claimed" in ln]
    must(orch(work, "stop", str(queued)), "stop queued")
    if not claimed:
        raise SystemExit("the queued up never claimed:\n" + "".join(ln for _, ln in lines))
    return claimed[0] - freed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="orch-bench-gpus-"))
    python = make_standin(root / "standin")
    install(root / "bin")
    env = (f"PATH={root / 'bin'}:/usr/local/bin:/usr/bin:/bin ORCH_FAKE_GPUS_DIR={root} "
           f"ORCH_GPU_CLAIMS_DIR={root / 'claims'}")
    try:
        with fake_cluster(args.hosts, root / "c", first_octet=FIRST_OCTET,
                          sshd_options={"SetEnv": env}) as cluster:
            for h in cluster.hosts:
                describe(root, h.address, 4, util=[30, 60, 90, 0])
            work = root / "work"
            work.mkdir()
            times = status_times(work, python, cluster, args.reps)
            waits = [wait_latency(work, python, cluster) for _ in range(args.reps)]
    finally:
        kill_pids(scan_marked([str(root)]))
        shutil.rmtree(root, ignore_errors=True)
    g, n = median(times["gpus"]), median(times["none"])
    print_table(f"GPU slots, {args.hosts} hosts (median of {args.reps}; load "
                f"{os.getloadavg()[0]:.2f})", ["measure", "value"],
                [["orch status, 4 stand-in GPUs per host (s)", f"{g:.2f}"],
                 ["orch status, gpus: 0 (s)", f"{n:.2f}"],
                 ["ratio with GPUs / without", f"{g / n:.2f}"],
                 ["up --wait: start after the holder's stop returned (s)",
                  f"{median(waits):.2f} (each: {', '.join(f'{w:.2f}' for w in waits)})"]])
    left = scan_marked([str(root)])
    print("processes left:", left or "none", file=sys.stderr)
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
