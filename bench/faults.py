"""Faults: how long orch takes to see one and to have the job stopped everywhere, at
4, 16 and 64 fake hosts (one sshd per loopback address), against pdsh + torchrun in the
same run.

Every host runs the stand-in torchrun (bench/torchrun_standin.py, as bench/scale.py:
torchrun's arguments and environment, a rendezvous, the ranks, the worst exit code)
through the same `python -m torch.distributed.run` for orch and for the baseline, so
that 64 torch imports on this machine's cores do not swamp the figures. Login shells:
`plain` (user orchbench, /bin/sh, made and authorized for the run, removed after) and
`root` (root's own shell: bash with a .bashrc).

Per fault, host count and shell (one machine, one clock for every "host"):

- detection: from the fault to the first host receiving orch's stop (the host writes
  run/stop.json with its clock before it signals anything);
- all stopped: from the fault to `orch up` returning, after every reachable host
  verified that no process of the job is left.

Faults: `crash` (one rank exits 3; the time it printed just before); `freeze` (one
host's sshd and agent SIGSTOPped: found after timeouts.HOST_LOST without a heartbeat).

The baseline (crash only): the same job under pdsh + torchrun. Nothing stops the other
hosts: each surviving rank blocks in its next collective until the collective's timeout
(gloo 30 min, NCCL 10 min by default). The job emulates that collective with a file in
a folder all "hosts" share: once the crashed rank is gone, the survivors wait --cap
seconds (the timeout, capped here) and exit 1, as a timed-out collective raises. The
figure is crash -> pdsh returned; with the default timeouts it is that minus the cap
plus 600 s (NCCL) or 1800 s (gloo).

    .venv/bin/python bench/faults.py [--hosts 4 16 64] [--shells plain root]
                                     [--faults crash freeze] [--reps 1] [--cap 20]

Every sshd, job process, the plain user's key and the files it made are gone at the
end (checked and printed; exit 1 if anything is left).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import (
    ORCH,
    Bed,
    Beds,
    bed_cluster,
    compile_orch,
    crash_time,
    kill_pids,
    markdown,
    median,
    orch_env,
    pdsh_crash,
    prepare_remote,
    remote_base,
    save_json,
)

JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
gone = os.path.join(os.environ["COLLECTIVE_DIR"], "crashed")
print("ready", rank, flush=True)
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    time.sleep(float(os.environ["FAIL_AFTER"]))
    open(gone, "w").close()
    print("crash_at", repr(time.time()), flush=True)
    sys.exit(3)
# every step a collective: it cannot complete once a peer is gone, and times out
while not os.path.exists(gone):
    time.sleep(0.1)
time.sleep(float(os.environ.get("COLLECTIVE_TIMEOUT", "3600")))
print("collective timed out", rank, flush=True)
sys.exit(1)
"""


def collective_dir(bed: Bed, name: str) -> Path:
    """The emulated collective's folder, shared by every host, empty."""
    d = bed.remote / "collective" / name
    prepare_remote(d.parent, bed.shell)
    prepare_remote(d, bed.shell)
    (d / "crashed").unlink(missing_ok=True)
    return d


def first_stop(bed: Bed) -> float:
    """The earliest time a host received orch's stop (run/stop.json), inf if none did."""
    times = []
    for d in bed.dirs:
        try:
            times.append(json.loads((Path(d) / "run" / "stop.json").read_text())["time"])
        except (OSError, ValueError, KeyError):
            continue
    return min(times, default=float("inf"))


