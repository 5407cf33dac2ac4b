"""CPU of one host's stop (agent/procs.stop), with and without a subreaper supervisor.

A host's stop ran one scan of every process's environment to verify that nothing of the
job was left; with the supervisor a child subreaper it signals the supervisor's tree and
takes the supervisor's own end as the proof. This measures the CPU (user + system of this
process, which runs the stop in its own thread, as the agent does) that one stop costs,
on a machine with `--extra` idle processes besides the job (a busy host; on the fleet
bench every fake host's agent shares one /proc of some thousands):

    .venv/bin/python bench/stopcpu.py --extra 2000 --stops 20

Each stop ends a real supervisor (agent/supervisor.py, forked from here) whose stand-in
torchrun runs `--ranks` sleeps and leaves a setsid'd daemon. `scan` is the stop as it was
(the supervisor's record says it is no subreaper: the known tree, then the marker scan);
`subtree` is the stop through the subreaper. CPU time, not wall: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.agent import procs, supervisor
from orchestrator.agent.common import job_paths, write_atomic
from orchestrator.agent.launch import job_folders


def idle(n: int) -> list[int]:
    """n blocking processes (sleep), this user's: what a stop's scan has to read."""
    return [os.posix_spawnp("sleep", ["sleep", "3600"], dict(os.environ)) for _ in range(n)]


def launch(root: Path, i: int, ranks: int) -> dict[str, Any]:
    """A real supervisor whose torchrun runs `ranks` sleeps and leaves a daemon."""
    job = root / f"job{i}"
    (job / "run").mkdir(parents=True)
    p = job_paths(str(job))
    job_folders(p["jd"])
    write_atomic(p["jd"], "run/launch.json", b"{}")
    script = "(setsid sleep 600 &); " + "sleep 600 & " * ranks + "wait"
    env = dict(os.environ, ORCH_JOB_DIR=str(job))

    def body(p: dict[str, Any], spec: dict[str, Any], wfd: int) -> None:
        def start() -> tuple[int, Any]:
            pid = supervisor.spawn(["sh", "-c", script], env)
            return pid, lambda: supervisor.wait_for(pid)
        supervisor.run_supervisor(p, spec, wfd, "supervisor", "run/torchrun.log", start)
    sup: dict[str, Any] = supervisor.start_detached(body, p, {"run_id": "b"}, "supervisor")[
        "supervisor"]
    deadline = time.monotonic() + 30   # the whole tree: torchrun, its ranks, the daemon
    while len(procs.subtree(sup["pid"])) < ranks + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return p


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_stop(p: dict[str, Any], mode: str) -> tuple[float, float, dict[str, Any]]:
    if mode == "scan":   # the record of a supervisor that is no subreaper: the old stop
        rec = json.loads((Path(p["job"]) / "run" / "supervisor.json").read_text())
        rec["subreaper"] = False
        write_atomic(p["jd"], "run/supervisor.json", json.dumps(rec).encode())
    c0, w0 = cpu(), time.monotonic()
    report = procs.stop(p["job"], 10.0)
    return cpu() - c0, time.monotonic() - w0, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extra", type=int, default=2000, help="idle processes besides the jobs")
    ap.add_argument("--stops", type=int, default=20, help="stops per mode")
    ap.add_argument("--ranks", type=int, default=4, help="ranks per job")
    args = ap.parse_args()
    extra = idle(args.extra)
    try:
        with tempfile.TemporaryDirectory(prefix="orch-stopcpu-") as tmp:
            results: dict[str, list[tuple[float, float]]] = {"scan": [], "subtree": []}
            print(f"load average before: {loadavg()}")
            for i in range(args.stops):
                for mode in results:
                    p = launch(Path(tmp) / mode, i, args.ranks)
                    c, w, report = one_stop(p, mode)
                    if report["left"] or report["found"] < args.ranks + 3:
                        raise SystemExit(f"{mode} stop {i}: {report!r}")
                    results[mode].append((c, w))
            procs_now = sum(1 for n in os.listdir("/proc") if n.isdigit())
            print(f"processes on the machine: {procs_now} ({args.extra} idle added); "
                  f"{args.stops} stops per mode")
            for mode, got in results.items():
                cpus, walls = [c * 1000 for c, _ in got], [w * 1000 for _, w in got]
                print(f"{mode:<8} CPU per stop: median {statistics.median(cpus):.1f} ms "
                      f"(min {min(cpus):.1f}, max {max(cpus):.1f}); "
                      f"wall median {statistics.median(walls):.0f} ms")
            print(f"load average after: {loadavg()}")
    finally:
        for pid in extra:
            os.kill(pid, signal.SIGKILL)
        for pid in extra:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