def orch_up(inv: Path) -> subprocess.Popen:
    return subprocess.Popen([str(ORCH), "up", "-c", str(inv)], env=orch_env(), cwd=inv.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def crash_env(bed: Bed, name: str) -> dict:
    return {"FAIL_RANK": str(bed.n // 2), "FAIL_AFTER": f"{2 + bed.n / 16:g}",
            "COLLECTIVE_DIR": str(collective_dir(bed, name))}


def crash(bed: Bed) -> tuple[float, float]:
    name = f"fault-crash-{bed.shell.name}-{bed.n}"
    inv = bed.inventory(name, JOB, crash_env(bed, name))
    up = orch_up(inv)
    out, err = up.communicate(timeout=900)
    ended = time.time()
    named = f"root cause rank {bed.n // 2} on host" in " ".join(err.split())
    left = bed.left_over()
    if up.returncode != 1 or not named or left:
        kill_pids(left)
        raise SystemExit(f"crash at {bed.n} hosts: exit {up.returncode}, named={named}, "
                         f"left={left}\n{err[-2000:]}")
    at = crash_time(out)
    return first_stop(bed) - at, ended - at


def freeze(bed: Bed) -> tuple[float, float]:
    name = f"fault-freeze-{bed.shell.name}-{bed.n}"
    inv = bed.inventory(name, JOB, {"COLLECTIVE_DIR": str(collective_dir(bed, name))})
    up = orch_up(inv)
    assert up.stdout is not None
    ready = 0
    for line in up.stdout:
        ready += "] ready" in line
        if ready == bed.n:
            break
    frozen = bed.hosts[bed.n // 2]
    at = time.time()
    frozen.pause()
    try:
        _, err = up.communicate(timeout=300)
        ended = time.time()
    finally:
        frozen.resume()
    named = f"root cause host {frozen.address}" in " ".join(err.split())
    subprocess.run([str(ORCH), "stop", "-c", str(inv)], env=orch_env(), cwd=inv.parent,
                   capture_output=True, timeout=300)
    left = bed.left_over()
    if up.returncode != 1 or not named or left:
        kill_pids(left)
        raise SystemExit(f"freeze at {bed.n} hosts: exit {up.returncode}, named={named}, "
                         f"left={left}\n{err[-2000:]}")
    return first_stop(bed) - at, ended - at


def baseline(bed: Bed, cap: float) -> float:
    """pdsh + torchrun, the same crash: seconds from it until pdsh returned."""
    name = f"base-crash-{bed.shell.name}-{bed.n}"
    env = " ".join(f"{k}={v}" for k, v in crash_env(bed, name).items())
    seconds, run = pdsh_crash(bed, JOB, f"{env} COLLECTIVE_TIMEOUT={cap:g}", timeout=cap + 300)
    timed_out = len(re.findall(r"collective timed out", run.stdout))
    if timed_out != bed.n - 1:
        raise SystemExit(f"baseline at {bed.n} hosts: {timed_out} of {bed.n - 1} survivors "
                         f"timed out (exit {run.returncode})\n{run.tail(2000)}")
    return seconds


FAULTS = {"crash": crash, "freeze": freeze}


def series(beds: Beds, n: int, shell: str, args: argparse.Namespace) -> list[list[object]]:
    sh = beds.shells[shell]
    bed = Bed(beds.cluster, beds.cluster.hosts[:n], sh, beds.python,
              beds.cluster.root.parent / "work" / f"{shell}{n}",
              remote_base(beds.cluster, sh) / f"faults-n{n}")
    rows = []
    for fault in args.faults:
        got = [FAULTS[fault](bed) for _ in range(args.reps)]
        print(f"  {fault}, {shell} shell, {n} hosts: "
              + ", ".join(f"{d:.2f} s / {a:.2f} s" for d, a in got), flush=True)
        base = float("nan")
        if fault == "crash" and args.cap > 0:
            base = baseline(bed, args.cap)
            print(f"  pdsh + torchrun, {shell} shell, {n} hosts: {base:.2f} s "
                  f"(collective timeout capped at {args.cap:g} s)", flush=True)
        all_stopped = median([g[1] for g in got])
        rows.append([fault, n, shell, median([g[0] for g in got]), all_stopped, base,
                     base / all_stopped if base == base else float("nan"),
                     f"{os.getloadavg()[0]:.1f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--shells", nargs="+", default=["plain", "root"], choices=["plain", "root"])
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cap", type=float, default=20.0,
                    help="the baseline's collective timeout, seconds (0: no baseline)")
    args = ap.parse_args()
    compile_orch()
    rows: list[list[object]] = []
    t0 = time.monotonic()
    with bed_cluster(max(args.hosts), args.shells, first_octet=100) as beds:
        for n in args.hosts:
            for shell in args.shells:
                rows += series(beds, n, shell, args)
    print(f"\nfaults, stand-in torchrun, median of {args.reps} ({time.monotonic() - t0:.0f} s)")
    markdown(["fault", "hosts", "shell", "fault -> first host stopping s",
                 "fault -> all stopped s", f"pdsh+torchrun s (timeout {args.cap:g} s)",
              "baseline/orch", "load"], rows)
    print(f"raw rows: {save_json('faults.json', rows)}")
    if not beds.clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
